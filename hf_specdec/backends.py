"""How the store (``cache.KVStore``) handles each kind of cache layer: one backend per layer class.

``KVStore`` is a slot table: which cache columns each row keeps (``valid``), how many tokens (``lengths``), at
which positions, and what was written since the last keep. It never touches a layer's tensors itself; it asks the
layer's backend, found by the layer's class in ``BACKENDS``. A kind of cache layer the store can speculate on
arrives as one more entry there, and ``support.check_supported`` accepts exactly the kinds that have one.

Terms: a layer's *columns* are the cache columns it counts (``get_seq_length``); the columns it *holds* are the
ones whose keys and values it still has (a sliding-window layer holds only the tail of what it counts). A *hole*
is a column no row attends to (padding, a rejected sibling of a trie): the mask hides it where the layer can keep
one (``holds_holes``); otherwise the store gathers each row's kept columns together before the next forward.

What a backend does, every operation in place on one layer (``LayerBackend``):

``crop(layer, length, window)``  forget every column from ``length`` on; ``window=False`` keeps what a
                                 sliding-window layer recorded past its window (a cache that will be handed back)
``settle(layer)``                after a round's keep: hold only what the next forward needs (a window's tail)
``gather(layer, start, index)``  per row r, the columns ``start + index[r]`` ([B, m]) moved to ``start..start+m-1``
``compact(layer, index)``        per row r, only the columns ``index[r]`` ([B, m]), in that order
``select_rows(layer, index)``    only the rows ``index``, in that order
``row_states(layer, row, kept)`` one row's states (``RowStates``) at its ``kept`` columns (None: the layer holds none)
``restore(layer, states, columns)``  a fresh layer (a new cache's, one row) holds a row's ``states``, counting
                                 ``columns`` columns (a row read on its own: ``cache.KVStore.feed``)
``set_states(layer, rows, columns, width)``  the layer holds the rows' ``RowStates``, row r's at its cache columns
                                 ``columns[r]`` ([n_r], the last of them where it holds fewer) of ``width``, zeros
                                 elsewhere (the cache ``cache.KVStore.finish`` hands back, in plain's columns)
``lend(mine, theirs)``           ``mine`` (an early-exit view's layer) starts from ``theirs``' tensors, uncopied

A row's states leave the layer (``row_states``) when the row leaves the batch, and come back in a layer of its own
(``restore``) or in the cache handed back (``set_states``); on the way, the tokens it kept after its stop are cut
off (``RowStates.cut``), whatever the kind of layer.

Layers that carry states through their inputs (recurrent and hybrid layers, ``Recurrent``) have no column per
token to crop: before each forward ``prepare`` tells them how many inputs may be rolled back (each input's state is
recorded), and at a keep ``keep_rows`` gives each row the states after its last kept input; for every other kind
both are no-ops (``Columns``).

Worked example (a full-attention layer of one row holding columns 0..5; a trie round wrote 3..5 and the row
kept 3 and 5): ``gather(layer, 3, [[0, 2]])`` moves column 5 to 4, and ``crop(layer, 5, True)`` drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
from transformers.cache_utils import (CacheLayerMixin, DummyLayer, DynamicIndexedLayer, DynamicLayer,
                                      DynamicSlidingWindowLayer)
from transformers.cache_utils import LinearAttentionAndFullAttentionLayer, LinearAttentionLayer


@dataclass(frozen=True)
class RowStates:
    """One row's states in one layer (``LayerBackend.row_states``): tensors of one row ([1, ...]; None where the
    layer has no such state) whose last entries along their token axis (``axes``) belong to the row's last tokens,
    so that going back over a row's last tokens is the same slice in every kind of layer (``cut``): keys and values
    [1, H, h, D] (axis 2: the columns of the last h tokens the layer holds), indexer keys [1, h, d] (axis 1), a
    recurrent layer's states after each of the row's last r inputs [1, r, ...] (axis 1: the last one is its
    current state).

    >>> states = RowStates((torch.arange(4.0).reshape(1, 1, 4, 1), None), (2, 1))
    >>> states.cut(1).parts[0].flatten().tolist()  # the row without its last token
    [0.0, 1.0, 2.0]
    """

    parts: tuple[torch.Tensor | None, ...]
    axes: tuple[int | None, ...]  # None: a part without a token axis (``Fixed``: no token of the row's is in it)

    def cut(self, count: int) -> "RowStates":
        """The same row without its last ``count`` tokens."""
        if count == 0:
            return self
        assert all(part is None or axis is None or part.shape[axis] >= count
                   for part, axis in zip(self.parts, self.axes)), \
            "cut: the layer holds fewer of the row's last tokens than it goes back over"
        return RowStates(tuple(part if part is None or axis is None else part.narrow(axis, 0, part.shape[axis] - count)
                               for part, axis in zip(self.parts, self.axes)), self.axes)

    def __add__(self, other: "RowStates") -> "RowStates":
        """The parts of both (a hybrid layer's: its recurrent states, then its keys and values)."""
        return RowStates(self.parts + other.parts, self.axes + other.axes)


def _scattered(parts: Sequence[torch.Tensor | None], columns: Sequence[torch.LongTensor], width: int,
               axis: int) -> torch.Tensor | None:
    """The rows' ``parts`` ([1, ..., h_r, ...] along ``axis``) in one tensor [B, ..., width, ...]: row r's at the last
    h_r of its ``columns[r]``, zeros elsewhere (None where no row has one).

    >>> _scattered([torch.ones(1, 2), None], [torch.tensor([0, 2]), torch.tensor([1])], 3, 1).tolist()
    [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    """
    like = next((part for part in parts if part is not None), None)
    if like is None:
        return None
    out = like.new_zeros((len(parts),) + like.shape[1: axis] + (width,) + like.shape[axis + 1:])
    for row, (part, where) in enumerate(zip(parts, columns)):
        if part is not None and part.shape[axis]:
            out[row: row + 1].index_copy_(axis, where[where.shape[0] - part.shape[axis]:].to(out.device), part)
    return out


def _set_keys_and_values(layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                         width: int, at: int = 0) -> None:
    """``set_states`` of a layer's keys and values: its rows' parts ``at`` and ``at + 1`` (none held: left as
    they are)."""
    for name, index in (("keys", at), ("values", at + 1)):
        states = _scattered([None if row is None else row.parts[index] for row in rows], columns, width, 2)
        if states is not None:
            setattr(layer, name, states)


def holds_states(layer) -> bool:
    """Does the layer hold keys and values (or a recurrent layer its states) yet (layers initialise lazily; a
    KV-shared layer never does)?"""
    return backend_for(layer).holds(layer)


def layer_columns(layer) -> int:
    """Columns the cache has in this layer (a sliding-window layer counts the ones it no longer holds)."""
    return layer.get_seq_length()


class LayerBackend(Protocol):
    """The operations ``KVStore`` needs from one kind of cache layer (module docstring)."""

    holds_holes: bool  # can a column no row attends to stay, masked? (a window counts columns: no)
    lendable: bool  # can an early-exit view share this layer's tensors (a forward concatenates into new ones)?
    branches: bool  # can one forward write a trie (several continuations of a token, each seeing its own path)?
    rows_apart: str | None  # why the rows of a batch cannot keep different numbers of tokens a round (None: they can)
    attends: bool  # does the layer attend over cache columns (a 2-D mask addresses them)? (Mamba's: no)
    chain_lane: bool  # is keeping a prefix of what was written a ``shorten`` and nothing else (one column per token,
    # every column held, no window, no state to restore)? ``cache.KVStore``'s fast lane for one row's chains

    def holds(self, layer) -> bool: ...

    def shorten(self, layer, length: int) -> None: ...

    def prepare(self, layer, inputs: int) -> None: ...

    def keep_rows(self, layer, start: int, kept: torch.LongTensor, retain: bool) -> None: ...

    def crop(self, layer, length: int, window: bool) -> None: ...

    def settle(self, layer) -> None: ...

    def gather(self, layer, start: int, index: torch.LongTensor) -> None: ...

    def compact(self, layer, index: torch.LongTensor) -> None: ...

    def select_rows(self, layer, index: torch.LongTensor) -> None: ...

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> RowStates | None: ...

    def restore(self, layer, states: RowStates, columns: int) -> None: ...

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None: ...

    def lend(self, mine, theirs) -> None: ...


class Columns:
    """What a layer of one key/value column per token shares: it holds keys once initialised, a crop undoes a
    forward (nothing to record before it), and a keep's columns are the store's to crop or gather."""

    attends = True

    def holds(self, layer) -> bool:
        return getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel() > 0

    def prepare(self, layer, inputs: int) -> None:
        """Nothing to record: a crop undoes the forward."""

    def keep_rows(self, layer, start: int, kept: torch.LongTensor, retain: bool) -> None:
        """The kept columns are the store's to crop or gather."""


class FullAttention(Columns):
    """A ``DynamicLayer``: one key/value column per token, every column held; a forward concatenates new ones."""

    holds_holes = True
    lendable = True
    branches = True
    rows_apart = None
    chain_lane = True

    def crop(self, layer, length: int, window: bool) -> None:
        current = layer.get_seq_length()
        if current > length:
            layer.crop(length - current)

    def shorten(self, layer, length: int) -> None:
        """The first ``length`` columns, where the store knows the layer holds at least as many (its fast lane)."""
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]

    def settle(self, layer) -> None:
        """Nothing to trim: the layer needs every column it holds."""

    def gather(self, layer, start: int, index: torch.LongTensor) -> None:
        rows, m = index.shape
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [B, H, S_layer, D]
            begin = states.shape[2] - (layer_columns(layer) - start)  # the layer's last columns are the cache's last
            where = (begin + index).to(states.device)[:, None, :, None].expand(rows, states.shape[1], m,
                                                                              states.shape[3])
            states[:, :, begin: begin + m, :] = states.gather(2, where)  # [B, H, m, D]

    def compact(self, layer, index: torch.LongTensor) -> None:
        rows, m = index.shape
        for name in ("keys", "values"):
            states = getattr(layer, name)
            where = index.to(states.device)[:, None, :, None].expand(rows, states.shape[1], m, states.shape[3])
            setattr(layer, name, states.gather(2, where))

    def select_rows(self, layer, index: torch.LongTensor) -> None:
        layer.batch_select_indices(index.to(layer.keys.device))

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> RowStates:
        start = layer_columns(layer) - layer.keys.shape[2]  # a sliding-window layer may hold only its tail
        held = (kept[kept >= start] - start).to(layer.keys.device)
        return RowStates((layer.keys[row: row + 1, :, held], layer.values[row: row + 1, :, held]), (2, 2))

    def restore(self, layer, states: RowStates, columns: int) -> None:
        layer.update(*states.parts[:2])

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None:
        _set_keys_and_values(layer, rows, columns, width)

    def lend(self, mine, theirs) -> None:
        mine.lazy_initialization(theirs.keys, theirs.values)
        mine.keys, mine.values = theirs.keys, theirs.values


class SlidingWindow(FullAttention):
    """A ``DynamicSlidingWindowLayer`` recording its past (``cache.new_cache``): it counts every column but, after
    ``settle``, holds only the last ``sliding_window - 1``. Its window counts columns, so a hole cannot stay, and a
    forward keeps state of its own (the count), so it cannot be lent."""

    holds_holes = False
    lendable = False
    chain_lane = False  # a keep also trims its window (``settle``)
    rows_apart = "it has sliding-window attention layers, whose window is kept per cache column"

    def crop(self, layer, length: int, window: bool) -> None:
        current = layer.get_seq_length()
        if current <= length:
            return
        if window:
            layer.crop(length - current)
            return
        held = layer.keys.shape[2] - (current - length)  # keep every column recorded before ``length``
        assert held >= 0, "rollback: the layer no longer holds those columns"
        layer.keys, layer.values = layer.keys[:, :, :held], layer.values[:, :, :held]
        layer.cumulative_length = length

    def settle(self, layer) -> None:
        layer.crop(0)  # restrict to the window (a no-op below it)

    def restore(self, layer, states: RowStates, columns: int) -> None:
        super().restore(layer, states, columns)  # (recording: it holds every column it is given)
        layer.cumulative_length = columns

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None:
        super().set_states(layer, rows, columns, width)
        layer.cumulative_length = width

    def compact(self, layer, index: torch.LongTensor) -> None:
        raise AssertionError("a sliding-window layer is never compacted: its window counts columns")


# ----------------------------------------------------------------------------------------------------------------
# Layers that follow another layer's slots, and layers with indexer keys
# ----------------------------------------------------------------------------------------------------------------


class Stateless(Columns):
    """A ``DummyLayer``: a layer that keeps no cache. A KV-shared consumer layer (Gemma 3n, Gemma 4 with
    ``num_kv_shared_layers``) reads the keys and values its producer layer (the last earlier layer of its type)
    returned in the same forward (``shared_kv_states``), under the same mask as the producer (masks go by layer
    type); a layer without attention needs none. So it follows its source layer's slots as they are, holes and
    window included: every operation is a no-op, and it holds nothing to lend, park or gather."""

    holds_holes = True
    lendable = True
    branches = True
    rows_apart = None

    chain_lane = True

    def crop(self, layer, length: int, window: bool) -> None:
        """Nothing held: the producer's crop is the consumer's."""

    def shorten(self, layer, length: int) -> None:
        """Nothing held."""

    def settle(self, layer) -> None:
        """Nothing held."""

    def gather(self, layer, start: int, index: torch.LongTensor) -> None:
        """Nothing held."""

    def compact(self, layer, index: torch.LongTensor) -> None:
        """Nothing held."""

    def select_rows(self, layer, index: torch.LongTensor) -> None:
        """Nothing held."""

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> None:
        return None

    def restore(self, layer, states: RowStates, columns: int) -> None:
        """Nothing held."""

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None:
        """Nothing held."""

    def lend(self, mine, theirs) -> None:
        """Nothing held: the borrower's consumer layer reads its own producer's keys in its forward."""


class Fixed(Stateless):
    """A layer whose keys and values are fixed for the call: a decoder's cross-attention layer in the decoder's own
    cache (Mllama's text model: ``cross_attention_layers``), holding the images' keys that the prompt's forward
    wrote and every later forward reads. None of the decoder's tokens is in it, so a round's keep, crop and
    compaction leave it as it is (``Stateless``'s no-ops); only rows that leave go, and a row's states are its
    whole tensors. (An encoder-decoder keeps these in a cache of their own: ``cache.split_cache``.)"""

    lendable = False

    def select_rows(self, layer, index: torch.LongTensor) -> None:
        layer.batch_select_indices(index.to(layer.keys.device))

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> RowStates:
        return RowStates((layer.keys[row: row + 1], layer.values[row: row + 1]), (None, None))

    def restore(self, layer, states: RowStates, columns: int) -> None:
        layer.lazy_initialization(*states.parts[:2])
        layer.keys, layer.values = states.parts[:2]

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None:
        layer.keys, layer.values = (torch.cat([row.parts[part] for row in rows]) for part in (0, 1))

    def lend(self, mine, theirs) -> None:
        raise AssertionError("a fixed layer is not lent (lendable is False)")


FIXED = Fixed()


class Indexed(FullAttention):
    """A ``DynamicIndexedLayer`` (DeepSeek-V3.2-style sparse attention: DeepSeek V3.2, GLM-MoE-DSA, ...): a full
    attention layer that also caches one indexer key per column (``indexer_keys`` [B, S, d]) and, in some models,
    the positions the indexer read (``indexer_position_ids`` [P, B, S]). The indexer scores every key column a query
    may see and keeps the top k; the mask hides holes from it as from the attention (masked scores are -inf), so
    holes can stay. Its indexer columns follow the key columns through every crop, gather, compaction and row
    selection (``select_rows``: ``batch_select_indices`` selects them too).

    >>> layer = DynamicIndexedLayer()
    >>> _ = layer.update(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2))
    >>> _ = layer.update_indexer(torch.arange(6.0).reshape(1, 6, 1))
    >>> Indexed().gather(layer, 3, torch.tensor([[0, 2]])); Indexed().crop(layer, 5, True)
    >>> layer.indexer_keys.flatten().tolist()  # column 5 moved to 4, the rest cropped
    [0.0, 1.0, 2.0, 3.0, 5.0]
    """

    chain_lane = False  # its indexer columns follow every crop (``crop``)

    def crop(self, layer, length: int, window: bool) -> None:
        """Each tensor cropped to ``length`` on its own (a forward that failed half-way may have written the keys
        and not the indexer keys)."""
        current = layer.get_seq_length()
        if current > length:
            DynamicLayer.crop(layer, length - current)  # the keys and values only
        if layer.is_indexer_initialized and layer.indexer_keys.shape[1] > length:
            layer.indexer_keys = layer.indexer_keys[:, :length]
        if layer.indexer_position_ids is not None and layer.indexer_position_ids.shape[-1] > length:
            layer.indexer_position_ids = layer.indexer_position_ids[..., :length]

    def gather(self, layer, start: int, index: torch.LongTensor) -> None:
        super().gather(layer, start, index)
        begin, m = start, index.shape[1]  # the indexer holds every column, like the keys
        if _holds_indexer(layer):
            keys = layer.indexer_keys  # [B, S, d]
            where = (begin + index).to(keys.device)[:, :, None].expand(-1, -1, keys.shape[2])
            keys[:, begin: begin + m] = keys.gather(1, where)
        if layer.indexer_position_ids is not None:
            positions = layer.indexer_position_ids  # [P, B, S]
            where = (begin + index).to(positions.device)[None].expand(positions.shape[0], -1, -1)
            positions[..., begin: begin + m] = positions.gather(2, where)

    def compact(self, layer, index: torch.LongTensor) -> None:
        super().compact(layer, index)
        if _holds_indexer(layer):
            where = index.to(layer.indexer_keys.device)[:, :, None].expand(-1, -1, layer.indexer_keys.shape[2])
            layer.indexer_keys = layer.indexer_keys.gather(1, where)
        if layer.indexer_position_ids is not None:
            positions = layer.indexer_position_ids
            layer.indexer_position_ids = positions.gather(2, index.to(positions.device)[None].expand(
                positions.shape[0], -1, -1))

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> RowStates:
        """The row's keys and values, then its indexer keys [1, h, d] and indexer positions [1, P, h] (None where
        the layer has none)."""
        held = kept.to(layer.keys.device)
        indexer = layer.indexer_keys[row: row + 1, held] if _holds_indexer(layer) else None
        positions = layer.indexer_position_ids
        if positions is not None:
            positions = positions[:, row: row + 1, held.to(positions.device)].movedim(1, 0)
        return super().row_states(layer, row, kept) + RowStates((indexer, positions), (1, 2))

    def restore(self, layer, states: RowStates, columns: int) -> None:
        super().restore(layer, states, columns)
        indexer, positions = states.parts[2:]
        if indexer is not None:
            layer.update_indexer(indexer)
        layer.indexer_position_ids = None if positions is None else positions.movedim(0, 1)

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None:
        """Keys, values, indexer keys and positions of every row at its columns (a masked column's indexer key is
        zeros, as its key: no query scores it)."""
        super().set_states(layer, rows, columns, width)
        indexer = _scattered([None if row is None else row.parts[2] for row in rows], columns, width, 1)
        if indexer is not None:
            layer.indexer_keys = indexer
        positions = _scattered([None if row is None else row.parts[3] for row in rows], columns, width, 2)
        layer.indexer_position_ids = None if positions is None else positions.movedim(0, 1)

    def lend(self, mine, theirs) -> None:
        super().lend(mine, theirs)
        if _holds_indexer(theirs):
            mine.lazy_initialization_indexer(theirs.indexer_keys)
            mine.indexer_keys = theirs.indexer_keys
        mine.indexer_position_ids = theirs.indexer_position_ids


def _holds_indexer(layer) -> bool:
    return layer.is_indexer_initialized and layer.indexer_keys.numel() > 0


# ----------------------------------------------------------------------------------------------------------------
# Static caches: preallocated buffers, written in place
# ----------------------------------------------------------------------------------------------------------------


class StaticAttention(Columns):
    """A ``StaticLayer``: keys and values in buffers of a fixed number of columns ([B, H, max_cache_len, D]),
    allocated at the first forward. A forward writes its columns at the layer's write position
    (``cumulative_length``, a tensor changed in place) and attends over the whole buffer, the columns past the
    written ones masked. A crop moves the write position back (the columns after it are overwritten later);
    gathering a path and compacting copy within the same buffers, so their tensors stay the same ones (a compiled
    forward holds their addresses). Forwards write into its tensors, so an early-exit view cannot share them.

    >>> from transformers import StaticCache
    >>> from hf_specdec.models.tiny import tiny_model
    >>> layer = StaticCache(config=tiny_model("llama").config, max_cache_len=8).layers[0]
    >>> _ = layer.update(torch.arange(6.0).reshape(1, 1, 6, 1), torch.zeros(1, 1, 6, 1))
    >>> buffer = layer.keys
    >>> STATIC.gather(layer, 3, torch.tensor([[0, 2]])); STATIC.crop(layer, 5, True)  # kept 3 and 5 of 3..5
    >>> layer.keys.flatten().tolist(), int(layer.get_seq_length()), layer.keys is buffer
    ([0.0, 1.0, 2.0, 3.0, 5.0, 5.0, 0.0, 0.0], 5, True)
    """

    holds_holes = True
    lendable = False
    branches = True
    rows_apart = None

    chain_lane = True

    def crop(self, layer, length: int, window: bool) -> None:
        if layer.is_initialized and int(layer.get_seq_length()) > length:
            self.place(layer, length)

    def shorten(self, layer, length: int) -> None:
        """The write position moved back to ``length``, where the store knows the layer holds at least as many
        columns (its fast lane): no read of the layer's count (a device tensor)."""
        if layer.is_initialized:
            self.place(layer, length)

    def settle(self, layer) -> None:
        """Nothing to trim: the buffers keep their width."""

    def gather(self, layer, start: int, index: torch.LongTensor) -> None:
        self._copy(layer, start + index, start)

    def compact(self, layer, index: torch.LongTensor) -> None:
        self._copy(layer, index, 0)
        self.place(layer, int(index.shape[1]))

    @staticmethod
    def _copy(layer, source: torch.LongTensor, start: int) -> None:
        """Per row r, the columns ``source[r]`` ([B, m]) copied to ``start..start+m-1`` of the same buffers."""
        rows, m = source.shape
        for states in (layer.keys, layer.values):
            where = source.to(states.device)[:, None, :, None].expand(rows, states.shape[1], m, states.shape[3])
            states[:, :, start: start + m].copy_(states.gather(2, where))

    def select_rows(self, layer, index: torch.LongTensor) -> None:
        index = index.to(layer.keys.device)
        layer.keys, layer.values = layer.keys[index], layer.values[index]  # a buffer of the rows left
        layer.batch_size = int(index.shape[0])

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> RowStates:
        kept = kept.to(layer.keys.device)
        return RowStates((layer.keys[row: row + 1, :, kept], layer.values[row: row + 1, :, kept]), (2, 2))

    def restore(self, layer, states: RowStates, columns: int) -> None:
        """Written at the start of the (fresh) buffers: the layer holds every column it counts."""
        layer.update(*states.parts[:2])
        self.place(layer, columns)

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None:
        """Buffers of ``width`` columns (``Buffers.release`` then puts back the width the cache came with)."""
        _set_keys_and_values(layer, rows, columns, width)

    def lend(self, mine, theirs) -> None:
        raise AssertionError("a static layer is never lent: forwards write into its buffers in place")

    def place(self, layer, columns: int) -> None:
        """Set the write position: the layer holds ``columns`` columns, and its next forward writes after them."""
        layer.cumulative_length.fill_(columns)

    def refusal(self, layer) -> str | None:
        """Why the store cannot speculate on this layer (None: it can)."""
        return None


class StaticSlidingWindow(StaticAttention):
    """A ``StaticSlidingWindowLayer`` no wider than its window (``max_cache_len <= sliding_window``, transformers'
    ``is_croppable``): it never drops a column, so its window hides none that a forward of the call reads, and it
    is a ``StaticAttention`` with a second count (``cumulative_length_int``). A wider one keeps only its window's
    last columns and rolls them, which no crop undoes (``refusal``). As in ``SlidingWindow``, the model masks it by
    column: holes are gathered at once, and the rows of a batch cannot keep different numbers of tokens."""

    holds_holes = False
    chain_lane = False  # its second count (``place``) and window go the general way
    rows_apart = "it has sliding-window attention layers, whose window is kept per cache column"

    def compact(self, layer, index: torch.LongTensor) -> None:
        raise AssertionError("a sliding-window layer is never compacted: its window counts columns")

    def place(self, layer, columns: int) -> None:
        super().place(layer, columns)
        layer.cumulative_length_int = columns

    def refusal(self, layer) -> str | None:
        if layer.is_croppable:
            return None
        return (f"its sliding-window layers keep only their window's last {layer.max_cache_len} columns of a longer "
                "static cache and roll them, so a rejected guess could not be rolled back")


STATIC = StaticAttention()
STATIC_SLIDING = StaticSlidingWindow()
BUFFERED: Mapping[type, StaticAttention] = {StaticLayer: STATIC, StaticSlidingWindowLayer: STATIC_SLIDING}


def _widened(states: torch.Tensor, width: int) -> torch.Tensor:
    """``states`` [B, H, S, D] in a buffer of ``width`` >= S columns, zeros after them."""
    grown = states.new_zeros(states.shape[:2] + (width,) + states.shape[3:])
    grown[:, :, : states.shape[2]] = states
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(grown)  # as the layer's own allocation marks its buffers
    return grown


def _settled(held: torch.Tensor, given: torch.Tensor | None, columns: int, width: int) -> torch.Tensor:
    """The first ``columns`` columns of ``held`` in a buffer of ``width`` columns, zeros after them: ``given`` (the
    cache's own buffer) where its shape fits, else a new one."""
    shape = held.shape[:2] + (width,) + held.shape[3:]
    fits = given is not None and given.shape == shape and given.dtype == held.dtype and given.device == held.device
    out = given if fits else held.new_zeros(shape)
    if out is not held:
        out[:, :, :columns] = held[:, :, :columns]
    out[:, :, columns:] = 0
    return out


class Buffers:
    """The preallocated buffers of a static cache's layers, as one store uses them.

    Every forward's keys span the buffers' whole width (``width``), so the store's masks span it too, the columns
    past the written ones masked, and a round's forward has the same shapes round after round. A forward that needs
    more columns than they have (a trie's rejected siblings kept as holes, the rows of a batch that advance apart)
    grows them first, to the next multiple of ``STEP`` columns: one copy, rarely. ``release`` puts back the width
    the cache came with (which holds the call's columns: ``check_room``), in the cache's own tensors where it had
    them (a cache passed in), zeros past its columns, as plain ``generate`` returns it.

    >>> from transformers import StaticCache
    >>> from hf_specdec.models.tiny import tiny_model
    >>> buffers = Buffers.of(StaticCache(config=tiny_model("llama").config, max_cache_len=20).layers)
    >>> buffers.reserve(16); buffers.width  # it has room
    20
    >>> buffers.reserve(21); buffers.width  # grown by a step
    64
    >>> buffers.release(5); buffers.width
    20
    """

    STEP = 64

    def __init__(self, layers) -> None:
        self.layers = [layer for layer in layers if type(layer) in BUFFERED]
        self._given = [(layer.max_cache_len, layer.keys, layer.values) for layer in self.layers]

    @classmethod
    def of(cls, layers) -> "Buffers | None":
        """The buffers of ``layers`` (a cache's), or None where none of them has one (a dynamic cache)."""
        buffers = cls(layers)
        return buffers if buffers.layers else None

    @property
    def width(self) -> int:
        """Columns every buffer has (a static cache's layers are all as wide: a narrower window is refused)."""
        return max(layer.max_cache_len for layer in self.layers)

    @property
    def own_width(self) -> int:
        """Columns the cache came with (what plain ``generate`` hands back, and its attention weights span)."""
        return min(given for given, _, _ in self._given)

    def refusal(self) -> str | None:
        """Why the store cannot speculate on these buffers (None: it can)."""
        return next((reason for reason in (BUFFERED[type(layer)].refusal(layer) for layer in self.layers)
                     if reason is not None), None)

    def check_room(self, columns: int) -> str | None:
        """Why a call that ends holding ``columns`` columns cannot use these buffers (None: they hold them)."""
        if columns <= self.own_width:
            return None
        return (f"the static cache holds {self.own_width} columns and the call needs {columns} (the prompt and every new "
                "token but the last)")

    def reserve(self, columns: int) -> None:
        """Grow every buffer to hold ``columns`` columns, if it does not yet (to a multiple of ``STEP``)."""
        if columns <= self.width:
            return
        width = -(-columns // self.STEP) * self.STEP
        for layer in self.layers:
            if layer.is_initialized:  # (one that is not allocates the new width at its first forward)
                layer.keys, layer.values = _widened(layer.keys, width), _widened(layer.values, width)
            layer.max_cache_len = width

    def release(self, columns: int) -> None:
        """Back to the width the cache came with, holding its first ``columns`` columns (``KVStore.finish``)."""
        for layer, (width, keys, values) in zip(self.layers, self._given):
            assert columns <= width, "release: the call's columns fit the cache it came with (check_room)"
            layer.max_cache_len = width
            if layer.is_initialized:
                layer.keys = _settled(layer.keys, keys, columns, width)
                layer.values = _settled(layer.values, values, columns, width)
                layer.batch_size = int(layer.keys.shape[0])
                BUFFERED[type(layer)].place(layer, columns)


# ----------------------------------------------------------------------------------------------------------------
# Recurrent and hybrid layers: states carried through the inputs, restored per row
# ----------------------------------------------------------------------------------------------------------------


class Recurrent:
    """A ``LinearAttentionLayer`` (Mamba, Mamba 2, the linear-attention layers of Jamba, Qwen3-Next, Granite 4
    hybrid, Qwen3.5): per row, a conv state (the last K inputs of a causal convolution, K its kernel) and a recurrent
    (SSM / delta-rule) state carried through the inputs; no columns. Recording (``cache.new_cache``), a forward
    appends its conv inputs to the conv state and, per input, the recurrent state before it to the layer's history
    (``recurrent_states_history``), for as many inputs as ``prepare`` asked: every input of a forward whose inputs
    may be rolled back (then the model also runs them one at a time, as plain decoding does; Mamba-1's chunked scan
    ignores a cached state), none at a prompt read. ``keep_rows`` then gives each row the states after its last
    kept input: row r, keeping m_r of the w inputs written since the last keep, takes the history's entry w - m_r
    from the end (its current state when m_r = w) and the conv window ending at its m_r-th input. One state per row
    cannot follow the branches of a trie (chains only), and a forward updates the states in place (no lending).

    After a keep the layer holds, besides its states, what goes back over the inputs each row kept (per row, its
    states after each of them: history entries and the conv inputs before them, ``_retained``), until ``settle``
    or a row selection (the rows that stay emitted every input they kept): ``crop`` goes back over the last c of
    them in every row (``discard``; a cache handed back cut to the emitted tokens, where each row's last c columns
    are its last c tokens); a crop past them only counts. ``row_states`` hands a row's states out stacked, the
    states after each of those inputs along the token axis, so a row that stopped inside its last round is cut
    back to its stop (``RowStates.cut``) as a row of keys and values is.

    Worked example (one row, kernel 2, states written as the tokens read so far): after ``keep_rows`` the row
    holds conv [b, c] and state "abc"; a forward over d, e appends conv d, e and history ["abc", "abcd"] (state
    "abcde"); keeping one of the two inputs leaves conv [c, d] and state "abcd".
    """

    holds_holes = True  # no columns: nothing to mask
    lendable = False
    branches = False
    rows_apart = None  # each row's states are restored on their own
    attends = False  # no attention over columns: a 2-D mask would address nothing (Mamba takes it per input)
    chain_lane = False  # a keep restores each row's states (``keep_rows``)

    def shorten(self, layer, length: int) -> None:
        raise AssertionError("a recurrent layer is never in the fast lane (chain_lane is False)")

    def holds(self, layer) -> bool:
        return any(layer.is_conv_states_initialized.values())

    def prepare(self, layer, inputs: int) -> None:
        """Before a forward of ``inputs`` inputs to be rolled back (0: a prompt read, kept whole): record the state
        before each of them. (``activate_past_recording`` gives every state index one shared history list; each
        gets its own.)"""
        layer.recurrent_states_to_keep = inputs
        histories = layer.recurrent_states_history
        if len({id(history) for history in histories.values()}) < len(histories):
            layer.recurrent_states_history = {index: list(history) if index == 0 else []
                                              for index, history in histories.items()}

    def keep_rows(self, layer, start: int, kept: torch.LongTensor, retain: bool = True) -> None:
        """Row r keeps the first ``kept[r]`` of the inputs the layer read after column ``start`` ([B]); the layer
        then counts ``start + max(kept)`` columns, as the attention layers of its model hold. ``retain``: it also
        holds what goes back over them (``_retained``); else only what the next forward needs."""
        written = int(layer.cumulative_length_linear) - start  # 0 where a failed forward never reached the layer
        kept = kept.cpu()
        dropped = (written - kept).clamp(min=0)  # [B]
        for index in self._indices(layer):
            history = layer.recurrent_states_history[index] if layer.is_recurrent_states_initialized[index] else []
            assert not layer.is_recurrent_states_initialized[index] or len(history) >= int(dropped.max()), \
                "keep: the forward recorded fewer states than it had inputs (prepare)"
            recorded = not layer.is_recurrent_states_initialized[index] or len(history) >= written
            retained = int(kept.max()) if retain and written > 0 and recorded else 0
            layer.conv_states[index] = self._windows(layer.conv_states[index], layer.conv_kernel_size[index] + retained,
                                                     dropped)
            if layer.is_recurrent_states_initialized[index]:
                state = layer.recurrent_states[index].clone()
                for row in dropped.nonzero()[:, 0].tolist():
                    state[row] = history[-int(dropped[row])][row]
                layer.recurrent_states[index].copy_(state)
                layer.recurrent_states_history[index] = self._retained(history[len(history) - written:], kept,
                                                                       retained)
        layer.cumulative_length_linear.fill_(start + int(kept.max()))

    @staticmethod
    def _retained(entries: list[torch.Tensor], kept: torch.LongTensor, retained: int) -> list[torch.Tensor]:
        """The history a keep leaves: ``retained`` entries, entry j holding per row r its state after its first
        ``kept[r] - retained + j`` inputs (``entries[i]`` [B, ...]: the states before the forward's input i), so
        that the entry c from the end is every row's state without its last c kept inputs (a row that kept fewer:
        its state before the forward). Rows that kept alike share the forward's own entries.

        >>> entries = [torch.tensor([10, 20]) + i for i in range(3)]  # two rows' states before inputs 0, 1, 2
        >>> [entry.tolist() for entry in Recurrent._retained(entries, torch.tensor([3, 1]), 3)]
        [[10, 20], [11, 20], [12, 20]]
        """
        if bool((kept == kept[0]).all()):
            return entries[int(kept[0]) - retained: int(kept[0])]
        return [torch.stack([entries[at][row] for row, at in enumerate((kept - retained + j).clamp(min=0).tolist())])
                for j in range(retained)]

    @staticmethod
    def _indices(layer) -> list[int]:
        return [index for index in range(layer.number_of_states) if layer.is_conv_states_initialized[index]]

    @staticmethod
    def _windows(conv: torch.Tensor, width: int, dropped: torch.LongTensor) -> torch.Tensor:
        """Per row r, the ``width`` conv inputs ([B, C, L]) that end ``dropped[r]`` before the last one (zeros
        before the first, as a causal convolution pads).

        >>> conv = torch.arange(1.0, 5.0).repeat(2, 1, 1)  # two rows of inputs 1..4
        >>> Recurrent._windows(conv, 2, torch.tensor([0, 3])).tolist()
        [[[3.0, 4.0]], [[0.0, 1.0]]]
        """
        rows, channels, length = conv.shape
        padded = torch.nn.functional.pad(conv, (width, 0))
        ends = (length + width - dropped).to(conv.device)  # [B] in padded columns
        where = ends[:, None] - width + torch.arange(width, device=conv.device)[None, :]  # [B, width]
        return padded.gather(2, where[:, None, :].expand(rows, channels, width))

    def crop(self, layer, length: int, window: bool) -> None:
        """Forget the inputs from column ``length`` on: the states go back over them where the layer still holds
        what rolls them back (inputs written or kept since the last ``settle``), by as many inputs in every row;
        past that (a column no row sees any more) only the count goes back."""
        current = int(layer.cumulative_length_linear)
        dropped = current - length
        if dropped <= 0:
            return
        for index in self._indices(layer):
            kernel = layer.conv_kernel_size[index]
            conv = layer.conv_states[index]
            history = layer.recurrent_states_history[index] if layer.is_recurrent_states_initialized[index] else None
            if conv.shape[-1] - kernel < dropped or (history is not None and len(history) < dropped):
                continue  # nothing recorded to go back over: those columns' states are no row's any more
            layer.conv_states[index] = conv[..., : conv.shape[-1] - dropped]
            if history is not None:
                layer.recurrent_states[index].copy_(history[-dropped])
                layer.recurrent_states_history[index] = history[: len(history) - dropped]
        layer.cumulative_length_linear.fill_(length)

    def settle(self, layer) -> None:
        """Hold only what the next forward needs: the last K conv inputs, no history."""
        for index in self._indices(layer):
            kernel = layer.conv_kernel_size[index]
            layer.conv_states[index] = self._windows(layer.conv_states[index], kernel,
                                                     torch.zeros(layer.conv_states[index].shape[0], dtype=torch.long))
            if layer.is_recurrent_states_initialized[index]:
                layer.recurrent_states_history[index] = []

    def gather(self, layer, start: int, index: torch.LongTensor) -> None:
        raise AssertionError("a recurrent layer keeps a prefix of what was written (chains only)")

    def compact(self, layer, index: torch.LongTensor) -> None:
        """No columns to move: the layer counts as many as its model's attention layers keep."""
        layer.cumulative_length_linear.fill_(int(index.shape[1]))

    def select_rows(self, layer, index: torch.LongTensor) -> None:
        for state in self._indices(layer):
            where = index.to(layer.conv_states[state].device)
            layer.conv_states[state] = layer.conv_states[state].index_select(0, where)
            if layer.is_recurrent_states_initialized[state]:
                layer.recurrent_states[state] = layer.recurrent_states[state].index_select(0, where)
                layer.recurrent_states_history[state] = [entry.index_select(0, where)
                                                         for entry in layer.recurrent_states_history[state]]
        self.settle(layer)  # the rows that stay emitted every input they kept: none goes back over them

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> RowStates:
        """Per state index, the row's conv windows [1, r, C, K] and recurrent states [1, r, ...] (None where it
        has none) after each of its last r - 1 inputs that the layer can go back over (``_retained``) and after
        the last, along axis 1; a layer without columns has no use for ``kept``."""
        parts: list[torch.Tensor | None] = []
        for index in range(layer.number_of_states):
            if not layer.is_conv_states_initialized[index]:
                parts += [None, None]
                continue
            conv, kernel = layer.conv_states[index][row: row + 1], layer.conv_kernel_size[index]
            back, recurrent = conv.shape[-1] - kernel, None
            if layer.is_recurrent_states_initialized[index]:
                history = layer.recurrent_states_history[index]
                back = min(back, len(history))
                recurrent = torch.stack([entry[row] for entry in history[len(history) - back:]] +
                                        [layer.recurrent_states[index][row]])[None]
            windows = conv[..., conv.shape[-1] - kernel - back:].unfold(-1, kernel, 1).movedim(-2, 1)
            parts += [windows.clone(), recurrent]
        return RowStates(tuple(parts), (1,) * len(parts))

    def restore(self, layer, states: RowStates, columns: int) -> None:
        """The row's last states (those after its last input) in a fresh layer, as after a read of its tokens: its
        next forward continues them (``has_previous_state``)."""
        for index in range(layer.number_of_states):
            windows, recurrent = states.parts[2 * index: 2 * index + 2]
            if windows is not None:
                conv = windows[:, -1]
                layer.lazy_initialization(conv_states=conv, state_idx=index, conv_kernel_size=conv.shape[-1])
                layer.conv_states[index] = conv.clone()
                layer.has_previous_state[index] = True
            if recurrent is not None:
                layer.lazy_initialization(recurrent_states=recurrent[:, -1], state_idx=index)
                layer.recurrent_states[index].copy_(recurrent[:, -1])
            layer.recurrent_states_history[index] = []
        layer.cumulative_length_linear.fill_(columns)

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None:
        """Every row's last states, nothing to go back over (as after ``settle``), counting ``width`` columns."""
        assert all(row is not None for row in rows), "set_states: every row holds its states"
        for index in self._indices(layer):
            layer.conv_states[index] = torch.cat([row.parts[2 * index][:, -1] for row in rows])
            if layer.is_recurrent_states_initialized[index]:
                layer.recurrent_states[index] = torch.cat([row.parts[2 * index + 1][:, -1] for row in rows])
                layer.recurrent_states_history[index] = []
        layer.cumulative_length_linear.fill_(width)

    def lend(self, mine, theirs) -> None:
        raise AssertionError("a recurrent layer is never lent: a forward updates its states in place")


class RecurrentAndAttention(Recurrent):
    """A ``LinearAttentionAndFullAttentionLayer`` (FalconH1: attention and a Mamba mixer side by side in every
    layer): a ``Recurrent`` layer that also holds one key/value column per token, handled as ``FullAttention``'s
    (holes stay masked; compaction moves columns). transformers' own ``crop`` of the layer crops both parts by one
    count; here each part goes its own way."""

    attends = True

    def holds(self, layer) -> bool:
        return super().holds(layer) or (layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0)

    def crop(self, layer, length: int, window: bool) -> None:
        super().crop(layer, length, window)
        current = DynamicLayer.get_seq_length(layer)
        if layer.is_initialized and current > length:
            DynamicLayer.crop(layer, length - current)

    def compact(self, layer, index: torch.LongTensor) -> None:
        super().compact(layer, index)
        FULL_ATTENTION.compact(layer, index)

    def select_rows(self, layer, index: torch.LongTensor) -> None:
        super().select_rows(layer, index)
        if layer.is_initialized:
            DynamicLayer.batch_select_indices(layer, index.to(layer.keys.device))

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> RowStates:
        """The recurrent states (``Recurrent.row_states``), then the keys and values."""
        attention = FULL_ATTENTION.row_states(layer, row, kept) if DynamicLayer.get_seq_length(layer) else \
            RowStates((None, None), (2, 2))
        return super().row_states(layer, row, kept) + attention

    def restore(self, layer, states: RowStates, columns: int) -> None:
        super().restore(layer, states, columns)
        keys, values = states.parts[2 * layer.number_of_states:]
        if keys is not None:
            DynamicLayer.update(layer, keys, values)

    def set_states(self, layer, rows: Sequence[RowStates | None], columns: Sequence[torch.LongTensor],
                   width: int) -> None:
        super().set_states(layer, rows, columns, width)
        _set_keys_and_values(layer, rows, columns, width, at=2 * layer.number_of_states)


FULL_ATTENTION = FullAttention()
RECURRENT = Recurrent()
# layers that carry states through their inputs (``prepare`` before a forward, ``keep_rows`` at a keep)
def prepare(layers, inputs: int) -> None:
    """Before a forward of ``inputs`` inputs over ``layers`` (a cache's) that may be rolled back (0: a prompt
    read, kept whole): its stateful layers record the state before each input (``Recurrent.prepare``)."""
    for layer in layers:
        backend_for(layer).prepare(layer, inputs)


def keep_rows(layers, start: int, kept: torch.LongTensor, retain: bool = True) -> None:
    """Row r keeps the first ``kept[r]`` inputs written after column ``start`` ([B]): the stateful layers among
    ``layers`` restore each row's states (``Recurrent.keep_rows``; ``retain``: holding what goes back over those
    inputs until the next keep); the others' columns are the store's to crop."""
    for layer in layers:
        backend = backend_for(layer)
        if backend.holds(layer):
            backend.keep_rows(layer, start, kept, retain)


def attends(layers) -> bool:
    """Does any of ``layers`` attend over cache columns (else a model takes no mask over them: Mamba)?"""
    return any(backend_for(layer).attends for layer in layers)


BACKENDS: Mapping[type, LayerBackend] = {
    DynamicLayer: FullAttention(),
    DynamicSlidingWindowLayer: SlidingWindow(),
    **BUFFERED,  # static caches
    DummyLayer: Stateless(),
    DynamicIndexedLayer: Indexed(),
    LinearAttentionLayer: RECURRENT,  # recurrent and hybrid layers
    LinearAttentionAndFullAttentionLayer: RecurrentAndAttention(),
}


def backend_for(layer: CacheLayerMixin) -> LayerBackend | None:
    """The backend of ``layer``'s class (None: the store cannot speculate on it)."""
    return BACKENDS.get(type(layer))


def layer_backends(model, layers) -> tuple[LayerBackend | None, ...]:
    """The backend of each of ``model``'s cache ``layers``: its class's, or ``Fixed`` for a cross-attention layer
    of the decoder (``cross_attention_layers`` of its text config: Mllama), whose keys are the images'."""
    fixed = set(getattr(model.config.get_text_config(decoder=True), "cross_attention_layers", None) or ())
    return tuple(FIXED if index in fixed else backend_for(layer) for index, layer in enumerate(layers))


def backend_named(class_name: str) -> LayerBackend | None:
    """The backend of the layer class called ``class_name`` (how ``support.py`` reads a config's layer kinds)."""
    return next((backend for kind, backend in BACKENDS.items() if kind.__name__ == class_name), None)
