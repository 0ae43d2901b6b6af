"""dtype, device and memory: dtype names, quantization of a draft (bitsandbytes 4-bit / 8-bit, torch dynamic
int8; torch's int4 weight-only kernel lives in ``int4``), footprints, the memory available, OOM at load; and the
machine itself: its CPU's name and flags, and the ``machine_record`` every report carries (``hf-specdec check``,
the eval harness, the bench scripts).

``dtype="auto"`` and ``quantize="auto"`` are not decided here: no CPU-flag rule predicts what is fast (on an AVX2
EPYC bf16 steps faster than fp32 but verifies 8 tokens at ~8x the cost). They are decided by the measured
hardware profile (``hf_specdec.models.choose``) in ``load_model``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import warnings
from typing import Any

import torch

from ..errors import is_out_of_memory

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
QUANTIZE = (None, "4bit", "8bit", "dynamic-int8", "int4", "fp32-packed")
# applied by hf_specdec to a model loaded in float (no bitsandbytes config, so a GGUF file can take them too)
# ("fp32-packed" quantizes nothing: it reorders fp32 weights for oneDNN, ``packed.py``; it is applied the same way)
POST_LOAD_QUANTIZE = ("dynamic-int8", "int4", "fp32-packed")


class ModelLoadOOMError(RuntimeError):
    """Loading a model ran out of memory (GPU or host). The message says what to try instead."""


def _proc_field(path: str, *names: str) -> str | None:
    """The value of the first ``name: value`` line of a /proc file whose name is one of ``names`` (None where the
    file cannot be read, not Linux, or has no such line): ``_proc_field("/proc/meminfo", "MemAvailable")``."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=1)
def _read_cpu_flags() -> frozenset[str]:
    return frozenset((_proc_field("/proc/cpuinfo", "flags", "Features") or "").split())


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    return _read_cpu_flags()


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


# the flags a report shows: bf16 is native only with avx512_bf16 or amx_bf16
RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where that cannot be read)."""
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()


def machine_record(device: torch.device | str | None = None, dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """Where and with what a measurement was taken (JSON-ready): CPU, its relevant flags, threads, GPU, versions.

        machine_record("cpu", "bf16")["cpu_flags"]   # ["avx2", "avx512f", ...]
    """
    import transformers

    from .. import __version__

    flags = cpu_flags()
    record: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_flags": [f for f in RELEVANT_CPU_FLAGS if f in flags],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_specdec": __version__,
        "device": None if device is None else str(device),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
    }
    if torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name(0)
        record["cuda"] = torch.version.cuda
    return record


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


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """Turn a dtype name (``"bf16"``, ``"float32"``, ...) or a ``torch.dtype`` into a ``torch.dtype``.

    ``"auto"`` is refused here: it is a measured choice (``hf_specdec.models.profile.choose_dtype``, made by
    ``load_model(dtype="auto")``), not a rule about the device.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        raise ValueError("dtype='auto' is decided by the measured hardware profile: call load_model(dtype='auto') "
                         "or hf_specdec.models.profile.choose_dtype(profile), or name a dtype ('bf16', 'fp32', ...).")
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype={dtype!r} is invalid: use 'auto', 'bf16', 'fp16', 'fp32' or a torch.dtype.") from None


def quantized_compute_dtype(device: str) -> torch.dtype:
    """The compute dtype of a bitsandbytes-quantized model: bf16, or fp16 on a GPU without bf16."""
    if str(device).startswith("cuda") and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def quantization_config(quantize: str | None, compute_dtype: torch.dtype = torch.bfloat16):
    """A ``BitsAndBytesConfig`` for ``quantize="4bit"`` (NF4) or ``"8bit"``; None for ``quantize=None`` and for
    the ``POST_LOAD_QUANTIZE`` kinds (applied after loading: :func:`quantize_dynamic_int8`,
    ``int4.quantize_int4``, ``packed.pack_linears``)."""
    if quantize in (None, "none", *POST_LOAD_QUANTIZE):
        return None
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r} is invalid: use 'auto', '4bit', '8bit', 'dynamic-int8', 'int4', "
                         "'fp32-packed' or None.")
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


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The module holding the decoder-layer stack and its attribute name (``model.model``, "layers" for Llama /
    Qwen2; ``model.transformer``, "h" for GPT-2): the ``ModuleList`` as long as ``num_hidden_layers``."""
    count = int(model.config.num_hidden_layers)
    found = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, torch.nn.ModuleList) and len(child) == count]
    if not found:
        raise ValueError(f"{type(model).__name__} has no ModuleList of its {count} decoder layers")
    return found[0]


def linear_slots(model: torch.nn.Module, lm_head: bool) -> list[tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
    """``(full name, parent, attribute, layer)`` of every ``nn.Linear`` of the decoder stack (and of the output
    layer with ``lm_head``), in module order: where ``int4`` and ``packed`` put their own layers."""
    stack_parent, stack_name = decoder_layers(model)
    stack = getattr(stack_parent, stack_name)
    prefix = {id(m): name for name, m in model.named_modules()}
    slots = [(f"{prefix[id(parent)]}.{attr}".lstrip("."), parent, attr, child)
             for parent in stack.modules() for attr, child in parent.named_children()
             if type(child) is torch.nn.Linear]
    head = model.get_output_embeddings() if lm_head else None
    if type(head) is torch.nn.Linear:
        head_parent = next(m for m in model.modules() if any(c is head for c in m.children()))
        head_attr = next(attr for attr, c in head_parent.named_children() if c is head)
        slots.append((f"{prefix[id(head_parent)]}.{head_attr}".lstrip("."), head_parent, head_attr, head))
    return slots


def quantize_dynamic_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Torch dynamic int8 quantization (``torch.ao.quantization.quantize_dynamic``) of the ``Linear`` layers of
    the decoder stack, in place, for an fp32 model on CPU. Embeddings and ``lm_head`` stay fp32 (as
    bitsandbytes keeps them), so the output layer is still a plain ``Linear`` that can be narrowed."""
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    if dtype != torch.float32 or device.type != "cpu":
        raise ValueError(f"quantize='dynamic-int8' needs an fp32 model on CPU, got {str(dtype).removeprefix('torch.')}"
                         f" on {device}")
    from torch.ao.quantization import quantize_dynamic

    parent, name = decoder_layers(model)
    with warnings.catch_warnings():  # torch 2.10+ warns that torch.ao.quantization moves to torchao
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*")
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        quantize_dynamic(getattr(parent, name), {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return model


def dynamic_int8_available() -> bool:
    """True when torch's dynamic int8 Linear has a CPU kernel engine here (fbgemm / x86 / onednn / qnnpack)."""
    return bool(set(torch.backends.quantized.supported_engines) - {"none"})


def available_memory_bytes(device: str) -> int | None:
    """Bytes that could still be allocated on ``device``: CUDA free memory, or the host's ``MemAvailable``
    (None where it cannot be read)."""
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    available = _proc_field("/proc/meminfo", "MemAvailable:")
    if available is not None:
        return int(available.split()[0]) * 1024  # "123456 kB"
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return None


def footprint_bytes(model: torch.nn.Module) -> int:
    """Bytes held by a model's parameters and buffers (shared tensors counted once; bitsandbytes 4-bit
    weights count their packed bytes plus their quantization statistics; torch dynamic int8 layers their int8
    weights and bias; oneDNN-reordered weights, opaque tensors without a storage, their values)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        opaque = t.layout == torch._mkldnn  # packed.PackedLinear's reordered weight: no storage to read
        key = (id(t), t.numel()) if opaque else (t.untyped_storage().data_ptr(), t.numel())
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
    unpacked: list[torch.Tensor] = []  # kept alive while counting, so no freed pointer is reused and skipped
    for module in model.modules():
        # a torch.ao dynamic quantized Linear: its weights live in a LinearPackedParams child, not in parameters
        if isinstance(getattr(module, "_packed_params", None), torch.nn.Module) and callable(module.weight):
            for t in (module.weight(), module.bias()):
                if t is not None:
                    unpacked.append(t)
                    add(t)
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
