"""dtype, device and memory: ``dtype="auto"``, bitsandbytes quantization of a draft, footprints, OOM at load.

``dtype="auto"`` picks bf16 where the hardware computes it natively (CPUs with ``avx512_bf16`` or ``amx_bf16``,
CUDA devices with bf16 support), fp16 on other CUDA devices and fp32 otherwise: on a CPU without bf16
instructions, bf16 matmuls are emulated and slower than fp32.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from ..errors import is_out_of_memory

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
QUANTIZE = (None, "4bit", "8bit")


class ModelLoadOOMError(RuntimeError):
    """Loading a model ran out of memory (GPU or host). The message says what to try instead."""


@functools.lru_cache(maxsize=1)
def _read_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    return _read_cpu_flags()


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str | torch.device = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when a GPU is available, else ``"cpu"``; other values are checked and returned."""
    device = str(device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid: use 'cpu', 'cuda', 'cuda:N' or 'auto'.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available; use device='cpu'.")
    return device


def resolve_dtype(dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """Turn a dtype name (``"auto"``, ``"bf16"``, ``"float32"``, ...) or a ``torch.dtype`` into a ``torch.dtype``.

    ``"auto"``: bf16 on CPUs with avx512_bf16/amx_bf16 and on CUDA devices with bf16 support, fp16 on other CUDA
    devices, fp32 otherwise.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        device = resolve_device(device)
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype={dtype!r} is invalid: use 'auto', 'bf16', 'fp16', 'fp32' or a torch.dtype.") from None


def quantization_config(quantize: str | None, compute_dtype: torch.dtype = torch.bfloat16):
    """A ``BitsAndBytesConfig`` for ``quantize="4bit"`` (NF4) or ``"8bit"``; None for ``quantize=None``."""
    if quantize in (None, "none"):
        return None
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r} is invalid: use '4bit', '8bit' or None.")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ImportError(
            f"quantize={quantize!r} needs bitsandbytes: pip install 'hf_specdec[quant]' (or bitsandbytes>=0.45)"
        ) from None
    from transformers import BitsAndBytesConfig

    if quantize == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=compute_dtype if compute_dtype != torch.float32 else torch.bfloat16,
            bnb_4bit_use_double_quant=False,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def footprint_bytes(model: torch.nn.Module) -> int:
    """Bytes held by a model's parameters and buffers (shared tensors counted once; bitsandbytes 4-bit
    weights count their packed bytes plus their quantization statistics)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = (t.untyped_storage().data_ptr(), t.numel())
        if key in seen:
            return
        seen.add(key)
        total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        state = getattr(p, "quant_state", None)
        if state is not None:
            add(getattr(state, "absmax", None))
            add(getattr(state, "code", None))
    for b in model.buffers():
        add(b)
    return total


def oom_message(ref: str, device: str, dtype: torch.dtype, quantize: str | None, exc: BaseException) -> str:
    remedies = []
    if quantize != "4bit":
        remedies.append("load the draft in 4-bit (quantize='4bit', `--draft-quantize 4bit`)")
    remedies.append("use a smaller draft (e.g. 'qwen2.5-coder-0.5b-instruct' or 'smollm2-135m-instruct')")
    if device.startswith("cuda"):
        remedies.append("free GPU memory used by other processes, or load on device='cpu'")
    else:
        remedies.append("close other programs to free host memory")
    if dtype == torch.float32:
        remedies.append("load in bf16 (dtype='bf16') to halve the memory")
    return (
        f"Out of memory while loading {ref!r} on {device} as {str(dtype).removeprefix('torch.')}"
        f"{f' ({quantize})' if quantize else ''}: {type(exc).__name__}: {str(exc)[:200]}\n"
        "Try: " + "; ".join(remedies) + "."
    )


@contextlib.contextmanager
def oom_guard(ref: str, device: str, dtype: torch.dtype, quantize: str | None = None):
    """Turn an out-of-memory failure inside the block into :class:`ModelLoadOOMError` with a remedy."""
    try:
        yield
    except ModelLoadOOMError:
        raise
    except BaseException as exc:  # noqa: BLE001 - filtered by is_out_of_memory
        if not is_out_of_memory(exc):
            raise
        if device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise ModelLoadOOMError(oom_message(ref, device, dtype, quantize, exc)) from exc
