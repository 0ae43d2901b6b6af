"""The "fp32-packed" format: full-precision Linear layers whose weights oneDNN reordered once, at load time.

Terms
-----
reordered weight
    ``torch.ops.mkldnn._reorder_linear_weight(weight [N, K], None)``: the same fp32 values, laid out in oneDNN's
    blocked format for any number of input rows (``None``: no fixed batch size), held in a plain tensor. torch's
    inductor does the same for the CPU linears of a frozen graph (``torch/_inductor/fx_passes/mkldnn_fusion.py``).
    It is an opaque tensor (``layout == torch._mkldnn``): no storage to read, so it cannot be deep-copied (a copy
    of a ``PackedLinear`` shares it: it is never written) and ``state_dict`` gets it back as ``to_dense()``, the
    original values exactly, under the layer's usual ``weight`` key.
the kernel
    ``torch.ops.mkldnn._linear_pointwise(x [M, K], reordered, bias, "none", [], "") -> [M, N]``, oneDNN's inner
    product over the reordered weight.

Why: ``F.linear`` in fp32 lays the weight out anew for each call of more than one row. One 1536 -> 8960 layer
of a 1.5B Qwen2 on an AMD EPYC with AVX2 only, 2 threads, ms by input rows (``/tmp``-style micro-benchmark,
docs/benchmarks.md, stop 29):

    rows        1     2     3     4     8    16    32
    F.linear  4.7   9.1  23.0  26.4  30.9  28.6  35.2
    packed    4.2   4.1   5.0   5.4   6.3   8.9  14.8

So a target forward over 8 inputs costs about 1.5 single steps instead of 6.5: verification becomes nearly as
cheap as one step, which is what speculation needs. Each row's result does not depend on how many rows are
computed with it (``F.linear``'s does), so the verify forward gives each token what a single step gives it.

Nothing is quantized: the values are the model's own; only their layout changes. Every ``nn.Linear`` of the
decoder stack and the output layer is replaced by a ``PackedLinear``. The output layer keeps its float
``weight`` beside the reordered copy (tied to the embeddings, as the bundles are, it costs nothing more), so
``vocab_size`` and the draft's narrowed head (``drafters.draft_model.SubVocabHead``) still read it.

    report = pack_linears(model)          # in place; an fp32 model on the CPU
    model.model.layers[0].mlp.up_proj     # PackedLinear(in_features=1536, out_features=8960, bias=False)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .hardware import linear_slots


def packed_available() -> bool:
    """True when this torch has oneDNN (mkldnn) and its reordered-weight linear (x86 CPU builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward over a weight oneDNN reordered once (module docstring); ``weight`` is kept (the
    output layer's float weight) or None (decoder layers: only the reordered copy)."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("reordered", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.reordered, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo):
        memo[id(self.reordered)] = self.reordered  # shared, never written (an opaque tensor cannot be copied)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight is None:  # a checkpoint of a packed model is the dense model's
            destination[prefix + "weight"] = self.reordered.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass(frozen=True)
class PackReport:
    """The names of the layers ``pack_linears`` replaced."""

    packed: tuple[str, ...]

    @property
    def summary(self) -> str:
        return f"fp32-packed: {len(self.packed)} Linear layers reordered for oneDNN (values unchanged)"


@torch.no_grad()
def pack_linears(model: torch.nn.Module) -> PackReport:
    """Replace, in place, every ``nn.Linear`` of ``model``'s decoder stack and its output layer by a
    ``PackedLinear``. The model must be fp32 on the CPU and this torch must have oneDNN (``packed_available``);
    ValueError otherwise."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        raise ValueError(f"fp32-packed takes an fp32 model on the CPU, got {parameter.dtype} on {parameter.device}")
    if not packed_available():
        raise ValueError("fp32-packed needs torch with oneDNN (torch.backends.mkldnn); this build has none")
    head = model.get_output_embeddings()
    packed = []
    for name, parent, attr, linear in linear_slots(model, lm_head=True):
        setattr(parent, attr, PackedLinear(linear, keep_weight=linear is head))
        packed.append(name)
    if not packed:
        raise ValueError(f"fp32-packed: {type(model).__name__} has no Linear layer to pack")
    return PackReport(tuple(packed))


def reordered_only_values(model: torch.nn.Module) -> int:
    """Weight values that ``PackedLinear`` layers hold reordered only, not as parameters: what a parameter count
    of a packed model must add to equal the dense model's."""
    return sum(m.reordered.numel() for m in model.modules() if isinstance(m, PackedLinear) and m.weight is None)


def is_packed(model: torch.nn.Module) -> bool:
    """True when ``model`` holds a ``PackedLinear``."""
    return any(isinstance(m, PackedLinear) for m in model.modules())
