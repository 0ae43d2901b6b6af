"""The "int4" draft format: weight-only 4-bit Linear layers over torch's own CPU kernel, no extra package.

Terms
-----
group
    ``group_size`` consecutive input features of one output row (one row of ``weight[N, K]``). Each group has
    its own scale ``s`` and zero ``z``; its weights are stored as ``q`` in 0..15 and read back as
    ``(q - 8) * s + z`` (asymmetric min/max quantization, the layout torch's int4 kernels take; torch's own
    ``test_linalg._group_quantize_tensor`` builds it the same way).
packed weight
    ``q`` of a ``[N, K]`` weight packed two to a byte by ``torch.ops.aten._convert_weight_to_int4pack_for_cpu``:
    ``[N, K / 2]`` uint8. The scales and zeros sit beside it as ``[K / group_size, N, 2]``.
the kernel
    ``torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group_size, scales_and_zeros) -> [M, N]``.
    Its limits, found by calling it (torch 2.13.0+cpu): ``x`` 2-D and contiguous, ``group_size`` one of 32, 64,
    128, 256, ``K`` a multiple of ``group_size``, ``N`` a multiple of 16, ``scales_and_zeros`` in ``x``'s dtype.
    It accepts bf16, fp16 and fp32 inputs, but only bf16 takes its vectorised path: on an AMD EPYC (AVX2 only)
    one decoder layer of a 0.5B Qwen2 over one row took 2.1 ms in bf16 and 85 ms in fp32 (78 ms in fp16), where
    the dense bf16 layer took 5.2 ms (docs/benchmarks.md). So ``Int4Linear`` always computes in bf16, whatever
    the model's dtype, and casts the result back.

What is quantized: every ``nn.Linear`` of the decoder stack whose shape suits the kernel; a layer that does not
(``int4_shape_problem``) stays in float and the ``Int4Report`` says so. The output layer stays in float unless
asked (``lm_head=True``): hf_specdec narrows a float output layer to the most frequent 32768 token ids while
drafting (``drafters.draft_model.SubVocabHead``), which reads fewer bytes than a whole 4-bit output layer over a
150k vocabulary, and the narrowing needs a float ``weight``. Embeddings, norms and attention stay in the model's
dtype. A draft's format never changes the output: the target verifies every token.

    report = quantize_int4(draft)                      # in place; draft loaded in bf16 on CPU
    report.quantized, report.kept                      # ("model.layers.0.self_attn.q_proj", ...), ()
    draft.model.layers[0].mlp.up_proj                  # Int4Linear(in_features=896, out_features=4864, group_size=32)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .hardware import linear_slots

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # the default group: the most precise one the kernel takes
GROUP_SIZES = (32, 64, 128, 256)  # what the kernel takes
ROW_MULTIPLE = 16  # the kernel packs output rows in blocks of 16
LEVELS = 16  # 4 bits
MIDPOINT = 8  # q = 8 reads back as the zero
COMPUTE_DTYPE = torch.bfloat16  # the kernel's vectorised path (module docstring)


def int4_available() -> bool:
    """True when this torch has the int4 CPU kernel (torch >= 2.6)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def int4_shape_problem(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> str | None:
    """Why a ``Linear(in_features -> out_features)`` cannot use the int4 kernel with ``group_size``, or None.

    >>> int4_shape_problem(4864, 896) is None
    True
    >>> int4_shape_problem(72, 64)
    'out_features 72 is not a multiple of 16'
    >>> int4_shape_problem(64, 72)
    'in_features 72 is not a multiple of the group size 32'
    >>> int4_shape_problem(64, 64, group_size=16)
    'group size 16 is not one of 32, 64, 128, 256'
    """
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    if out_features % ROW_MULTIPLE:
        return f"out_features {out_features} is not a multiple of {ROW_MULTIPLE}"
    return None


def quantize_groups(weight: torch.Tensor,  # [N, K] float
                    group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales_and_zeros)``: ``q`` [N, K] int32 in 0..15 and ``scales_and_zeros`` [K / group_size, N, 2]
    (scale, zero) in ``COMPUTE_DTYPE``, such that ``(q - 8) * scale + zero`` approximates ``weight`` group by
    group (``dequantize``). Scale and zero are rounded to bf16 first and ``q`` is computed from the rounded
    values, so what the kernel reads back is what was aimed at: each weight within about half a scale.

    >>> q, sz = quantize_groups(torch.tensor([[0.0, 1.5] * 16]))   # one row, one group of 32
    >>> q[0, :2].tolist(), sz[0, 0].tolist()                      # scale 0.1 (bf16 0.10009765625), zero 0.80078125
    ([0, 15], [0.10009765625, 0.80078125])
    >>> dequantize(q, sz)[0, :2].tolist()
    [0.0, 1.50146484375]
    """
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)  # [N, G, group]
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)  # [N, G, 1]
    scale = ((high - low) / (LEVELS - 1)).clamp(min=1e-6).to(COMPUTE_DTYPE).float()
    zero = (low + scale * MIDPOINT).to(COMPUTE_DTYPE).float()
    q = ((groups - zero) / scale + MIDPOINT).round().clamp(0, LEVELS - 1).to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    return q, scales_and_zeros.to(COMPUTE_DTYPE)


def dequantize(q: torch.Tensor,  # [N, K] int32 in 0..15
               scales_and_zeros: torch.Tensor) -> torch.Tensor:  # [K / group, N, 2]
    """The float32 weight [N, K] that ``q`` and ``scales_and_zeros`` stand for: ``(q - 8) * scale + zero``."""
    n, k = q.shape
    groups = scales_and_zeros.shape[0]
    scale, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, G] each
    per_group = (q.reshape(n, groups, k // groups).float() - MIDPOINT) * scale[..., None] + zero[..., None]
    return per_group.reshape(n, k)


class Int4Linear(torch.nn.Module):
    """A ``Linear`` whose weight is stored in 4 bits (``packed`` [N, K / 2] uint8, ``scales_and_zeros``
    [K / group_size, N, 2] bf16; buffers, so ``.to()`` and footprints see them) and multiplied by torch's int4
    CPU kernel in bf16. Input ``[..., K]`` in any float dtype, output ``[..., N]`` in the input's dtype. The
    bias stays in the original layer's dtype. Inference only (the kernel has no backward)."""

    def __init__(self, in_features: int, out_features: int, group_size: int, packed: torch.Tensor,
                 scales_and_zeros: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        problem = int4_shape_problem(out_features, in_features, group_size)
        if problem is not None:
            raise ValueError(f"Int4Linear({in_features} -> {out_features}): {problem}; keep this layer in float")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int = GROUP_SIZE) -> "Int4Linear":
        """The 4-bit copy of ``linear`` (on CPU). Raises ValueError, saying why, for a shape the kernel does not
        take (``int4_shape_problem``) or a layer not on the CPU."""
        if not int4_available():
            raise RuntimeError(f"torch {torch.__version__} has no int4 CPU kernel (_weight_int4pack_mm_for_cpu); "
                               "use torch >= 2.6")
        weight = linear.weight
        if weight.device.type != "cpu":
            raise ValueError(f"Int4Linear runs on CPU only (torch's _weight_int4pack_mm_for_cpu), not {weight.device}")
        problem = int4_shape_problem(linear.out_features, linear.in_features, group_size)
        if problem is not None:
            raise ValueError(f"Int4Linear({linear.in_features} -> {linear.out_features}): {problem}; keep this "
                             "layer in float")
        q, scales_and_zeros = quantize_groups(weight, group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)  # [N, K / 2]; innerKTiles unused on CPU
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(linear.in_features, linear.out_features, group_size, packed, scales_and_zeros, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous()  # [M, K]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size,
                                                         self.scales_and_zeros)  # [M, N] bf16
        out = out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


@dataclass(frozen=True)
class Int4Report:
    """What ``quantize_int4`` did: the names of the layers now ``Int4Linear`` and ``(name, why)`` of those kept
    in float because the kernel does not take their shape."""

    quantized: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]
    group_size: int
    lm_head: bool

    @property
    def summary(self) -> str:
        """One line: "int4: 168 Linear layers (group size 32), output layer in float; kept in float: ..."."""
        head = "output layer in 4 bits too" if self.lm_head else "output layer in float"
        kept = "; kept in float: " + ", ".join(f"{name} ({why})" for name, why in self.kept) if self.kept else ""
        return f"int4: {len(self.quantized)} Linear layers (group size {self.group_size}), {head}{kept}"


@torch.no_grad()
def quantize_int4(model: torch.nn.Module, *, group_size: int = GROUP_SIZE, lm_head: bool = False) -> Int4Report:
    """Replace, in place, every ``nn.Linear`` of ``model``'s decoder stack (and its output layer with
    ``lm_head``) by an ``Int4Linear``; layers of a shape the kernel does not take stay in float (the report
    says which and why, and a warning is logged). The model must be on the CPU; bf16 is its fast dtype (the
    kernel computes in bf16; an fp32 model works, casting around every layer). A tied output layer quantized
    with ``lm_head`` gets its own 4-bit copy; the embeddings keep theirs. Raises ValueError when no layer can be
    quantized (nothing would change) or the model is not on the CPU."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"quantize='int4' runs on CPU only (torch's _weight_int4pack_mm_for_cpu), got {device}")
    quantized: list[str] = []
    kept: list[tuple[str, str]] = []
    for name, parent, attr, linear in linear_slots(model, lm_head):
        problem = int4_shape_problem(linear.out_features, linear.in_features, group_size)
        if problem is not None:
            kept.append((name, problem))
            continue
        setattr(parent, attr, Int4Linear.from_linear(linear, group_size))
        quantized.append(name)
    if not quantized:
        raise ValueError(f"quantize='int4': no Linear layer of {type(model).__name__} suits the int4 kernel ("
                         + "; ".join(f"{n}: {why}" for n, why in kept[:3]) + ")")
    report = Int4Report(tuple(quantized), tuple(kept), group_size, lm_head)
    if kept:
        logger.warning("%s", report.summary)
    return report


def is_int4(model: torch.nn.Module) -> bool:
    """True when ``model`` holds an ``Int4Linear``."""
    return any(isinstance(m, Int4Linear) for m in model.modules())
