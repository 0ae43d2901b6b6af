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
``row_states(layer, row, kept)`` one row's keys and values at its ``kept`` columns (None: the layer holds none)
``lend(mine, theirs)``           ``mine`` (an early-exit view's layer) starts from ``theirs``' tensors, uncopied

Worked example (a full-attention layer of one row holding columns 0..5; a trie round wrote 3..5 and the row
kept 3 and 5): ``gather(layer, 3, [[0, 2]])`` moves column 5 to 4, and ``crop(layer, 5, True)`` drops the rest.
"""

from __future__ import annotations

from typing import Mapping, Protocol

import torch
from transformers.cache_utils import (CacheLayerMixin, DummyLayer, DynamicIndexedLayer, DynamicLayer,
                                      DynamicSlidingWindowLayer)

KV = tuple[torch.Tensor, torch.Tensor]  # a row's keys and values [1, H, h, D]


def holds_states(layer) -> bool:
    """Does the layer hold keys and values yet (layers initialise lazily; a KV-shared layer never does)?"""
    return getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel() > 0


def layer_columns(layer) -> int:
    """Columns the cache has in this layer (a sliding-window layer counts the ones it no longer holds)."""
    return layer.get_seq_length()


class LayerBackend(Protocol):
    """The operations ``KVStore`` needs from one kind of cache layer (module docstring)."""

    holds_holes: bool  # can a column no row attends to stay, masked? (a window counts columns: no)
    lendable: bool  # can an early-exit view share this layer's tensors (a forward concatenates into new ones)?
    branches: bool  # can one forward write a trie (several continuations of a token, each seeing its own path)?
    rows_apart: str | None  # why the rows of a batch cannot keep different numbers of tokens a round (None: they can)

    def crop(self, layer, length: int, window: bool) -> None: ...

    def settle(self, layer) -> None: ...

    def gather(self, layer, start: int, index: torch.LongTensor) -> None: ...

    def compact(self, layer, index: torch.LongTensor) -> None: ...

    def select_rows(self, layer, index: torch.LongTensor) -> None: ...

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> KV | None: ...

    def lend(self, mine, theirs) -> None: ...


class FullAttention:
    """A ``DynamicLayer``: one key/value column per token, every column held; a forward concatenates new ones."""

    holds_holes = True
    lendable = True
    branches = True
    rows_apart = None

    def crop(self, layer, length: int, window: bool) -> None:
        current = layer.get_seq_length()
        if current > length:
            layer.crop(length - current)

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

    def row_states(self, layer, row: int, kept: torch.LongTensor) -> KV:
        start = layer_columns(layer) - layer.keys.shape[2]  # a sliding-window layer may hold only its tail
        held = (kept[kept >= start] - start).to(layer.keys.device)
        return layer.keys[row: row + 1, :, held], layer.values[row: row + 1, :, held]

    def lend(self, mine, theirs) -> None:
        mine.lazy_initialization(theirs.keys, theirs.values)
        mine.keys, mine.values = theirs.keys, theirs.values


class SlidingWindow(FullAttention):
    """A ``DynamicSlidingWindowLayer`` recording its past (``cache.new_cache``): it counts every column but, after
    ``settle``, holds only the last ``sliding_window - 1``. Its window counts columns, so a hole cannot stay, and a
    forward keeps state of its own (the count), so it cannot be lent."""

    holds_holes = False
    lendable = False
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

    def compact(self, layer, index: torch.LongTensor) -> None:
        raise AssertionError("a sliding-window layer is never compacted: its window counts columns")


# ----------------------------------------------------------------------------------------------------------------
# Layers that follow another layer's slots, and layers with indexer keys
# ----------------------------------------------------------------------------------------------------------------


class Stateless:
    """A ``DummyLayer``: a layer that keeps no cache. A KV-shared consumer layer (Gemma 3n, Gemma 4 with
    ``num_kv_shared_layers``) reads the keys and values its producer layer (the last earlier layer of its type)
    returned in the same forward (``shared_kv_states``), under the same mask as the producer (masks go by layer
    type); a layer without attention needs none. So it follows its source layer's slots as they are, holes and
    window included: every operation is a no-op, and it holds nothing to lend, park or gather."""

    holds_holes = True
    lendable = True
    branches = True
    rows_apart = None

    def crop(self, layer, length: int, window: bool) -> None:
        """Nothing held: the producer's crop is the consumer's."""

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

    def lend(self, mine, theirs) -> None:
        """Nothing held: the borrower's consumer layer reads its own producer's keys in its forward."""


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

    def lend(self, mine, theirs) -> None:
        super().lend(mine, theirs)
        if _holds_indexer(theirs):
            mine.lazy_initialization_indexer(theirs.indexer_keys)
            mine.indexer_keys = theirs.indexer_keys
        mine.indexer_position_ids = theirs.indexer_position_ids


def _holds_indexer(layer) -> bool:
    return layer.is_indexer_initialized and layer.indexer_keys.numel() > 0


BACKENDS: Mapping[type, LayerBackend] = {
    DynamicLayer: FullAttention(),
    DynamicSlidingWindowLayer: SlidingWindow(),
    DummyLayer: Stateless(),
    DynamicIndexedLayer: Indexed(),
}


def backend_for(layer: CacheLayerMixin) -> LayerBackend | None:
    """The backend of ``layer``'s class (None: the store cannot speculate on it)."""
    return BACKENDS.get(type(layer))


def backend_named(class_name: str) -> LayerBackend | None:
    """The backend of the layer class called ``class_name`` (how ``support.py`` reads a config's layer kinds)."""
    return next((backend for kind, backend in BACKENDS.items() if kind.__name__ == class_name), None)
