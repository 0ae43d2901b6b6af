"""The one model call, and the slot table of a call's cache (each layer's tensors are its backend's: backends.py).

Speculation writes KV for tokens that may be thrown away, so every cache it uses must be able to forget them.
``KVStore`` keeps the slot table (which columns each row keeps, at which positions) and asks each layer's backend
(``backends.py``, one per kind of cache layer) to crop, gather, select rows or lend; a cache with a layer no
backend handles is refused up front with a clear message instead of failing mid-generation.

``call_model`` is the one model-call path: new tokens appended to a cache, a ``ForwardResult`` back (float logits
at the requested inputs, the last hidden states on request, an optional narrowed output layer).

``KVStore`` is the cache of a decoding call, addressed by slots (absolute cache columns): B rows (B = 1 for one
prompt) that advance by different numbers of tokens per round. It owns each row's kept tokens (``lengths``: how
many) and which columns each row attends to (``valid``), so that every forward sees exactly what plain
``generate`` would give the model: the prompt's position ids as ``generate`` gave them (``cumsum(attention_mask) -
1``, or the caller's ``position_ids``), each later token at the last one + 1 (``next_positions``: ``lengths`` plus
a per-row offset), padding, holes of the mask and rejected tokens masked. It decodes in a fresh cache or in one
passed in that holds the prompt's first columns (a chat's earlier turn), and a store that hands its cache back
leaves it as plain ``generate`` leaves it (``finish``). Operations:

``prefill(input_ids, mask)``   read the prompts' uncached tokens (padding and holes masked); they are kept at once;
``forward(batch, after=)``     write a round's stacked inputs (``layout.BatchInputs``) at new slots, each row at its
                               own positions: after its kept tokens, or continuing a slot written since the last
                               keep (a draft model drafting step by step); returns the result and the slots;
``keep(kept)``                 row r keeps the slots ``kept[r]`` (a path: its next positions, in order) of what was
                               written since the last keep, and forgets the rest of it;
``discard()``                  forget everything written since the last keep (also a failed forward's half-written
                               layers after an out-of-memory);
``compact()``                  gather each row's kept columns together and drop the columns no row keeps (by
                               itself once holes pass ``COMPACT_FRACTION``, or, ``compacts_on_keep=False``, as a
                               step of its owner's, when ``compaction_due``, timed apart from the forward);
``select_rows(rows)``          drop the rows that finished;
``lend(model)``                a store for an early-exit view of the model (its first layers) starting from this
                               store's kept keys and values in those layers, without copying them;
``feed(new_tokens, pad)``      run over each row that stopped early the forward plain ``generate`` runs after its
                               stop (its last token, then padding), for what plain returns of those steps;
``finish(new_tokens, pad)``    the cache as plain ``generate`` leaves it: the prompt and every emitted token but the
                               last, in plain's columns (a row that stopped early padded as plain pads it).

Worked example (one row, 10 prompt tokens, a trie round of 4 inputs: the last token and nodes a, b, c where
b and c are children of a). ``forward`` writes them at slots 10..13 (positions 10, 11, 12, 12); the target
accepts a -> c, so ``keep([[10, 11, 13]])``: the row keeps 13 tokens, slot 12 becomes a hole masked from then on,
and nothing is copied. Had it accepted a -> b (a prefix of what was written), the keep would be a crop. Holes are
compacted away when they pass ``COMPACT_FRACTION`` of the columns, or at once in models that cannot mask them
(sliding-window layers count columns; a model without ``position_ids`` counts positions by column). In a model
that counts positions by column, no column is ever dropped (``columns_are_positions``): a prompt's holes stay. In
one that reads positions only as column distances (T5: ``positions_are_distances``), every keep lays each row's
tokens out at plain's distances from each other, the next inputs of every row at one column (``_alignment``).

With one unpadded row and no holes, a chain forward passes no attention mask at all (the model's own causal
mask), as plain decoding does. ``rollback`` (crop every layer to a length) is the low-level step the offline
timings use.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import DynamicCache, EncoderDecoderCache, StaticCache
from transformers.cache_utils import Cache

from .backends import Buffers, RowStates, attends, backend_for, holds_states, keep_rows, layer_backends, prepare
from .encoder_decoder import DECODER_ARGUMENTS, argument, forward_params, is_encoder_decoder, positions_are_distances
from .encoder_decoder import reads_encoder
from .encoder_decoder import recorded as decoder_recorded
from .errors import Unsupported
from .inputs import NO_INPUTS, NO_KWARGS, ONE_MASK_MODELS, ModelInputs
from .layout import BatchInputs, to_model_mask
from .layout import positions as _arange


def new_cache(model) -> DynamicCache | EncoderDecoderCache:
    """A DynamicCache for ``model``; its sliding-window layers record their past so that they can roll back. A
    model that reads encoder states (an encoder-decoder, or WhisperForCausalLM) gets an ``EncoderDecoderCache`` of
    two, as generate() makes it: the decoder's self-attention and its cross-attention."""
    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config)  # as generate() makes it
    for layer in cache.layers:
        if hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    return EncoderDecoderCache(cache, DynamicCache(config=config)) if reads_encoder(model) else cache


def split_cache(cache: Cache) -> tuple[Cache, tuple[Cache, ...]]:
    """(the cache speculation writes to, the caches it only selects rows of): an encoder-decoder's self-attention
    cache and its cross-attention cache (the encoder's keys and values, fixed for the call); a decoder's own."""
    if isinstance(cache, EncoderDecoderCache):
        return cache.self_attention_cache, (cache.cross_attention_cache,)
    return cache, ()


def check_cache_supported(cache: Cache | None, columns: int | None = None) -> None:
    """Refuse caches that cannot roll back. ``None`` (a fresh cache will be made) is fine, and so are a
    ``DynamicCache`` and a ``StaticCache`` (``cache_implementation="static"``) that already hold the start of the
    prompt (a cache passed in: decoding continues from it; a static one in its own buffers, ``backends.Buffers``).
    ``columns``: those the call ends holding (the prompt and every new token but the last), which a static cache
    must have room for, as plain ``generate`` needs (it fails part-way through otherwise)."""
    if cache is None:
        return
    if isinstance(cache, EncoderDecoderCache) and all(type(part) is DynamicCache for part in split_cache(cache)[1]):
        cache = cache.self_attention_cache
    if type(cache) not in (DynamicCache, StaticCache) or (type(cache) is StaticCache and cache.offloading):
        offloaded = " (offloaded)" if getattr(cache, "offloading", False) else ""
        raise Unsupported(
            f"hf_specdec decodes with a DynamicCache or a StaticCache, which it rolls back after each round; got "
            f"{type(cache).__name__}{offloaded}. Offloaded static and quantized caches, and an encoder-decoder's "
            "static cache, are not supported. Pass cache=DynamicCache(config=model.config) (filled by an "
            "earlier forward or call, if you continue from one), a StaticCache, or no cache, and no "
            "cache_implementation='quantized'/'offloaded_static'; or use plain generate() with that cache."
        )
    if cache.layers and not all(backend_for(layer) is not None for layer in cache.layers):
        raise ValueError(
            "This model's cache has layers that cannot roll back (recurrent or linear attention), so speculative "
            "decoding cannot undo rejected tokens. Use plain generate() for this model."
        )
    buffers = Buffers.of(cache.layers)
    reason = None if buffers is None else buffers.refusal()
    if reason is None and buffers is not None and columns is not None:
        reason = buffers.check_room(columns)
    if reason is not None:
        raise Unsupported(
            f"hf_specdec cannot decode with this StaticCache: {reason}. Pass a StaticCache whose max_cache_len holds "
            "the call (and, in a model with sliding-window layers, is at most their window), or use the default "
            "dynamic cache (no cache_implementation, or cache=DynamicCache(config=model.config)), or plain generate()."
        )


def rollback(cache: Cache, length: int, window: bool = True) -> None:
    """Forget every cached position from ``length`` on, in every layer.

    Layers are cropped one by one, so a cache left uneven by a failed forward (out of memory half-way through
    the layers) is repaired too. ``window=False`` leaves a sliding-window layer holding every column it recorded
    (``DynamicSlidingWindowLayer.crop`` would also cut it to its window): a store that will hand its cache back
    crops it as plain ``generate`` leaves it only at the end (``KVStore.finish``).
    """
    for layer in cache.layers:
        backend_for(layer).crop(layer, length, window)


def accepts_position_ids(model) -> bool:
    return argument(model, "position_ids") in forward_params(type(model))


# ----------------------------------------------------------------------------------------------------------------
# The one model call
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    """Which per-layer outputs a forward also returns, for a caller of ``generate`` who asked for them
    (``output_hidden_states`` / ``output_attentions`` with ``return_dict_in_generate``). Nothing by default: a
    forward nobody asked to record computes and keeps nothing more than its logits."""

    hidden_states: bool = False
    attentions: bool = False

    def __bool__(self) -> bool:
        return self.hidden_states or self.attentions


NOTHING = Recording()
NOT_RECORDED = MappingProxyType(dict(hidden_states=None, attentions=None, cross_attentions=None))  # what
# ``encoder_decoder.recorded`` gives where nothing is recorded


@dataclass(frozen=True)
class ForwardResult:
    """What one forward gives back.

    logits: [B, m, V] float, at the requested inputs; hidden: [B, m, H] the last hidden states at the same inputs
    (only when asked, else None); slots: [B, n] the cache columns every input was written at (``KVStore.forward``
    only, else None), the handles ``KVStore.keep`` takes. What a ``Recording`` asked for, at every input:
    hidden_states, the model's tuple (embeddings, then each layer) of [B, n, D]; attentions, its tuple (one per
    layer) of [B, heads, n, past + n] weights over every cache column, or () where the attention kernel returns
    none (sdpa, as in plain ``generate``); None where not asked.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[torch.Tensor, ...] | None = None  # per layer [B, heads, n, S]: a model reading encoder
    # states (``encoder_decoder.recorded``), where attentions are asked
    output: Any = None  # the model's own output object, where asked (``call_model(keep_output=True)``)


LogitsAt = int | torch.Tensor | None  # the last n inputs, or [m] input indices, or None: every input

# Causal LMs whose forward is exactly ``logits = lm_head(base(...).last_hidden_state[:, logits_to_keep])`` (no logit
# scaling, no softcapping, no other output), read in each one's modeling file of transformers 5.25: ``call_model``
# runs their base model and ``lm_head`` itself (``plain_head``). By (module, class name): a subclass may differ.
PLAIN_HEADS = frozenset((f"transformers.models.{module}.modeling_{module}", name) for module, name in (
    ("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"), ("phi3", "Phi3ForCausalLM"), ("gemma", "GemmaForCausalLM"),
    ("olmo2", "Olmo2ForCausalLM"), ("smollm3", "SmolLM3ForCausalLM")))


def plain_head(model) -> torch.nn.Module | None:
    """``model``'s output layer where ``call_model`` may run the base model and that layer itself instead of the
    model's own forward (a class in ``PLAIN_HEADS``, whose forward is run as the class defines it: none set on the
    instance or patched onto the class, no hooks on the model itself), bit-identical logits without the wrapper's
    host work (its decorators, its output object); None for any other model (Gemma 2's softcapping, Granite's
    scaling, ...).

    >>> from hf_specdec.models.tiny import tiny_model
    >>> model = tiny_model("llama")
    >>> plain_head(model) is model.lm_head
    True
    """
    kind = type(model)
    forward = kind.forward  # the class's own, as its modeling file defines it (not one patched onto the class)
    if ((kind.__module__, kind.__qualname__) not in PLAIN_HEADS or "forward" in vars(model)
            or getattr(forward, "__qualname__", None) != f"{kind.__qualname__}.forward"
            or getattr(forward, "__module__", None) != kind.__module__
            or model._forward_hooks or model._forward_pre_hooks):
        return None
    return model.lm_head


def _select(states: torch.Tensor, logits_at: LogitsAt) -> torch.Tensor:
    """[B, n, ...] -> [B, m, ...]: the inputs ``logits_at`` asks for.

    >>> states = torch.arange(5)[None, :, None]  # [1, 5, 1]
    >>> _select(states, 2).flatten().tolist(), _select(states, torch.tensor([0, 3])).flatten().tolist()
    ([3, 4], [0, 3])
    """
    if isinstance(logits_at, torch.Tensor):
        return states[:, logits_at.to(states.device)]
    return states if logits_at is None else states[:, -logits_at:]


def call_model(
    model,
    input_ids: torch.LongTensor,  # [B, n] new tokens
    cache: Cache,
    *,
    logits_at: LogitsAt = 1,
    position_ids: torch.LongTensor | None = None,  # [B, n], default: the model's (continue after the cache)
    attention_mask: torch.Tensor | dict | None = None,  # 2-D [B, past + n], 4-D [B, 1, n, past + n] (or one per
    # layer kind), or None (the model's causal mask)
    hidden: bool = False,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    record: Recording = NOTHING,
    model_inputs: Mapping[str, Any] = NO_KWARGS,  # the call's other inputs for this forward (``inputs.py``)
    rolls_back: bool = True,  # the forward may be rolled back (False: a prompt read, kept whole)
    keep_output: bool = False,  # also return the model's output object (``ForwardResult.output``)
    call: Callable | None = None,  # runs the model's forward in its stead (``compiled.CompiledVerify``: compiled)
    slots: torch.Tensor | None = None,  # ``ForwardResult.slots``, passed through (``KVStore.forward``)
) -> ForwardResult:
    """One forward over ``input_ids`` appended to ``cache`` (the cache grows by n columns in every layer).

    ``head`` replaces the model's output layer (``drafters.draft_model.SubVocabHead``, a narrowed vocabulary):
    the base model runs and the head maps its hidden states [B, m, H] to logits. ``hidden`` also returns the
    hidden states (without a head: the model's last reported hidden states, for most models after the final
    norm). The model computes logits only where asked when it can (``logits_to_keep``). ``record`` also returns
    every input's hidden states and attention weights (``ForwardResult``), the model's flags set as plain
    ``generate`` sets them; with a ``head``, those of the base model. ``model_inputs`` go to the model as they
    are (``inputs.ModelInputs``: what plain ``generate`` gives this forward besides tokens, positions and mask).
    A recurrent layer records the state before each input of a forward that ``rolls_back`` (``backends.prepare``).
    A model in ``PLAIN_HEADS`` asked for logits alone runs as its base model and its own output layer as ``head``.
    """
    prepare(split_cache(cache)[0].layers, input_ids.shape[1] if rolls_back else 0)
    if head is None and call is None and not hidden and not record and not keep_output:
        head = plain_head(model)
    if head is not None:
        model = getattr(model, model.base_model_prefix)
    params = forward_params(type(model))
    kwargs = {("cache" if "cache" in params else "past_key_values"): cache, "use_cache": True}
    if head is None and logits_at is not None and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = logits_at.to(input_ids.device) if isinstance(logits_at, torch.Tensor) else logits_at
    names = DECODER_ARGUMENTS if is_encoder_decoder(model) else NO_KWARGS  # (``argument``: an encoder-decoder's
    # decoder_*, read once)
    if position_ids is not None and names.get("position_ids", "position_ids") in params:
        kwargs[names.get("position_ids", "position_ids")] = position_ids
    if attention_mask is not None:
        kwargs[names.get("attention_mask", "attention_mask")] = attention_mask
    if (hidden and head is None) or record.hidden_states:
        kwargs["output_hidden_states"] = True
    if record.attentions:
        kwargs["output_attentions"] = True
    if model_inputs:  # token types, images at a prefill, a prompt's embeddings (input_ids None)
        kwargs.update(model_inputs)
    if model_inputs.get("input_ids", input_ids) is not None:  # (None: the model reads a prompt's embeddings)
        kwargs[names.get("input_ids", "input_ids")] = input_ids
    output = (model if call is None else call)(**kwargs)
    recorded = decoder_recorded(model, output, record.hidden_states, record.attentions) if record else NOT_RECORDED
    # (an encoder-decoder's decoder_*, and its cross-attentions)
    if head is not None:
        states = _select(output.last_hidden_state, logits_at)  # [B, m, H]
        return ForwardResult(head(states).float(), states if hidden else None, slots, **recorded,
                             output=output if keep_output else None)
    logits = output.logits
    if "logits_to_keep" not in params:  # the model computed every position
        logits = _select(logits, logits_at)
    states = _select(output.hidden_states[-1], logits_at) if hidden else None
    return ForwardResult(logits.float(), states, slots, **recorded, output=output if keep_output else None)


# ----------------------------------------------------------------------------------------------------------------
# The slot-addressed store
# ----------------------------------------------------------------------------------------------------------------


def _counts_up(offsets: torch.Tensor, n: int) -> bool:
    """Are ``offsets`` [1, n] 0, 1, ..., n - 1 (a plain chain's)? A view of the shared ``layout.positions(n)`` is,
    without a look at its values (what every chain's layout hands over); any other tensor is compared.

    >>> _counts_up(_arange(3)[None], 3), _counts_up(torch.tensor([[0, 1, 1]]), 3)
    (True, False)
    """
    counted = _arange(n)
    return ((offsets.data_ptr() == counted.data_ptr() and offsets.stride(-1) == 1 and offsets.shape[-1] == n)
            or torch.equal(offsets[0], counted))


def _widen(mask: torch.Tensor, span: int) -> torch.Tensor:
    """``mask`` [..., c] with ``span - c`` masked columns (zeros, False) after its own (a static buffer's columns past
    the written ones).

    >>> _widen(torch.tensor([[True, False]]), 4).tolist()
    [[True, False, False, False]]
    """
    if span <= mask.shape[-1]:
        return mask
    return torch.cat([mask, mask.new_zeros(mask.shape[:-1] + (span - mask.shape[-1],))], dim=-1)


@dataclass(frozen=True)
class _Parked:
    """A row's cache as ``KVStore.finish`` needs it: per layer, its states (``backends.RowStates``: the keys and
    values of the last h of the row's ``count`` kept tokens that the layer holds, in order, no padding, no holes;
    a recurrent layer's states after each of its last inputs; None for a layer that holds no states), the position
    of its next token, and its other model inputs (``inputs.ModelInputs``)."""

    states: tuple[RowStates | None, ...]
    count: int
    next_position: int
    inputs: ModelInputs = NO_INPUTS

    def committed(self, count: int) -> "_Parked":
        """The same row with only its first ``count`` kept tokens (a last round may have kept tokens after a stop)."""
        cut = self.count - count
        assert cut >= 0, "finish: a row holds fewer tokens than it committed"
        states = tuple(None if states is None else states.cut(cut) for states in self.states)
        return _Parked(states, count, self.next_position - cut, self.inputs)


@dataclass(frozen=True)
class Fed:
    """What ``KVStore.feed`` gives for a row that stopped early: the forward over its last token and the padding
    plain ``generate`` fed it after (``result``: logits at every input, hidden states and attentions as recorded;
    attentions over the row's ``count`` tokens before the forward, then the forward's inputs)."""

    result: ForwardResult
    count: int


class Continue(enum.Enum):
    """``KVStore.forward``'s ``after`` given by name."""

    LAST = "last"  # every row continues the last slot written (rows write in step: the same column in each), as a
    # draft model drafting a chain step by step does


_UNSET = object()  # a lazily made attribute not made yet


class _Ranges:
    """0, 1, 2, ... on the host and on a device, grown by doubling: slices of them are a fast-lane forward's
    slots and positions, views made without an allocation. Shared by one store: callers must not modify them."""

    def __init__(self, device: torch.device) -> None:
        self._device, self._host, self._on_device = device, torch.arange(64), torch.arange(64, device=device)

    def host(self, n: int) -> torch.LongTensor:
        """[>= n] on the host."""
        if self._host.shape[0] < n:
            self._host = torch.arange(max(n, 2 * self._host.shape[0]))
        return self._host

    def device(self, n: int) -> torch.LongTensor:
        """[>= n] on the store's device."""
        if self._on_device.shape[0] < n:
            self._on_device = torch.arange(max(n, 2 * self._on_device.shape[0]), device=self._device)
        return self._on_device


@dataclass(frozen=True)
class _LaneCall:
    """A fast-lane forward that asks for logits alone, run as ``call_model`` would run it with nothing else asked
    (``plain_head``'s bypass, or the store's own head) but with what ``call_model`` decides per call decided once
    per store: the base model, the output layer, the cache's keyword. Only where nothing else goes into the
    forward: no model inputs besides tokens, positions that are text positions, a decoder-only model, layers
    with nothing to record before a forward (every ``chain_lane`` backend)."""

    base: torch.nn.Module
    head: Callable[[torch.Tensor], torch.Tensor]
    cache_keyword: str

    @classmethod
    def of(cls, store: "KVStore") -> "_LaneCall | None":
        """The store's lane call, or None where ``call_model`` must run each forward."""
        head = store.head if store.head is not None else plain_head(store.model)
        if (head is None or is_encoder_decoder(store.model) or store.inputs.offsets is not None
                or store.inputs.step(1)):
            return None
        base = getattr(store.model, store.model.base_model_prefix)
        params = forward_params(type(base))
        if "position_ids" not in params or not {"cache", "past_key_values"} & params:
            return None
        return cls(base, head, "cache" if "cache" in params else "past_key_values")

    def __call__(self, input_ids: torch.LongTensor, cache: Cache, position_ids: torch.LongTensor,
                 logits_at: int | None) -> torch.Tensor:
        """Float logits [1, m, V] at the last ``logits_at`` inputs (None: every input)."""
        output = self.base(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                           **{self.cache_keyword: cache})
        states = output.last_hidden_state
        return self.head(states if logits_at is None else states[:, -logits_at:]).float()


class KVStore:
    """The cache of B rows that advance at their own pace, addressed by slots (see the module docstring).

    State, all explicit: ``cache`` holds ``width + len(written)`` columns; the first ``width`` are kept ones
    (``valid``: [B, width] bool, which of them each row attends to, or None when every row attends to all: the
    dense case, no mask needed); ``lengths``: [B] each row's kept tokens, and ``next_positions()`` [B] the
    position of its next token (``lengths`` with plain's positions; a caller's ``position_ids`` shift it). The
    columns after ``width`` were written since the last ``keep``: per written column, its position
    (``_positions`` [B, w]) and which written columns it saw (``_sees`` [B, w, w], itself included), so that a
    later forward can continue any of them and ``keep`` can take any path through them.

    The fast lane: one row with no holes, in layers whose kept prefix is a crop (``backends``' ``chain_lane``: full
    attention, dynamic or static), writing plain chains (``forward`` with no ``after`` or ``Continue.LAST``, no
    inner mask, no padding, offsets 0..n-1) skips the slot table: the written inputs are counted in Python ints
    (their positions follow the kept tokens one by one, each sees all before it), ``_positions`` and ``_sees`` are
    made from them only if another operation reads them, and ``keep`` of a prefix is a crop of every layer
    (``backends``' ``shorten``). What it runs is what the general path runs in that case; ``lane_forwards`` and
    ``lane_keeps`` count it.

    >>> from hf_specdec.layout import BatchInputs
    >>> from hf_specdec.models.tiny import tiny_model
    >>> store = KVStore(tiny_model("llama"))
    >>> _ = store.prefill(torch.tensor([[5, 6, 7]]), None)  # kept at once: 3 tokens, positions 0..2
    >>> trie = BatchInputs(torch.tensor([[8, 9, 10]]), torch.tensor([[0, 1, 1]]), None,  # 8, then 9 or 10
    ...                    torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool))
    >>> store.forward(trie).slots.tolist()
    [[3, 4, 5]]
    >>> store.keep([[3, 5]])  # 8 -> 10: one row gathers 10 next to 8 (in a batch, slot 4 would stay a masked hole)
    >>> store.lengths.tolist(), store.valid, store.width, store.gathers
    ([5], None, 5, 1)
    """

    COMPACT_FRACTION = 0.5  # compact when more than this fraction of the kept columns are holes
    inputs: ModelInputs = NO_INPUTS  # the call's other model inputs, from ``prefill`` on (``inputs.py``)

    def __init__(self, model, attention: str = "sdpa", head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 cache: DynamicCache | None = None, returns_cache: bool = False, keeps_rows: bool = False,
                 compacts_on_keep: bool = True):
        self.model, self.attention = model, attention
        # False: the owner compacts (``compaction_due``, ``compact``) as a step of its own, timed apart from the
        # forward, so that a forward's measured cost is the forward's (the decoding loop's target store)
        self.compacts_on_keep = compacts_on_keep
        self.head = head  # optional: hidden [B, n, H] -> logits, a narrowed output layer
        self.returns_cache = returns_cache  # ``finish`` will leave the cache as plain generate() leaves it
        self.keeps_rows = keeps_rows or returns_cache  # rows that leave are kept aside, for ``feed`` and ``finish``
        self.cache = new_cache(model) if cache is None else cache  # a cache passed in holds the prompt's start
        check_cache_supported(self.cache)
        # the cache speculated on (an encoder-decoder's self-attention cache), and caches only rows leave from (its
        # cross-attention cache: the encoder's keys, fixed for the call)
        self.speculated, self.fixed = split_cache(self.cache)
        self.layers = self.speculated.layers
        self._caching = model if head is None else getattr(model, model.base_model_prefix)  # the model its layers run
        self._backends: tuple = ()  # one per layer: each one's kind, as this model uses it (``backends``)
        self.buffers = Buffers.of(self.layers)  # a static cache's preallocated buffers (None: a dynamic cache)
        self._recording = [(layer, layer.record_past) for layer in self.layers if hasattr(layer, "record_past")]
        for layer, _ in self._recording:
            layer.activate_past_recording()
        self.valid: torch.Tensor | None = None
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.width = int(self.cache.get_seq_length())  # the columns a cache passed in holds: the prompt's first ones
        # positions (module docstring): a row's next token sits at ``lengths + _offset``; ``_column_shift`` maps a
        # token's index among the row's kept tokens to its column in plain generate's layout (``_window_columns``)
        self._offset = torch.zeros(0, dtype=torch.long)
        self._column_shift = torch.zeros(0, dtype=torch.long)
        self._prompt_width = 0  # the prompt's columns, cached ones included: the layout of plain generate's cache
        self._prompt_valid: torch.Tensor | None = None  # [B0, prompt width] the prompt's mask, None if all ones
        self._row_ids = torch.zeros(0, dtype=torch.long)  # the original row of each row still in the store
        self._parked: dict[int, _Parked] = {}  # rows that left, kept for ``feed`` and ``finish`` (keeps_rows)
        self._fed: dict[int, _Parked] = {}  # rows that stopped early after ``feed``: their padding read
        # the fixed caches' keys and values of every row, kept from the first row selection for ``finish`` (keeps_rows)
        self._fixed_rows: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # the fast lane (class docstring): inputs written in it since the last keep, the position of the first
        self._lane_written, self._lane_start, self._lane_ready = 0, 0, None
        self._ranges = _Ranges(next(model.parameters()).device)  # positions and slots, as views
        self._lane_call: _LaneCall | None | object = _UNSET  # made at the first lane forward (``_LaneCall.of``)
        self.lane_forwards = self.lane_keeps = 0  # forwards and keeps that took the fast lane
        self._positions = torch.zeros(0, 0, dtype=torch.long)
        self._sees = torch.zeros(0, 0, 0, dtype=torch.bool)
        self.gathers = 0  # how many times columns were gathered (``compact``, or ``keep`` where holes cannot stay)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @property
    def backends(self) -> tuple:
        """Each layer's backend (``backends.layer_backends``), as many as the cache has layers: a cache may add
        layers in a forward (one made without its config, or a model's extra layers), which get theirs then."""
        if len(self._backends) != len(self.layers):
            self._backends = layer_backends(self._caching, self.layers)
        return self._backends

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_written(self) -> int:
        """Columns written since the last keep."""
        return self._written_positions.shape[1] + self._lane_written

    @property
    def _positions(self) -> torch.LongTensor:
        """[B, w] the position of each column written since the last keep (class docstring)."""
        self._leave_lane()
        return self._written_positions

    @_positions.setter
    def _positions(self, value: torch.LongTensor) -> None:
        assert not self._lane_written, "the fast lane's columns are in _positions before it is set"
        self._written_positions = value

    @property
    def _sees(self) -> torch.Tensor:
        """[B, w, w] which written columns each written column saw, itself included (class docstring)."""
        self._leave_lane()
        return self._written_sees

    @_sees.setter
    def _sees(self, value: torch.Tensor) -> None:
        assert not self._lane_written, "the fast lane's columns are in _sees before it is set"
        self._written_sees = value

    def _leave_lane(self) -> None:
        """Put the columns written in the fast lane in the slot table, as the general path would have: positions
        one after the other from the lane's first, each seeing every one before it and itself."""
        w = self._lane_written
        if w:
            self._lane_written = 0
            self._written_positions = (_arange(w) + self._lane_start)[None]
            self._written_sees = torch.ones(w, w, dtype=torch.bool).tril()[None]

    def _lane_open(self) -> bool:
        """Can this store's forwards take the fast lane at all (one row, no holes, only ``chain_lane`` layers, a
        model that reads positions as positions)? The layers' part is settled once they are all there."""
        if self.num_rows != 1 or self.valid is not None:
            return False
        if self._lane_ready is None or self._lane_ready[0] is not self.backends:
            backends = self.backends
            ready = (bool(backends) and all(backend is not None and backend.chain_lane for backend in backends)
                     and not self.positions_are_distances())
            self._lane_ready = (backends, ready)
        return self._lane_ready[1]

    def _takes_lane(self, batch: BatchInputs, after) -> bool:
        """Does this ``forward`` take the fast lane (class docstring)?"""
        if after is None:
            if self.num_written:
                return False
        elif after is not Continue.LAST or not self._lane_written:
            return False
        n = batch.input_ids.shape[1]
        return (batch.inner is None and batch.valid is None and batch.input_ids.shape[0] == 1 and self._lane_open()
                and _counts_up(batch.offsets, n))

    def _lane_forward(self, batch: BatchInputs, logits_at: LogitsAt, hidden: bool, record: Recording,
                      call: Callable | None) -> ForwardResult:
        """``forward`` in the fast lane: the inputs at the positions after the last written (or kept) one, the
        model's own causal mask (the general path's dense case), no slot table. Logits alone, from a model whose
        forward is its base model and an output layer, take ``_LaneCall``; the rest ``call_model``."""
        n = batch.input_ids.shape[1]
        past = self.width + self._lane_written
        if not self._lane_written:
            self._lane_start = int(self.lengths[0]) + int(self._offset[0])  # (host tensors)
        start = self._lane_start + self._lane_written
        self._span(past + n)  # a static cache's buffers grown first where the forward does not fit them
        slots = self._ranges.host(past + n)[None, past: past + n]  # [1, n], a view: nobody writes into slots
        if self._lane_call is _UNSET:
            self._lane_call = _LaneCall.of(self)
        positions = self._ranges.device(start + n)[None, start: start + n]  # [1, n] text positions
        if (self._lane_call is not None and call is None and not hidden and not record
                and not isinstance(logits_at, torch.Tensor)):  # (the lane call's model positions are text positions)
            logits = self._lane_call(batch.input_ids.to(self.device), self.cache, positions, logits_at)
            result = ForwardResult(logits, slots=slots)
        else:
            result = call_model(self.model, batch.input_ids.to(self.device), self.cache, logits_at=logits_at,
                                position_ids=self.inputs.positions(positions).to(self.device), hidden=hidden,
                                head=self.head, record=record, model_inputs=self.inputs.step(n), call=call,
                                slots=slots)
        self._lane_written += n
        self.lane_forwards += 1
        return result

    def continues_lane(self) -> bool:
        """Can ``lane_steps`` run: the last forward took the fast lane and asked for logits alone (``_LaneCall``)?"""
        return bool(self._lane_written) and self._lane_call not in (None, _UNSET) and self._lane_open()

    def starts_lane(self) -> bool:
        """Can ``lane_steps`` start a chain after the kept tokens: nothing written since the last keep, and an
        earlier forward of this store took the fast lane and asked for logits alone (``_LaneCall``)?"""
        return self.num_written == 0 and self._lane_call not in (None, _UNSET) and self._lane_open()

    def lane_steps(self, tokens: torch.LongTensor, steps: int,
                   choose: Callable[[torch.Tensor], torch.LongTensor | None]) -> int:
        """Up to ``steps`` forwards in the fast lane, as ``forward(..., logits_at=1)`` runs each where
        ``continues_lane()`` (each continues the last written slot: ``after=Continue.LAST``) or ``starts_lane()``
        (the first continues the kept tokens: no ``after``): the first over ``tokens`` [1, u], each next over what
        ``choose`` makes of the last one's float logits [1, V] (None: stop here). A draft's chain (gpt-fast's
        ``decode_n_tokens``): what ``forward`` decides per call is decided once for all of them. Returns how many
        forwards ran; their u + ran - 1 slots follow the last written one (the last kept one)."""
        assert self.continues_lane() or self.starts_lane(), "lane_steps continues the kept tokens or the fast lane"
        if not self._lane_written:
            self._lane_start = int(self.lengths[0]) + int(self._offset[0])  # (host tensors)
        n = tokens.shape[1] + steps - 1  # inputs, at most
        start = self._lane_start + self._lane_written
        self._span(self.width + self._lane_written + n)
        positions = self._ranges.device(start + n)[None]  # [1, >= start + n] text positions
        end = start + tokens.shape[1]
        for ran in range(1, steps + 1):
            logits = self._lane_call(tokens, self.cache, positions[:, start: end], 1)
            self._lane_written += end - start
            self.lane_forwards += 1
            tokens = choose(logits[:, 0])
            if tokens is None:
                return ran
            start, end = end, end + 1
        return steps

    def _lane_keep(self, kept: Sequence[Sequence[int]]) -> bool:
        """``keep`` in the fast lane where it is one: the row keeps a prefix of what it wrote in it (a crop of every
        layer, no index tensors). Returns whether it did."""
        if not self._lane_written or len(kept) != 1:
            return False
        m = len(kept[0])
        if m > self._lane_written or list(kept[0]) != list(range(self.width, self.width + m)):
            return False
        if m < self._lane_written:
            for layer, backend in zip(self.layers, self.backends):
                backend.shorten(layer, self.width + m)
        self.width += m
        self.lengths = self.lengths + m
        self._lane_written = 0
        self.lane_keeps += 1
        return True

    @property
    def dense(self) -> bool:
        """Every row attends to every kept column and nothing is written since the last keep."""
        return self.valid is None and self.num_written == 0

    def nbytes(self) -> int:
        """Bytes the cached keys and values take now (every layer, every row, padding columns included)."""
        total = 0
        for layer in (*self.layers, *(layer for fixed in self.fixed for layer in fixed.layers)):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    def holes_maskable(self) -> bool:
        """Can columns no row attends to stay in the cache? Not with sliding-window layers (they keep a count of
        columns) nor in a model that takes no position ids (it counts positions by column)."""
        model = getattr(self.model, self.model.base_model_prefix) if self.head is not None else self.model
        return accepts_position_ids(model) and all(backend.holds_holes for backend in self.backends)

    def columns_are_positions(self) -> bool:
        """Does the model number its inputs by cache column (it takes no position ids: the next input sits at
        ``get_seq_length()``, as MBart's and Marian's learned positions do)? Then every column stays where plain
        ``generate`` has it, holes and padding included: dropping one would move every later position."""
        model = getattr(self.model, self.model.base_model_prefix) if self.head is not None else self.model
        return not accepts_position_ids(model)

    def positions_are_distances(self) -> bool:
        """Does the model read positions only as column distances (``encoder_decoder.positions_are_distances``:
        T5)? Then every keep and row selection lays each row's tokens out as plain ``generate`` has them relative
        to each other, the next inputs of every row at the same column (``_alignment``), instead of leaving
        holes: a row's tokens then see each other, and its next inputs, at plain's distances."""
        model = getattr(self.model, self.model.base_model_prefix) if self.head is not None else self.model
        return positions_are_distances(model)

    def next_positions(self) -> torch.LongTensor:
        """[B] the position of each row's next token (after its kept tokens): ``lengths`` with plain generate's
        positions, shifted where a caller's ``position_ids`` start elsewhere."""
        return self.lengths + self._offset

    def _kept_valid(self) -> torch.Tensor:
        """[B, width] the kept columns each row attends to (all of them when ``valid`` is None)."""
        return self.valid if self.valid is not None else torch.ones(self.num_rows, self.width, dtype=torch.bool)

    def _span(self, columns: int) -> int:
        """The key columns a forward that ends holding ``columns`` columns attends over: those, or a static cache's
        buffer width (``backends.Buffers``), grown first where they do not fit."""
        if self.buffers is None:
            return columns
        self.buffers.reserve(columns)
        return self.buffers.width

    def _reset_written(self) -> None:
        self._lane_written = 0
        self._positions = torch.zeros(self.num_rows, 0, dtype=torch.long)
        self._sees = torch.zeros(self.num_rows, 0, 0, dtype=torch.bool)

    def prefill(self, input_ids: torch.LongTensor, mask: torch.Tensor | None, logits_at: LogitsAt = 1, *,
                record: Recording = NOTHING, positions: torch.LongTensor | None = None,
                inputs: ModelInputs = NO_INPUTS) -> ForwardResult:
        """Read the prompts' uncached tokens ``input_ids`` [B, n] into the store and keep them, after the c columns
        a cache passed in holds (c = 0 for an empty store), as plain ``generate`` reads them: ``mask`` [B, c + n]
        over the cached and the new columns (0 for padding and holes, masked from now on; None: all ones) and
        ``positions`` [B, n] (or [1, n]) of the new tokens, by default ``cumsum(mask) - 1`` (0 where masked). Each
        row's next token sits at its last position + 1. A zero-width prompt reads nothing (logits [B, 0, 0]).
        ``inputs``: the call's other model inputs (``inputs.ModelInputs``), those of the prompt now and those of
        new tokens in every later forward. Returns logits [B, m, V] at ``logits_at``."""
        assert self.num_written == 0 and self.width == self.cache.get_seq_length(), "prefill fills a new store"
        rows, length = input_ids.shape
        cached = self.width
        valid = None if mask is None or bool(mask.bool().all()) else mask.bool().cpu()  # [B, c + n]
        assert valid is None or valid.shape == (rows, cached + length), "the mask spans the cached and new columns"
        self.lengths = torch.full((rows,), cached + length) if valid is None else valid.sum(-1)
        if positions is None:
            every = (torch.arange(cached + length).repeat(rows, 1) if valid is None
                     else (valid.long().cumsum(-1) - 1).masked_fill(~valid, 0))  # as plain generate derives them
            positions = every[:, cached:]
        positions = positions.cpu().expand(rows, length).contiguous()
        self._offset = (positions[:, -1] + 1 - self.lengths) if length else -self.lengths
        self._prompt_width = cached + length
        self._column_shift = self._prompt_width - self.lengths
        self._prompt_valid, self._row_ids, self._parked, self._fed = valid, torch.arange(rows), {}, {}
        self._reset_written()
        if length == 0:
            return ForwardResult(torch.zeros(rows, 0, 0))
        span = self._span(cached + length)
        attention = None if valid is None else _widen(valid, span).long().to(self.device)
        self.inputs = inputs
        result = call_model(self.model, input_ids.to(self.device), self.cache, logits_at=logits_at,
                            position_ids=inputs.prefill_positions(positions).to(self.device), attention_mask=attention,
                            head=self.head, record=record, model_inputs=inputs.prefill_kwargs(length),
                            rolls_back=False, keep_output=inputs.awaiting is not None)
        self.inputs = inputs.after_prefill(result.output)  # a step that reads the prompt forward's outputs
        keep_rows(self.layers, cached, torch.full((rows,), length))  # recurrent layers: hold the prompt's states
        self.valid, self.width = valid, cached + length
        if self.positions_are_distances():  # (a decoder prompt padded on the right: its next inputs move up)
            self._align()
        return result

    def forward(self, batch: BatchInputs, *, after: torch.LongTensor | Continue | None = None,
                logits_at: LogitsAt = None, hidden: bool = False, record: Recording = NOTHING,
                call: Callable | None = None) -> ForwardResult:
        """Write a round's stacked inputs (``batch``: [B, n]) at the next n slots and run the model over them.

        Each row's inputs sit at its next positions plus their offsets and see the row's kept columns, each
        other as ``batch`` says and, with ``after`` ([B] slots written since the last keep), the written path
        that ends at ``after[r]`` (that slot and what it saw): the inputs continue it, at its position + 1 +
        offset. ``after`` [B, n] gives each input its own path (a tree's frontier, drafted depth by depth: each
        node continues its parent; ``batch.inner`` is then required). Without ``after`` they see none of the
        written slots. ``Continue.LAST``: every row continues the last slot written. Returns logits [B, m, V] at
        ``logits_at`` (hidden states on request) and ``slots`` [B, n], the columns the inputs were written at.
        ``call`` runs the model in its stead (``call_model``). One row's chains take the fast lane (class docstring).
        """
        if self._takes_lane(batch, after):
            return self._lane_forward(batch, logits_at, hidden, record, call)
        rows, n = batch.input_ids.shape
        if after is Continue.LAST:
            assert self.num_written, "after: written slots"
            after = torch.full((rows,), self.width + self.num_written - 1)
        assert self.num_written or not self.positions_are_distances() or self._alignment() is None, \
            "positions are distances: the rows' tokens are laid out as plain's before a round (_align)"
        past = self.width + self.num_written
        if after is None:
            base = self.next_positions()[:, None]  # [B, 1]
            sees_written = torch.zeros(rows, 1, self.num_written, dtype=torch.bool)  # [B, 1, w]
        else:
            written = after.cpu().reshape(rows, -1) - self.width  # [B, 1 or n] indices among the written columns
            assert bool((written >= 0).all()) and bool((written < self.num_written).all()), "after: written slots"
            assert written.shape[1] == 1 or batch.inner is not None, "a path per input needs a 4-D layout"
            base = self._positions.gather(1, written) + 1  # [B, 1 or n]
            sees_written = self._sees[torch.arange(rows)[:, None], written]  # [B, 1 or n, w]
        positions = base + batch.offsets  # [B, n]
        span = self._span(past + n)  # the key columns the forward attends over
        sees_all = self.valid is None and bool(sees_written.all()) and batch.valid is None  # the dense case
        new_valid = batch.valid if batch.valid is not None else torch.ones(rows, n, dtype=torch.bool)
        if batch.inner is None:  # chains: the model's own causal mask, over a 2-D mask unless all is visible
            mask = None
            if not sees_all and attends(self.layers):  # (a model of recurrent layers only, Mamba: no mask, as plain)
                sees_past = torch.cat([self._kept_valid(), sees_written[:, 0]], dim=1)  # [B, past]
                mask = _widen(torch.cat([sees_past, new_valid], dim=1), span).long().to(self.device)  # [B, span]
            inner = torch.ones(n, n, dtype=torch.bool).tril().expand(rows, n, n) & new_valid[:, None, :]
        else:  # trees: a 4-D mask, True = attend
            inner = batch.inner
            kept = self._kept_valid()[:, None, :].expand(rows, n, self.width)
            full = _widen(torch.cat([kept, sees_written.expand(rows, n, self.num_written), inner], dim=2),
                          span)  # [B, n, span]
            mask = self._layer_masks(full, positions, n)
        result = call_model(self.model, batch.input_ids.to(self.device), self.cache, logits_at=logits_at,
                            position_ids=self.inputs.positions(positions).to(self.device), attention_mask=mask,
                            hidden=hidden, head=self.head, record=record, model_inputs=self.inputs.step(n), call=call)
        w = self.num_written
        sees = torch.zeros(rows, w + n, w + n, dtype=torch.bool)
        sees[:, :w, :w] = self._sees
        sees[:, w:, :w] = sees_written
        sees[:, w:, w:] = inner
        self._sees = sees
        self._positions = torch.cat([self._positions, positions], dim=1)
        return dataclasses.replace(result, slots=past + _arange(n).repeat(rows, 1))  # [B, n]

    def columns(self, row: int, path: Sequence[int]) -> torch.LongTensor:
        """The cache columns a query of row ``row`` attends to when it ends the path ``path`` (slots written since
        the last keep, in order): the row's kept columns (no padding, no holes), then the path's slots. They are
        the row's tokens in order, the columns of plain ``generate``'s attention row after its padding.

        >>> from hf_specdec.layout import BatchInputs
        >>> from hf_specdec.models.tiny import tiny_model
        >>> store = KVStore(tiny_model("llama"))
        >>> _ = store.prefill(torch.tensor([[0, 6, 7]]), torch.tensor([[0, 1, 1]]))  # one padding column
        >>> trie = BatchInputs(torch.tensor([[8, 9, 10]]), torch.tensor([[0, 1, 1]]), None,
        ...                    torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool))
        >>> store.forward(trie).slots.tolist()
        [[3, 4, 5]]
        >>> store.columns(0, [3, 5]).tolist()  # 8 -> 10: the sibling at slot 4 is not among them
        [1, 2, 3, 5]
        """
        kept = self._kept_valid()[row].nonzero()[:, 0]
        return torch.cat([kept, torch.tensor(list(path), dtype=torch.long)])

    def attention_rows(self, attentions: Sequence[torch.Tensor], row: int, query: int, path: Sequence[int],
                       padding: int, total: int) -> tuple[torch.Tensor, ...]:
        """Plain ``generate``'s attention row, per layer [1, heads, 1, K], of the input ``query`` of row ``row`` of
        the last forward (``attentions``: its weights, per layer [B, heads, n, K_layer] over the layer's last
        K_layer of ``total`` columns), the input ending the path ``path`` (``columns``): ``padding`` columns at
        weight 0 (the row's left padding, which plain's mask gives weight 0), then the row's tokens up to it. A
        sliding-window layer keeps, as plain's returns them, the last ``sliding_window`` of those columns (its
        window: padding counts); a column the layer did not hand its attention has weight 0 (outside it)."""
        return self._attention_rows(attentions, row, query, self.columns(row, path), padding, total)

    def fed_attention_rows(self, fed: Fed, query: int, padding: int) -> tuple[torch.Tensor, ...]:
        """``attention_rows`` of the input ``query`` of a ``feed`` forward: ``padding`` columns at weight 0, the
        row's tokens, the forward's inputs up to this one (plain's columns at that step)."""
        total = fed.count + fed.result.logits.shape[1]
        return self._attention_rows(fed.result.attentions, 0, query, torch.arange(fed.count + query + 1), padding,
                                    total)

    def _attention_rows(self, attentions: Sequence[torch.Tensor], row: int, query: int, columns: torch.LongTensor,
                        padding: int, total: int) -> tuple[torch.Tensor, ...]:
        """``attention_rows`` over the given ``columns`` (of ``total``) that the query attends to."""
        rows = []
        for layer, window, weights in zip(self.layers, self._windows(), attentions):
            offset = max(total - weights.shape[-1], 0)  # the columns before it are not among the layer's keys (a
            # static buffer's keys are every column from the first, and more)
            inside = columns >= offset
            picked = weights[row: row + 1, :, query: query + 1]  # [1, heads, 1, K_layer]
            values = picked.new_zeros(picked.shape[:3] + (padding + columns.shape[0],))
            values[..., padding + inside.nonzero()[:, 0].to(values.device)] = \
                picked[..., (columns[inside] - offset).to(picked.device)]
            if self.buffers is not None:  # plain's weights span the static cache's whole width, zeros past the query
                values = _widen(values, self.buffers.own_width)
            elif window is not None:
                values = values[..., -min(values.shape[-1], window):]
            rows.append(values)
        return tuple(rows)

    def _windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it attends to every column). A KV-shared layer, which keeps no cache
        (Gemma 3n, Gemma 4), has the window of the layers of its type: it reads their keys under their mask."""
        types = list(getattr(self.model.config.get_text_config(decoder=True), "layer_types", None) or ())
        types += [None] * (len(self.layers) - len(types))
        window = {kind: layer.sliding_window for kind, layer in zip(types, self.layers)
                  if getattr(layer, "is_sliding", False)}
        return [layer.sliding_window if getattr(layer, "is_sliding", False) else window.get(kind)
                for layer, kind in zip(self.layers, types)]

    def _window_columns(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where plain ``generate``'s cache has each column: ([B, width + w + n] every cached and new column,
        [B, n] the new inputs at ``positions``), what a sliding window counts (columns, padding and holes included,
        not positions). A prompt column is where it was read; a later token follows the prompt in the order it
        was kept; a hole's is meaningless (it is masked)."""
        shift = (self._column_shift - self._offset)[:, None]  # [B, 1]: position -> column after the prompt
        column = torch.arange(self.width)[None, :]
        later = (self._kept_valid().long().cumsum(-1) - 1) + self._column_shift[:, None]
        kept = torch.where(column < self._prompt_width, column, later)  # [B, width]
        queries = positions + shift
        return torch.cat([kept, self._positions + shift, queries], dim=1), queries

    def _layer_masks(self, full: torch.Tensor, positions: torch.Tensor, n: int):
        """The 4-D mask each kind of layer takes: the full one, and for sliding-window layers the columns they
        return (their window) with the window applied by position. A model with ``config.layer_types`` gets
        them by layer type; one without gets its only kind. A model that builds the masks of its layer types
        itself from the one mask it is given (``ONE_MASK_MODELS``) gets the full one, which its sliding layers read
        as it is: exact while their window covers every column (refused past it).

        full: [B, n, past + n] bool; positions: [B, n] of the inputs.
        """
        sliding = {type(layer).__name__: layer for layer in self.layers if getattr(layer, "is_sliding", False)}
        # the attention of the layers that read the mask: a multimodal model's text model may run another one
        # (PaliGemma 2: sdpa at the top, eager in its Gemma 2)
        attention = getattr(self.model.config.get_text_config(decoder=True), "_attn_implementation", None)
        as_model = lambda mask: to_model_mask(mask[:, None].to(self.device), attention or self.attention,  # noqa: E731
                                              self.dtype)
        if not sliding or self.buffers is not None:  # a static cache's windows hold every column it has
            return as_model(full)
        past = full.shape[2] - n
        key_columns, query_columns = self._window_columns(positions)  # [B, past + n], [B, n]
        masks, windowless = {}, True
        for layer in sliding.values():
            visible = layer.get_mask_sizes(n)[0] - n  # cached columns the layer hands its attention
            in_window = key_columns[:, None, past - visible:] > query_columns[:, :, None] - layer.sliding_window
            windowless = windowless and visible == past and bool((in_window | ~full).all())
            masks["sliding_attention"] = as_model(full[:, :, past - visible:] & in_window)
        if self.model.config.model_type in ONE_MASK_MODELS:  # its sliding layers read the one mask it is given
            if not windowless:
                raise ValueError(
                    f"hf_specdec cannot mask the sliding-window layers of {type(self.model).__name__} past their "
                    "window: the model takes one attention mask for all its layers. Use plain generate() for "
                    "sequences longer than its sliding_window.")
            return as_model(full)
        layer_types = getattr(self.model.config.get_text_config(decoder=True), "layer_types", None)
        if not layer_types:  # every layer slides (Mistral, Phi-3): one mask
            return masks["sliding_attention"]
        masks["full_attention"] = as_model(full)
        return {kind: masks.get(kind, masks["full_attention"]) for kind in set(layer_types)}  # indexed: full

    def keep(self, kept: Sequence[Sequence[int]]) -> None:
        """Row r keeps the slots ``kept[r]`` of those written since the last keep: a path at its next positions,
        in order (an empty list keeps nothing); every other written slot is forgotten.

        A prefix of what was written in every row is a crop (a dense row stays dense); other paths are gathered
        together right away where holes cannot be masked (``holes_maskable``) and in a store of one row (a copy of
        at most the written columns keeps the row dense: holes would put a mask in every later forward of the call
        and keep it out of the fast lane); in a batch they leave holes that the mask hides, gathered by
        ``compact`` when they pass ``COMPACT_FRACTION`` of the columns.
        """
        assert len(kept) == self.num_rows, "one list of slots per row"
        if self._lane_keep(kept):
            return
        w = self.num_written
        counts = torch.tensor([len(k) for k in kept], dtype=torch.long)
        index = torch.zeros(self.num_rows, w, dtype=torch.long)  # [B, w]: the written column of each kept token
        for r, slots in enumerate(kept):
            if slots:
                index[r, : len(slots)] = torch.tensor(slots, dtype=torch.long) - self.width
        m = int(counts.max()) if self.num_rows else 0
        taken = torch.arange(w)[None, :] < counts[:, None]  # [B, w]
        assert bool(((index >= 0) & (index < w) | ~taken).all()), "keep: only slots written since the last keep"
        path_positions = self._positions.gather(1, index) if w else index
        expected = self.next_positions()[:, None] + torch.arange(w)[None, :]
        assert bool(((path_positions == expected) | ~taken).all()), "keep: each row's next positions, in order"
        prefix = bool(((index == torch.arange(w)[None, :]) | ~taken).all())
        if prefix or self.num_rows == 1 or not self.holes_maskable():
            if not prefix:  # gather each row's path to the start of the written block
                gather = torch.where(taken, index, index[:, :1])[:, :m]  # [B, m]
                for layer, backend in zip(self.layers, self.backends):
                    if holds_states(layer):
                        backend.gather(layer, self.width, gather)
                self.gathers += 1
            # recurrent layers: each row's states after its path (and, where a row may stop inside it, after each
            # input of it)
            keep_rows(self.layers, self.width, counts, retain=self._goes_back())
            self._rollback(self.width + m)
            if not self._goes_back():  # hold only what the next forward needs (a sliding window's tail)
                for layer, backend in zip(self.layers, self.backends):
                    if holds_states(layer):
                        backend.settle(layer)
            new_columns = taken[:, :m]  # [B, m]
        else:  # holes stay, masked; the columns after the last kept one go
            new_columns = torch.zeros(self.num_rows, w, dtype=torch.bool)  # [B, w]
            new_columns[torch.arange(self.num_rows)[:, None].expand(-1, w)[taken], index[taken]] = True
            last = int(new_columns.any(dim=0).nonzero().max()) + 1 if bool(new_columns.any()) else 0
            self._rollback(self.width + last)
            new_columns = new_columns[:, :last]
        if self.valid is not None or not bool(new_columns.all()):
            self.valid = torch.cat([self._kept_valid(), new_columns], dim=1)
        self.width += int(new_columns.shape[1])
        self.lengths = self.lengths + counts
        self._reset_written()
        self._tidy()

    def discard(self) -> None:
        """Forget everything written since the last keep, in every layer (a forward that failed half-way, out of
        memory, leaves layers of different lengths: each is cropped to the kept columns)."""
        self._rollback(self.width)
        self._reset_written()

    def _rollback(self, length: int) -> None:
        """``rollback`` to ``length`` columns; a store that hands its cache back keeps its sliding-window layers'
        recorded columns until ``finish``."""
        for layer, backend in zip(self.layers, self.backends):
            backend.crop(layer, length, not self.returns_cache)

    def can_lend(self) -> bool:
        """Can ``lend`` start another store from this one's tensors? Only full-attention layers (``DynamicLayer``:
        a forward concatenates new columns into a new tensor); a sliding-window layer keeps a state of its own."""
        return all(backend.lendable for backend in self.backends)

    def lend(self, model, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "KVStore":
        """A store for ``model``, whose decoder layers are this store's model's first layers (an early-exit draft,
        ``drafters/early_exit.py``), holding what this store keeps in those layers: the same key and value tensors
        (its forwards concatenate into new ones, so nothing it writes reaches this store), the same rows, lengths
        and mask. The keys and values of the first layers of a model over the same tokens at the same positions
        are exactly these (LayerSkip's cache reuse), so the view needs no prompt read and no cache of its own.
        Only between rounds (nothing written since the last keep, which the lent store could not see), and only
        while ``can_lend``; valid until this store's next forward or keep: a borrower drops it after a round.

        >>> from hf_specdec.drafters.early_exit import early_exit_model
        >>> from hf_specdec.models.tiny import tiny_model
        >>> target = tiny_model("llama", num_hidden_layers=4)
        >>> store = KVStore(target); _ = store.prefill(torch.tensor([[5, 6, 7]]), None)
        >>> lent = store.lend(early_exit_model(target, 2))
        >>> len(lent.cache.layers), lent.lengths.tolist(), lent.cache.layers[1].keys is store.layers[1].keys
        (2, [3], True)
        >>> _ = lent.forward(BatchInputs(torch.tensor([[8]]), torch.tensor([[0]]), None, None))
        >>> lent.cache.layers[0].keys.shape[2], store.layers[0].keys.shape[2]  # the lender is untouched
        (4, 3)
        """
        assert self.num_written == 0, "lend between rounds: nothing written since the last keep"
        assert self.can_lend(), "only full-attention layers can be lent"
        store = KVStore(model, self.attention, head=head)
        assert len(store.layers) <= len(self.layers), "the borrower runs the lender's first layers"
        for mine, theirs, backend in zip(store.layers, self.layers, self.backends):
            if holds_states(theirs):
                backend.lend(mine, theirs)
        store.valid = None if self.valid is None else self.valid.clone()
        store.lengths, store.width = self.lengths.clone(), self.width
        store._offset, store._column_shift, store._prompt_width = self._offset, self._column_shift, self._prompt_width
        store.inputs = self.inputs
        store._reset_written()
        return store

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (in this order): the others finished (a store that hands its cache back keeps
        theirs aside for ``finish``)."""
        index = torch.tensor(rows, dtype=torch.long)
        if self.keeps_rows:
            assert self.num_written == 0, "rows leave between rounds"
            for row in sorted(set(range(self.num_rows)) - set(rows)):
                self._parked[int(self._row_ids[row])] = self._park(row)
        for layer, backend in zip(self.layers, self.backends):
            if holds_states(layer):
                backend.select_rows(layer, index)
        if self.keeps_rows and self._fixed_rows is None:  # (every row's, in the order prefill read them)
            self._fixed_rows = [[(layer.keys, layer.values) for layer in fixed.layers] for fixed in self.fixed]
        for fixed in self.fixed:
            fixed.batch_select_indices(index)
        self.lengths, self._offset, self._row_ids = self.lengths[index], self._offset[index], self._row_ids[index]
        self._column_shift = self._column_shift[index]
        self._positions, self._sees = self._positions[index], self._sees[index]
        self.inputs = self.inputs.select_rows(index)
        if self.valid is not None:
            self.valid = self.valid[index]
            self._tidy()

    def _tidy(self) -> None:
        """After a keep or a row selection: drop kept columns no row sees at the end, compact when holes pass
        ``COMPACT_FRACTION``, and go back to ``valid = None`` when every row sees every column. Where positions are
        distances, lay the rows out as plain's instead (``_align``: a step of the keep, as a gather where holes
        cannot stay)."""
        if self.valid is None or self.num_written:
            return
        if self.positions_are_distances():
            self._align()
            return
        if self.columns_are_positions():
            return
        seen = self.valid.any(dim=0)  # [width]
        if not bool(seen.all()):
            last = int(seen.nonzero().max()) + 1 if bool(seen.any()) else 0
            if last < self.width:
                self._rollback(last)
                self.valid, self.width = self.valid[:, :last], last
        if self.compacts_on_keep and self.compaction_due():
            self.compact()
        if self.valid is not None and bool(self.valid.all()):
            self.valid = None

    def _alignment(self) -> tuple[torch.LongTensor, torch.Tensor] | None:
        """Where positions are distances (``positions_are_distances``): each row's kept tokens at the columns that
        give them plain ``generate``'s distances, the prompt's as it was read (its padding and holes between), every
        later token after the prompt's columns, one after the other, and each row's next input at the same column
        W (the new width), as few columns as that takes. Returns (index [B, W]: the current column each new one
        takes, valid [B, W]), or None where the rows sit so already.

        >>> from hf_specdec.models.tiny import tiny_model
        >>> store = KVStore(tiny_model("llama"))  # (the layout alone: T5's store runs it after each keep)
        >>> store._prompt_width, store._row_ids, store.width = 2, torch.arange(2), 5
        >>> store.lengths = torch.tensor([5, 3])
        >>> store.valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()  # after a 2-token prompt, row 0
        >>> index, valid = store._alignment()  # kept 3 tokens, row 1 one: its tokens move 2 columns up
        >>> index.tolist(), valid.long().tolist()
        ([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]], [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
        """
        if self.valid is None:  # every row keeps every column: one contiguous layout, plain's
            return None
        kept = self.valid
        prompt = self._prompt_mask(int(self._row_ids.max()) + 1)
        plain, following = [], []  # per row: plain's column of each kept token, and of its next input
        for r in range(self.num_rows):
            own = prompt[int(self._row_ids[r])].nonzero()[:, 0]
            later = int(kept[r].sum()) - own.shape[0]
            plain.append(torch.cat([own, self._prompt_width + torch.arange(later)]))
            following.append(self._prompt_width + later)
        width = max(end - (int(columns[0]) if columns.numel() else end) for columns, end in zip(plain, following))
        index = torch.zeros(self.num_rows, width, dtype=torch.long)
        valid = torch.zeros(self.num_rows, width, dtype=torch.bool)
        for r, (columns, end) in enumerate(zip(plain, following)):
            target = columns - end + width
            index[r, target], valid[r, target] = kept[r].nonzero()[:, 0], True
        if width == self.width and torch.equal(valid, kept):
            return None
        return index, valid

    def _align(self) -> None:
        """Move each row's kept columns where ``_alignment`` puts them (one gather per layer), if they are not
        there."""
        alignment = self._alignment()
        if alignment is not None:
            index, valid = alignment
            for layer, backend in zip(self.layers, self.backends):
                if holds_states(layer):
                    backend.compact(layer, index)
            self.valid, self.width = valid, int(index.shape[1])
            self.gathers += 1
        if self.valid is not None and bool(self.valid.all()):
            self.valid = None

    def compaction_due(self) -> bool:
        """Do holes (columns a row does not attend to: padding, rejected branches) pass ``COMPACT_FRACTION`` of
        the kept columns, in a layout that can be compacted? A query: nothing changes."""
        return (self.valid is not None and self.num_written == 0 and bool(self.valid.numel())
                and not self.columns_are_positions() and self.holes_maskable()
                and float(self.valid.float().mean()) < 1 - self.COMPACT_FRACTION)

    def compact(self) -> int:
        """Move each row's kept columns to the end (right-aligned, as left padding is) and drop the columns no row
        sees: one gather per layer. Only between rounds (nothing written since the last keep); a model with
        sliding-window layers holds only their window, and one that counts positions by column
        (``columns_are_positions``) needs every column where it is: their layout stays as it is. Returns the
        holes removed (row x column cells), what the cost of compacting is priced by."""
        assert self.num_written == 0, "compact after keep or discard"
        if self.valid is None or self.columns_are_positions() or not self.holes_maskable():
            return 0
        before = self.valid.numel()
        counts = self.valid.sum(-1)
        width = int(counts.max())
        index = torch.zeros(self.num_rows, width, dtype=torch.long)
        for row in range(self.num_rows):
            columns = self.valid[row].nonzero()[:, 0]
            index[row, width - columns.shape[0]:] = columns
        for layer, backend in zip(self.layers, self.backends):
            if holds_states(layer):
                backend.compact(layer, index)
        self.valid = torch.arange(width)[None, :] >= (width - counts)[:, None]
        self.width = width
        self.gathers += 1
        holes = before - self.valid.numel()
        if bool(self.valid.all()):
            self.valid = None
        return holes

    def _goes_back(self) -> bool:
        """Does the store hold, after a keep, what goes back over each row's last round (until the next keep)? A
        row that stops inside a round kept tokens after its stop, which ``finish`` (a cache handed back) and
        ``feed`` (a row of a batch that stopped before the others) cut off (``_Parked.committed``)."""
        return self.returns_cache or self.keeps_rows and self.num_rows + len(self._parked) > 1

    def _rows_by_id(self) -> dict[int, _Parked]:
        """Every row, those that left and those still here, by the order ``prefill`` read them."""
        return {**self._parked, **{int(self._row_ids[r]): self._park(r) for r in range(self.num_rows)}}

    def _prompt_mask(self, rows: int) -> torch.Tensor:
        """[B0, prompt width] the prompt's mask (all ones when it had none)."""
        return self._prompt_valid if self._prompt_valid is not None else \
            torch.ones(rows, self._prompt_width, dtype=torch.bool)

    def feed(self, new_tokens: Sequence[Sequence[int]], pad_token_id: int, *, record: Recording = NOTHING,
             logits_at: LogitsAt = None) -> dict[int, Fed]:
        """For each row that emitted fewer tokens (``new_tokens[r]``, rows in the order ``prefill`` read them) than
        the longest, the forward plain ``generate`` runs over it after its stop until the others stop: its last
        token, then ``pad_token_id`` up to the longest row's count, at its next positions, with its model inputs,
        over its kept tokens (one forward per such row, its own cache). ``finish`` reuses these rows. Returns, per
        such row, the forward (logits at ``logits_at``, hidden states and attentions as ``record`` asks).
        Between rounds, in a store that ``keeps_rows``."""
        assert self.keeps_rows and self.num_written == 0, "feed: a store that keeps its rows, between rounds"
        longest = max(len(tokens) for tokens in new_tokens)
        if all(len(tokens) == longest for tokens in new_tokens):
            return {}
        rows, fed = self._rows_by_id(), {}
        prompt = self._prompt_mask(len(rows))
        for r, tokens in enumerate(new_tokens):
            if len(tokens) < longest:  # plain fed the row its last token and then padding
                row = rows[r].committed(int(prompt[r].sum()) + len(tokens) - 1)
                self._fed[r], result = self._extend(row, [tokens[-1]] + [pad_token_id] * (longest - len(tokens) - 1),
                                                    record=record, logits_at=logits_at)
                fed[r] = Fed(result, row.count)
        return fed

    def _park(self, row: int) -> _Parked:
        """Row ``row``'s kept tokens, as ``finish`` takes them."""
        columns = self._kept_valid()[row].nonzero()[:, 0]  # the row's kept tokens, in order
        states = []
        for layer, backend in zip(self.layers, self.backends):
            states.append(backend.row_states(layer, row, columns) if holds_states(layer) else None)
        return _Parked(tuple(states), int(columns.shape[0]), int(self.next_positions()[row]),
                       self.inputs.select_rows(torch.tensor([row])))

    def finish(self, new_tokens: Sequence[Sequence[int]], pad_token_id: int) -> None:
        """Leave the cache as plain ``generate`` leaves it after emitting ``new_tokens[r]`` in row r (the rows
        in the order ``prefill`` read them; a row that stopped early padded with ``pad_token_id``, as plain pads
        it): the prompt's columns, then every emitted token but the last one, in every row [B, H, prompt + N - 1,
        D] for N the longest row's tokens; a row that stopped early also holds its last token and the padding
        plain fed after it (one forward over them), sliding-window layers their window, recording as it was.
        Columns plain masks (padding, holes) hold zeros: no query ever reads them. A static cache is back in
        buffers of the width it came with (``backends.Buffers.release``); an encoder-decoder's cross-attention cache
        holds every row again. The store is spent after it.
        """
        assert self.returns_cache and self.num_written == 0, "finish: a store that hands its cache back, between rounds"
        longest = max(len(tokens) for tokens in new_tokens)
        width = self._prompt_width + longest - 1
        same = all(len(tokens) == longest for tokens in new_tokens)
        if not self._parked and same and self.valid is None and self._prompt_valid is None:
            self._rollback(width)  # already plain's layout: only the tokens kept after a stop go
        else:
            self._assemble(new_tokens, pad_token_id, longest)
        for layer, backend in zip(self.layers, self.backends):  # as plain's layers hold them: a window's tail,
            if holds_states(layer):  # a recurrent layer's last states
                backend.settle(layer)
        for layer, recording in self._recording:
            layer.record_past = recording
        if self.buffers is not None:
            self.buffers.release(width)
        for fixed, rows in zip(self.fixed, self._fixed_rows or ()):  # every row's cross-attention, as plain's
            for layer, (keys, values) in zip(fixed.layers, rows):
                layer.keys, layer.values = keys, values

    def _assemble(self, new_tokens: Sequence[Sequence[int]], pad_token_id: int, longest: int) -> None:
        """``finish`` where rows left early, stopped early, or hold padding or holes: each row's kept tokens are
        cut to what it committed, extended by what plain fed it after its stop, and scattered to the columns plain
        gives them ([prompt mask, ones])."""
        rows = self._rows_by_id()
        prompt = self._prompt_mask(len(rows))
        width = self._prompt_width + longest - 1
        final, columns = [], []
        for r in range(len(rows)):
            row = rows[r].committed(int(prompt[r].sum()) + len(new_tokens[r]) - 1)
            if r in self._fed:  # ``feed`` read its padding already
                row = self._fed[r]
            elif len(new_tokens[r]) < longest:  # plain fed the row its last token and then padding
                row = self._extend(row, [new_tokens[r][-1]] + [pad_token_id] * (longest - len(new_tokens[r]) - 1),
                                   logits_at=1)[0]
            final.append(row)
            columns.append(torch.cat([prompt[r].nonzero()[:, 0], torch.arange(self._prompt_width, width)]))
        for index, (layer, backend) in enumerate(zip(self.layers, self.backends)):
            if holds_states(layer):
                backend.set_states(layer, [row.states[index] for row in final], columns, width)

    def _extend(self, row: _Parked, tokens: list[int], *, record: Recording = NOTHING,
                logits_at: LogitsAt = 1) -> tuple[_Parked, ForwardResult]:
        """``row`` after a forward over ``tokens`` at its next positions (one row, its own cache), and that
        forward's result."""
        cache = new_cache(self.model)
        layers = split_cache(cache)[0].layers  # (an encoder-decoder's self-attention: its cross-attention is
        # written by the forward, from the row's encoder states)
        backends = layer_backends(self._caching, layers)  # a fresh cache's (not a static buffer's)
        for layer, backend, states in zip(layers, backends, row.states):
            if states is not None:
                backend.restore(layer, states, row.count)
        positions = row.next_position + torch.arange(len(tokens))[None]
        result = call_model(self.model, torch.tensor([tokens], device=self.device), cache, logits_at=logits_at,
                            position_ids=row.inputs.positions(positions).to(self.device), head=self.head,
                            record=record, model_inputs=row.inputs.step(len(tokens)))
        count = row.count + len(tokens)
        states = tuple(None if before is None else backend.row_states(layer, 0, torch.arange(count))
                       for layer, backend, before in zip(layers, backends, row.states))
        return _Parked(states, count, row.next_position + len(tokens), row.inputs), result
