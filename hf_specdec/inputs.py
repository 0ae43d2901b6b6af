"""The model inputs of a call besides its tokens, carried as plain ``generate`` carries them.

Besides the mask, the positions and the cache, which the loop gives the model itself (``cache.KVStore``),
``generate`` hands a ``custom_generate`` callable the model's other inputs: per-token inputs (``token_type_ids``,
``mm_token_type_ids``), images and audio (``pixel_values``, ``image_sizes``, grids, ``input_features``, or the
``mm_encoder_outputs`` that ``generate`` encoded from them before the call), a prompt given as ``inputs_embeds``,
and positions that depend on the images (multimodal RoPE: ``position_ids`` [K, B, P], Qwen2-VL's K = 4: the text
positions, then the M-RoPE rows from ``get_rope_index``). Plain ``generate`` builds every forward's inputs with
the model's own ``prepare_inputs_for_generation``: the prompt's with ``is_first_iteration=True`` (images
included), each later one over one new token, its inputs grown by ``_update_model_kwargs_for_generation`` (the
prompt's last ``token_type_ids`` repeated, ``mm_token_type_ids`` 0, every position row + 1).

``ModelInputs`` is that, made once per call by asking those two methods of the model what its prompt forward and
its next one-token step get (``from_generate``):

prefill
    the extra inputs of the prompt's forward, images and prompt embeddings included; per-token ones (and the
    embeddings) cut to the columns a prefill reads;
step
    what every later forward gets for its n new inputs, wherever they sit (a chain, a trie's nodes, a Jacobi
    window): a per-token input (``PER_TOKEN``) at the value plain gives a new token, the same for every new
    token (IDEFICS' ``image_attention_mask``: the images the prompt's last token attends to); any other input
    plain passes on a step, unchanged. A forward over n new tokens reads what n one-token steps of plain would
    read; images are read once, at the prefill. Where the model's step reads what the prompt's forward returned
    (IDEFICS: the encoded images, ``image_encoder_embeddings``), the step is made from that forward's output
    (``StepMaker``, ``after_prefill``), as plain's second step is;
positions
    the model's positions from the store's text positions (``cumsum(mask) - 1``, a trie node at its depth):
    the same, or, where ``generate`` gave [K, B, P] positions, each row + the offset of the row's last prompt
    token (Qwen2-VL: ``rope_deltas`` on rows 1-3, 0 on row 0), which is where plain's "+ 1 per step" leads.

A call without any of these gets ``NO_INPUTS``: its forwards get no extra argument and the same positions, and
``from_generate`` asks the model nothing.

Worked example: GPT-2 with ``token_type_ids`` [[0, 0, 3]] and a Qwen2-VL-style prompt whose last token sits at
text position 9 and M-RoPE position 6 (an image of 3x3 patches folded 9 tokens into 6 positions). Every new token
gets type 3; a trie round at text positions 10, 11, 11 gets positions [[10, 11, 11], [7, 8, 8], ...]:

>>> typed = ModelInputs(step_tokens={"token_type_ids": torch.tensor([[3]])})
>>> typed.step(3)["token_type_ids"].tolist()
[[3, 3, 3]]
>>> rope = ModelInputs(offsets=torch.tensor([0, -3, -3, -3])[:, None, None])  # [K, B, 1]
>>> rope.positions(torch.tensor([[10, 11, 11]]))[:, 0].tolist()
[[10, 11, 11], [7, 8, 8], [7, 8, 8], [7, 8, 8]]
>>> dict(NO_INPUTS.step(3)), NO_INPUTS.positions(torch.tensor([[10]])).tolist()
({}, [[10]])
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch
from transformers import GenerationMixin
from transformers.utils import ModelOutput

NO_KWARGS: Mapping[str, Any] = MappingProxyType({})

# What the loop gives the model itself (cache.call_model / KVStore), or what changes no output: never an extra
# input. The output_* flags are the output side's (return_dict_in_generate).
SUPPLIED = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                      "logits_to_keep", "cache_position", "return_dict", "output_attentions", "output_hidden_states",
                      "next_sequence_length"})
# The per-token inputs: one value per token along dimension 1 ([B, P], or [B, P, ...]: IDEFICS' image_attention_mask
# [B, P, images], the images each token attends to; Mllama's cross_attention_mask [B, P, images, tiles]), sliced to
# the new tokens by ``prepare_inputs_for_generation`` (as are the positions); the value of a new token is what the
# model's own step gives it (``from_generate``: both models grow their mask by a copy of its last row).
PER_TOKEN = frozenset({"token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids", "image_attention_mask",
                       "cross_attention_mask"})
# per-token inputs that tie each token to the images it attends to: a model that takes one reads its images by
# cross-attention and reads no prompt without them (``for_draft``)
IMAGE_BOUND = frozenset({"image_attention_mask", "cross_attention_mask"})
EMBEDS = "inputs_embeds"
# model types whose forward builds the per-layer-type masks (full, sliding) from the one mask it is given and hands
# a 4-D one to every layer as it is: they take one 4-D mask, never a mapping of them (``cache.KVStore``)
ONE_MASK_MODELS = frozenset({"paligemma"})
# inputs generate() builds from the caller's own before a custom_generate callable sees them: named in a refusal
# by what the caller passed
MADE_BY_GENERATE = MappingProxyType({
    "mm_encoder_outputs": "the image / video inputs (pixel_values, ...), which generate() encoded into "
                          "mm_encoder_outputs,",
    "encoder_outputs": "the encoder inputs, which generate() encoded into encoder_outputs,",
})


class UnsupportedInput(ValueError):
    """A model input hf_specdec cannot carry as plain ``generate`` does; the message names it and the way out."""


def _rows_of(value, index: torch.Tensor, rows: int, grouped: bool = False):
    """``value`` restricted to the batch rows ``index`` when it has one entry per row (a tensor of ``rows``
    first entries), or, ``grouped``, k entries per row in row order (``rows`` x k first entries: IDEFICS' encoded
    images, k per row); anything else is the same for every row."""
    if not isinstance(value, torch.Tensor) or not value.dim():
        return value
    if value.shape[0] == rows:
        return value[index.to(value.device)]
    if grouped and value.shape[0] % rows == 0:
        return value.reshape(rows, -1, *value.shape[1:])[index.to(value.device)].flatten(0, 1)
    return value


def _grown(value: torch.Tensor, n: int) -> torch.Tensor:
    """A per-token input's value of one new token [B, 1, ...] for n new tokens [B, n, ...]."""
    return value.expand(-1, n, *value.shape[2:])


@dataclass(frozen=True)
class CallerPrompt:
    """The caller's prompts as laid out, which a model whose inputs are tied to that layout (images: Llava's
    placeholder tokens, IDEFICS' ``image_attention_mask`` rows, multimodal RoPE positions) reads at its prefill as
    the target reads them: every column, padding and holes masked. A draft model's own batch would otherwise hold
    only the attended tokens (``DraftModelDrafter``), which no longer line up with its image inputs.

    input_ids: [B, P]; mask: [B, P] (None: all ones); positions: [B or 1, P] the caller's text positions (None:
    ``cumsum(mask) - 1``, as plain derives them)."""

    input_ids: torch.LongTensor
    mask: torch.Tensor | None = None
    positions: torch.LongTensor | None = None


@dataclass(frozen=True)
class ModelInputs:
    """The extra inputs of one call's forwards (module docstring). Per-row tensors are in the batch's row order
    (``select_rows`` follows the rows that finish).

    prefill: the prompt forward's extra inputs ([B, P] per-token, [B, P, D] ``inputs_embeds``, images whole);
    prompt_positions: the prompt's positions where the model's own preparation gives it others than the text
    positions ([K, B, P] multimodal, or [B, P] shifted), else None; offsets: [K, B, 1] or [B, 1] model positions -
    text positions of every later token, else None;
    step_tokens: per-token input -> [B, 1] the value of every new token; step_constant: the rest of a step's
    (a tensor with one entry per row follows the rows, ``select_rows``); rows: B.
    prompt_valid: [B, P] the prompt's real (unpadded) columns, None without padding (to lay a row's per-token
    values out for a draft model's own batch: ``for_draft``).
    grouped: the step inputs with k entries per row in row order (B x k first entries), taken from the prompt
    forward's outputs (IDEFICS' encoded images: k images per row), which ``select_rows`` selects k at a time.
    awaiting: how to make the step's inputs once the prompt's forward returns, where the model's update reads
    its outputs (``StepMaker``, ``after_prefill``); None once they are made.
    encoder: the encoder states every forward of an encoder-decoder's decoder (or of a decoder reading another
    model's encoder) cross-attends to (``encoder_decoder.EncoderStates``), in the batch's row order; None for others.
    layout: the caller's prompts as laid out, for a draft model whose inputs are tied to that layout (``laid_out``:
    its images): it reads them so at its prefill, as the target does (``CallerPrompt``); None for others.
    """

    prefill: Mapping[str, Any] = field(default_factory=lambda: NO_KWARGS)
    prompt_positions: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    step_tokens: Mapping[str, torch.Tensor] = field(default_factory=lambda: NO_KWARGS)
    step_constant: Mapping[str, Any] = field(default_factory=lambda: NO_KWARGS)
    prompt_valid: torch.Tensor | None = None
    rows: int = 0
    grouped: frozenset[str] = frozenset()
    awaiting: "StepMaker | None" = None
    encoder: Any = None
    layout: "CallerPrompt | None" = None

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.step_tokens or self.step_constant or self.offsets is not None
                    or self.prompt_positions is not None or self.encoder is not None)

    @property
    def laid_out(self) -> bool:
        """Are these inputs tied to the caller's prompt batch as laid out (images, [K, B, P] positions, a prompt's
        embeddings), so that a model reads its prompt in that layout (a draft model: ``layout``; ``relaid`` keeps
        them as they are)? Per-token inputs alone follow any layout."""
        return self.prompt_positions is not None or any(name not in PER_TOKEN for name in self.prefill)

    @property
    def embeds(self) -> torch.Tensor | None:
        """[B, P, D] the prompt as embeddings (``inputs_embeds``), or None."""
        return self.prefill.get(EMBEDS)

    def prompt_ids(self, input_ids: torch.LongTensor) -> torch.LongTensor:
        """The ids a store reads the prompt as: ``input_ids``, or for a prompt given as embeddings without ids
        of its width, placeholders of its width (the model reads the embeddings there, never these)."""
        embeds = self.embeds
        if embeds is None or input_ids.shape[1] == embeds.shape[1]:
            return input_ids
        return torch.zeros(embeds.shape[:2], dtype=torch.long, device=input_ids.device)

    def prefill_kwargs(self, n: int) -> Mapping[str, Any]:
        """The prompt forward's extra inputs when it reads the prompt's last ``n`` columns."""
        if not self.prefill and self.encoder is None:
            return NO_KWARGS
        out = {} if self.encoder is None else self.encoder.kwargs()
        for name, value in self.prefill.items():
            if name in PER_TOKEN and value.shape[1] != n:
                value = value[:, -n:]
            elif name == EMBEDS and value.shape[1] != n:
                value = value[:, -n:]
            out[name] = value
        if EMBEDS in out:
            out["input_ids"] = None  # the model reads the embeddings, as plain's first step
        return out

    def prefill_positions(self, text: torch.Tensor) -> torch.Tensor:
        """Model positions of a prefill over the prompt's last n columns, from their text positions [B, n]."""
        if self.prompt_positions is None:
            return text
        return self.prompt_positions[..., -text.shape[1]:].to(text.device)

    def step(self, n: int) -> Mapping[str, Any]:
        """The extra inputs of a later forward over n new inputs (a constant mapping when there are none)."""
        if self.encoder is not None:
            return {**self.step_constant, **self.encoder.kwargs(),
                    **{name: _grown(value, n) for name, value in self.step_tokens.items()}}
        if not self.step_tokens:
            return self.step_constant
        return {**self.step_constant, **{name: _grown(value, n) for name, value in self.step_tokens.items()}}

    def after_prefill(self, output) -> "ModelInputs":
        """These inputs once the prompt's forward returned ``output`` (the model's output object): with the step's
        inputs made from it where they await it (``awaiting``), else these."""
        if self.awaiting is None:
            return self
        return self.awaiting.fill(self, self.awaiting.grown(output))

    def positions(self, text: torch.Tensor) -> torch.Tensor:
        """Model positions of later inputs from their text positions [B, n]: the same, or [K, B, n]."""
        if self.offsets is None:
            return text
        text = text.to(self.offsets.device)
        return (text[None] if self.offsets.dim() == 3 else text) + self.offsets

    def select_rows(self, index: torch.Tensor) -> "ModelInputs":
        """The same inputs for the batch rows ``index`` (in that order), after others finished."""
        if self.empty:
            return self
        return dataclasses.replace(
            self, prefill=NO_KWARGS, prompt_positions=None, prompt_valid=None, layout=None,
            rows=int(index.shape[0]),
            offsets=None if self.offsets is None else self.offsets[..., index.to(self.offsets.device), :],
            step_tokens={name: value[index.to(value.device)] for name, value in self.step_tokens.items()},
            step_constant={name: _rows_of(value, index, self.rows, name in self.grouped)
                           for name, value in self.step_constant.items()},
            encoder=None if self.encoder is None else self.encoder.select_rows(index))

    def for_draft(self, draft_model) -> "ModelInputs":
        """What a draft model's forwards get of these: the per-token inputs its forward takes (a text-only draft
        reads the images' placeholder ids at text positions; images encoded for the target are not its inputs: a
        multimodal draft gets its own, ``from_generate``, and reads the caller's layout, ``CallerPrompt``). Raises
        ``UnsupportedInput`` for a draft that reads its images by cross-attention (``IMAGE_BOUND``): it cannot read
        a prompt as text."""
        takes = frozenset(inspect.signature(type(draft_model).forward).parameters)
        bound = sorted(IMAGE_BOUND & takes & (set(self.prefill) | set(self.step_tokens)))
        if bound:
            raise UnsupportedInput(
                f"hf_specdec cannot run the draft model ({type(draft_model).__name__}) on this prompt: it reads "
                f"images through {bound[0]}, and here it would read the prompt as text (a cache passed in holds "
                "the prompt's first tokens, which the draft has not read, or its own image inputs were not passed), "
                "which it cannot do without images. Pass the whole prompt with its images and no cache, use a "
                "text-only draft model, or decoding='lookahead'.")
        tokens = {name: value for name, value in self.step_tokens.items() if name in takes}
        if not tokens:
            return NO_INPUTS
        return ModelInputs(prefill={name: self.prefill[name] for name in tokens if name in self.prefill},
                           step_tokens=tokens, prompt_valid=self.prompt_valid, rows=self.rows)

    def relaid(self, rows: Sequence[int], lengths: Sequence[int], width: int) -> "ModelInputs":
        """These per-token inputs for a batch of its own (a draft model's): the caller's rows ``rows``, row i
        holding its first ``lengths[i]`` tokens (the prompt without padding, then new tokens), left-padded to
        ``width``. Pads take 0. Inputs ``laid_out`` stay as they are (the batch must be the caller's prompts);
        encoder states take the rows."""
        index = torch.tensor(list(rows), dtype=torch.long)
        encoder = None if self.encoder is None else self.encoder.select_rows(index)
        if not self.step_tokens or self.laid_out:
            return self if encoder is None or list(rows) == list(range(self.rows)) else \
                dataclasses.replace(self, encoder=encoder, rows=len(rows))
        prefill = {}
        for name, step in self.step_tokens.items():
            prompt = self.prefill.get(name)
            out = torch.zeros(len(rows), width, *step.shape[2:], dtype=step.dtype, device=step.device)
            for i, (row, length) in enumerate(zip(rows, lengths)):
                own = prompt[row] if prompt is not None else step[row, :0]
                if prompt is not None and self.prompt_valid is not None:
                    own = own[self.prompt_valid[row].to(own.device)]
                own = torch.cat([own, step[row].expand(max(0, length - own.shape[0]), *step.shape[2:])])[:length]
                if length:
                    out[i, width - length:] = own
            prefill[name] = out
        return ModelInputs(prefill=prefill, step_tokens={name: value[index.to(value.device)]
                                                         for name, value in self.step_tokens.items()},
                           rows=len(rows), encoder=encoder)

    @classmethod
    def from_generate(cls, model, input_ids: torch.LongTensor, model_kwargs: Mapping[str, Any]) -> "ModelInputs":
        """The inputs plain ``generate`` would give ``model``'s forwards, from the ``model_kwargs`` it hands a
        ``custom_generate`` callable: the prompt's forward and a next step, each from the model's own
        ``prepare_inputs_for_generation`` (a step's inputs grown by its ``_update_model_kwargs_for_generation``).
        Raises ``UnsupportedInput`` for an input a step changes in a way hf_specdec does not know how to carry
        over n new tokens."""
        given = {name: value for name, value in model_kwargs.items() if name not in SUPPLIED and value is not None}
        positions = model_kwargs.get("position_ids")
        multi_positions = isinstance(positions, torch.Tensor) and positions.dim() == 3
        own = type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation
        if not given and not multi_positions and not (own and positions is not None):
            return NO_INPUTS  # the loop's own arguments are what plain gives: nothing to ask the model
        mask = model_kwargs.get("attention_mask")
        kwargs = dict(given, attention_mask=mask, use_cache=True)
        if positions is not None:
            kwargs["position_ids"] = positions
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        first = model.prepare_inputs_for_generation(input_ids, cache=cache, is_first_iteration=True, **kwargs)
        prefill = {name: value for name, value in first.items() if name not in SUPPLIED and value is not None}
        steps = StepMaker(model, input_ids, cache, MappingProxyType(kwargs), MappingProxyType(first))
        prompt_positions = offsets = None
        prepared = first.get("position_ids")  # what plain's prompt forward gets: [K, B, P], or 1-indexed (PaliGemma)
        if prepared is not None and (positions is None or prepared.dim() == 3 or not torch.equal(prepared, positions)):
            if positions is not None and positions.dim() == 2:  # the store's text positions are these
                text_last = positions[:, -1]
            else:
                text_last = (mask.long().sum(-1) - 1 if mask is not None else
                             torch.full((positions.shape[-2],), positions.shape[-1] - 1, dtype=torch.long))
            text_last = text_last.to(prepared.device)[:, None]  # [B, 1]
            prompt_positions, offsets = prepared, prepared[..., -1:] - text_last  # offsets [B, 1] or [K, B, 1]
        valid = None if mask is None or bool(mask.bool().all()) else mask.bool().cpu()
        inputs = cls(prefill=prefill, prompt_positions=prompt_positions, offsets=offsets, prompt_valid=valid,
                     rows=int(input_ids.shape[0]))
        try:
            grown = steps.grown(ModelOutput())
        except AttributeError:  # its update reads what the prompt's forward returns (IDEFICS: the encoded images)
            return dataclasses.replace(inputs, awaiting=steps)
        return steps.fill(inputs, grown)


@dataclass(frozen=True)
class StepMaker:
    """How ``ModelInputs.from_generate`` asks the model what a step after the prompt gets: its
    ``_update_model_kwargs_for_generation`` over the prompt forward's outputs (``grown``), then its
    ``prepare_inputs_for_generation`` over one new token (``fill``). Most models' update reads no output but the
    cache, so the step is made before any forward; a model whose update reads more (IDEFICS: the images its vision
    model encoded, passed on to every step as ``image_encoder_embeddings``) waits for the prompt's forward
    (``ModelInputs.awaiting``, ``after_prefill``), as plain's second step does.

    model; input_ids [B, P] the prompt; cache: generate's; kwargs: the inputs ``from_generate`` prepared the
    prompt's forward from; first: what that preparation gave."""

    model: Any
    input_ids: torch.LongTensor
    cache: Any
    kwargs: Mapping[str, Any]
    first: Mapping[str, Any]

    def grown(self, outputs) -> dict:
        """The model's inputs for the step after the prompt, grown by its own update from ``outputs``."""
        return self.model._update_model_kwargs_for_generation(outputs, dict(self.kwargs), is_encoder_decoder=False,
                                                              num_new_tokens=1)

    def fill(self, inputs: "ModelInputs", grown: Mapping[str, Any]) -> "ModelInputs":
        """``inputs`` with the step's: per-token inputs at the value of a new token, the rest as the step gets
        them; an input taken from the prompt forward's outputs (a tensor ``grown`` has and the prompt's inputs had
        not) holds the batch's rows in order, k entries each (``ModelInputs.grouped``). Raises
        ``UnsupportedInput`` for an input a step changes in a way hf_specdec does not know how to carry over n
        new tokens."""
        grown = {name: value for name, value in grown.items() if name not in ("cache", "past_key_values")}
        read = {id(value) for name, value in grown.items()
                if name not in self.kwargs and isinstance(value, torch.Tensor)}  # from the outputs
        step_ids = torch.cat([self.input_ids, self.input_ids.new_zeros(self.input_ids.shape[0], 1)], dim=1)
        step = self.model.prepare_inputs_for_generation(step_ids, next_sequence_length=1, cache=self.cache,
                                                        is_first_iteration=False, **grown)
        step_tokens, step_constant = {}, {}
        for name, value in step.items():
            if name in SUPPLIED or name == EMBEDS or value is None:
                continue
            if name in PER_TOKEN:
                step_tokens[name] = value[:, -1:]
                continue
            before = self.first.get(name)
            if isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor) and value.shape != before.shape:
                what = MADE_BY_GENERATE.get(name, name)
                raise UnsupportedInput(
                    f"hf_specdec does not know how {what} grows with new tokens (plain generate() gives it another "
                    f"shape on each step), so it cannot pass it to a forward over several new tokens as plain "
                    "generate() would; use plain generate() for this input.")
            step_constant[name] = value
        return dataclasses.replace(inputs, step_tokens=step_tokens, step_constant=step_constant, awaiting=None,
                                   grouped=frozenset(name for name, value in step_constant.items() if id(value) in read))


NO_INPUTS = ModelInputs()
