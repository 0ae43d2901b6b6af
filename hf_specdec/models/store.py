"""The profile's store: one JSON file per measurement under ``<cache>/profiles/``, keyed by ``ProfileKey``, and
``get_profile``, which reads what is cached and measures (``measure``) what is not.

    profile = get_profile("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")   # measured once
    forward, steps = cached_costs(model, draft)    # loaded models, from the cache only: {n: s}, {rows: s}
    profile = cached_profile(model, draft)         # the same as a HardwareProfile (prompt reads included)

A cache is a speed hint, never a reason to fail: an entry that cannot be read (not UTF-8, not JSON, a value of
the wrong type) is measured again with a logged warning, and a cache that cannot be written keeps the measured
profile in memory with a warning, leaving no temporary file behind. Entries are written to a temporary name and
renamed: never half a file.

A cache is trusted only while it agrees with itself and with what calls time. A measurement that is not
self-consistent (``profile.check_cost``: t(n) nondecreasing, no forward dearer than as many single steps, rounds
that agree, no load drift while it ran) is measured once more (``REMEASURE``); when it still is not, it is cached
marked ``unverified`` (with why, a note and a warning): measuring it in every process would cost every process
minutes, and the proxies' timings of a quiet machine can disagree too. A cached entry that contradicts itself and
is not so marked (one written before these checks) is measured again, as a damaged one is; and any entry a call's
timed forwards disagree with (``models.seeding``) is scaled to what the call timed (``calibrate``): the call ran
the real model, the entry holds a proxy's estimate. So a profile measured on a busy machine, or one a proxy got
wrong, misleads one process at most.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from . import measure
from .formats import TARGET_FORMATS, FormatUnavailable, as_format, candidate_formats, model_format
from .hardware import resolve_device
from .profile import (Consistency, DeviceIdentity, FormatCost, HardwareProfile, ProfileKey, check_cost,
                      model_fingerprint)
from .refs import config_of

logger = logging.getLogger(__name__)

Measurer = Callable[..., FormatCost]  # (config, role, format, device, weights, slower_than=None) -> FormatCost
# A draft format is measured in full only while it can still be chosen: once one format is measured, another whose
# first steps take over SLOWER_MARGIN times its t(1) is left at that probe (the chooser takes the fastest within
# 5%; the margin keeps a probe that another process slowed from ruling a format out).
SLOWER_MARGIN = 2.0
REMEASURE = 1  # a measurement that contradicts itself (``check_cost``) is measured this many more times at most
CALIBRATED = "calibrated"  # an entry's field, set by ``calibrate``: why a call scaled its t(n)
UNVERIFIED = "unverified"  # an entry's field: why it was cached though it never measured self-consistently


def read_entry(key: ProfileKey, cache_dir=None) -> FormatCost | None:
    """The cached measurement for ``key``, or None: absent, written for another key, or damaged (unreadable,
    not UTF-8, not JSON, or not a measurement: logged as a warning, then measured again and rewritten)."""
    path = key.path(cache_dir)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # ValueError: UnicodeDecodeError and JSONDecodeError
        logger.warning("hardware profile cache entry %s cannot be read (%s: %s); measuring it again", path,
                       type(err).__name__, err)
        return None
    if not isinstance(data, dict) or data.get("key") != key.to_dict():
        return None
    try:
        cost = FormatCost.from_dict(data.get("cost"))
    except ValueError as err:
        logger.warning("hardware profile cache entry %s is damaged (%s); measuring it again", path, err)
        return None
    verdict = check_cost(cost)
    if not verdict.ok and not data.get(UNVERIFIED):
        logger.warning("hardware profile cache entry %s contradicts itself (%s); measuring it again", path,
                       verdict.why)
        return None
    return cost


def write_entry(key: ProfileKey, cost: FormatCost, cache_dir=None, seconds: float | None = None,
                unverified: str | None = None) -> Path:
    """Store one measurement (written to a temporary name, then renamed: never half a file, and no temporary
    file left when writing fails); ``unverified``: why it is kept though it is not self-consistent. Raises
    OSError when the cache cannot be written."""
    data = {"key": key.to_dict(), "cost": cost.to_dict(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "measure_seconds": seconds}
    if unverified:
        data[UNVERIFIED] = unverified
    return _write_json(key.path(cache_dir), data)


def calibrate(key: ProfileKey, table: Mapping[int, float], factor: float, why: str, cache_dir=None) -> bool:
    """Scale the cached t(n) of ``key`` by ``factor`` (``why``: how a call's forwards disagreed with it) while it
    still holds the ``table`` that was judged (an entry measured or calibrated since is left alone): a call timed
    the real model at its real context, where the entry holds a proxy's estimate (one layer's difference scaled by
    the layer count) or a load's. Measuring the proxy again could repeat its error in every process. True when it
    was calibrated; raises OSError when the cache cannot be written."""
    path = key.path(cache_dir)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        cost = FormatCost.from_dict(data["cost"]) if isinstance(data, dict) else None
    except FileNotFoundError:
        return False
    except (KeyError, ValueError):  # a damaged entry: measured again anyway
        return False
    if cost is None or data.get("key") != key.to_dict() or cost.table != dict(table):
        return False
    scaled = dataclasses.replace(cost, step=tuple((n, seconds * factor) for n, seconds in cost.step))
    _write_json(path, {**data, "cost": scaled.to_dict(), CALIBRATED: why})
    logger.warning("hardware profile cache entry %s disagrees with what a call timed (%s); its t(n) is scaled by "
                   "%.3g", path, why, factor)
    return True


def _write_json(path: Path, data: dict) -> Path:
    """Write ``data`` to ``path`` through a temporary name in its folder (never half a file, none left behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(data, indent=1))
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone once renamed; removed when anything failed
    return path


def _stored(key: ProfileKey, cost: FormatCost, cache_dir, seconds: float, unverified: str | None = None) -> None:
    """Write one measurement; a cache that cannot be written is a warning (the profile holds the measurement)."""
    try:
        write_entry(key, cost, cache_dir, seconds, unverified)
    except OSError as err:
        logger.warning("hardware profile cache %s cannot be written (%s: %s); this measurement is not kept for "
                       "the next run", key.path(cache_dir).parent, type(err).__name__, err)


def get_profile(target=None, draft=None, *, device: str = "cpu", cache_dir=None, refresh: bool = False,
                cached_only: bool = False, target_formats: Iterable[str] | None = None,
                draft_formats: Iterable[str] | None = None, measurer: Measurer | None = None,
                log: Callable[[str], None] | None = None) -> HardwareProfile:
    """The hardware profile of a target and/or a draft (configs, models, references or resolved references) on
    ``device``.

    Each (role, format) comes from the cache when its key matches, else it is measured (``measurer``, default
    :func:`hf_specdec.models.measure.measure_format`) and cached. ``refresh``: measure everything again;
    ``cached_only``: never measure (what is not cached is left out). Formats that cannot be measured here are
    left out with a note. A draft format whose first steps are over ``SLOWER_MARGIN`` times the fastest draft
    format's t(1) so far is kept at that probe (``FormatCost.method == "probe"``): it cannot be chosen, and
    measuring it in full could take minutes (``measure.measure_format(slower_than=)``). A damaged cache entry is
    measured again and a cache that cannot be written is warned about: neither raises. A measurement that is not
    self-consistent (``check_cost``) is measured up to ``REMEASURE`` more times, else cached marked unverified and
    noted; a cached one that is not (unmarked) is measured again.
    """
    device = resolve_device(device)
    measurer = measurer or measure.measure_format
    log = log or (lambda msg: None)
    identity = DeviceIdentity.here(device)
    entries: dict[str, list[FormatCost]] = {"target": [], "draft": []}
    fingerprints: dict[str, str | None] = {"target": None, "draft": None}
    notes: list[str] = []
    for role, ref, formats in (("target", target, target_formats), ("draft", draft, draft_formats)):
        if ref is None:
            continue
        config, weights = config_of(ref, cache_dir=cache_dir)
        fingerprints[role] = fingerprint = model_fingerprint(config)
        for fmt in (as_format(f) for f in (formats or candidate_formats(role, device))):
            key = ProfileKey(role, fmt, fingerprint, identity, torch.__version__)
            cost = None if refresh else read_entry(key, cache_dir)
            if cost is None and not cached_only:
                log(f"measuring the {role} in {fmt} on {identity.label} (once; cached in {key.path(cache_dir)})")
                start = time.perf_counter()
                fastest = min((e.t1 for e in entries[role]), default=None)
                bound = {"slower_than": SLOWER_MARGIN * fastest} if role == "draft" and fastest else {}
                try:
                    cost, verdict = _consistent(lambda: measurer(config, role, fmt, device, weights, **bound),
                                                f"the {role} in {fmt}", log)
                except FormatUnavailable as err:
                    notes.append(f"{role} {fmt} not measured: {err}")
                    continue
                _stored(key, cost, cache_dir, time.perf_counter() - start, None if verdict.ok else verdict.why)
                if not verdict.ok:
                    notes.append(f"{role} {fmt} cached unverified (timed {1 + REMEASURE} times, never "
                                 f"self-consistent: {verdict.why}); calibrated by the first call that disagrees")
                    logger.warning("hardware profile: the %s in %s did not measure self-consistently (%s); cached "
                                   "unverified, calibrated by the first call that disagrees", role, fmt, verdict.why)
            if cost is not None:
                entries[role].append(cost)
    return HardwareProfile(identity, torch.__version__, tuple(entries["target"]), tuple(entries["draft"]),
                           fingerprints["target"], fingerprints["draft"], tuple(notes))


def _consistent(timed: Callable[[], FormatCost], what: str, log: Callable[[str], None]
                ) -> tuple[FormatCost, Consistency]:
    """A measurement of ``what`` (``timed()``) and its verdict (``check_cost``): measured again, up to
    ``REMEASURE`` more times, while it contradicts itself (the machine was busy: another try may find it quiet);
    the last one when none agrees."""
    for attempt in range(1 + REMEASURE):
        cost = timed()
        verdict = check_cost(cost)
        if verdict.ok:
            break
        if attempt < REMEASURE:
            log(f"{what} measured inconsistently ({verdict.why}); measuring it again")
    return cost, verdict


def cached_profile(target, draft=None, *, cache_dir=None) -> HardwareProfile:
    """The cached profile of a loaded ``target`` in its format and a loaded ``draft`` in its format, on the
    target's device: at most one entry per role (none where nothing is cached). Never measures, so it costs a
    few file reads at the start of a call."""
    device = str(next(target.parameters()).device)
    target_format = model_format(target)
    draft_formats = [model_format(draft)] if draft is not None else None
    return get_profile(target, draft, device=device, cache_dir=cache_dir, cached_only=True,
                       target_formats=[target_format] if target_format in TARGET_FORMATS else [],
                       draft_formats=draft_formats)


def cached_costs(target, draft=None, *, cache_dir=None) -> tuple[dict[int, float] | None, dict[int, float] | None]:
    """For the decoding core: the cached t(n) table of a loaded ``target`` in its format and the cached draft step
    by rows of a loaded ``draft`` in its format, on the target's device, or None for what is not cached. Never
    measures (``cached_profile``; the draft's prompt read is there too, ``profile.draft[0].read_table``):

        forward_seconds, draft_step_seconds = cached_costs(model, draft)  # {n: s}, {rows: s}
        model.speculative_memory.seed(draft, forward_seconds, draft_step_seconds)
    """
    profile = cached_profile(target, draft, cache_dir=cache_dir)
    forward = profile.target[0].table if profile.target else None
    steps = profile.draft[0].table if profile.draft else None
    return forward, steps


def read_profile_file(path: str | os.PathLike) -> HardwareProfile:
    """A profile from a JSON file written by ``hf-specdec tune --json`` (or ``HardwareProfile.to_dict``)."""
    data = json.loads(Path(path).read_text())
    return HardwareProfile.from_dict(data.get("profile", data) if isinstance(data, dict) else data)
