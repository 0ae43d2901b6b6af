"""How hf_specdec plugs into ``model.generate``: ``enable(model)`` and the ``custom_generate`` callables.

transformers' ``generate()`` prepares everything (generation config, special tokens, logits processors and
warpers, stopping criteria, a DynamicCache, max length) and then calls a ``custom_generate`` callable instead of
its own decoding method. hf_specdec uses that seam and nothing private:

- ``speculative_generate`` / ``lookahead_generate`` are such callables. transformers forwards to a callable only
  the keyword arguments it declares that ``_sample`` does not have, and drops ``assistant_model`` and
  ``streamer``, so the callables take ``draft_model=`` and ``spec_streamer=`` instead.
- ``enable(model)`` replaces ``generate`` on that one instance (the way transformers itself binds a Hub
  ``custom_generate``), so that ``model.generate(..., assistant_model=draft)`` and ``decoding="lookahead"`` route
  here with the usual argument names. Calls without them reach the original ``generate`` untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput, StopStringCriteria

from . import cache as kv
from .compiled import verifier_for
from .config import LookaheadConfig, PolicyKind, SpecConfig, TreeMode, auto_draft_vocab_size
from .costmodel import Estimates, reads_wait
from .drafters.base import DraftCall, DraftKind, DraftSource
from .drafters.early_exit import EarlyExit
from .drafters.lookahead import LookaheadSource
from .drafters.source import draft_kind, draft_source
from . import encoder_decoder as ed
from .inputs import NO_INPUTS, PER_TOKEN, SUPPLIED, CallerPrompt, ModelInputs
from .loop import DecodeInputs, decode
from .memory import LookaheadMemory, Seeding, SpeculativeMemory
from .models.packed import reordered_only_values
from .models.seeding import call_end, call_start_lookahead, call_start_speculative
from .policy import make_policy
from .stats import SpecStats, stats_holder
from .support import Unsupported, check_cache_implementation, check_own_generate, check_supported, tree_refusal

logger = logging.getLogger(__name__)

_ENABLED = "__hf_specdec__"


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the stats of the call."""

    spec_stats: SpecStats | None = None


def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft_model=None,
    spec_config: SpecConfig | dict | None = None,
    speculative_memory=None,
    spec_streamer=None,
    draft_model_inputs: dict | None = None,
    inputs_tensor: torch.Tensor | None = None,
    **model_kwargs,
):
    """``custom_generate`` callable: speculative decoding with ``draft_model`` (see module docstring).

    ``draft_model`` is a causal LM sharing the target's tokenizer, ``EarlyExit(N)`` (the target's own first N
    decoder layers, ``drafters/early_exit.py``), or any object implementing ``Drafter``.
    ``speculative_memory``: a ``SpeculativeMemory`` whose estimates for this draft the call starts from and
    refines (on its first call with this draft, seeded from the cached hardware profile: ``models.seeding``);
    None measures from scratch and keeps nothing.
    ``draft_model_inputs``: a multimodal draft's own image / audio inputs (``pixel_values``, grids, ...), which it
    reads with the prompts as plain generate() would (``model.generate`` after ``enable`` passes the caller's
    when the draft's forward takes them; generate() has encoded them for the target before this call); without
    them a draft gets the target's per-token inputs its forward takes and reads images as their placeholder ids.
    ``inputs_tensor``: the encoder input generate() encoded for an encoder-decoder target, which an
    encoder-decoder draft encodes too (``encoder_decoder.draft_states``).
    """
    stats_holder(model).set(None)  # a call that raises leaves no stats, never the previous call's
    if draft_model is None:
        raise ValueError("speculative_generate needs a draft model: pass draft_model=<a small causal LM>.")
    config = _as_config(spec_config, SpecConfig, "spec_config")
    if speculative_memory is not None and not isinstance(speculative_memory, SpeculativeMemory):
        raise ValueError(f"speculative_memory must be a hf_specdec.SpeculativeMemory or None, got "
                         f"{type(speculative_memory).__name__}.")
    rows = input_ids.shape[0]
    check_supported(model, "speculative", rows)
    source = draft_source(draft_model, model, speculative_memory)  # "auto" early exit: the N the memory prices best
    draft = _checked_draft(source, rows)  # the model whose forwards draft; None: a drafter of one's own
    config = _with_trees(config, model, draft)
    inputs = _prepare(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
                      spec_streamer)
    origin = call_start_speculative(speculative_memory, model, source)  # seeds a memory's first call
    estimates = speculative_memory.estimates(source.memory_key) if speculative_memory is not None else Estimates()
    lookup = config.history_lookup and config.policy == PolicyKind.ADAPTIVE  # fixed and heuristic k never read it
    call = DraftCall(model, logits_processor, do_sample=inputs.do_sample, vocab_size=inputs.vocab_size,
                     special_token_ids=_special_token_ids(generation_config), pad_token_id=inputs.pad_token_id,
                     history_lookup=lookup, batch=rows, verifier=inputs.verifier)
    if draft is not None:
        _check_same_family(model, draft)  # verified over the target's whole vocabulary, never cut to the draft's
        if estimates.draft_read.prior is None:
            estimates.draft_read.prior = compute_share(draft, model)
        call = dataclasses.replace(
            call, model_inputs=_draft_inputs(draft, inputs, draft_model_inputs, inputs_tensor),
            draft_vocab_size=_draft_vocab_size(config, inputs.vocab_size) if ed.draft_reads_ids_only(draft) else None)
    drafter = source.drafter(call)
    policy = make_policy(config, estimates, width=inputs.verifier.width, reads_wait=reads_wait(model.device))
    return _run(model, inputs, drafter, policy, spec_streamer, generation_config, "speculative", origin)


def lookahead_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    lookahead_config: LookaheadConfig | dict | None = None,
    lookahead_memory=None,
    spec_streamer=None,
    **model_kwargs,
):
    """``custom_generate`` callable: lookahead decoding (Jacobi window + n-gram pool), no draft model. A model that
    cannot read a trie in one forward (``support.tree_refusal``: no position ids, a mask or bias of its own) runs
    chains only: each round verifies the best path of the candidates, with no window.

    ``lookahead_memory``: a ``LookaheadMemory`` to read and extend (earlier calls' text, measured costs and
    acceptance; on its first call, the target's t(n) from the cached hardware profile); None starts from nothing
    and keeps nothing.
    """
    stats_holder(model).set(None)  # a call that raises leaves no stats, never the previous call's
    config = _as_config(lookahead_config, LookaheadConfig, "lookahead_config")
    if lookahead_memory is not None and not isinstance(lookahead_memory, LookaheadMemory):
        raise ValueError(f"lookahead_memory must be a hf_specdec.LookaheadMemory or None, got "
                         f"{type(lookahead_memory).__name__}.")
    check_supported(model, "lookahead", input_ids.shape[0])
    trees = tree_refusal(model) is None  # else chains only, every round of the call (docs/lookahead.md)
    inputs = _prepare(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
                      spec_streamer)
    origin = call_start_lookahead(lookahead_memory, model)  # seeds a memory's first call
    memory = lookahead_memory if lookahead_memory is not None else LookaheadMemory()
    source = LookaheadSource(config, memory, remember=lookahead_memory is not None, trees=trees)
    drafter = source.drafter(DraftCall(model, inputs.logits_processor, do_sample=inputs.do_sample,
                                       vocab_size=inputs.vocab_size, pad_token_id=inputs.pad_token_id))
    return _run(model, inputs, drafter, make_policy(config, memory.estimates, width=inputs.verifier.width),
                spec_streamer, generation_config, "lookahead", origin)


# -- shared preparation ---------------------------------------------------------------------------------------------
def _as_config(value, cls, name):
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls.from_dict(value)
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be a {cls.__name__} or a dict of its fields, got {type(value).__name__}.")
    return value


def _checked_draft(source: DraftSource, rows: int):
    """The model whose forwards draft (``source.model``), refused where hf_specdec cannot run it exactly as a
    draft; None: a drafter of one's own, which runs no model of the draft's."""
    if source.model is not None:
        check_supported(source.model, "speculative", rows, role="draft")
    return source.model


def _with_trees(config: SpecConfig, model, draft_model) -> SpecConfig:
    """``tree="auto"`` becomes "off" where the target or the draft model cannot read a tree in one forward
    (``support.tree_refusal``: position ids, a 4-D mask); ``tree="on"`` is refused there. ``draft_model`` None: a
    drafter of one's own, which says in its offers whether it drafts trees."""
    if config.tree == TreeMode.OFF:
        return config
    models = [(role, checked) for role, checked in (("target", model), ("draft", draft_model)) if checked is not None]
    for role, checked in models:
        reason = tree_refusal(checked)
        if reason is None:
            continue
        if config.tree == TreeMode.ON:
            name = f"{type(checked).__name__} ({getattr(checked.config, 'model_type', '?')})"
            raise Unsupported(f"SpecConfig(tree='on') needs a {role} model that reads a tree of guesses in one "
                              f"forward, and this one cannot ({name}: {reason}); use tree='auto' (chains where "
                              "trees cannot run) or tree='off'.")
        return dataclasses.replace(config, tree=TreeMode.OFF.value)
    return config


def _draft_vocab_size(config: SpecConfig, shared: int) -> int | None:
    if config.draft_vocab_size == "auto":
        return auto_draft_vocab_size(shared)
    return config.draft_vocab_size


def _special_token_ids(generation_config: GenerationConfig) -> tuple[int, ...]:
    ids = []
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(generation_config, name, None)
        if value is None:
            continue
        ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return tuple(int(i) for i in ids)


def vocab_size(model) -> int:
    """Rows of the output layer (the logits a model computes); the config's vocab_size without one."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def compute_share(draft_model, model) -> float:
    """The draft's share of the target's compute per token: its parameters over the target's, embeddings
    excluded (a lookup, not a product). The prior of the draft's prompt read as a share of the target's
    (``costmodel.ReadCost``) until a read was timed."""
    def count(m) -> int:  # a packed model's reordered weights count as the parameters they were
        own = m.num_parameters(exclude_embeddings=True) if hasattr(m, "num_parameters") else \
            sum(p.numel() for p in m.parameters())
        return int(own) + reordered_only_values(m)

    return count(draft_model) / max(1, count(model))


def _check_same_family(model, draft_model) -> None:
    target_vocab, draft_vocab = vocab_size(model), vocab_size(draft_model)
    if min(target_vocab, draft_vocab) < 0.95 * max(target_vocab, draft_vocab):
        raise ValueError(
            f"Target and draft vocabularies differ too much ({target_vocab} vs {draft_vocab} rows) to be one "
            "tokenizer with padding. hf_specdec needs a draft that shares the target's tokenizer; run "
            "`hf-specdec check --target T --draft D` to compare them, or pass tokenizer= and "
            "assistant_tokenizer= through enable(model) to use transformers' universal assisted generation."
        )


def _prepare(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs, streamer):
    """Refuse what the loop cannot do, and collect the loop's inputs."""
    if generation_config.num_beams > 1 or generation_config.num_return_sequences > 1:
        raise ValueError(  # through enable(model), num_beams > 1 runs transformers' beam search (route_generate)
            "hf_specdec does not do beam search or several return sequences "
            f"(num_beams={generation_config.num_beams}, num_return_sequences="
            f"{generation_config.num_return_sequences}); set both to 1, or call model.generate(num_beams=...) "
            "after hf_specdec.enable(model), which runs transformers' beam search."
        )
    returned = bool(generation_config.return_dict_in_generate)
    model_kwargs, encoder = ed.decoder_view(model, model_kwargs)  # an encoder-decoder's decoder, its encoder apart
    model_inputs = _model_inputs(model, input_ids, model_kwargs, encoder)
    if generation_config.use_cache is False:
        raise ValueError("Speculation needs the KV cache: do not pass use_cache=False.")
    kv.check_cache_supported(model_kwargs.get("cache", model_kwargs.get("past_key_values")))
    flags = {flag: returned and bool(getattr(generation_config, flag, False) or model_kwargs.get(flag))
             for flag in ("output_scores", "output_logits", "output_hidden_states", "output_attentions")}
    rows = input_ids.shape[0]
    if rows > 1 and streamer is not None:
        raise ValueError(
            f"With a batch of {rows} prompts, rows emit different numbers of tokens per round, so hf_specdec cannot "
            "stream them (streamer=). Drop it, or generate one prompt at a time."
        )
    mask = model_kwargs.get("attention_mask")  # zeros anywhere (padding, holes): masked as plain masks them
    positions = model_kwargs.get("position_ids")  # [K, B, P] multimodal positions are model_inputs'
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    cached, positions = _check_positions(model_inputs.prompt_ids(input_ids), mask, None if
                                         positions is not None and positions.dim() == 3 else positions, cache,
                                         generation_config)
    if cache is not None:  # a static cache holds the columns the call ends with: its uncached prompt and new tokens
        kv.check_cache_supported(cache, int(cache.get_seq_length()) - cached + int(generation_config.max_length) - 1)
    if mask is not None:
        mask = mask.to(input_ids.device)
        if bool(mask.all()):
            mask = None
    pad_token = getattr(generation_config, "_pad_token_tensor", None)
    if pad_token is None:
        pad_token = generation_config.pad_token_id
    pad_token = int(pad_token.reshape(-1)[0]) if isinstance(pad_token, torch.Tensor) else int(pad_token or 0)
    return DecodeInputs(
        target=model,
        input_ids=input_ids,
        attention_mask=mask,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        do_sample=bool(generation_config.do_sample),
        max_length=int(generation_config.max_length),
        vocab_size=vocab_size(model),
        pad_token_id=pad_token,
        attention=getattr(model.config, "_attn_implementation", None) or "eager",
        **flags,
        model_inputs=model_inputs,
        cache=cache,
        cached=cached,
        position_ids=positions,
        # plain generate() returns its cache with return_dict_in_generate, and extends a caller's in place
        return_cache=returned or bool(getattr(cache, "_is_user_defined", False)),
        verifier=verifier_for(model, generation_config, cache),  # compiled where plain's forward would be
    )


def _model_inputs(model, input_ids, model_kwargs: dict, encoder: ed.EncoderStates | None = None) -> ModelInputs:
    """The call's other model inputs, as plain generate() gives them to each forward (``inputs.py``); an
    encoder-decoder's encoder states besides (``encoder_decoder.decoder_view``)."""
    if encoder is not None:
        return ModelInputs(encoder=encoder, rows=int(input_ids.shape[0]))
    return ModelInputs.from_generate(model, input_ids, model_kwargs)


def _draft_inputs(draft_model, inputs: DecodeInputs, given: dict | None,
                  inputs_tensor: torch.Tensor | None = None) -> ModelInputs:
    """What the draft model's forwards get: with image / audio inputs of its own (``draft_model_inputs``), those
    and its per-token inputs as plain generate() would give them to it (its own positions: multimodal RoPE);
    otherwise the target's per-token inputs its forward takes. A draft with images of its own reads the prompts in
    the caller's layout, mask included (``CallerPrompt``: padding and holes masked, each image's placeholders and
    per-token image rows where the caller put them), as the target does; a text-only draft reads them without their
    masked columns, left-padded (``DraftModelDrafter``). A draft of an encoder-decoder reads encoder states
    (``encoder_decoder.draft_states``: its own or the target's) or none."""
    encoder = inputs.model_inputs.encoder
    if encoder is not None or ed.is_encoder_decoder(draft_model):
        if encoder is None:
            raise Unsupported(f"The draft {type(draft_model).__name__} is an encoder-decoder and the target "
                              f"{type(inputs.target).__name__} is not: an encoder-decoder draft drafts for an "
                              "encoder-decoder target. Use a causal LM sharing the target's tokenizer as the draft.")
        states = ed.draft_states(draft_model, encoder, inputs_tensor, given)
        return NO_INPUTS if states is None else ModelInputs(encoder=states, rows=int(inputs.input_ids.shape[0]))
    if not given or not _draft_reads_caller_layout(inputs):
        return inputs.model_inputs.for_draft(draft_model)
    kwargs = {**given, "attention_mask": inputs.attention_mask}
    if kv.accepts_position_ids(draft_model):
        kwargs["position_ids"] = draft_model._prepare_position_ids_for_generation(inputs.input_ids, dict(kwargs))
    own = ModelInputs.from_generate(draft_model, inputs.input_ids, kwargs)
    if not own.laid_out or own.embeds is not None:  # (a prompt given as embeddings: the draft reads the new tokens)
        return own
    # the caller's text positions where they are the whole prompt's (a cache passed in: derived from the mask)
    positions = inputs.position_ids if not inputs.cached else None
    return dataclasses.replace(own, layout=CallerPrompt(inputs.input_ids, inputs.attention_mask, positions))


def _draft_reads_caller_layout(inputs: DecodeInputs) -> bool:
    """Can a draft read the caller's prompts as laid out: is ``input_ids`` the whole prompt, its mask (if any) over
    exactly its columns? Not where ``input_ids`` are the tokens after a cache passed in (the mask is longer): the
    draft has no cache of those.

    >>> from types import SimpleNamespace as Inputs
    >>> ids = torch.zeros(2, 3, dtype=torch.long)
    >>> [_draft_reads_caller_layout(Inputs(input_ids=ids, attention_mask=None if mask is None else torch.tensor(mask)))
    ...  for mask in (None, [[0, 1, 1], [1, 0, 1]], [[1, 1, 1, 1], [1, 1, 1, 1]])]
    [True, True, False]
    """
    mask = inputs.attention_mask
    return mask is None or tuple(mask.shape) == tuple(inputs.input_ids.shape)


def _draft_model_inputs(draft_model, kwargs: dict) -> dict | None:
    """The caller's model inputs a multimodal draft model reads (its forward takes them, images among them),
    before generate() encodes the images for the target; None for a text-only draft."""
    if draft_kind(draft_model) is not DraftKind.MODEL:
        return None
    forward = frozenset(inspect.signature(type(draft_model).forward).parameters)
    given = {name: value for name, value in kwargs.items()
             if value is not None and name in forward and name not in _GENERATE_ARGUMENTS and name not in SUPPLIED}
    return given if any(name not in PER_TOKEN for name in given) else None


# generate()'s own arguments and the generation config's fields: everything else a caller passes is a model input
_GENERATE_ARGUMENTS = (frozenset(inspect.signature(GenerationMixin.generate).parameters)
                       | frozenset(GenerationConfig().to_dict())
                       | {"input_ids", "tokenizer", "assistant_tokenizer", "stop_strings", "trust_remote_code"})


def _refuse_up_front(model, mode: str, args: tuple, kwargs: dict) -> None:
    """What the callable would refuse, refused before generate() runs anything: a model (or draft) hf_specdec
    cannot run exactly, and the model inputs the model's forward names that the loop cannot pass. Without this,
    generate() would first run an encoder or encode images, or a class's own generate() its own steps. Inputs the
    forward does not name are left to generate()'s own validation (a typo) and to the callable's check."""
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids", kwargs.get("input_features")))
    rows = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 else 1  # ids, features
    check_supported(model, mode, rows)
    check_own_generate(model, inputs)
    check_cache_implementation(model, kwargs)
    draft = kwargs.get("assistant_model")
    if mode == "speculative" and draft is not None:
        _checked_draft(draft_source(draft, model), rows)  # an early exit: its depth and its layers too
    if ed.is_encoder_decoder(model):
        ed.check_inputs(model, kwargs)


def _check_positions(input_ids, mask, positions, cache, generation_config) -> tuple[int, torch.Tensor | None]:
    """Which leading columns of ``input_ids`` the cache already holds, and the positions of the others, as plain
    generate()'s prefill decides them: with a mask (or, where generate() dropped an all-ones one, the length it
    recorded) as long as input_ids, input_ids is the whole prompt and the cache holds its first columns; with a
    longer one, input_ids are the new tokens after the cache's. Positions are the last columns of those generate()
    derived from the mask or the caller gave (plain generate() reads them so, and counts on from the last one).
    A mask may hold zeros anywhere (padding, holes). Returns (cached columns, positions [B or 1, n] or None)."""
    shape = tuple(input_ids.shape)
    rows, width = shape
    past = int(cache.get_seq_length()) if cache is not None else 0  # (a static cache counts in a tensor)
    lengths = (width, past + width)  # the whole prompt, or the cache's columns and the new tokens
    over = "over the cache's columns and input_ids" if past else "of input_ids' shape"
    advice = f"; pass an attention_mask {over} (1 for tokens, 0 for padding), or none."
    if mask is not None and (mask.dim() != 2 or mask.shape[0] != rows or mask.shape[1] not in lengths):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape {shape}{advice}")
    if positions is not None and (positions.dim() != 2 or positions.shape[0] not in (1, rows)
                                  or positions.shape[1] not in lengths):
        # generate() drops an all-ones mask but derives the positions from it: a wrong shape shows here
        raise ValueError(f"attention_mask (or position_ids) has shape {tuple(positions.shape)} but input_ids has "
                         f"shape {shape}{advice}")
    recorded = getattr(generation_config, "_mask_length", None)
    mask_length = mask.shape[1] if mask is not None else (recorded if recorded is not None else width)
    if mask_length not in lengths:
        raise ValueError(f"attention_mask has shape {(rows, mask_length)} but input_ids has shape {shape}{advice}")
    cached = past if mask_length == width else 0
    if past and cached >= width:
        raise ValueError(f"The cache passed in already holds {past} columns, and input_ids has {width}: nothing of "
                         "the prompt is left to read. Pass input_ids with at least one token after the cached ones "
                         "(the whole prompt, or only the new tokens with an attention_mask over both).")
    if positions is None:
        return cached, None
    read = width - cached
    return cached, positions[:, positions.shape[1] - read:].to(input_ids.device)


def _run(model, inputs, drafter, policy, streamer, generation_config, mode, origin: Seeding):
    stats = SpecStats(mode=mode, rows=int(inputs.input_ids.shape[0]), estimates_from=origin.kind,
                      estimates_why=origin.why)
    decoded = decode(inputs, drafter, policy, stats, streamer=streamer)
    call_end(model, origin, stats.verify_time_by_tokens, stats.rows)  # a cached profile it contradicts: stale
    stats_holder(model).set(stats)
    if not generation_config.return_dict_in_generate:
        return decoded.sequences
    if ed.is_encoder_decoder(model):
        return ed.generate_output(model, inputs, decoded, stats)
    return SpecGenerateOutput(sequences=decoded.sequences, scores=decoded.scores or None,
                              logits=decoded.logits or None, attentions=decoded.attentions or None,
                              hidden_states=decoded.hidden_states or None, cache=decoded.cache,
                              spec_stats=stats)


# -- enable(model) --------------------------------------------------------------------------------------------------
def enable(model):
    """Route ``model.generate(..., assistant_model=draft)`` and ``decoding="lookahead"`` through hf_specdec.

    Only this instance changes (its ``generate`` attribute); the class and every other model are untouched.
    It also gets ``model.lookahead_memory`` and ``model.speculative_memory``, which its calls share unless they
    pass ``lookahead_memory=`` / ``speculative_memory=`` (None: a call that neither reads nor writes it); see
    ``LookaheadMemory`` and ``SpeculativeMemory``; and ``model.last_spec_stats``, the calling thread's latest
    call's ``SpecStats`` (``stats.LastSpecStats``: per thread, reset when a call starts). ``disable(model)`` undoes
    all four. Returns the model.
    """
    if getattr(model.generate, _ENABLED, False):
        return model
    original = model.generate
    model.lookahead_memory = LookaheadMemory()
    model.speculative_memory = SpeculativeMemory()
    stats_holder(model)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        kwargs.setdefault("lookahead_memory", model.lookahead_memory)
        kwargs.setdefault("speculative_memory", model.speculative_memory)
        with stats_holder(model).opened():  # this thread's call's stats: none for a plain call or one that raises;
            # the hf_specdec calls made inside it (Whisper's long-form windows) combined
            return route_generate(original, *args, model=model, **kwargs)

    setattr(generate, _ENABLED, True)
    model.generate = generate
    return model


def route_generate(original, *args, model=None, assistant_model=None, assistant_early_exit=None, decoding=None,
                   spec_config=None, lookahead_config=None, lookahead_memory=None, speculative_memory=None, **kwargs):
    """Send a ``generate`` call to hf_specdec or, without ``assistant_model``/``assistant_early_exit``/``decoding``,
    to ``original``.

    ``model`` (the model ``original`` generates with) lets a call hf_specdec would refuse be refused before
    ``original`` runs anything (``_refuse_up_front``); without it the refusals come from the callable, after
    generate()'s own preparation."""
    if assistant_early_exit is None:  # transformers reads it from a generation config passed too
        assistant_early_exit = getattr(kwargs.get("generation_config"), "assistant_early_exit", None)
    if assistant_early_exit is not None:
        assistant_model = _early_exit_draft(assistant_early_exit, assistant_model, decoding)
    mode = decoding if decoding is not None else ("speculative" if assistant_model is not None else None)
    if mode is None:
        if spec_config is not None or lookahead_config is not None:
            raise ValueError("spec_config/lookahead_config given without assistant_model= or decoding=.")
        return original(*args, **kwargs)
    if mode not in ("speculative", "lookahead"):
        raise ValueError(f"decoding={decoding!r} is unknown: use 'speculative' (with assistant_model=) or 'lookahead'.")
    _check_mode_arguments(mode, assistant_model, spec_config, lookahead_config)
    beams = _num_beams(model, kwargs)
    if beams > 1:  # transformers' own way with an assistant: one warning, then beam search without it
        logger.warning("hf_specdec: num_beams=%d runs transformers' beam search, as generate() does with an "
                       "assistant; %s is unused.", beams,
                       "decoding='lookahead'" if mode == "lookahead" else "the draft (assistant_model=)")
        return original(*args, **kwargs)
    if kwargs.get("assistant_tokenizer") is not None:
        # different tokenizers: hf_specdec verifies token ids, so hand over to transformers' universal assisted generation
        logger.info("hf_specdec: assistant_tokenizer given, delegating to transformers' universal assisted generation.")
        return original(*args, assistant_model=assistant_model, **kwargs)
    if model is not None:
        _refuse_up_front(model, mode, args, {**kwargs, "assistant_model": assistant_model})
    streamer = kwargs.pop("streamer", None)
    _move_stop_strings(kwargs)
    if mode == "lookahead":
        return original(*args, custom_generate=lookahead_generate, lookahead_config=lookahead_config,
                        lookahead_memory=lookahead_memory, spec_streamer=streamer, **kwargs)
    if assistant_model is None:
        raise ValueError("decoding='speculative' needs assistant_model=<draft model>.")
    return original(*args, custom_generate=speculative_generate, draft_model=assistant_model,
                    spec_config=spec_config, speculative_memory=speculative_memory, spec_streamer=streamer,
                    draft_model_inputs=_draft_model_inputs(assistant_model, kwargs), **kwargs)


def _num_beams(model, kwargs: dict) -> int:
    """The call's ``num_beams``, as generate() resolves it: the argument, else the generation config passed, else
    the model's."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = kwargs.get("num_beams")
    return int(beams if beams is not None else getattr(config, "num_beams", None) or 1)


def _early_exit_draft(layers, assistant_model, decoding) -> EarlyExit:
    """transformers' ``assistant_early_exit=N`` as hf_specdec's draft: ``EarlyExit(N)``, the target's own first N
    decoder layers (``drafters/early_exit.py``); the range is checked against the target when the call starts."""
    if assistant_model is not None:
        raise ValueError("assistant_early_exit= drafts with the model's own first layers and would ignore "
                         "assistant_model=; pass one of them.")
    if decoding == "lookahead":
        raise ValueError("assistant_early_exit= is a draft for speculative decoding and decoding='lookahead' would "
                         "ignore it; drop one of them.")
    return EarlyExit.of(layers)


def _check_mode_arguments(mode, assistant_model, spec_config, lookahead_config) -> None:
    """Refuse the arguments of the other mode, which this call would silently ignore."""
    if mode == "lookahead" and assistant_model is not None:
        raise ValueError("decoding='lookahead' drafts from the model's own n-gram pool and would ignore "
                         "assistant_model=; drop assistant_model=, or drop decoding='lookahead' to draft with it.")
    if mode == "lookahead" and spec_config is not None:
        raise ValueError("spec_config= configures speculative decoding and decoding='lookahead' would ignore it; "
                         "pass lookahead_config= (a LookaheadConfig) instead, or drop it.")
    if mode == "speculative" and lookahead_config is not None:
        raise ValueError("lookahead_config= configures decoding='lookahead' and speculative decoding would ignore "
                         "it; pass spec_config= (a SpecConfig) instead, or drop it.")


def disable(model):
    """Undo ``enable(model)``."""
    if getattr(model.generate, _ENABLED, False):
        del model.generate
        model.__dict__.pop("lookahead_memory", None)
        model.__dict__.pop("speculative_memory", None)
        model.__dict__.pop("last_spec_stats", None)
    return model


def _move_stop_strings(kwargs: dict) -> None:
    """transformers drops ``tokenizer`` on the way to a custom_generate callable, and stop strings need it:
    turn ``stop_strings`` into a StopStringCriteria here, where the tokenizer is still at hand."""
    stop_strings = kwargs.pop("stop_strings", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if stop_strings is None:
        return
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass tokenizer=<your tokenizer> to generate().")
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
