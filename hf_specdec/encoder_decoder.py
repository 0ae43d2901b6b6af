"""Encoder-decoder models (BART, T5, Whisper, ...) and decoders that read another model's encoder (distil-whisper's
``WhisperForCausalLM``): the encoder runs once, every decoder forward cross-attends to its states.

Plain ``generate`` runs the encoder once (``_prepare_encoder_decoder_kwargs_for_generation``) before it hands a
``custom_generate`` callable its decoder prompt as ``input_ids`` (``decoder_input_ids``, or the decoder start
token) and, among the model kwargs, ``encoder_outputs``, the encoder's ``attention_mask`` and the decoder's own
``decoder_attention_mask`` / ``decoder_position_ids``. The loop then decodes the decoder exactly as it decodes a
decoder-only model:

- the decoder's self-attention cache is what the store speculates on; the cross-attention cache (the encoder
  states' keys and values, written by the first forward) never changes, only its rows follow the batch's;
- the loop's names for a forward's tokens, mask and positions are the decoder's (``argument``:
  ``decoder_input_ids``, ``decoder_attention_mask``, ``decoder_position_ids``), and every forward also gets the
  encoder states (``EncoderStates.kwargs``), which follow the rows that remain (``select_rows``);
- a draft model reads the encoder states too: a decoder-only draft that takes ``encoder_outputs`` shares the
  target's (``EncoderReading.SHARED``: distil-whisper, whose encoder is the target's), an encoder-decoder draft
  runs its own encoder once on the call's encoder input (``draft_states``), and any other causal LM drafts from
  the decoder tokens alone;
- with ``return_dict_in_generate`` the call returns what plain returns (``generate_output``): the encoder's hidden
  states and attentions from its one run, and per step the decoder's (``recorded``: a forward's ``decoder_*``) and
  the cross-attentions, each step's query row [B, heads, 1, S] split from the verify forward along the query
  dimension (``loop.Step``);
- a batch's rows advance at their own pace, each at its own positions: a decoder that takes
  ``decoder_position_ids`` (Whisper) gets them; one that reads positions only as column distances
  (``positions_are_distances``: T5's relative bias) gets each row's tokens laid out at plain's distances after
  every keep (``cache.KVStore._alignment``); one that numbers its tokens by cache column (BART's learned
  positions) runs one prompt at a time (``support.check_supported``);
- Whisper's own generate() hands over long-form audio window by window (``support.ROUTED_GENERATE``), one call
  per window and per temperature-fallback rerun, each decoded as plain decodes it: its decoder prompt (the previous
  windows' text before the start tokens, left-padded, with its ``decoder_attention_mask``) is a padded prompt, its
  encoder input one window, and its encoder ``attention_mask`` the caller's (every audio's frames, whichever rows
  are left: plain passes it so, and Whisper's decoder never reads it). ``model.last_spec_stats`` (after
  ``enable``) holds the windows' calls' stats combined (``stats.combined``).

Worked example (the decoder's argument names; a decoder-only model keeps the loop's):

>>> from types import SimpleNamespace as Model
>>> bart = Model(config=Model(is_encoder_decoder=True))
>>> [argument(bart, name) for name in ("input_ids", "attention_mask", "position_ids", "cache")]
['decoder_input_ids', 'decoder_attention_mask', 'decoder_position_ids', 'cache']
>>> argument(Model(config=Model(is_encoder_decoder=False)), "attention_mask")
'attention_mask'
"""

from __future__ import annotations

import copy
import enum
import functools
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch
from transformers import GenerationMixin
from transformers.generation import GenerateEncoderDecoderOutput
from transformers.modeling_outputs import BaseModelOutput

from .errors import Unsupported

# the loop's name of a forward argument -> an encoder-decoder's name for its decoder's
DECODER_ARGUMENTS = MappingProxyType({"input_ids": "decoder_input_ids", "attention_mask": "decoder_attention_mask",
                                      "position_ids": "decoder_position_ids"})
# what plain generate() would pass that the loop cannot carry over several new decoder tokens
REFUSED_DECODER_INPUTS = MappingProxyType({
    "decoder_inputs_embeds": "a decoder prompt given as embeddings",
    "decoder_head_mask": "a decoder head mask",
    "cross_attn_head_mask": "a cross-attention head mask",
})
# model types whose decoder places its tokens by column distance alone: T5's relative attention bias
# (``compute_bias``) reads key column - query column, a query sitting at the cache's length + its index among the
# forward's inputs; no absolute position anywhere. (Switch Transformers has the same bias, but its experts' capacity
# counts a forward's tokens, so a forward over several tokens is not several one-token steps.)
DISTANCE_POSITIONED = frozenset({"t5", "mt5", "umt5", "longt5"})
# a forward output's names for what a ``cache.Recording`` asks (hidden states, self-attentions, cross-attentions):
# an encoder-decoder's (``Seq2SeqLMOutput``), a decoder-only model's (its cross-attentions: a decoder reading
# another model's encoder, WhisperForCausalLM)
RECORDED_NAMES = MappingProxyType({True: ("decoder_hidden_states", "decoder_attentions", "cross_attentions"),
                                   False: ("hidden_states", "attentions", "cross_attentions")})


class EncoderReading(enum.Enum):
    """How a model's decoder forward takes the encoder states."""

    OWN = "own"  # an encoder-decoder: ``encoder_outputs`` (a ``BaseModelOutput``) and the encoder ``attention_mask``
    SHARED = "shared"  # a decoder-only model reading another's encoder (WhisperForCausalLM): ``encoder_outputs``


def is_encoder_decoder(model) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


@functools.cache
def forward_params(model_class: type) -> frozenset[str]:
    """The argument names ``model_class.forward`` takes, read once per class (every check and forward asks)."""
    return frozenset(inspect.signature(model_class.forward).parameters)


def reads_encoder(model) -> bool:
    """Does ``model``'s forward take encoder states (an encoder-decoder, or a decoder such as WhisperForCausalLM)?"""
    return isinstance(model, torch.nn.Module) and "encoder_outputs" in forward_params(type(model))


def positions_are_distances(model) -> bool:
    """Does ``model``'s decoder read its tokens' positions only as distances between cache columns
    (``DISTANCE_POSITIONED``)? Then a row's tokens may sit at any columns whose distances to each other and to
    the row's next inputs are those plain ``generate`` gives them (``cache.KVStore``: each row's tokens as plain
    lays them out, the next inputs of every row at the same column), whatever the other rows of a batch hold."""
    return getattr(getattr(model, "config", None), "model_type", None) in DISTANCE_POSITIONED


def argument(model, name: str) -> str:
    """``model``'s forward argument for the loop's ``name`` (module docstring)."""
    return DECODER_ARGUMENTS.get(name, name) if is_encoder_decoder(model) else name


@dataclass(frozen=True)
class EncoderStates:
    """What every decoder forward of a call cross-attends to: the encoder's last hidden states ``hidden`` [B, S, D]
    and its mask ``mask`` [B, S] (None: every column), rows in the batch's order, given as ``reading`` says."""

    hidden: torch.Tensor
    mask: torch.Tensor | None
    reading: EncoderReading = EncoderReading.OWN
    # the encoder run's own outputs, whole batch, that plain generate() returns as encoder_hidden_states /
    # encoder_attentions (None where the encoder was not asked for them); decoder forwards never read them, and a
    # row selection leaves them out
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    # the encoder's output as generate() made it, of the model's own class (its other fields, such as an encoder's
    # downsampled ``attention_mask`` or MoE ``router_logits``, are read by some decoders' forwards); None: built
    # from ``hidden``
    outputs: Any = None

    def kwargs(self) -> dict[str, Any]:
        """The forward arguments that carry them."""
        if self.reading is EncoderReading.SHARED:
            return {"encoder_outputs": self.hidden}
        given = self.outputs if self.outputs is not None else BaseModelOutput(last_hidden_state=self.hidden)
        out: dict[str, Any] = {"encoder_outputs": given}
        if self.mask is not None:
            out["attention_mask"] = self.mask
        return out

    def select_rows(self, index: torch.Tensor) -> "EncoderStates":
        """The same states for the batch rows ``index``, in that order."""
        index = index.to(self.hidden.device)
        rows = self.hidden.shape[0]
        outputs = None if self.outputs is None else type(self.outputs)(
            **{name: _rows_of(value, index, rows) for name, value in self.outputs.items()})
        return EncoderStates(self.hidden[index], None if self.mask is None else self.mask[index], self.reading,
                             outputs=outputs)

    def shared(self) -> "EncoderStates":
        """As a decoder-only model reading this encoder takes them."""
        return EncoderStates(self.hidden, self.mask, EncoderReading.SHARED)


def _rows_of(value, index: torch.Tensor, rows: int):
    """``value`` (a tensor of the batch, first dimension ``rows``, or a tuple of them) at the rows ``index``; a value
    not laid out by batch row stays as it is (no decoder forward reads one by row)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_rows_of(part, index, rows) for part in value)
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
        return value[index.to(value.device)]
    return value


def check_inputs(model, model_kwargs: Mapping[str, Any]) -> None:
    """Refuse, before any forward, what the loop cannot pass to an encoder-decoder as plain ``generate`` does."""

    for name, what in REFUSED_DECODER_INPUTS.items():
        if model_kwargs.get(name) is not None:
            raise Unsupported(f"hf_specdec cannot pass {name} ({what}) to {type(model).__name__}'s decoder over "
                              f"several new tokens as plain generate() passes it over one; drop {name}=, or use "
                              "plain generate().")


def recorded(model, output, hidden_states: bool, attentions: bool) -> dict[str, tuple | None]:
    """What a forward of ``model`` returned that a ``cache.Recording`` asked for, under ``cache.ForwardResult``'s
    names: ``hidden_states`` (embeddings, then each layer), ``attentions`` (the self-attention weights per layer),
    and ``cross_attentions`` (per layer [B, heads, n, S] over the encoder's S columns; None for a model that reads
    no encoder), each None where not asked, attentions () where the kernel returns none (sdpa), as plain
    ``generate`` returns them. An encoder-decoder's output names them ``decoder_*``."""
    hidden_name, attention_name, cross_name = RECORDED_NAMES[is_encoder_decoder(model)]
    cross = reads_encoder(model) and attentions
    return dict(hidden_states=tuple(output[hidden_name]) if hidden_states else None,
                attentions=tuple(output.get(attention_name) or ()) if attentions else None,
                cross_attentions=tuple(output.get(cross_name) or ()) if cross else None)


def decoder_view(model, model_kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], EncoderStates | None]:
    """An encoder-decoder's ``model_kwargs`` (as generate() hands them to a ``custom_generate`` callable) as the
    loop reads a decoder-only model's: its decoder's mask and positions under the loop's names
    (``attention_mask``, ``position_ids``), the cache and flags as they are; and its encoder states apart. A
    decoder-only model's kwargs come back as they are, with None."""
    if not is_encoder_decoder(model):
        return dict(model_kwargs), None
    check_inputs(model, model_kwargs)
    encoded = model_kwargs.get("encoder_outputs")
    if encoded is None:
        raise ValueError(f"{type(model).__name__} is an encoder-decoder and generate() handed hf_specdec no "
                         "encoder_outputs; call model.generate(inputs, ...) so that generate() runs the encoder.")
    hidden = encoded[0] if isinstance(encoded, (tuple, list)) else encoded.last_hidden_state
    mask = model_kwargs.get("attention_mask")
    per_layer = {name: None if isinstance(encoded, (tuple, list)) else encoded.get(name)
                 for name in ("hidden_states", "attentions")}  # (as plain generate() reads them)
    states = EncoderStates(hidden, mask, **per_layer,
                           outputs=None if isinstance(encoded, (tuple, list)) else encoded)
    view = {name: value for name, value in model_kwargs.items()
            if name not in ("encoder_outputs", "attention_mask") and name not in DECODER_ARGUMENTS.values()}
    for name, decoder_name in DECODER_ARGUMENTS.items():
        if name != "input_ids" and model_kwargs.get(decoder_name) is not None:
            view[name] = model_kwargs[decoder_name]
    return view, states


def draft_states(draft_model, target: EncoderStates, inputs_tensor: torch.Tensor | None,
                 given: Mapping[str, Any] | None = None) -> EncoderStates | None:
    """The encoder states ``draft_model``'s forwards read, for a call whose target reads ``target``: an
    encoder-decoder draft's own, its encoder run once on ``inputs_tensor`` (the call's encoder input) with the
    target's encoder mask and the call's other inputs its forward takes (``given``: a document's boxes, its
    images), as transformers' assisted generation runs it; the target's, for a decoder-only draft
    that reads an encoder (its encoder must be the target's: distil-whisper); None for any other draft (it
    drafts from the decoder tokens alone)."""
    if not reads_encoder(draft_model):
        return None
    if not is_encoder_decoder(draft_model):
        if int(target.hidden.shape[-1]) != int(getattr(draft_model.config, "d_model", target.hidden.shape[-1])):
            raise ValueError(
                f"The draft {type(draft_model).__name__} reads the target's encoder states, whose width "
                f"({int(target.hidden.shape[-1])}) is not its d_model ({draft_model.config.d_model}); a decoder-only "
                "draft must share the target's encoder (distil-whisper's), or use an encoder-decoder draft.")
        return target.shared()
    if inputs_tensor is None:
        raise ValueError("An encoder-decoder draft runs its own encoder on the call's inputs, which generate() did "
                         "not hand over; call model.generate(inputs, ...) (not with encoder_outputs=).")
    config = copy.deepcopy(draft_model.generation_config)
    kwargs: dict[str, Any] = {name: value for name, value in (given or {}).items()  # (the encoder input is
                              if name not in DECODER_ARGUMENTS.values() and name != draft_model.main_input_name}
    # ``inputs_tensor``)
    if target.mask is not None:
        kwargs["attention_mask"] = target.mask
    inputs, name, kwargs = draft_model._prepare_model_inputs(inputs_tensor, config.bos_token_id, kwargs)
    with torch.no_grad():
        kwargs = draft_model._maybe_prepare_encoder_kwargs_for_generation(inputs, kwargs, name, config)
    encoded = kwargs["encoder_outputs"]
    if isinstance(encoded, (tuple, list)):
        return EncoderStates(encoded[0], target.mask, EncoderReading.OWN)
    return EncoderStates(encoded.last_hidden_state, target.mask, EncoderReading.OWN, outputs=encoded)


def draft_reads_ids_only(draft_model) -> bool:
    """Can a narrowed output layer run the draft's base model (``drafters.draft_model.SubVocabHead``)? Not for a
    model reading encoder states: its base model takes them under other names."""
    return not reads_encoder(draft_model)


def generate_output(model, inputs, decoded, stats) -> GenerateEncoderDecoderOutput:
    """What plain ``generate`` returns for an encoder-decoder with ``return_dict_in_generate``, from the call's
    ``loop.DecodeInputs`` and the loop's ``loop.Decoded``: per step the scores, logits, decoder hidden states,
    decoder attentions and cross-attentions asked for, the encoder's hidden states and attentions from its one
    run (as plain reads them: where their flag is set), the cache, and the call's stats. A class whose own
    generate() takes the output apart by its fields (Whisper's, which routes its calls here) gets plain's own
    type, which has no field for the stats (``model.last_spec_stats`` holds them)."""

    encoder = inputs.model_inputs.encoder
    fields = dict(sequences=decoded.sequences, scores=decoded.scores or None, logits=decoded.logits or None,
                  encoder_hidden_states=encoder.hidden_states if inputs.output_hidden_states else None,
                  encoder_attentions=encoder.attentions if inputs.output_attentions else None,
                  decoder_hidden_states=decoded.hidden_states or None, decoder_attentions=decoded.attentions or None,
                  cross_attentions=decoded.cross_attentions or None, cache=decoded.cache)
    if type(model).generate is not GenerationMixin.generate:  # its own generate(), which routed the call here
        return GenerateEncoderDecoderOutput(**fields)
    return SpecGenerateEncoderDecoderOutput(**fields, spec_stats=stats)


@dataclass
class SpecGenerateEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """``GenerateEncoderDecoderOutput`` (what plain ``generate`` returns for an encoder-decoder with
    ``return_dict_in_generate``) plus the stats of the call."""

    spec_stats: Any = None
