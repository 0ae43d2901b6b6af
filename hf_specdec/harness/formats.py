"""What loading chose and why, as every caller shows it, and hf_specdec's speculative memory started from the
hardware profile.

``choice_line("target", info)`` is one line of a ``LoadInfo``: ``"target bf16: expected 19.4 s for ..."`` when
``dtype="auto"`` / ``quantize="auto"`` chose it (the profile's why), ``"draft fp32 (as asked)"`` when it was
given. ``choices_record`` is the same for a report (JSON-ready).

``seed_memory(target, draft)`` starts the speculative memory of a target that ``hf_specdec.enable`` was called
on (``target.speculative_memory``) for this draft from the hardware profile before any call, as the first
speculative call would itself (``hf_specdec.models.seeding``), but from a given profile too (``--profile``);
``target.lookahead_memory`` gets the same t(n), and the record carries it (``forward_seconds``) for the fresh
memories of cold lookahead calls. Nothing is ever measured here. It returns a record of what was seeded, or why
not:

    hf_specdec.enable(target)
    seed_memory(target, draft)["why"]   # "seeded from the cached hardware profile: target t(n) in bf16 at ..."
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..memory import EstimatesFrom, Seeding
from ..models.formats import as_format
from ..models.seeding import seed_speculative


def loaded_format(info) -> str:
    """The format a ``LoadInfo`` describes: its quantization ("4bit", "8bit", "dynamic-int8") or its dtype as a
    format name ("bf16", "fp32", ...)."""
    if info.quantize:
        return str(info.quantize)
    try:
        return as_format(info.dtype)
    except ValueError:
        return str(info.dtype)


def choice_line(role: str, info) -> str:
    """``"<role> <format>: <why>"`` for a measured choice, ``"<role> <format> (as asked)"`` for a given one."""
    fmt = loaded_format(info)
    choice = getattr(info, "choice", None)
    if choice is None:
        return f"{role} {fmt} (as asked)"
    why = choice.why
    return f"{role} {why}" if why.startswith(f"{choice.value}:") and choice.value == fmt else f"{role} {fmt}: {why}"


def choices_record(infos: Mapping[str, Any]) -> dict[str, dict | None]:
    """Per role (``{"target": LoadInfo, "draft": LoadInfo | None, ...}``): the ``format`` loaded, whether the
    profile ``chosen`` it, its ``why`` and ``split`` note (None when given) and the ``line`` shown to people."""
    record: dict[str, dict | None] = {}
    for role, info in infos.items():
        if info is None:
            record[role] = None
            continue
        choice = getattr(info, "choice", None)
        record[role] = {"format": loaded_format(info), "chosen": choice is not None,
                        "why": None if choice is None else choice.why,
                        "split": None if choice is None else choice.split, "line": choice_line(role, info)}
    return record


def seed_memory(target, draft, *, profile=None, cache_dir=None) -> dict[str, Any]:
    """Seed ``target.speculative_memory`` (``hf_specdec.enable(target)`` first) for ``draft`` and
    ``target.lookahead_memory`` from ``profile`` (a ``HardwareProfile``) or, without one, from the profile cache
    (``hf_specdec.models.seeding.seed_speculative``: what the first speculative call on the memory would do
    itself; never measures, never raises).

    Returns ``Seeding.to_dict()``: ``{"kind", "seeded", "source", "target_format", "draft_format",
    "forward_sizes", "forward_seconds", "t1_s", "draft_step_s", "draft_steps", "draft_read_seconds",
    "draft_read_share", "c", "why"}``; ``why`` says what was seeded or why nothing was. A memory that already
    holds estimates for this draft (an earlier call or harness) is left as it is, and ``forward_seconds`` is
    the t(n) it holds. A target hf_specdec was not enabled on is a record that says so.
    """
    memory = getattr(target, "speculative_memory", None)
    if memory is None:
        return Seeding(EstimatesFrom.PRIORS, reason="not seeded: hf_specdec is not enabled on the target "
                                                    "(hf_specdec.enable(target) first)").to_dict()
    seeding = seed_speculative(memory, target, draft, profile=profile, cache_dir=cache_dir)
    if seeding.seeded:
        target.lookahead_memory.seed(seeding.forward_seconds, origin=seeding.target_only())
    return seeding.to_dict()
