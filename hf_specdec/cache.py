"""The one place that touches KV caches and calls a model.

Speculation writes KV for tokens that may be thrown away, so every cache it uses must be able to forget them.
Only ``DynamicCache`` qualifies (sliding-window layers included: they record their past until cropped); static,
quantized, offloaded-static and recurrent (linear-attention / Mamba) caches are refused up front with a clear
message instead of failing mid-generation.

``call_model`` is the one model-call path: new tokens appended to a cache, a ``ForwardResult`` back (float logits
at the requested inputs, the last hidden states on request, an optional narrowed output layer).

``KVStore`` is the cache of a decoding call, addressed by slots (absolute cache columns): B rows (B = 1 for one
prompt) that advance by different numbers of tokens per round. It owns each row's kept tokens (``lengths``, the
position of its next token) and which columns each row attends to (``valid``), so that every forward sees exactly
what plain ``generate`` would give the model: position ids ``cumsum(attention_mask) - 1``, padding and rejected
tokens masked. Operations:

``prefill(input_ids, mask)``   read the (left-padded) prompts; they are kept at once;
``forward(batch, after=)``     write a round's stacked inputs (``layout.BatchInputs``) at new slots, each row at its
                               own positions: after its kept tokens, or continuing a slot written since the last
                               keep (a draft model drafting step by step); returns the result and the slots;
``keep(kept)``                 row r keeps the slots ``kept[r]`` (a path: its next positions, in order) of what was
                               written since the last keep, and forgets the rest of it;
``discard()``                  forget everything written since the last keep (also a failed forward's half-written
                               layers after an out-of-memory);
``compact()``                  gather each row's kept columns together and drop the columns no row keeps;
``select_rows(rows)``          drop the rows that finished;
``lend(model)``                a store for an early-exit view of the model (its first layers) starting from this
                               store's kept keys and values in those layers, without copying them.

Worked example (one row, 10 prompt tokens, a trie round of 4 inputs: the last token and nodes a, b, c where
b and c are children of a). ``forward`` writes them at slots 10..13 (positions 10, 11, 12, 12); the target
accepts a -> c, so ``keep([[10, 11, 13]])``: the row keeps 13 tokens, slot 12 becomes a hole masked from then on,
and nothing is copied. Had it accepted a -> b (a prefix of what was written), the keep would be a crop. Holes are
compacted away when they pass ``COMPACT_FRACTION`` of the columns, or at once in models that cannot mask them
(sliding-window layers count columns; a model without ``position_ids`` counts positions by column).

With one unpadded row and no holes, a chain forward passes no attention mask at all (the model's own causal
mask), as plain decoding does. ``rollback`` (crop every layer to a length) is the low-level step the offline
timings use.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from .layout import BatchInputs, to_model_mask


def new_cache(model) -> DynamicCache:
    """A DynamicCache for ``model``; its sliding-window layers record their past so that they can roll back."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))  # as generate() makes it
    for layer in cache.layers:
        if hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    return cache


def check_cache_supported(cache: Cache | None) -> None:
    """Refuse caches that cannot roll back. ``None`` (a fresh cache will be made) is fine."""
    if cache is None:
        return
    if type(cache) is not DynamicCache:
        raise ValueError(
            f"hf_specdec decodes with a DynamicCache, which it rolls back and compacts after each round; got "
            f"{type(cache).__name__}. Static, offloaded and quantized caches are not supported yet (a StaticCache "
            "could roll back by moving its write position, but compacting a verified trie into its fixed buffers "
            "and masking them is not implemented). Do not pass cache_implementation='static'/'quantized'/"
            "'offloaded_static' or a cache object: leave the cache to generate(), or use plain generate() with "
            "the static cache."
        )
    if cache.layers and not all(getattr(layer, "is_croppable", True) for layer in cache.layers):
        raise ValueError(
            "This model's cache has layers that cannot roll back (recurrent or linear attention), so speculative "
            "decoding cannot undo rejected tokens. Use plain generate() for this model."
        )


def rollback(cache: Cache, length: int) -> None:
    """Forget every cached position from ``length`` on, in every layer.

    Layers are cropped one by one, so a cache left uneven by a failed forward (out of memory half-way through
    the layers) is repaired too.
    """
    for layer in cache.layers:
        current = layer.get_seq_length()
        if current > length:
            layer.crop(length - current)


def _has_states(layer) -> bool:
    return getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel() > 0


def _gather_columns(layer, start: int, index: torch.LongTensor) -> None:
    """In ``layer``, write the columns ``start + index[r]`` ([B, m]) of each row r at columns ``start..start+m-1``
    (the layer's last columns are the cache's last columns: a sliding-window layer holds only its tail)."""
    rows, m = index.shape
    for name in ("keys", "values"):
        states = getattr(layer, name)  # [B, H, S_layer, D]
        begin = states.shape[2] - (layer_columns(layer) - start)
        gather = (begin + index).to(states.device)[:, None, :, None].expand(rows, states.shape[1], m, states.shape[3])
        states[:, :, begin: begin + m, :] = states.gather(2, gather)  # [B, H, m, D]


def layer_columns(layer) -> int:
    """Columns the cache has in this layer (a sliding-window layer counts the ones it no longer holds)."""
    return layer.get_seq_length()


@functools.cache
def _forward_params(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def accepts_position_ids(model) -> bool:
    return "position_ids" in _forward_params(type(model))


# ----------------------------------------------------------------------------------------------------------------
# The one model call
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardResult:
    """What one forward gives back.

    logits: [B, m, V] float, at the requested inputs; hidden: [B, m, H] the last hidden states at the same inputs
    (only when asked, else None); slots: [B, n] the cache columns every input was written at (``KVStore.forward``
    only, else None), the handles ``KVStore.keep`` takes.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    slots: torch.Tensor | None = None


LogitsAt = int | torch.Tensor | None  # the last n inputs, or [m] input indices, or None: every input


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
) -> ForwardResult:
    """One forward over ``input_ids`` appended to ``cache`` (the cache grows by n columns in every layer).

    ``head`` replaces the model's output layer (``drafters.draft_model.SubVocabHead``, a narrowed vocabulary):
    the base model runs and the head maps its hidden states [B, m, H] to logits. ``hidden`` also returns the
    hidden states (without a head: the model's last reported hidden states, for most models after the final
    norm). The model computes logits only where asked when it can (``logits_to_keep``).
    """
    if head is not None:
        model = getattr(model, model.base_model_prefix)
    params = _forward_params(type(model))
    kwargs = {("cache" if "cache" in params else "past_key_values"): cache, "use_cache": True}
    if head is None and logits_at is not None and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = logits_at.to(input_ids.device) if isinstance(logits_at, torch.Tensor) else logits_at
    if position_ids is not None and "position_ids" in params:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if hidden and head is None:
        kwargs["output_hidden_states"] = True
    output = model(input_ids=input_ids, **kwargs)
    if head is not None:
        states = _select(output.last_hidden_state, logits_at)  # [B, m, H]
        return ForwardResult(head(states).float(), states if hidden else None)
    logits = output.logits
    if "logits_to_keep" not in params:  # the model computed every position
        logits = _select(logits, logits_at)
    states = _select(output.hidden_states[-1], logits_at) if hidden else None
    return ForwardResult(logits.float(), states)


# ----------------------------------------------------------------------------------------------------------------
# The slot-addressed store
# ----------------------------------------------------------------------------------------------------------------


class KVStore:
    """The cache of B rows that advance at their own pace, addressed by slots (see the module docstring).

    State, all explicit: ``cache`` holds ``width + len(written)`` columns; the first ``width`` are kept ones
    (``valid``: [B, width] bool, which of them each row attends to, or None when every row attends to all: the
    dense case, no mask needed); ``lengths``: [B] each row's kept tokens, the position of its next token. The
    columns after ``width`` were written since the last ``keep``: per written column, its position
    (``_positions`` [B, w]) and which written columns it saw (``_sees`` [B, w, w], itself included), so that a
    later forward can continue any of them and ``keep`` can take any path through them.

    >>> from hf_specdec.layout import BatchInputs
    >>> from hf_specdec.models.tiny import tiny_model
    >>> store = KVStore(tiny_model("llama"))
    >>> _ = store.prefill(torch.tensor([[5, 6, 7]]), None)  # kept at once: 3 tokens, positions 0..2
    >>> trie = BatchInputs(torch.tensor([[8, 9, 10]]), torch.tensor([[0, 1, 1]]), None,  # 8, then 9 or 10
    ...                    torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool))
    >>> store.forward(trie).slots.tolist()
    [[3, 4, 5]]
    >>> store.keep([[3, 5]])  # 8 -> 10: slot 4 becomes a hole, masked from now on
    >>> store.lengths.tolist(), store.valid.tolist(), store.gathers
    ([5], [[True, True, True, True, False, True]], 0)
    >>> store.compact(); store.dense, store.width, store.gathers
    (True, 5, 1)
    """

    COMPACT_FRACTION = 0.5  # compact when more than this fraction of the kept columns are holes

    def __init__(self, model, attention: str = "sdpa", head: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.model, self.attention = model, attention
        self.head = head  # optional: hidden [B, n, H] -> logits, a narrowed output layer
        self.cache = new_cache(model)
        self.valid: torch.Tensor | None = None
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.width = 0
        self._positions = torch.zeros(0, 0, dtype=torch.long)
        self._sees = torch.zeros(0, 0, 0, dtype=torch.bool)
        self.gathers = 0  # how many times columns were gathered (``compact``, or ``keep`` where holes cannot stay)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_written(self) -> int:
        """Columns written since the last keep."""
        return int(self._positions.shape[1])

    @property
    def dense(self) -> bool:
        """Every row attends to every kept column and nothing is written since the last keep."""
        return self.valid is None and self.num_written == 0

    def nbytes(self) -> int:
        """Bytes the cached keys and values take now (every layer, every row, padding columns included)."""
        total = 0
        for layer in getattr(self.cache, "layers", ()):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    def holes_maskable(self) -> bool:
        """Can columns no row attends to stay in the cache? Not with sliding-window layers (they keep a count of
        columns) nor in a model that takes no position ids (it counts positions by column)."""
        model = getattr(self.model, self.model.base_model_prefix) if self.head is not None else self.model
        return accepts_position_ids(model) and not any(getattr(layer, "is_sliding", False)
                                                       for layer in self.cache.layers)

    def _kept_valid(self) -> torch.Tensor:
        """[B, width] the kept columns each row attends to (all of them when ``valid`` is None)."""
        return self.valid if self.valid is not None else torch.ones(self.num_rows, self.width, dtype=torch.bool)

    def _reset_written(self) -> None:
        self._positions = torch.zeros(self.num_rows, 0, dtype=torch.long)
        self._sees = torch.zeros(self.num_rows, 0, 0, dtype=torch.bool)

    def prefill(self, input_ids: torch.LongTensor, mask: torch.Tensor | None, logits_at: LogitsAt = 1) -> ForwardResult:
        """Read the prompts ``input_ids`` [B, P] (``mask`` [B, P]: 0 for left padding, or None) into an empty
        store and keep them: positions as plain ``generate`` gives them, ``cumsum(mask) - 1``. A zero-width
        prompt reads nothing (logits [B, 0, 0]). Returns logits [B, m, V] at ``logits_at``."""
        assert self.width == 0 and self.num_written == 0, "prefill fills an empty store"
        rows, length = input_ids.shape
        valid = None if mask is None or bool(mask.bool().all()) else mask.bool().cpu()  # [B, P]
        self.lengths = torch.full((rows,), length) if valid is None else valid.sum(-1)
        self._reset_written()
        if length == 0:
            return ForwardResult(torch.zeros(rows, 0, 0))
        positions = torch.arange(length).repeat(rows, 1) if valid is None else (valid.long().cumsum(-1) - 1).clamp_min(0)
        attention = None if valid is None else valid.long().to(self.device)
        result = call_model(self.model, input_ids.to(self.device), self.cache, logits_at=logits_at,
                            position_ids=positions.to(self.device), attention_mask=attention, head=self.head)
        self.valid, self.width = valid, length
        return result

    def forward(self, batch: BatchInputs, *, after: torch.LongTensor | None = None, logits_at: LogitsAt = None,
                hidden: bool = False) -> ForwardResult:
        """Write a round's stacked inputs (``batch``: [B, n]) at the next n slots and run the model over them.

        Each row's inputs sit at its next positions plus their offsets and see the row's kept columns, each
        other as ``batch`` says and, with ``after`` ([B] slots written since the last keep), the written path
        that ends at ``after[r]`` (that slot and what it saw): the inputs continue it, at its position + 1 +
        offset. ``after`` [B, n] gives each input its own path (a tree's frontier, drafted depth by depth: each
        node continues its parent; ``batch.inner`` is then required). Without ``after`` they see none of the
        written slots. Returns logits [B, m, V] at ``logits_at`` (hidden states on request) and ``slots`` [B, n],
        the columns the inputs were written at.
        """
        rows, n = batch.input_ids.shape
        past = self.width + self.num_written
        if after is None:
            base = self.lengths[:, None]  # [B, 1]
            sees_written = torch.zeros(rows, 1, self.num_written, dtype=torch.bool)  # [B, 1, w]
        else:
            written = after.cpu().reshape(rows, -1) - self.width  # [B, 1 or n] indices among the written columns
            assert bool((written >= 0).all()) and bool((written < self.num_written).all()), "after: written slots"
            assert written.shape[1] == 1 or batch.inner is not None, "a path per input needs a 4-D layout"
            base = self._positions.gather(1, written) + 1  # [B, 1 or n]
            sees_written = self._sees[torch.arange(rows)[:, None], written]  # [B, 1 or n, w]
        positions = base + batch.offsets  # [B, n]
        sees_all = self.valid is None and bool(sees_written.all()) and batch.valid is None  # the dense case
        new_valid = batch.valid if batch.valid is not None else torch.ones(rows, n, dtype=torch.bool)
        if batch.inner is None:  # chains: the model's own causal mask, over a 2-D mask unless all is visible
            mask = None
            if not sees_all:
                sees_past = torch.cat([self._kept_valid(), sees_written[:, 0]], dim=1)  # [B, past]
                mask = torch.cat([sees_past, new_valid], dim=1).long().to(self.device)  # [B, past + n]
            inner = torch.ones(n, n, dtype=torch.bool).tril().expand(rows, n, n) & new_valid[:, None, :]
        else:  # trees: a 4-D mask, True = attend
            inner = batch.inner
            kept = self._kept_valid()[:, None, :].expand(rows, n, self.width)
            full = torch.cat([kept, sees_written.expand(rows, n, self.num_written), inner], dim=2)  # [B, n, past + n]
            mask = self._layer_masks(full, positions, n)
        result = call_model(self.model, batch.input_ids.to(self.device), self.cache, logits_at=logits_at,
                            position_ids=positions.to(self.device), attention_mask=mask, hidden=hidden,
                            head=self.head)
        w = self.num_written
        sees = torch.zeros(rows, w + n, w + n, dtype=torch.bool)
        sees[:, :w, :w] = self._sees
        sees[:, w:, :w] = sees_written
        sees[:, w:, w:] = inner
        self._sees = sees
        self._positions = torch.cat([self._positions, positions], dim=1)
        slots = past + torch.arange(n).repeat(rows, 1)  # [B, n]
        return ForwardResult(result.logits, result.hidden, slots)

    def _key_positions(self) -> torch.Tensor:
        """[B, width + w] the position of every column (a hole's is meaningless: it is masked)."""
        kept = (self._kept_valid().long().cumsum(-1) - 1).clamp_min(0)
        return torch.cat([kept, self._positions], dim=1)

    def _layer_masks(self, full: torch.Tensor, positions: torch.Tensor, n: int):
        """The 4-D mask each kind of layer takes: the full one, and for sliding-window layers the columns they
        return (their window) with the window applied by position. A model with ``config.layer_types`` gets
        them by layer type; one without gets its only kind.

        full: [B, n, past + n] bool; positions: [B, n] of the inputs.
        """
        sliding = {type(layer).__name__: layer for layer in self.cache.layers if getattr(layer, "is_sliding", False)}
        as_model = lambda mask: to_model_mask(mask[:, None].to(self.device), self.attention, self.dtype)  # noqa: E731
        if not sliding:
            return as_model(full)
        past = full.shape[2] - n
        key_positions = torch.cat([self._key_positions(), positions], dim=1)  # [B, past + n]
        masks = {}
        for layer in sliding.values():
            visible = layer.get_mask_sizes(n)[0] - n  # cached columns the layer hands its attention
            in_window = key_positions[:, None, past - visible:] > positions[:, :, None] - layer.sliding_window
            masks["sliding_attention"] = as_model(full[:, :, past - visible:] & in_window)
        layer_types = getattr(self.model.config.get_text_config(decoder=True), "layer_types", None)
        if not layer_types:  # every layer slides (Mistral, Phi-3): one mask
            return masks["sliding_attention"]
        masks["full_attention"] = as_model(full)
        return {kind: masks[kind] for kind in set(layer_types)}

    def keep(self, kept: Sequence[Sequence[int]]) -> None:
        """Row r keeps the slots ``kept[r]`` of those written since the last keep: a path at its next positions,
        in order (an empty list keeps nothing); every other written slot is forgotten.

        A prefix of what was written in every row is a crop (a dense row stays dense); other paths leave holes
        that the mask hides, gathered together right away where holes cannot be masked
        (``holes_maskable``) and otherwise by ``compact`` when they pass ``COMPACT_FRACTION`` of the columns.
        """
        assert len(kept) == self.num_rows, "one list of slots per row"
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
        expected = self.lengths[:, None] + torch.arange(w)[None, :]
        assert bool(((path_positions == expected) | ~taken).all()), "keep: each row's next positions, in order"
        prefix = bool(((index == torch.arange(w)[None, :]) | ~taken).all())
        if prefix or not self.holes_maskable():
            if not prefix:  # gather each row's path to the start of the written block
                gather = torch.where(taken, index, index[:, :1])[:, :m]  # [B, m]
                for layer in self.cache.layers:
                    if _has_states(layer):
                        _gather_columns(layer, self.width, gather)
                self.gathers += 1
            rollback(self.cache, self.width + m)
            for layer in self.cache.layers:  # a sliding-window layer restricts itself to its window
                if getattr(layer, "is_sliding", False) and _has_states(layer):
                    layer.crop(0)
            new_columns = taken[:, :m]  # [B, m]
        else:  # holes stay, masked; the columns after the last kept one go
            new_columns = torch.zeros(self.num_rows, w, dtype=torch.bool)  # [B, w]
            new_columns[torch.arange(self.num_rows)[:, None].expand(-1, w)[taken], index[taken]] = True
            last = int(new_columns.any(dim=0).nonzero().max()) + 1 if bool(new_columns.any()) else 0
            rollback(self.cache, self.width + last)
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
        rollback(self.cache, self.width)
        self._reset_written()

    def can_lend(self) -> bool:
        """Can ``lend`` start another store from this one's tensors? Only full-attention layers (``DynamicLayer``:
        a forward concatenates new columns into a new tensor); a sliding-window layer keeps a state of its own."""
        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

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
        >>> len(lent.cache.layers), lent.lengths.tolist(), lent.cache.layers[1].keys is store.cache.layers[1].keys
        (2, [3], True)
        >>> _ = lent.forward(BatchInputs(torch.tensor([[8]]), torch.tensor([[0]]), None, None))
        >>> lent.cache.layers[0].keys.shape[2], store.cache.layers[0].keys.shape[2]  # the lender is untouched
        (4, 3)
        """
        assert self.num_written == 0, "lend between rounds: nothing written since the last keep"
        assert self.can_lend(), "only full-attention layers can be lent"
        store = KVStore(model, self.attention, head=head)
        assert len(store.cache.layers) <= len(self.cache.layers), "the borrower runs the lender's first layers"
        for mine, theirs in zip(store.cache.layers, self.cache.layers):
            if _has_states(theirs):
                mine.lazy_initialization(theirs.keys, theirs.values)
                mine.keys, mine.values = theirs.keys, theirs.values
        store.valid = None if self.valid is None else self.valid.clone()
        store.lengths, store.width = self.lengths.clone(), self.width
        store._reset_written()
        return store

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (in this order): the others finished."""
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self.cache.layers:
            if _has_states(layer):
                layer.batch_select_indices(index.to(layer.keys.device))
        self.lengths = self.lengths[index]
        self._positions, self._sees = self._positions[index], self._sees[index]
        if self.valid is not None:
            self.valid = self.valid[index]
            self._tidy()

    def _tidy(self) -> None:
        """After a keep or a row selection: drop kept columns no row sees at the end, compact when holes pass
        ``COMPACT_FRACTION``, and go back to ``valid = None`` when every row sees every column."""
        if self.valid is None or self.num_written:
            return
        seen = self.valid.any(dim=0)  # [width]
        if not bool(seen.all()):
            last = int(seen.nonzero().max()) + 1 if bool(seen.any()) else 0
            if last < self.width:
                rollback(self.cache, last)
                self.valid, self.width = self.valid[:, :last], last
        if self.valid.numel() and float(self.valid.float().mean()) < 1 - self.COMPACT_FRACTION:
            self.compact()
        if self.valid is not None and bool(self.valid.all()):
            self.valid = None

    def compact(self) -> None:
        """Move each row's kept columns to the end (right-aligned, as left padding is) and drop the columns no row
        sees: one gather per layer. Only between rounds (nothing written since the last keep); a model with
        sliding-window layers holds only their window, so its layout stays as it is."""
        assert self.num_written == 0, "compact after keep or discard"
        if self.valid is None or any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            return
        counts = self.valid.sum(-1)
        width = int(counts.max())
        index = torch.zeros(self.num_rows, width, dtype=torch.long)
        for row in range(self.num_rows):
            columns = self.valid[row].nonzero()[:, 0]
            index[row, width - columns.shape[0]:] = columns
        for layer in self.cache.layers:
            if not _has_states(layer):
                continue
            for name in ("keys", "values"):
                states = getattr(layer, name)
                gather = index.to(states.device)[:, None, :, None].expand(
                    self.num_rows, states.shape[1], width, states.shape[3])
                setattr(layer, name, states.gather(2, gather))
        self.valid = torch.arange(width)[None, :] >= (width - counts)[:, None]
        self.width = width
        self.gathers += 1
        if bool(self.valid.all()):
            self.valid = None
