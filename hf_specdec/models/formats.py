"""The format vocabulary: what a model's format is called, how ``load_model`` loads one, and which formats a
hardware profile measures for each role.

A format is a target format (a dtype "bf16", "fp16", "fp32", or "fp32-packed": fp32 Linear layers whose weights
oneDNN reordered once at load, ``packed``; the values stay the model's own) or a draft format (those, bitsandbytes
"8bit" / "4bit", torch "dynamic-int8", and "int4": weight-only 4-bit Linear layers over torch's own CPU kernel,
``int4``). Every other room of ``hf_specdec.models`` names formats through this one:

    as_format(torch.bfloat16)      # "bf16"
    as_format("float32")           # "fp32"
    format_load_args("4bit")       # (torch.bfloat16, "4bit"): load_model's dtype and quantize
    format_load_args("fp32-packed")  # (torch.float32, "fp32-packed"): a post-load step, like "dynamic-int8"
    candidate_formats("target")    # ("bf16", "fp32", "fp32-packed") on an x86 CPU (torch with oneDNN)
    candidate_formats("draft")     # ("bf16", "fp32", "8bit", "4bit", "dynamic-int8", "int4", "fp32-packed")
    quantize_loaded(model, "int4") # the post-load kinds, applied in place to a model loaded in float

It imports nothing of the profile: the profile's data (``profile``), its timing (``measure``), its store
(``store``) and the choices (``choose``) all stand on it.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from .hardware import quantize_dynamic_int8, quantized_compute_dtype
from .int4 import int4_available, is_int4, quantize_int4
from .packed import is_packed, pack_linears, packed_available

TARGET_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DRAFT_SIZES = (1, 2, 4, 8)  # rows of a batched draft step

# every format a profile can hold; for drafts, also the tie-break order (full precision first, then less memory)
FORMATS = ("bf16", "fp16", "fp32", "fp32-packed", "8bit", "dynamic-int8", "int4", "4bit")
FORMAT_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32})
# what a target may be in: its own values, in a dtype or a layout (a quantized target would change the output)
TARGET_FORMATS = (*FORMAT_DTYPES, "fp32-packed")
FP32_POST_LOAD = ("dynamic-int8", "fp32-packed")  # post-load kinds applied to a model loaded in fp32
DTYPE_FORMATS = MappingProxyType({torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"})
ROLES = ("target", "draft")


def role_sizes(role: str) -> tuple[int, ...]:
    """The sizes a role is measured at: t(n) of a target, a draft step over n rows."""
    return TARGET_SIZES if role == "target" else DRAFT_SIZES


class FormatUnavailable(RuntimeError):
    """A format cannot be measured (or loaded) here: bitsandbytes missing, layers too narrow for its kernels, no
    int8 engine, no int4 CPU kernel (or not a CPU), out of memory. The profile notes it and goes on without that
    format."""


def as_format(dtype_or_format: str | torch.dtype) -> str:
    """A format name from a format ("bf16", "4bit", ...), a dtype name ("bfloat16", "float32") or a torch.dtype."""
    if isinstance(dtype_or_format, torch.dtype):
        try:
            return DTYPE_FORMATS[dtype_or_format]
        except KeyError:
            raise ValueError(f"no profile format for {dtype_or_format}") from None
    name = str(dtype_or_format).lower().removeprefix("torch.")
    name = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
            "int8": "dynamic-int8"}.get(name, name)
    if name not in FORMATS:
        raise ValueError(f"unknown format {dtype_or_format!r}: use one of {', '.join(FORMATS)}")
    return name


def format_load_args(fmt: str, device: str = "cpu") -> tuple[torch.dtype, str | None]:
    """``(dtype, quantize)`` that ``load_model`` takes to load a model in format ``fmt`` on ``device``."""
    fmt = as_format(fmt)
    if fmt in FORMAT_DTYPES:
        return FORMAT_DTYPES[fmt], None
    if fmt in FP32_POST_LOAD:
        return torch.float32, fmt
    return quantized_compute_dtype(device), fmt


def model_format(model: torch.nn.Module) -> str:
    """The format of a loaded model: "4bit" / "8bit" (bitsandbytes layers), "dynamic-int8" (torch dynamic
    quantized Linear layers), "int4" (``int4.Int4Linear`` layers), "fp32-packed" (``packed.PackedLinear``
    layers), else its parameters' dtype ("bf16", "fp16", "fp32")."""
    if is_int4(model):
        return "int4"
    if is_packed(model):
        return "fp32-packed"
    kinds = {type(m).__name__ for m in model.modules()}
    if "Linear4bit" in kinds:
        return "4bit"
    if "Linear8bitLt" in kinds:
        return "8bit"
    if any(isinstance(getattr(m, "_packed_params", None), torch.nn.Module) for m in model.modules()):
        return "dynamic-int8"
    return as_format(next(p.dtype for p in model.parameters() if p.is_floating_point()))


def candidate_formats(role: str, device: str = "cpu") -> tuple[str, ...]:
    """The formats a profile measures for ``role`` on ``device``: target formats CPU bf16, fp32 and fp32-packed
    (where torch has oneDNN), CUDA bf16 (where supported) and fp16; draft formats add bitsandbytes 8-bit / 4-bit
    and, on CPU, dynamic int8, int4 (where torch has its int4 CPU kernel) and fp32-packed."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: use 'target' or 'draft'")
    cuda = str(device).startswith("cuda")
    if cuda:
        dense = ("bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp16",)
    else:
        dense = ("bf16", "fp32")
    packed = () if cuda or not packed_available() else ("fp32-packed",)
    if role == "target":
        return dense + packed
    cpu_only = () if cuda else ("dynamic-int8",) + (("int4",) if int4_available() else ()) + packed
    return dense + ("8bit", "4bit") + cpu_only


def quantize_loaded(model: torch.nn.Module, quantize: str | None) -> torch.nn.Module:
    """Apply a ``hardware.POST_LOAD_QUANTIZE`` kind to ``model`` (loaded in float), in place: "dynamic-int8"
    (``hardware.quantize_dynamic_int8``, an fp32 model), "int4" (``int4.quantize_int4``, bf16 is its fast
    dtype) or "fp32-packed" (``packed.pack_linears``, an fp32 model; nothing quantized). Any other ``quantize``
    (None, the bitsandbytes kinds, applied while loading) leaves it as it is."""
    if quantize == "dynamic-int8":
        quantize_dynamic_int8(model)
    elif quantize == "int4":
        quantize_int4(model)
    elif quantize == "fp32-packed":
        pack_linears(model)
    return model
