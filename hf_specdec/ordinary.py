"""A call decodes in torch's inference mode; what it hands back holds ordinary tensors.

Why inference mode: it skips autograd's bookkeeping for every tensor an op makes (the version counter, view
tracking) that ``no_grad``, plain ``generate``'s mode, still keeps. A forward of a small model is hundreds of small
ops, so that bookkeeping is a share of its time: 5-13% of the tiny pair's forwards (``docs/benchmarks.md``, the
tiny-model regime). The kernels are the same, so are the tokens and logits.

What it costs: a tensor made in inference mode (an "inference tensor") cannot be written in place outside it, nor
saved for backward. A caller may do either with what a call returns: a static cache fed to plain ``generate`` is
written in place, a trainer runs the model with gradients over the returned sequences (its embedding saves them).
So ``ordinary`` replaces every inference tensor the caller can reach by an ordinary copy, outside inference mode:
in the outputs, and in the cache the call returns or was passed (its own tensors, written in place in inference
mode, stay themselves: a static cache keeps its buffers). Tensors that never leave hf_specdec (the draft's cache, a
memory's tables) are only ever used in inference mode and stay as they are.

    >>> with torch.inference_mode():
    ...     made = {"ids": torch.arange(3), "steps": (torch.ones(2),)}
    >>> made["ids"].is_inference(), ordinary(made)["ids"].is_inference(), ordinary(made)["steps"][0].is_inference()
    (True, False, False)
"""

from __future__ import annotations

import dataclasses

import torch

_DEPTH = 6  # a cache's objects nest (a cache, its layers, their dicts of states); nothing that returns nests deeper


def ordinary(value, depth: int = _DEPTH):
    """``value`` with every inference tensor it holds replaced by an ordinary clone: a tensor, or a container of
    them (tuple, list, dict, a dataclass, a ``ModelOutput``), or an object holding them in its attributes (a
    cache and its layers). Lists, dicts and objects are updated in place, so that whoever holds them (the caller,
    for a cache it passed in) sees the copies; tuples and frozen dataclasses are rebuilt. Modules are not entered.
    Must run outside inference mode (a clone made inside it is an inference tensor again)."""
    assert not torch.is_inference_mode_enabled(), "ordinary() makes ordinary tensors only outside inference mode"
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if depth == 0 or value is None or isinstance(value, (str, bytes, int, float, bool, torch.nn.Module)):
        return value
    if isinstance(value, tuple):
        items = tuple(ordinary(item, depth - 1) for item in value)
        changed = any(new is not old for new, old in zip(items, value))
        return (type(value)(*items) if hasattr(value, "_fields") else type(value)(items)) if changed else value
    if isinstance(value, list):
        for i, item in enumerate(value):
            new = ordinary(item, depth - 1)
            if new is not item:
                value[i] = new
        return value
    if isinstance(value, dict):  # a ModelOutput too: setting an item sets its attribute
        for key, item in list(value.items()):
            new = ordinary(item, depth - 1)
            if new is not item:
                value[key] = new
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            new = ordinary(item, depth - 1)
            if new is not item:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if hasattr(value, "__dict__") and not isinstance(value, type):
        for name, item in list(vars(value).items()):
            new = ordinary(item, depth - 1)
            if new is not item:
                setattr(value, name, new)
    return value
