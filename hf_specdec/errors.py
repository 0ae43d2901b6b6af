"""Errors that mean "not here, not now" rather than "a bug": out of memory, on any device; and what hf_specdec
cannot run exactly (``Unsupported``, raised before the first forward)."""

from __future__ import annotations

import torch


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA out of memory, ``MemoryError``, or a failed host allocation (PyTorch raises it as a RuntimeError).

    >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
    True
    >>> is_out_of_memory(RuntimeError("shape mismatch"))
    False
    """
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error).lower()
    return "out of memory" in message or "can't allocate memory" in message or "failed to allocate" in message


class Unsupported(ValueError):
    """hf_specdec cannot run this model in this mode exactly; the message says why and what to use instead."""
