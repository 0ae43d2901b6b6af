"""The speculative and lookahead memories started from the hardware profile, for the decoding core and the harness.

A memory that holds nothing yet starts from priors: its first round is a plain step (the reference of every
other size), the draft step is unknown so the first drafting round is not priced, the draft's prompt read is a
share of parameters. The hardware profile already measured all three on this machine, so a memory is seeded from
it once, before its first call: the target's t(n) in its loaded format, the draft's step by rows and its prompt
read in its format (``seed_speculative``), or the target's t(n) alone (``seed_lookahead``). The costs come from a
given ``HardwareProfile`` or from the profile cache (``store.cached_profile``: a few file reads, never a
measurement). Seeding is a speed hint, never a reason to fail: a missing or damaged profile leaves the memory on
its priors, and the returned ``memory.Seeding`` says why.

    seeding = seed_speculative(model.speculative_memory, model, draft)
    seeding.why   # "seeded from the cached hardware profile: target t(n) in bf16 at 10 sizes (t(1) 180.2 ms), ..."

``speculative_generate`` / ``lookahead_generate`` call ``call_start_speculative`` / ``call_start_lookahead``:
seed a memory on its first call, then hand the call its ``Seeding`` (what its ``SpecStats`` show).

A seeded call then checks the profile against what it timed (``call_end``): where its forwards of one size took
over ``STALE_FACTOR`` times, or under 1 / ``STALE_FACTOR`` of, what the cached entry predicts (``disagreement``,
over ``STALE_SAMPLES`` forwards at least), the entry's t(n) is scaled by the call's ratio (``store.calibrate``):
a profile measured while the machine was busy, or one a proxy got wrong, is not trusted forever.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..costmodel import ForwardCost
from ..drafters.base import DraftSource
from ..drafters.source import draft_source
from ..memory import EstimatesFrom, LookaheadMemory, Seeding, SpeculativeMemory
from .formats import model_format
from .hardware import resolve_device
from .profile import DeviceIdentity, HardwareProfile, ProfileKey, model_fingerprint
from .refs import config_of
from .store import cached_profile, calibrate

logger = logging.getLogger(__name__)

PROFILE_HINT = "hf-specdec tune, or load with dtype/quantize 'auto', measures it once"
CACHED, GIVEN = "the cached hardware profile", "the given hardware profile"

STALE_FACTOR = 2.0  # a call's median forward this many times the profile's, or under 1 / this: the entry is stale
STALE_SAMPLES = 5  # forwards of one size a call must have timed before their median is compared

# what reading a profile for loaded models can raise: a cache that cannot be read, a model whose format or config
# no profile knows; a seeding that meets one runs on priors and says so
_PROFILE_ERRORS = (OSError, ValueError, TypeError, KeyError, RuntimeError)


def read_share(profile: HardwareProfile, target_format: str, reads: dict[int, float] | None) -> float | None:
    """The draft's prompt read over the target's prefill of as many tokens (the median over the lengths the
    profile read), the prior of ``costmodel.ReadCost``; None without both."""
    if not reads or target_format not in profile.target_formats:
        return None
    return statistics.median(seconds / profile.prefill_seconds(target_format, tokens)
                             for tokens, seconds in reads.items())


def profile_seeding(target, draft=None, *, profile: HardwareProfile | None = None, cache_dir=None) -> Seeding:
    """What ``profile`` (or, without one, the profile cache) holds for ``target`` in its loaded format and a
    ``draft`` model in its format, on the target's device: a seeding of kind ``HARDWARE_PROFILE`` to write into a
    memory, or of kind ``PRIORS`` with the reason it has none. ``draft`` None (a draft source's ``profile_draft``
    for a draft that is no model of its own: early exit, a ``Drafter`` object): the target's t(n) alone. Never
    measures, never raises."""
    given = profile is not None
    source = GIVEN if given else CACHED
    try:
        target_format = model_format(target)
        draft_format = model_format(draft) if draft is not None else None
        profile = profile if given else cached_profile(target, draft, cache_dir=cache_dir)
        forward = profile.target_entry(target_format).table if target_format in profile.target_formats else None
        steps = reads = None
        if draft_format is not None and draft_format in profile.draft_formats:
            steps, reads = profile.draft_steps(draft_format), profile.draft_read(draft_format) or None
        share = read_share(profile, target_format, reads)
    except _PROFILE_ERRORS as err:  # a speed hint only: say why and run on priors
        return Seeding(EstimatesFrom.PRIORS, reason=f"not seeded: {type(err).__name__}: {err}")
    if forward is None and steps is None:
        return Seeding(EstimatesFrom.PRIORS, target_format=target_format, draft_format=draft_format,
                       reason=_not_held(target_format, draft_format, given))
    return Seeding(EstimatesFrom.HARDWARE_PROFILE, seeded=True, source=source, target_format=target_format,
                   draft_format=draft_format, forward_seconds=forward, draft_steps=steps, draft_read_seconds=reads,
                   draft_read_share=share)


def _not_held(target_format: str, draft_format: str | None, given: bool) -> str:
    if given:
        what = (f"neither the target in {target_format} nor the draft in {draft_format}" if draft_format
                else f"no target in {target_format}")
        return f"not seeded: the given hardware profile has {what}"
    draft = f" or the draft in {draft_format}" if draft_format else ""
    return f"not seeded: no cached hardware profile of the target in {target_format}{draft} ({PROFILE_HINT})"


def seed_speculative(memory: SpeculativeMemory, target, draft, *, profile: HardwareProfile | None = None,
                     cache_dir=None) -> Seeding:
    """Seed ``memory`` for ``draft`` (a draft model, ``EarlyExit(N)`` or a ``Drafter`` object, as
    ``draft_model=`` takes it) from ``profile`` or the profile cache while it holds no cost for this draft (a
    memory that does, from earlier calls or an earlier seeding, is left as it is). A profile that holds nothing
    for them leaves the memory on priors and records why (the call's stats show it)."""
    return _seed_source(memory, target, draft_source(draft, target, memory), profile=profile, cache_dir=cache_dir)


def _seed_source(memory: SpeculativeMemory, target, source: DraftSource, *, profile: HardwareProfile | None = None,
                 cache_dir=None) -> Seeding:
    """``seed_speculative`` for a draft source: its estimates under ``source.memory_key``, the profile's costs of
    ``source.profile_draft``."""
    key = source.memory_key
    if memory.holds(key):
        return _left(memory.origin(key), memory.estimates(key).forward.table(), "the speculative memory",
                     " for this draft")
    seeding = profile_seeding(target, source.profile_draft, profile=profile, cache_dir=cache_dir)
    memory.seed(key, seeding.forward_seconds, seeding.draft_steps, draft_read_share=seeding.draft_read_share,
                origin=seeding)
    return seeding


def seed_lookahead(memory: LookaheadMemory, target, *, profile: HardwareProfile | None = None,
                   cache_dir=None) -> Seeding:
    """Seed ``memory``'s t(n) of ``target`` from ``profile`` or the profile cache while it holds none (as
    ``seed_speculative``)."""
    if memory.estimates.forward.largest:
        return _left(memory.origin, memory.estimates.forward.table(), "the lookahead memory", "")
    seeding = profile_seeding(target, profile=profile, cache_dir=cache_dir)
    memory.seed(seeding.forward_seconds, origin=seeding)
    return seeding


def _left(origin: Seeding | None, forward: dict[int, float], memory: str, what: str) -> Seeding:
    """A memory that seeding leaves as it is: its t(n) (as good a seed for another memory) and why."""
    return Seeding(origin.kind if origin is not None else EstimatesFrom.EARLIER_CALLS, forward_seconds=forward or None,
                   reason=f"{memory} already holds estimates{what} (left as they are)")


def call_start_speculative(memory: SpeculativeMemory | None, target, source: DraftSource) -> Seeding:
    """Where a speculative call starting now finds its estimates: ``memory`` seeded from the cached profile if
    this is its first call with the draft of ``source`` and nothing seeded it before (tried once: a memory the
    profile holds nothing for stays on priors); None, a call that keeps nothing, starts from priors."""
    if memory is None:
        return Seeding(EstimatesFrom.PRIORS, reason="no speculative memory (speculative_memory=None): a call that "
                                                    "starts from priors and keeps nothing")
    if memory.origin(source.memory_key) is None:
        _seed_source(memory, target, source)
    return memory.start_call(source.memory_key)


def call_start_lookahead(memory: LookaheadMemory | None, target) -> Seeding:
    """As ``call_start_speculative``, for a lookahead call's memory."""
    if memory is None:
        return Seeding(EstimatesFrom.PRIORS, reason="no lookahead memory (lookahead_memory=None): a call that "
                                                    "starts from priors and keeps nothing")
    if memory.origin is None:
        seed_lookahead(memory, target)
    return memory.start_call()


# -- a call's timings against the profile it was seeded from -------------------------------------------------------
@dataclass(frozen=True)
class Disagreement:
    """Where a call's timed forwards disagree with a profile: the size ``n``, the profile's ``predicted``
    seconds, the median of the call's ``samples`` forwards of that size (``timed``) and their ratio."""

    n: int
    predicted: float
    timed: float
    samples: int

    @property
    def ratio(self) -> float:
        return self.timed / self.predicted

    @property
    def why(self) -> str:
        return (f"t({self.n}): the profile predicts {self.predicted:.3g} s, {self.samples} forwards of a call took "
                f"{self.timed:.3g} s (median), {self.ratio:.2g}x")


def disagreement(seeded: Mapping[int, float], timed: Mapping[int, Sequence[float]], *,
                 factor: float = STALE_FACTOR, samples: int = STALE_SAMPLES) -> Disagreement | None:
    """The size where a call's forwards (``timed``: seconds by forward size, as ``SpecStats.verify_time_by_tokens``
    holds them) disagree most with the profile's t(n) ``seeded``, when their median is over ``factor`` times the
    prediction or under 1 / ``factor`` of it; None when they agree. Only sizes with ``samples`` forwards or more,
    within the sizes the profile measured, are judged (a median over a few forwards outlasts a cold start or a
    stray slow one; a profile off by a third in level, as proxies and other cache lengths are, agrees).

    >>> profile = {1: 2.49, 2: 11.0, 8: 14.6}  # measured under load
    >>> print(disagreement(profile, {1: [0.31, 0.30, 0.29, 0.30, 0.33], 4: [0.5, 0.6]}).why)
    t(1): the profile predicts 2.49 s, 5 forwards of a call took 0.3 s (median), 0.12x
    >>> disagreement({1: 0.26, 8: 0.78}, {1: [0.31] * 6, 4: [0.6] * 5}) is None  # within a factor of 2
    True
    """
    curve, sizes = ForwardCost.from_table(seeded), sorted(seeded)
    found = []
    for n, seconds in timed.items():
        if len(seconds) < samples or not sizes[0] <= n <= sizes[-1]:
            continue
        predicted, median = curve.estimate(n), statistics.median(seconds)
        if predicted and median > 0 and not predicted / factor <= median <= predicted * factor:
            found.append(Disagreement(int(n), predicted, median, len(seconds)))
    return max(found, key=lambda d: abs(math.log(d.ratio)), default=None)


def call_end(target, origin: Seeding, timed: Mapping[int, Sequence[float]], rows: int = 1, *,
             cache_dir=None) -> Disagreement | None:
    """After a call on a memory seeded from the cached profile (``origin``: what its first call read): the cached
    t(n) entry of ``target`` in its format is scaled by the ratio (``store.calibrate``) when the call's own forwards
    (``timed``, one row: a batch's forwards are not the profile's) disagree with it (``disagreement``). Returns
    the disagreement (None: nothing to judge, or agreement). Never raises: a cache that cannot be read or written
    is a warning."""
    if rows != 1 or not origin.seeded or origin.source != CACHED or not origin.forward_seconds:
        return None
    found = disagreement(origin.forward_seconds, timed)
    if found is None:
        return None
    try:
        identity = DeviceIdentity.here(resolve_device(str(next(target.parameters()).device)))
        key = ProfileKey("target", origin.target_format, model_fingerprint(config_of(target)[0]), identity,
                         torch.__version__)
        calibrate(key, origin.forward_seconds, found.ratio, found.why, cache_dir)
    except _PROFILE_ERRORS as err:
        logger.warning("the hardware profile entry that a call disagreed with (%s) could not be calibrated "
                       "(%s: %s)", found.why, type(err).__name__, err)
    return found
