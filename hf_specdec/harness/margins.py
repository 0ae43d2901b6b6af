"""The target's own view of a greedy divergence: teacher-forced top-two logit margins (the eval's analysis and the
demo's "differs from token N" note)."""

from __future__ import annotations

import inspect
import math

import torch

from .run import device_of


@torch.inference_mode()
def teacher_forced(model, prompt_ids: list[int], gen_ids: list[int]) -> dict[str, list]:
    """One forward over prompt + generated tokens: per generated position, the model's argmax, top1-top2 margin
    and top logit, in the dtype it ran.

    Position i holds the prediction for ``gen_ids[i]`` given ``prompt + gen_ids[:i]``.
    """
    if not gen_ids:
        return {"argmax": [], "margin": [], "top": []}
    seq = torch.tensor([prompt_ids + gen_ids[:-1]], device=device_of(model))  # [1, L + n - 1]
    n = len(gen_ids)
    keep = {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    logits = model(input_ids=seq, **keep).logits[0, -n:].float()  # [n, vocab]
    top2 = logits.topk(2, dim=-1).values
    return {"argmax": logits.argmax(-1).tolist(), "margin": (top2[:, 0] - top2[:, 1]).tolist(),
            "top": top2[:, 0].tolist()}


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s values at ``value`` (one rounding step there).

    >>> rounding_step(12.0, torch.bfloat16)
    0.0625
    """
    exponent = math.floor(math.log2(abs(value))) if value else 0
    return torch.finfo(dtype).eps * 2.0 ** exponent


def divergence_note(model, prompt_ids: list[int], plain_ids: list[int], position: int) -> str:
    """What the target says at the first token where a mode's greedy output left plain's (``position`` into the
    generated tokens): its top-two margin there, teacher-forced over prompt + the common prefix, and whether it
    is a tie in a half-precision dtype (margin within one rounding step of the top logit)."""
    if position >= len(plain_ids):
        return ""
    found = teacher_forced(model, prompt_ids, plain_ids[: position + 1])
    margin, top = found["margin"][-1], found["top"][-1]
    dtype = next(model.parameters()).dtype
    name = str(dtype).replace("torch.", "")
    note = f"target's top-two logit margin there {margin:.4g} in {name}"
    if dtype in (torch.bfloat16, torch.float16) and margin <= rounding_step(top, dtype):
        short = "bf16" if dtype == torch.bfloat16 else "fp16"
        note += (f": a tie in {short} (margin ≤ one {short} rounding step), not an error; fp32 is "
                 "token-identical")
    return note
