"""What loading chose and why, as every caller shows it, and hf_specdec's speculative memory started from the
hardware profile.

``choice_line("target", info)`` is one line of a ``LoadInfo``: ``"target bf16: expected 19.4 s for ..."`` when
``dtype="auto"`` / ``quantize="auto"`` chose it (the profile's why), ``"draft fp32 (as asked)"`` when it was
given. ``choices_record`` is the same for a report (JSON-ready).

``seed_memory(target, draft)`` starts the speculative memory of a target that ``hf_specdec.enable`` was called
on (``target.speculative_memory``) for this draft from the hardware profile: the target's t(n) in its loaded
format, the draft's step and its prompt read in its format, so the first speculative call is sized from the
start instead of measuring a plain step and probing a first draft length; ``target.lookahead_memory`` gets the
same t(n), and the record carries it (``forward_seconds``) for the fresh memories of cold lookahead calls. The
costs come from a given profile or from the profile cache (``hf_specdec.models.store.cached_profile``): nothing
is ever measured here. It returns a record of what was seeded, or why not:

    hf_specdec.enable(target)
    seed_memory(target, draft)["why"]   # "seeded from the cached hardware profile: target t(n) in bf16 at ..."
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from ..models.formats import as_format, model_format
from ..models.store import cached_profile

PROFILE_HINT = "hf-specdec tune, or load with dtype/quantize 'auto', measures it once"


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


Table = dict[int, float]


def _profile_costs(profile, target, draft) -> tuple[Table | None, Table | None, Table | None]:
    """The target's t(n) in its loaded format, the draft's step by rows and its prompt read by prompt tokens in
    its format, from ``profile`` (None for what it does not hold)."""
    target_format, draft_format = model_format(target), model_format(draft)
    forward = profile.target_entry(target_format).table if target_format in profile.target_formats else None
    if draft_format not in profile.draft_formats:
        return forward, None, None
    return forward, profile.draft_steps(draft_format), profile.draft_read(draft_format) or None


def read_share(profile, target, reads: Table | None) -> float | None:
    """The draft's prompt read over the target's prefill of as many tokens (the median over the lengths the
    profile read), the prior of ``costmodel.ReadCost``; None without both."""
    target_format = model_format(target)
    if not reads or target_format not in profile.target_formats:
        return None
    return statistics.median(seconds / profile.prefill_seconds(target_format, tokens)
                             for tokens, seconds in reads.items())


def _not_seeded(record: dict[str, Any], given: bool) -> str:
    t_fmt, d_fmt = record["target_format"], record["draft_format"]
    if given:
        return f"not seeded: the given hardware profile has neither the target in {t_fmt} nor the draft in {d_fmt}"
    return (f"not seeded: no cached hardware profile of the target in {t_fmt} or the draft in {d_fmt} "
            f"({PROFILE_HINT})")


def _seeded(record: dict[str, Any], source: str, forward: Table | None, steps: Table | None,
            reads: Table | None) -> str:
    """The why of a seeded memory: what came from the profile and what is left to measure while decoding."""
    t1, step = record["t1_s"], record["draft_step_s"]
    if forward:
        parts = [f"target t(n) in {record['target_format']} at {len(forward)} sizes"
                 + (f" (t(1) {t1 * 1e3:.1f} ms)" if t1 else "")]
    else:
        parts = [f"no target t(n) in {record['target_format']} (measured while decoding)"]
    rows = f" (also over {'/'.join(str(n) for n in sorted(steps)[1:])} rows)" if steps and len(steps) > 1 else ""
    parts.append(f"draft step in {record['draft_format']} {step * 1e3:.1f} ms{rows}" if step is not None
                 else f"no draft step in {record['draft_format']} (measured while decoding)")
    if reads:
        parts.append("draft prompt read at " + "/".join(str(n) for n in sorted(reads)) + " tokens")
    if record["c"] is not None:
        parts.append(f"c = {record['c']:.2f}")
    return f"seeded from {source}: " + ", ".join(parts)


def seed_memory(target, draft, *, profile=None, cache_dir=None) -> dict[str, Any]:
    """Seed ``target.speculative_memory`` (``hf_specdec.enable(target)`` first) for ``draft`` from ``profile``
    (a ``HardwareProfile``) or, without one, from the profile cache (``cached_profile``; never measures).

    Returns ``{"seeded": bool, "source", "target_format", "draft_format", "forward_sizes", "forward_seconds",
    "t1_s", "draft_step_s", "draft_read_seconds", "c", "why"}``; ``why`` says what was seeded or why nothing
    was. A memory that already holds estimates for this draft (an earlier call or harness) is left as it is.
    Never raises: seeding is a speed hint, and a harness must run without it (a target hf_specdec was not
    enabled on, or a damaged profile cache, is a record that says so).
    """
    record: dict[str, Any] = {"seeded": False, "source": None, "target_format": None, "draft_format": None,
                              "forward_sizes": [], "forward_seconds": None, "t1_s": None, "draft_step_s": None,
                              "draft_read_seconds": None, "c": None, "why": ""}
    memory = getattr(target, "speculative_memory", None)
    if memory is None:
        record["why"] = "not seeded: hf_specdec is not enabled on the target (hf_specdec.enable(target) first)"
        return record
    try:
        record["target_format"], record["draft_format"] = model_format(target), model_format(draft)
        estimates = memory.estimates(draft)
        if estimates.forward.largest or estimates.draft_step.largest:
            record["why"] = "the speculative memory already holds estimates for this draft (left as they are)"
            record["forward_seconds"] = estimates.forward.table() or None  # what it measured: as good a seed
            return record
        given = profile is not None
        source = "the given hardware profile" if given else "the cached hardware profile"
        profile = profile if given else cached_profile(target, draft, cache_dir=cache_dir)
        forward, steps, reads = _profile_costs(profile, target, draft)
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # a speed hint only: say why and run unseeded
        record["why"] = f"not seeded: {type(err).__name__}: {err}"
        return record
    if forward is None and steps is None:
        record["why"] = _not_seeded(record, given)
        return record
    memory.seed(draft, forward, steps, draft_read_share=read_share(profile, target, reads))
    target.lookahead_memory.seed(forward)
    t1, step = (forward.get(1) if forward else None), (steps.get(1) if steps else None)
    record.update(seeded=True, source=source, forward_sizes=sorted(forward) if forward else [],
                  forward_seconds=dict(sorted(forward.items())) if forward else None, t1_s=t1,
                  draft_step_s=step, draft_read_seconds=dict(sorted(reads.items())) if reads else None,
                  c=step / t1 if step is not None and t1 else None)
    record["why"] = _seeded(record, source, forward, steps, reads)
    return record
