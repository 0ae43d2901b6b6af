"""What one ``generate`` call learns, carried into the next calls on the same model.

``SpeculativeMemory``: per draft model, the ``Estimates`` speculative decoding measured with it (the target's
forward cost t(n), the draft's step time, how often its and prompt lookup's guesses are accepted), so that a
later call starts sized instead of measuring a plain step and probing a first draft length again. It is
seeded from a hardware profile (``seed``) before its first call: ``speculative_generate`` seeds a memory that
holds nothing for its draft from the cached profile (``hf_specdec.models.seeding``), once.

``Seeding``: where a memory's estimates for a call started (``EstimatesFrom``: a hardware profile, given costs,
earlier calls, or priors) and what was seeded; each call's ``SpecStats`` shows it.

``LookaheadMemory``: what lookahead learns in one call, carried into the next calls.

- ``corpus``: the prompts and outputs of earlier calls, indexed for prompt lookup. Requests repeat each other
  (imports, boilerplate, a test harness, the same function asked for again), so their text predicts the next
  answer the way the prompt does; at most ``max_tokens`` of it are kept, the oldest dropped first.
- ``successors``: the target's newest top choices after each token it has read (Token Recycling).
- ``estimates``: the measured forward cost by number of inputs and every source's acceptance (``costmodel``),
  so that a new call starts with a known cost curve instead of a plain first step and one doubling of forward
  size per round.

Outputs never depend on it (every candidate is verified by the target); only speed does. ``enable(model)``
keeps one per model as ``model.lookahead_memory``; pass ``lookahead_memory=None`` to ``generate`` for a call
that neither reads nor writes it, or your own ``LookaheadMemory()`` to scope it (one per user, say).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, replace
from typing import Any, Hashable, Mapping, MutableMapping, Sequence

import torch

from .config import LookaheadConfig
from .costmodel import Estimates, ForwardCost
from .ngram_pool import HistoryIndex


class EstimatesFrom(enum.StrEnum):
    """Where the estimates a call starts from came from (``SpecStats.estimates_from``)."""

    HARDWARE_PROFILE = "hardware profile"  # seeded from a hardware profile (the cached one: read, never measured)
    GIVEN_COSTS = "given costs"  # seeded with costs handed to ``seed``
    EARLIER_CALLS = "earlier calls"  # measured by earlier calls on the same memory
    PRIORS = "priors"  # nothing seeded or measured: the first rounds measure (a plain step, then a draft length)


Table = Mapping[int, float]


@dataclass(frozen=True)
class Seeding:
    """Where a memory's estimates start, and what one seeding wrote into it.

    ``kind``: ``EstimatesFrom``; ``seeded``: this seeding wrote costs into the memory; ``source``: the profile
    they came from ("the cached hardware profile", "the given hardware profile"); ``target_format`` /
    ``draft_format``: the formats they were looked up in (no draft format: the target's t(n) alone, for
    lookahead or a ``Drafter`` that is no model); ``forward_seconds``: the target's t(n) by inputs;
    ``draft_steps``: the draft step by rows; ``draft_read_seconds``: the draft's prompt read by prompt tokens and
    ``draft_read_share``: that read over the target's prefill of as many tokens; ``reason``: the wording when
    nothing was seeded (why not, or where the estimates came from instead).

    >>> profiled = Seeding(EstimatesFrom.HARDWARE_PROFILE, True, "a profile", "fp32", "bf16",
    ...                    forward_seconds={1: 0.2, 2: 0.21}, draft_steps={1: 0.05, 2: 0.06})
    >>> profiled.why.removeprefix("seeded from a profile: ")
    'target t(n) in fp32 at 2 sizes (t(1) 200.0 ms), draft step in bf16 50.0 ms (also over 2 rows), c = 0.25'
    >>> profiled.target_only().why
    'seeded from a profile: target t(n) in fp32 at 2 sizes (t(1) 200.0 ms)'
    >>> later = profiled.after_call()
    >>> later.kind
    <EstimatesFrom.EARLIER_CALLS: 'earlier calls'>
    >>> later.why, later.after_call() is later
    ('measured by earlier calls on this memory (which started from a profile)', True)
    """

    kind: EstimatesFrom
    seeded: bool = False
    source: str | None = None
    target_format: str | None = None
    draft_format: str | None = None
    forward_seconds: Table | None = None
    draft_steps: Table | None = None
    draft_read_seconds: Table | None = None
    draft_read_share: float | None = None
    reason: str = ""

    @property
    def t1_s(self) -> float | None:
        return self.forward_seconds.get(1) if self.forward_seconds else None

    @property
    def draft_step_s(self) -> float | None:
        return self.draft_steps.get(1) if self.draft_steps else None

    @property
    def c(self) -> float | None:
        """The seeded draft step over the seeded t(1)."""
        step, t1 = self.draft_step_s, self.t1_s
        return step / t1 if step is not None and t1 else None

    @property
    def why(self) -> str:
        """One line: what was seeded from where, or ``reason``."""
        if not self.seeded or self.source is None:
            return self.reason
        forward, steps, reads = self.forward_seconds, self.draft_steps, self.draft_read_seconds
        if forward:
            t1 = f" (t(1) {self.t1_s * 1e3:.1f} ms)" if self.t1_s else ""
            parts = [f"target t(n) in {self.target_format} at {len(forward)} sizes{t1}"]
        else:
            parts = [f"no target t(n) in {self.target_format} (measured while decoding)"]
        if self.draft_format is not None:
            rows = f" (also over {'/'.join(str(n) for n in sorted(steps)[1:])} rows)" if steps and len(steps) > 1 \
                else ""
            parts.append(f"draft step in {self.draft_format} {self.draft_step_s * 1e3:.1f} ms{rows}"
                         if self.draft_step_s is not None
                         else f"no draft step in {self.draft_format} (measured while decoding)")
            if reads:
                parts.append("draft prompt read at " + "/".join(str(n) for n in sorted(reads)) + " tokens")
            if self.c is not None:
                parts.append(f"c = {self.c:.2f}")
        return f"seeded from {self.source}: " + ", ".join(parts)

    def target_only(self) -> "Seeding":
        """The same seeding without the draft's parts: what a lookahead memory seeded from it holds."""
        return replace(self, draft_format=None, draft_steps=None, draft_read_seconds=None, draft_read_share=None)

    def after_call(self) -> "Seeding":
        """Where the next call on the same memory starts: what the calls so far measured."""
        if self.kind is EstimatesFrom.EARLIER_CALLS:
            return self
        started = self.source if self.seeded and self.source else str(self.kind)
        return Seeding(EstimatesFrom.EARLIER_CALLS,
                       reason=f"measured by earlier calls on this memory (which started from {started})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, the sizes, t(1), the draft step, c and ``why``."""
        return {"kind": str(self.kind), "seeded": self.seeded, "source": self.source,
                "target_format": self.target_format, "draft_format": self.draft_format,
                "forward_sizes": sorted(self.forward_seconds) if self.forward_seconds else [],
                "forward_seconds": dict(sorted(self.forward_seconds.items())) if self.forward_seconds else None,
                "t1_s": self.t1_s, "draft_step_s": self.draft_step_s,
                "draft_steps": dict(sorted(self.draft_steps.items())) if self.draft_steps else None,
                "draft_read_seconds": dict(sorted(self.draft_read_seconds.items())) if self.draft_read_seconds
                else None, "draft_read_share": self.draft_read_share, "c": self.c, "why": self.why}


GIVEN_COSTS = Seeding(EstimatesFrom.GIVEN_COSTS, reason="seeded with given costs (the memory's seed())")


def _started(origin: Seeding | None, measured: bool) -> Seeding:
    """What a call starting now reads: ``origin``, or without one what the memory holds (measured or nothing)."""
    if origin is not None:
        return origin
    if measured:
        return Seeding(EstimatesFrom.EARLIER_CALLS, reason="measured by earlier calls on this memory")
    return Seeding(EstimatesFrom.PRIORS, reason="no seeds and nothing measured yet")


def held_by_value(key) -> bool:
    """Does ``SpeculativeMemory`` hold ``key`` by value: a value, whose class defines its own equality
    (``EarlyExit(N)``, made anew by each call: an equal one finds the same estimates), rather than an object known
    by identity (a draft model, a drafter object), which it holds weakly so that a draft that is gone is
    forgotten? The key is the draft source's ``memory_key`` (``drafters/base.py``).

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Depth:
    ...     layers: int
    >>> held_by_value(Depth(2)), held_by_value(object())
    (True, False)
    """
    return type(key).__eq__ is not object.__eq__


class SpeculativeMemory:
    """The estimates of each draft used with one target, by the draft source's ``memory_key``: a draft model or a
    drafter object held weakly (a draft that is gone is forgotten), an early-exit draft of the target itself
    (``EarlyExit(N)``: a value) by value (``held_by_value``); and where they started (``origin``).

    Outputs never depend on it (every guess is verified); only speed does. ``enable(model)`` keeps one per model
    as ``model.speculative_memory``; pass ``speculative_memory=None`` for a call that neither reads nor writes
    it.
    """

    def __init__(self) -> None:
        self._by_draft: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._by_value: dict[Hashable, Estimates] = {}
        self._origins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._origins_by_value: dict[Hashable, Seeding] = {}

    def _tables(self, draft) -> tuple[MutableMapping, MutableMapping]:
        """``draft``'s (estimates, origins) tables: by value for a value key, weakly by the object else."""
        if held_by_value(draft):
            return self._by_value, self._origins_by_value
        return self._by_draft, self._origins

    def holds(self, draft) -> bool:
        """Does the memory hold any cost for ``draft`` (seeded or measured)?"""
        found = self._tables(draft)[0].get(draft)
        return found is not None and bool(found.forward.largest or found.draft_step.largest)

    def origin(self, draft) -> Seeding | None:
        """Where ``draft``'s estimates started (None: nothing seeded, and no call made yet)."""
        return self._tables(draft)[1].get(draft)

    def start_call(self, draft) -> Seeding:
        """Where a call starting now finds ``draft``'s estimates; the calls after it find earlier calls'."""
        origin = _started(self.origin(draft), self.holds(draft))
        self._tables(draft)[1][draft] = origin.after_call()
        return origin

    def estimates(self, draft) -> Estimates:
        """The estimates for ``draft`` (made empty on first use)."""
        table = self._tables(draft)[0]
        found = table.get(draft)
        if found is None:
            found = table[draft] = Estimates()
        return found

    def seed(self, draft, forward_seconds: Mapping[int, float] | None = None,
             draft_step_seconds: float | Mapping[int, float] | None = None, *,
             draft_read_share: float | None = None, origin: Seeding | None = None) -> None:
        """Start ``draft``'s estimates from measured costs (a hardware profile): t(n) of the target by inputs,
        the seconds of one draft step, of one row or by rows (``{rows: seconds}``: its shape also prices batch
        sizes not measured yet, ``Estimates.draft_seconds``), and the draft's prompt read as a share of the
        target's prefill of the same prompt (``costmodel.ReadCost``). They are priors: the first measurement at
        each size replaces its seed (``ForwardCost.from_table(prior=True)``), the first reads timed here replace
        the share. ``origin``: where they came from, what the next call's stats show (``models.seeding`` passes
        the profile it read, or priors when it held nothing); default ``GIVEN_COSTS``."""
        self._tables(draft)[1][draft] = origin if origin is not None else GIVEN_COSTS
        estimates = self.estimates(draft)
        if forward_seconds:
            estimates.forward = ForwardCost.from_table(forward_seconds, prior=True)
        if isinstance(draft_step_seconds, Mapping):
            estimates.draft_rows = ForwardCost.from_table(draft_step_seconds)
            draft_step_seconds = draft_step_seconds.get(1)
        if draft_step_seconds is not None:
            estimates.draft_step = ForwardCost.from_table({1: draft_step_seconds}, prior=True)
        if draft_read_share is not None:
            estimates.draft_read.prior = float(draft_read_share)

    def clear(self) -> None:
        self._by_draft = weakref.WeakKeyDictionary()
        self._origins = weakref.WeakKeyDictionary()
        self._by_value = {}
        self._origins_by_value = {}


class LookaheadMemory:
    def __init__(self, max_tokens: int = 1 << 16) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"LookaheadMemory(max_tokens={max_tokens!r}) is invalid: use an int >= 1.")
        self.max_tokens = max_tokens
        self.clear()

    def clear(self) -> None:
        """Forget everything: the earlier calls' text and what was measured."""
        self.corpus = HistoryIndex(max_match=LookaheadConfig().history_match)
        self.estimates = Estimates()
        self.successors: torch.Tensor | None = None  # [V, K] the target's top choices after each token, -1 unknown
        self.origin: Seeding | None = None  # where the estimates started (None: nothing seeded, no call yet)

    def seed(self, forward_seconds: Mapping[int, float] | None, *, origin: Seeding | None = None) -> None:
        """Start the target's t(n) from measured costs (a hardware profile: ``{n: seconds}``) while nothing has
        been measured yet, so the first call prices every size from the start instead of trying sizes it has
        not measured (on a CPU without bf16 units a 2-token forward costs 1.8 plain steps). They are priors: the
        first measurement at each size replaces its seed; text and acceptance are not touched. ``origin``: where
        they came from (as ``SpeculativeMemory.seed``); kept while nothing has been measured."""
        if self.estimates.forward.largest:
            return
        if forward_seconds:
            self.estimates.forward = ForwardCost.from_table(forward_seconds, prior=True)
        if forward_seconds or origin is not None:
            self.origin = origin if origin is not None else GIVEN_COSTS

    def start_call(self) -> Seeding:
        """Where a call starting now finds the estimates; the calls after it find earlier calls'."""
        origin = _started(self.origin, bool(self.estimates.forward.largest))
        self.origin = origin.after_call()
        return origin

    def recycle(self, inputs: torch.LongTensor, top_next: torch.LongTensor) -> None:
        """Keep the target's newest top choices ``top_next`` [R, K] after each of the tokens ``inputs`` [R].

        The table grows to hold every token it names, as an input or a choice, so a chain can always look up the
        choices after any token it holds."""
        needed = int(max(int(inputs.max()), int(top_next.max()))) + 1
        if self.successors is not None and self.successors.shape[1] != top_next.shape[1]:
            self.successors = None  # another recycle_width: start a new table
        if self.successors is None or self.successors.shape[0] < needed:
            size = max(needed, 1024, 2 * (0 if self.successors is None else self.successors.shape[0]))
            grown = torch.full((size, top_next.shape[1]), -1, dtype=torch.long)
            if self.successors is not None:
                grown[: self.successors.shape[0]] = self.successors
            self.successors = grown
        self.successors[inputs] = top_next

    def remember(self, tokens: Sequence[int]) -> None:
        """Add one call's prompt and output; past ``max_tokens``, keep the newest half."""
        self.corpus.extend(tokens)
        if len(self.corpus.tokens) > self.max_tokens:
            kept = self.corpus.tokens[len(self.corpus.tokens) - self.max_tokens // 2:]
            self.corpus = HistoryIndex(kept, max_match=self.corpus.max_match)
