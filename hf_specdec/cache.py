"""The one place that touches KV caches.

Speculation writes KV for tokens that may be thrown away, so every cache it uses must be able to forget them.
Only ``DynamicCache`` qualifies (sliding-window layers included: they record their past until cropped); static,
quantized, offloaded-static and recurrent (linear-attention / Mamba) caches are refused up front with a clear
message instead of failing mid-generation.

``RowCache`` is the cache of a decoding call: B rows (B = 1 for one prompt) that advance by different numbers of
tokens per round. It owns the rows' positions and which cached columns each row attends to, so that every
forward sees exactly what plain ``generate`` would give the model: position ids ``cumsum(attention_mask) - 1``,
padding masked. With one unpadded row it is a plain dense cache, and keeping a chain's accepted tokens is a
crop. Operations:

``prefill(input_ids, mask)``   read the (left-padded) prompts;
``forward(batch)``             one forward over a round's stacked inputs (``layout.BatchInputs``);
``keep(kept)``                 after it, each row keeps the KV of only these of its inputs (the accepted path);
``truncate(lengths)``          each row forgets its newest tokens down to ``lengths[r]`` (a draft model's cache);
``discard()``                  forget a forward that failed half-way (out of memory), in every layer;
``select_rows(rows)``          drop the rows that finished.

The module functions ``rollback``, ``forward`` and ``forward_hidden`` are the low-level steps it is built on.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

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


def _keep_block(layer, n: int, index: torch.LongTensor) -> None:
    """In a layer whose last ``n`` columns are a round's inputs, keep the inputs ``index`` ([B, m]) of each row in
    their place at the start of that block and drop the rest of it (with the layer's own crop, so sliding-window
    layers keep their count and window)."""
    if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
        return
    rows, m = index.shape
    if not bool((index == torch.arange(m, device=index.device)).all()):
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [B, H, S, D]
            block = states[:, :, states.shape[2] - n:, :]
            gather = index.to(states.device)[:, None, :, None].expand(rows, states.shape[1], m, states.shape[3])
            kept = block.gather(2, gather)  # [B, H, m, D]
            states[:, :, states.shape[2] - n: states.shape[2] - n + m, :] = kept
    if n > m:  # (a sliding-window layer records its past until then: cropping also restricts it to its window)
        layer.crop(-(n - m))


@functools.cache
def _forward_params(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def accepts_position_ids(model) -> bool:
    return "position_ids" in _forward_params(type(model))


def forward(
    model,
    input_ids: torch.LongTensor,  # [B, n] new tokens
    cache: Cache,
    *,
    num_logits: int | torch.LongTensor | None = 1,  # last ``num_logits`` positions, or [m] input indices, or None: all
    position_ids: torch.LongTensor | None = None,  # [B, n], default: the model's (continue after the cache)
    attention_mask: torch.Tensor | None = None,  # 2-D [B, past + n] or 4-D [B, 1, n, past + n], or None (causal)
    batched: bool = False,
) -> torch.Tensor:
    """One forward over ``input_ids`` appended to ``cache``; returns float logits [n_logits, vocab] of row 0, or
    [B, n_logits, vocab] with ``batched``."""
    params = _forward_params(type(model))
    kwargs = {("cache" if "cache" in params else "past_key_values"): cache, "use_cache": True}
    if num_logits is not None and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = num_logits
    if position_ids is not None and "position_ids" in params:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    logits = model(input_ids=input_ids, **kwargs).logits
    if "logits_to_keep" not in params:  # the model computed every position
        if isinstance(num_logits, torch.Tensor):
            logits = logits[:, num_logits.to(logits.device)]
        elif num_logits is not None:
            logits = logits[:, -num_logits:]
    return (logits if batched else logits[0]).float()


def forward_hidden(base_model, input_ids: torch.LongTensor, cache: Cache, position_ids=None,
                   attention_mask=None) -> torch.Tensor:
    """Forward of a base (headless) model over ``input_ids`` [B, n] appended to ``cache``: hidden states [B, n, H]."""
    params = _forward_params(type(base_model))
    kwargs = {("cache" if "cache" in params else "past_key_values"): cache, "use_cache": True}
    if position_ids is not None and "position_ids" in params:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    return base_model(input_ids=input_ids, **kwargs).last_hidden_state


class RowCache:
    """The cache of B rows that advance at their own pace (see the module docstring).

    ``valid``: [B, S] bool, which cached columns each row attends to, or None when every column is valid for
    every row (one unpadded row: the dense case, no mask needed); ``lengths``: [B] each row's valid tokens, the
    position of its next token.
    """

    def __init__(self, model, attention: str = "sdpa", head=None) -> None:
        self.model, self.attention = model, attention
        self.head = head  # optional: a callable (hidden [B, n, H]) -> logits, for a narrowed output layer
        self.cache = new_cache(model)
        self.valid: torch.Tensor | None = None
        self.lengths = torch.zeros(0, dtype=torch.long)
        self._appended = 0  # columns the last forward added, until keep()
        self._past = 0  # columns before the last forward
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def dense(self) -> bool:
        return self.valid is None

    def nbytes(self) -> int:
        """Bytes the cached keys and values take now (every layer, every row, padding columns included)."""
        total = 0
        for layer in getattr(self.cache, "layers", ()):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    def _columns(self) -> int:
        return self.cache.get_seq_length() if self.num_rows else 0

    def _call(self, input_ids, positions, mask, num_logits):
        kwargs = dict(position_ids=positions.to(self.device), attention_mask=mask)
        if isinstance(num_logits, torch.Tensor):
            num_logits = num_logits.to(self.device)
        if self.head is not None:
            base = getattr(self.model, self.model.base_model_prefix)
            hidden = forward_hidden(base, input_ids.to(self.device), self.cache, **kwargs)
            if isinstance(num_logits, torch.Tensor):
                hidden = hidden[:, num_logits]
            elif num_logits is not None:
                hidden = hidden[:, -num_logits:]
            return self.head(hidden)
        return forward(self.model, input_ids.to(self.device), self.cache, num_logits=num_logits, batched=True,
                       **kwargs)

    def prefill(self, input_ids: torch.LongTensor, mask: torch.Tensor | None,
                num_logits: int | None = 1) -> torch.Tensor:
        """Read the prompts ``input_ids`` [B, P] (``mask`` [B, P]: 0 for left padding, or None): positions as
        plain ``generate`` gives them, ``cumsum(mask) - 1``. Returns logits [B, num_logits, V]."""
        rows, length = input_ids.shape
        valid = None if mask is None or bool(mask.bool().all()) else mask.bool().cpu()
        if valid is None:
            positions = torch.arange(length).repeat(rows, 1)
        else:
            positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        self._appended, self._past = length, 0
        attention = None if valid is None else valid.long().to(self.device)
        logits = self._call(input_ids, positions, attention, num_logits)
        self.valid = valid
        self.lengths = torch.full((rows,), length) if valid is None else valid.sum(-1)
        self._appended = 0
        return logits

    def forward(self, batch: BatchInputs, num_logits: int | None = None) -> torch.Tensor:
        """One forward over a round's stacked inputs; each row's inputs sit at its own positions and see its own
        valid cache columns. Returns logits [B, n or num_logits, V]."""
        rows, n = batch.input_ids.shape
        past = self._columns()
        positions = self.lengths[:, None] + batch.offsets
        if batch.inner is None:  # chains: the model's own causal mask over a 2-D padding mask
            mask = None
            if self.valid is not None or batch.valid is not None:
                past_valid = self.valid if self.valid is not None else torch.ones(rows, past, dtype=torch.bool)
                new_valid = batch.valid if batch.valid is not None else torch.ones(rows, n, dtype=torch.bool)
                mask = torch.cat([past_valid, new_valid], dim=1).long().to(self.device)
        else:  # trees: a 4-D mask, True = attend
            past_valid = self.valid if self.valid is not None else torch.ones(rows, past, dtype=torch.bool)
            full = torch.cat([past_valid[:, None, :].expand(rows, n, past), batch.inner], dim=2)  # [B, n, past + n]
            mask = self._layer_masks(full, positions, n)
        self._appended, self._past = n, past
        return self._call(batch.input_ids, positions, mask, num_logits)

    def _layer_masks(self, full: torch.Tensor, positions: torch.Tensor, n: int):
        """The 4-D mask each kind of layer takes: the full one, and for sliding-window layers the columns they
        return (their window) with the window applied by position (one dense row: column index = position).
        A model with ``config.layer_types`` gets them by layer type; one without gets its only kind."""
        sliding = {type(layer).__name__: layer for layer in self.cache.layers if getattr(layer, "is_sliding", False)}
        as_model = lambda mask: to_model_mask(mask[:, None].to(self.device), self.attention, self.dtype)  # noqa: E731
        if not sliding:
            return as_model(full)
        past = full.shape[2] - n
        masks = {}
        for layer in sliding.values():
            visible = layer.get_mask_sizes(n)[0] - n  # cached columns the layer hands its attention
            key_positions = torch.cat([torch.arange(past - visible, past)[None].expand(full.shape[0], visible),
                                       positions], dim=1)  # [B, visible + n]
            in_window = key_positions[:, None, :] > positions[:, :, None] - layer.sliding_window
            masks["sliding_attention"] = as_model(full[:, :, past - visible:] & in_window)
        layer_types = getattr(self.model.config.get_text_config(decoder=True), "layer_types", None)
        if not layer_types:  # every layer slides (Mistral, Phi-3): one mask
            return masks["sliding_attention"]
        masks["full_attention"] = as_model(full)
        return {kind: masks[kind] for kind in set(layer_types)}

    def keep(self, kept: list[list[int]]) -> None:
        """After ``forward``: row r keeps the KV of its inputs ``kept[r]`` (increasing), in that order."""
        n, self._appended = self._appended, 0
        counts = torch.tensor([len(k) for k in kept])
        m = int(counts.max())
        index = torch.tensor([k + [k[-1]] * (m - len(k)) for k in kept], dtype=torch.long)  # [B, m]
        for layer in self.cache.layers:
            _keep_block(layer, n, index)
        if self.valid is not None or bool((counts != m).any()):
            past_valid = self.valid if self.valid is not None else torch.ones(self.num_rows, self._columns() - m,
                                                                              dtype=torch.bool)
            self.valid = torch.cat([past_valid, torch.arange(m)[None, :] < counts[:, None]], dim=1)
            self._normalise()
        self.lengths = self.lengths + counts

    def truncate(self, lengths: torch.LongTensor) -> None:
        """Row r keeps only its first ``lengths[r]`` valid tokens (never more than it has)."""
        lengths = torch.minimum(lengths, self.lengths)
        if bool((lengths == self.lengths).all()):
            return
        if self.dense and bool((lengths == lengths[0]).all()):
            rollback(self.cache, int(lengths[0]))
        else:
            valid = self.valid if self.valid is not None else torch.ones(self.num_rows, self._columns(),
                                                                         dtype=torch.bool)
            self.valid = valid & (valid.long().cumsum(-1) <= lengths[:, None])
            self._normalise()
        self.lengths = lengths

    def discard(self) -> None:
        """Forget the columns a failed forward may have written (out of memory half-way through the layers)."""
        rollback(self.cache, self._past)
        self._appended = 0

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (in this order): the others finished."""
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                layer.batch_select_indices(index.to(layer.keys.device))
        self.lengths = self.lengths[index]
        if self.valid is not None:
            self.valid = self.valid[index]
            self._normalise()

    def _normalise(self) -> None:
        """Drop trailing columns no row sees; compact when most columns are dead; None when all are valid."""
        seen = self.valid.any(dim=0)
        if not bool(seen.all()):
            last = int(seen.nonzero().max()) + 1 if bool(seen.any()) else 0
            if last < self.valid.shape[1]:
                rollback(self.cache, last)
                self.valid = self.valid[:, :last]
        if self.valid.numel() and float(self.valid.float().mean()) < 0.5:
            self._compact()
        if bool(self.valid.all()):
            self.valid = None

    def _compact(self) -> None:
        """Move each row's valid columns to the end (right-aligned, as left padding is), drop the dead ones."""
        if any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            return  # sliding layers hold only their window: leave the layout as it is
        counts = self.valid.sum(-1)
        width = int(counts.max())
        index = torch.zeros(self.num_rows, width, dtype=torch.long)
        for row in range(self.num_rows):
            columns = self.valid[row].nonzero()[:, 0]
            index[row, width - columns.shape[0]:] = columns
        new_valid = torch.arange(width)[None, :] >= (width - counts)[:, None]
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                states = getattr(layer, name)
                gather = index.to(states.device)[:, None, :, None].expand(
                    self.num_rows, states.shape[1], width, states.shape[3])
                setattr(layer, name, states.gather(2, gather))
        self.valid = new_valid
