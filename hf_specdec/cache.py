"""The one place that touches KV caches.

Speculation writes KV for tokens that may be thrown away, so every cache it uses must be able to forget them.
Only ``DynamicCache`` with croppable layers qualifies; static, quantized, offloaded-static and recurrent
(linear-attention / Mamba) caches are refused up front with a clear message instead of failing mid-generation.

Operations:

``rollback(cache, length)``        keep the first ``length`` positions of every layer (the draft model's cache,
                                   and repair after a failed forward).
``keep(cache, start, kept)``       after a round's forward appended its inputs at ``start``: keep positions
                                   ``[0, start)`` plus ``start + kept[i]``, in that order (the accepted path's KV);
                                   a contiguous prefix (a chain) is a rollback, anything else a gather.
``forward(model, ...)``            one model call over a cache, returning logits; hides the 5.23/5.24 rename of
                                   ``past_key_values`` to ``cache``.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def check_cache_supported(cache: Cache | None) -> None:
    """Refuse caches that cannot roll back. ``None`` (a fresh cache will be made) is fine."""
    if cache is None:
        return
    if type(cache) is not DynamicCache:
        raise ValueError(
            f"hf_specdec needs a DynamicCache that can roll back rejected draft tokens; got {type(cache).__name__}. "
            "Do not pass cache_implementation='static'/'quantized'/'offloaded_static' or a custom cache object: "
            "leave the cache to generate()."
        )
    if cache.layers and not all(getattr(layer, "is_croppable", True) for layer in cache.layers):
        raise ValueError(
            "This model's cache has layers that cannot roll back (sliding-window or recurrent/linear attention), "
            "so speculative decoding cannot undo rejected tokens. Use plain generate() for this model."
        )


def seq_length(cache: Cache) -> int:
    return cache.get_seq_length()


def rollback(cache: Cache, length: int) -> None:
    """Forget every cached position from ``length`` on, in every layer.

    Layers are cropped one by one, so a cache left uneven by a failed forward (out of memory half-way through
    the layers) is repaired too.
    """
    for layer in cache.layers:
        current = layer.get_seq_length()
        if current > length:
            layer.crop(length - current)


def compact(cache: Cache, start: int, keep: torch.LongTensor) -> None:
    """Keep positions ``[0, start)`` and then ``start + keep`` (``keep``: [m] offsets, increasing), drop the rest.

    After a tree or lookahead forward appended n positions at ``start``, this moves the KV of the accepted path
    into place so that the cache equals what a plain forward over the accepted tokens would have produced.
    """
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        index = keep.to(layer.keys.device) + start
        kept_keys = layer.keys.index_select(-2, index)  # [B, H, m, D]
        kept_values = layer.values.index_select(-2, index)
        layer.keys = torch.cat([layer.keys[..., :start, :], kept_keys], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :], kept_values], dim=-2)


def keep(cache: Cache, start: int, kept: torch.LongTensor) -> None:
    """The accepted path's KV stays, the rest of the round goes (``kept``: [m] input offsets, increasing).

    A chain that accepted 2 of its 4 draft tokens keeps inputs 0, 1, 2: a rollback to ``start + 3``.
    """
    if kept.tolist() == list(range(kept.shape[0])):
        rollback(cache, start + kept.shape[0])
    else:
        compact(cache, start, kept)


@functools.cache
def _forward_params(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def forward(
    model,
    input_ids: torch.LongTensor,  # [1, n] new tokens
    cache: Cache,
    *,
    num_logits: int | torch.LongTensor | None = 1,  # last ``num_logits`` positions, or [m] input indices, or None: all
    position_ids: torch.LongTensor | None = None,  # [1, n], default: continue after the cache
    attention_mask: torch.Tensor | None = None,  # 4-D [1, 1, n, past + n] (tree/lookahead) or None (causal)
) -> torch.Tensor:
    """One forward over ``input_ids`` appended to ``cache``; returns float logits [n_logits, vocab]."""
    params = _forward_params(type(model))
    kwargs = {("cache" if "cache" in params else "past_key_values"): cache, "use_cache": True}
    if num_logits is not None and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = num_logits
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    outputs = model(input_ids=input_ids, **kwargs)
    logits = outputs.logits[0]
    if "logits_to_keep" not in params:  # the model computed every position
        if isinstance(num_logits, torch.Tensor):
            logits = logits[num_logits.to(logits.device)]
        elif num_logits is not None:
            logits = logits[-num_logits:]
    return logits.float()


def forward_hidden(base_model, input_ids: torch.LongTensor, cache: Cache) -> torch.Tensor:
    """Forward of a base (headless) model over ``input_ids`` [1, n] appended to ``cache``: hidden states [n, H]."""
    params = _forward_params(type(base_model))
    kwargs = {("cache" if "cache" in params else "past_key_values"): cache, "use_cache": True}
    return base_model(input_ids=input_ids, **kwargs).last_hidden_state[0]
