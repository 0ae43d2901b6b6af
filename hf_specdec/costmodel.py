"""What things cost and how often guesses are right: the one cost model and the one acceptance estimator.

Every sizing decision in hf_specdec (``policy.py``) is an argmax of expected tokens per second, so it needs
two kinds of numbers, both measured on the machine it runs on and never assumed:

- costs: ``ForwardCost`` t(n), seconds of one target forward over n new tokens (monotone, interpolated), and
  another of the seconds of one draft-model step over n rows, t_d (it grows with the batch, as t(n) does);
  ``RoundCost``, the one price of a round (draft work, the verify forward and its holes, the draft's prompt
  read, what a finished round took) that every decision reads (its extrapolation rules are written there
  once); ``ReadCost``, the draft model's prompt read priced by its structure, as a share of the target's read
  of the same prompt;
- acceptance: ``DecayedAcceptance``, P(a guess at position i is accepted | the guesses before it were), one per
  source of guesses (the draft model, prompt lookup, the lookahead pool, ...), decayed counts with a Beta prior.

``Estimates`` holds one set of them: per call, or carried across calls (``LookaheadMemory``, and one per draft
model after ``enable()``). ``expected_tokens`` and ``best_count`` are the arithmetic every policy shares
(``run_length_tokens`` the same from teacher-forced agreement: ``hf-specdec check``, ``distill``);
``Regret`` caps what probing may lose against plain decoding. ``forward_times`` is the one offline measurement of
t(n) (``hf-specdec check``, the eval harness, the hardware profile).

Terms (see ``verify.py``): c = t_d / t(1); v(n) = t(n) / t(1).
"""

from __future__ import annotations

import bisect
import enum
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from .round import RoundKind, RoundOutcome, SourceKind, TreeShape


class Ema:
    """Exponential moving average that starts at its first sample.

    >>> ema = Ema(weight=0.5)
    >>> ema.value is None
    True
    >>> ema.update(2.0); ema.update(4.0); ema.value
    3.0
    """

    __slots__ = ("value", "weight")

    def __init__(self, weight: float = 0.3) -> None:
        self.value: float | None = None
        self.weight = weight

    def update(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample


class ForwardCost:
    """Measured seconds of one target forward as a function of n, the number of new tokens it reads.

    Each size keeps an exponential moving average of its timings. ``estimate`` makes sizes n >= 2 monotone (a
    forward over more tokens costs no less, so every measurement at m >= n also bounds t(n) from above; one slow
    sample cannot make longer forwards look cheap), interpolates linearly between measured sizes and, beyond the
    largest, is flat (optimistic: a longer forward gets tried once and then is measured) or, with
    ``extrapolate``, continues the slope of the two largest measured sizes.

    Points seeded from a hardware profile (``from_table(..., prior=True)``) are priors: the first measurement at a
    seeded size replaces the seed instead of averaging with it, and ``measured_only`` is the curve of what was
    measured here. A profile measured on proxies, at another cache length or on a quieter machine can be off by
    a third in level while its shape (how t grows with n) holds better, so a size still priced by its seed is
    priced at the level measured here: its seed times the median of measured / seed over the seeded sizes
    measured at or below it (over every measured seeded size when none is below; the seed itself before any).
    Where a seed was off at one size only, the others come out too low: an error the round that tries such a
    size corrects, where a size priced too high is never tried. A first measurement ``COLD`` times its seed is
    the one-time cold start of a new shape's kernels (on CPUs, the first forward over a new number of inputs can
    cost several warm ones) and is not learned; the seed then stands until the next measurement, which replaces
    it.

    t(1) stands on its own: a one-token forward runs matrix-vector products, which can cost more than a product
    over a few rows (measured on an AMD EPYC CPU in bf16, oneDNN: 0.22 s for one token, 0.19 s for two, 0.21 s
    for four). Bounding it by the larger sizes would hide that a round verifying a guess or two is cheaper than
    a plain step.

    >>> cost = ForwardCost()
    >>> for n, seconds in [(1, 0.20), (4, 0.20), (8, 0.26), (2, 0.30)]:
    ...     cost.observe(n, seconds)
    >>> cost.estimate(2), cost.estimate(6), cost.estimate(16), cost.estimate(16, extrapolate=True)
    (0.2, 0.23, 0.26, 0.38)
    >>> cost.observe(1, 0.24)  # a matrix-vector step slower than the two-to-four-token products
    >>> round(cost.estimate(1), 3), cost.estimate(2)
    (0.212, 0.2)
    >>> ForwardCost.from_table({1: 1.0, 4: 1.5}).estimate(3)
    1.333333333333
    >>> seeded = ForwardCost.from_table({1: 0.30, 4: 0.14, 8: 0.21}, prior=True)  # a profile's t(1) that was off
    >>> seeded.observe(1, 0.14); seeded.observe(4, 0.15)
    >>> seeded.estimate(1), seeded.estimate(8), seeded.seeded(8), seeded.measured_only().estimate(8)
    (0.14, 0.1615, True, 0.15)
    >>> seeded.observe(8, 0.9); seeded.estimate(8), seeded.cold  # a cold start: the (scaled) seed stands
    (0.1615, 1)
    >>> seeded.observe(8, 0.2); seeded.estimate(8)  # the next measurement replaces it
    0.2
    >>> wrong = ForwardCost.from_table({1: 0.1, 8: 0.1}, prior=True)  # a seed a third of the real cost or less
    >>> wrong.observe(8, 0.5); wrong.observe(8, 0.5); wrong.estimate(8), wrong.cold  # set aside once, then learned
    (0.5, 1)
    >>> level = ForwardCost.from_table({1: 0.5, 4: 0.6, 8: 0.8, 16: 1.2}, prior=True)  # a proxy's level
    >>> level.observe(1, 0.4)  # t(1) measured at 0.8 times its seed: every size still seeded is priced so
    >>> level.estimate(4), level.estimate(8), level.estimate(16)
    (0.48, 0.64, 0.96)
    >>> level.observe(8, 0.72); level.estimate(16)  # median of 0.8 and 0.9 at or below 16
    1.02
    """

    def __init__(self) -> None:
        self._by_size: dict[int, Ema] = {}
        self._prior: set[int] = set()  # sizes whose value is still a seed, not measured here
        self._seeds: dict[int, float] = {}  # every seed, kept after its size is measured (its level against ours)
        self._curve: tuple[list[int], dict[int, float]] | None = None  # (sizes, bounded), until the next observe
        self._measured: ForwardCost | None = None  # measured_only(), until the next observe
        self._cold_sizes: set[int] = set()  # sizes whose first measurement was set aside as a cold start
        self.cold = 0  # first measurements not learned as cold starts

    @classmethod
    def from_table(cls, seconds_by_size: Mapping[int, float], *, prior: bool = False) -> "ForwardCost":
        """A cost curve from measured points (seconds, or any unit: v(n) works as well as t(n)); with ``prior``,
        the points are seeds that the first measurement at each size replaces."""
        cost = cls()
        for n, seconds in seconds_by_size.items():
            cost.observe(int(n), float(seconds))
        if prior:
            cost._prior = set(cost._by_size)
            cost._seeds = {n: ema.value for n, ema in cost._by_size.items()}
        return cost

    COLD = 3.0  # a first measurement this many times its seed is a one-time cold start, not the size's cost

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Learn one timing, unless it is a first measurement at a seeded size more than ``COLD`` times its seed:
        a one-time cold start of that shape's kernels, counted in ``cold`` and not learned. One sample per size at
        most is set aside so: the next one is learned whatever it says (a seed that was wrong is corrected)."""
        n = int(num_tokens)
        if n in self._prior:  # the first measurement here replaces the seed
            if n not in self._cold_sizes and seconds > self.COLD * self._by_size[n].value:
                self._cold_sizes.add(n)
                self.cold += 1
                return
            self._prior.discard(n)
            del self._by_size[n]
        self._by_size.setdefault(n, Ema()).update(seconds)
        self._curve = self._measured = None

    def seeded(self, num_tokens: int) -> bool:
        """Is the value at this size a seed not measured here yet?"""
        return int(num_tokens) in self._prior

    def measured_only(self) -> "ForwardCost":
        """The curve of the sizes measured here, without the seeds (empty before any measurement)."""
        if self._measured is None:
            self._measured = ForwardCost()
            for n, ema in self._by_size.items():
                if n not in self._prior:
                    self._measured._by_size[n] = ema
        return self._measured

    def measured(self, num_tokens: int) -> bool:
        return int(num_tokens) in self._by_size

    @property
    def largest(self) -> int:
        """The largest size measured so far (0 before any measurement)."""
        return max(self._by_size, default=0)

    def table(self) -> dict[int, float]:
        """The averaged measurement at each measured size, and each size still seeded at the level measured here."""
        return {n: self._value(n) for n in sorted(self._by_size)}

    def _value(self, n: int) -> float:
        """The averaged measurement at size ``n``; a seed, scaled by measured / seed of the seeded sizes measured
        here (class docstring)."""
        value = self._by_size[n].value
        if n not in self._prior:
            return value
        ratios = {m: self._by_size[m].value / seed for m, seed in self._seeds.items()
                  if m not in self._prior and seed > 0}
        below = [ratio for m, ratio in ratios.items() if m <= n] or list(ratios.values())
        return round(value * statistics.median(below), 12) if below else value

    def estimate(self, n: int, extrapolate: bool = False) -> float | None:
        """Seconds for a forward over n new tokens; None before anything was measured."""
        if not self._by_size:
            return None
        sizes, bounded = self._bounded()
        if n <= sizes[0]:
            return bounded[sizes[0]]
        if n >= sizes[-1]:
            if extrapolate and len(sizes) >= 2:  # continue the slope of the two largest measured sizes
                slope = (bounded[sizes[-1]] - bounded[sizes[-2]]) / (sizes[-1] - sizes[-2])
                return round(bounded[sizes[-1]] + max(0.0, slope) * (n - sizes[-1]), 12)
            return bounded[sizes[-1]]
        if n in bounded:
            return bounded[n]
        high = bisect.bisect_left(sizes, n)
        low, high = sizes[high - 1], sizes[high]
        return round(bounded[low] + (bounded[high] - bounded[low]) * (n - low) / (high - low), 12)

    def _bounded(self) -> tuple[list[int], dict[int, float]]:
        """The measured sizes, ascending, and each one's time bounded by every larger size's (sizes >= 2); kept
        until the next ``observe`` (a round's plan reads the curve dozens of times)."""
        if self._curve is None:
            sizes = sorted(self._by_size)
            bounded, running = {}, float("inf")
            for m in reversed(sizes):
                running = min(running, self._value(m)) if m >= 2 else self._value(m)
                bounded[m] = running
            self._curve = (sizes, bounded)
        return self._curve

    def scaled(self, n: int, like: "ForwardCost") -> float | None:
        """``estimate(n)``; beyond the largest measured size m, t(m) scaled as ``like`` grows from m to n.

        For costs that grow alike: a draft step over 8 rows, measured only over 1, from the draft's profiled
        step by rows (or, without one, the target's t(8) / t(1)). Flat (``estimate``) while ``like`` does not
        reach n (it is never extrapolated).

        >>> draft, target = ForwardCost.from_table({1: 0.02, 4: 0.03}), ForwardCost.from_table({4: 0.1, 8: 0.2})
        >>> draft.scaled(2, target), draft.scaled(8, target), draft.scaled(6, target), draft.scaled(16, target)
        (0.023333333333, 0.06, 0.045, 0.03)
        """
        m = self.largest
        if m == 0 or n <= m or like.largest < n:
            return self.estimate(n)
        return round(self.estimate(m) * like.estimate(n) / like.estimate(m), 12)


class Bound(enum.Enum):
    """How a price treats forward sizes past the largest one measured (``RoundCost``).

    EXPECTED: what a round is expected to cost. For one row, flat past the largest measured size (optimistic: t(n)
        is flat up to a few dozen inputs on every device measured, and a larger forward is tried once, then
        known); for a batch the slope of the two largest sizes continues (a B x n forward is far past where t
        stays flat). A size priced only by its seed (the hardware profile) past the largest measured here is
        priced as the measured curve continues when the planner says a round may lose the difference
        (``RoundCost.may_lose``, its regret account): the round then measures it (a profile that overpriced a
        size would otherwise keep rounds from ever reaching it).
    WORST: the slope of the two largest measured sizes, continued. For what cannot be undone once run: a round
        sized by its worst case, a prompt read decided on what it saves.
    """

    EXPECTED = "expected"
    WORST = "worst"


@dataclass(frozen=True)
class RoundCost:
    """The one price of a round: every decision that prices a round, a step or a forward reads this.

    A round costs its draft work (k draft-model steps for a chain, a draft forward per depth over the nodes it
    reads for a tree, nothing for ready-made candidates: prompt lookup, the lookahead pool), the target's verify
    forward over n inputs per row (and the holes it leaves, compacted later), and once per call, before a draft
    model's first step, its read of the prompts. The rules of ``Bound`` are written here once.

    ``cost``: the target's t(n), by inputs over every row; ``rows``: rows in the batch (a forward over n inputs
    per row reads rows x n); ``t_draft``: seconds of one draft-model step over these rows, one input each (None:
    unmeasured, or no draft model); ``hole``: seconds each hole (a written input off the kept path, in one row)
    costs when the cache compacts it, measured (0 until a compaction ran); ``draft``: seconds of one draft forward
    over n inputs, every row's, as a tree's depth reads them (``Estimates.tree_draft_seconds``; None: ``t_draft``
    at one input a row, nothing wider); ``width``: the inputs per row the target's forward runs for n (a compiled
    verify pads n to its bucket; None: n itself); ``may_lose``: the planner's decision whether a round may lose so many
    seconds against this price (``Regret.allows``: the regret allowance is the planner's, not the price's; None:
    nothing, so the measured curve prices a size only where it costs no less than the seed); ``read``: seconds of
    the draft's prompt read a round pays before drafting (0 once read); ``host``: seconds of a round's host work
    by its kind (``round.RoundKind``: its plan, layout, keep and learning, measured by the loop,
    ``RoundOutcome.host_time``), which every round's price holds (None: 0, nothing measured). Where a forward
    costs a few milliseconds (a GPU, a tiny model) a tree's search, masks and gathers can cost more than the
    tokens it adds; where it costs a tenth of a second they are noise. A price serves one round's decisions: it
    remembers each forward size it was asked for, so it is made again (``Planner.price``) once the estimates learn.

    >>> cost = ForwardCost.from_table({1: 0.10, 4: 0.20, 8: 0.30, 16: 0.34}, prior=True)  # a profile's seeds
    >>> cost.observe(1, 0.10); cost.observe(4, 0.11)  # measured here: t(4) is one step, not two
    >>> price = RoundCost(cost)
    >>> price(4), price(8), price(8, Bound.WORST)  # t(8) is the seed's (at the level measured): nothing paid for it
    (0.11, 0.2325, 0.2325)
    >>> RoundCost(cost, may_lose=lambda seconds: seconds <= 0.5)(8)  # the planner may lose the gap: as measured
    0.11
    >>> chain = RoundCost(cost, t_draft=0.02)
    >>> chain.round(3)  # 3 draft steps and a forward over 4 inputs
    0.17
    >>> RoundCost(cost, t_draft=0.02, read=0.5).round(3, with_read=True)  # the call's first round reads the prompts
    0.67
    >>> RoundCost(cost, width=lambda n: 8 if n > 4 else 4)(5)  # a compiled verify runs 5 inputs in the 8 bucket
    0.2325
    >>> hosted = RoundCost(cost, t_draft=0.02, host={RoundKind.PLAIN: 0.001, RoundKind.CHAIN: 0.002}.get)
    >>> hosted.step(), hosted.round(3)  # each round's host work on top of its forwards
    (0.101, 0.172)
    """

    cost: "ForwardCost"
    rows: int = 1
    t_draft: float | None = None
    hole: float = 0.0
    draft: Callable[[int], float | None] | None = None
    width: Callable[[int], int] | None = None
    may_lose: Callable[[float], bool] | None = None
    read: float = 0.0
    host: Callable[[RoundKind], float | None] | None = None
    # t(n) by (width, bound) and draft forwards by width, filled as the round's decisions ask: a price lives for one
    # round's decisions, over estimates that change only after the round (~100 sizes a round, ~30 of them distinct)
    _seen: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def host_seconds(self, kind: RoundKind) -> float:
        """Seconds of the host work of a round of this kind (0 while unmeasured)."""
        return (self.host(kind) or 0.0) if self.host is not None else 0.0

    def _hosted(self, t: float | None, kind: RoundKind) -> float | None:
        """A round's forward time ``t`` with its kind's host work (as it is where nothing prices host work)."""
        return t if t is None or self.host is None else round(t + self.host_seconds(kind), 12)

    def __call__(self, n: int, bound: Bound = Bound.EXPECTED, holes: int = 0) -> float | None:
        """Seconds of the target's verify forward over n inputs per row (at the width it runs) that leaves
        ``holes`` inputs per row off the kept path (a trie's other branches: compacted later, at ``hole`` seconds
        each); None before anything was measured.

        >>> price = RoundCost(ForwardCost.from_table({1: 0.10, 8: 0.12}), rows=2, hole=1e-4)
        >>> price(4), price(4, holes=5)  # 2 rows x 5 holes
        (0.12, 0.121)
        """
        t = self._forward(n if self.width is None else self.width(n), bound)
        return t if t is None or not holes else round(t + self.rows * holes * self.hole, 12)

    def _forward(self, n: int, bound: Bound) -> float | None:
        key = (n, bound)
        if key not in self._seen:
            self._seen[key] = self._estimate(n, bound)
        return self._seen[key]

    def _estimate(self, n: int, bound: Bound) -> float | None:
        total, batch = self.rows * n, self.rows > 1
        if bound is Bound.WORST:
            return self.cost.estimate(total, extrapolate=True)
        t = self.cost.estimate(total, extrapolate=batch)
        measured = self.cost.measured_only()
        if t is None or not measured.largest or total <= measured.largest:
            return t
        optimistic = measured.estimate(total, extrapolate=batch)
        gap = t - optimistic  # what pricing it as measured could lose
        return optimistic if (gap <= 0.0 if self.may_lose is None else self.may_lose(gap)) else t

    def step(self) -> float | None:
        """A plain step of these rows, its host work included: the reference every other size is compared to."""
        return self._hosted(self(1), RoundKind.PLAIN)

    def round(self, k: int, extra: int = 0, bound: Bound = Bound.EXPECTED, with_read: bool = False) -> float | None:
        """T(k): k draft steps and a forward over the last token, the k drafted and ``extra`` more inputs (a
        lookup tail; -1: a round at the end of a sequence verifies no bonus position), with the draft's prompt
        read first when ``with_read``, and the host work of its kind (a chain's; k = 0: a plain step's); None
        while either is unmeasured."""
        t = self(k + 1 + extra, bound)
        if t is None or (k > 0 and self.t_draft is None):
            return None
        host = self.host_seconds(RoundKind.CHAIN if k > 0 else RoundKind.PLAIN)
        return round(k * (self.t_draft or 0.0) + t + (self.read if with_read else 0.0) + host, 12)

    def draft_forward(self, width: int) -> float | None:
        """Seconds of a tree's draft forward over ``width`` inputs per row: ``draft``; without it, ``t_draft`` (a
        chain's step) at one input a row and None wider."""
        if self.draft is None:
            return self.t_draft if width == 1 else None
        key = ("draft", width)
        if key not in self._seen:
            self._seen[key] = self.draft(self.rows * width)
        return self._seen[key]

    def tree(self, shape: TreeShape, bound: Bound = Bound.WORST) -> float | None:
        """T of a round growing ``shape``: a draft forward per depth over the nodes it reads,
        and the target's forward over the last token and every node, the nodes off the deepest path left as
        holes; at ``Bound.WORST`` by default: a tree never gets the optimism a chain's next size gets, so where
        t(n) is steep it is not tried "once" before it is known.

        >>> price = RoundCost(ForwardCost.from_table({1: 0.1, 8: 0.1}), t_draft=0.01, draft=lambda n: 0.01 * n)
        >>> price.tree(TreeShape(nodes=(2, 2, 1), expanded=(1, 2, 1), children=2))  # 0.01 + 0.02 + 0.01 + t(6)
        0.14
        """
        verify = self(1 + shape.num_nodes, bound, holes=shape.num_nodes - shape.depth)
        if verify is None:
            return None
        total = verify + self.host_seconds(RoundKind.TREE)
        for width in shape.expanded:
            seconds = self.draft_forward(width)
            if seconds is None:
                return None
            total += seconds
        return round(total, 12)

    def trie(self, nodes: int, deepest: int, bound: Bound = Bound.EXPECTED) -> float | None:
        """T of a round verifying a trie of ready-made candidates (no draft forward): ``nodes`` per row, the
        ones off its ``deepest`` candidate left as holes."""
        return self._hosted(self(1 + nodes, bound, holes=max(0, nodes - deepest)), RoundKind.TRIE)

    def saved(self, k: int, tokens: float, remaining: int) -> float | None:
        """Seconds rounds of k draft tokens emitting ``tokens`` each save over ``remaining`` tokens against plain
        steps, every row advancing together: remaining x (t(1) - T(k) / tokens), T(k) at its worst (what it is
        weighed against, a prompt read, cannot be undone)."""
        step, seconds = self.step(), self.round(k, bound=Bound.WORST)
        return None if step is None or seconds is None else remaining * (step - seconds / tokens)

    @staticmethod
    def spent(outcomes: Sequence[RoundOutcome]) -> float:
        """Seconds a finished round took (its outcome per row): the target's forward and
        verification, the compaction after it, every row's draft work and set-up, and the round's host work."""
        first = outcomes[0]
        return first.verify_time + first.compact_time + first.host_time + sum(
            o.proposal.draft_time + o.proposal.setup_time for o in outcomes)


class ReadCost:
    """Seconds the draft model takes to read the prompts before it first drafts, priced by its structure.

    A prompt read is one forward over every prompt token: a fixed part (one pass over the weights) plus a part
    per token (the compute). The target has just read the same prompts (its prefill, timed by the loop), so its
    read already has this call's structure, length and padding; the draft's read is priced as a share of it,
    ``ratio`` x the target's prefill seconds, the share learned from the calls where both were timed. Before any,
    the share is the ``prior`` (the hardware profile's draft read over its target prefill, or the draft's share of
    the target's parameters, which is what a forward's compute scales with).

    A first read in a process pays one-time costs (kernel set-up, weight packing) that no later read pays: a
    sample more than ``COLD`` times the share expected is such a cold start, counted in ``cold`` and not learned,
    so one slow first read cannot price every later prompt out of drafting. One sample at most is set aside so:
    a read that is slow again is the read's real cost, and is learned (a prior that was too low is corrected, so
    a read cannot stay priced below what it costs). Learned shares are an average that the
    next sample moves, never a verdict: a call whose read was not repaid does not sample again, so each such call
    (``relax``) moves a share above its prior halfway back towards it, and a later call reads and measures again.

    >>> read = ReadCost(prior=0.3)
    >>> read.estimate(target_seconds=2.0)  # the target read this prompt in 2 s
    0.6
    >>> read.observe(draft_seconds=5.0, target_seconds=1.0)  # a first read with the 4-bit kernels cold
    False
    >>> read.observe(draft_seconds=1.0, target_seconds=2.0), read.estimate(2.0)
    (True, 1.0)
    >>> read.relax(); read.estimate(2.0)  # a call that did not read: halfway back to the prior's 0.6
    0.8
    >>> slow = ReadCost(prior=0.3)  # a prior far below what this draft's reads cost
    >>> slow.observe(4.0, 1.0), slow.observe(4.0, 1.0), slow.share()  # set aside once, then learned
    (False, True, 4.0)
    """

    COLD = 3.0  # a read this many times the expected share is a cold start

    __slots__ = ("prior", "ratio", "cold", "blocked")

    def __init__(self, prior: float | None = None) -> None:
        self.prior = prior
        self.ratio = Ema(weight=0.5)
        self.cold = 0  # reads not learned as cold starts
        self.blocked = False  # a round of the last call did not draft because this read was not repaid

    def share(self) -> float | None:
        """The draft's read over the target's read of the same prompts (None: nothing to go by)."""
        return self.ratio.value if self.ratio.value is not None else self.prior

    def estimate(self, target_seconds: float | None) -> float | None:
        """Seconds of the draft reading prompts that took the target ``target_seconds`` to read."""
        share = self.share()
        if share is None or target_seconds is None:
            return None
        return round(share * target_seconds, 12)

    def observe(self, draft_seconds: float, target_seconds: float) -> bool:
        """Learn from one read (False: a cold start, not learned)."""
        if target_seconds <= 0.0:
            return False
        sample, share = draft_seconds / target_seconds, self.share()
        if share is not None and self.cold == 0 and sample > self.COLD * share:
            self.cold += 1
            return False
        self.ratio.update(sample)
        return True

    def start_call(self) -> None:
        """A new call: ``relax`` if the last call's read was priced out of drafting."""
        if self.blocked:
            self.relax()
            self.blocked = False

    def relax(self) -> None:
        """A call did not read because the read was priced above what it saves: move a learned share above the
        prior halfway back, so a later call measures again."""
        if self.ratio.value is not None and self.prior is not None and self.ratio.value > self.prior:
            self.ratio.value = round(0.5 * (self.ratio.value + self.prior), 12)


def beta_rate(kept: float, judged: float, centre: float, weight: float) -> float:
    """The mean of a Beta posterior: ``kept`` of ``judged`` observed, a prior centred on ``centre`` worth
    ``weight`` observations.

    >>> beta_rate(3, 4, 0.5, 2.0)  # (3 + 1) / (4 + 2)
    0.6666666666666666
    """
    return (kept + weight * centre) / (judged + weight)


class DecayedAcceptance:
    """P(a guess in slot i is accepted | it was judged), from decayed counts with a Beta prior.

    A slot is a position along a candidate (1 = its first token), or a confidence bin. The estimate of slot i
    is ``(kept[i] + weight * centre) / (judged[i] + weight)``: ``weight`` says how many observations the prior
    is worth, and its centre is ``prior`` for slot 1 and, deeper, the larger of ``prior`` and the estimate of
    slot i - 1. A depth is judged only when every depth before it was kept, so the deep slots see the fewest
    rounds; and a guess that has held so far is not less likely to hold at the next token (a copy goes on, a
    draft that agreed keeps agreeing about as often). Centred on the prior alone, a copy kept in full at depths
    1..5 priced depth 6 at that prior, so rounds stopped at depth 5 and depth 6 was never judged: ignorance
    that blocked its own correction. A first token that is seldom kept says little about the next one given
    it was, so the prior stays the floor. With nothing seen every slot is the prior. Each ``observe`` first
    multiplies every count by ``decay`` (old rounds fade), then adds one observation. A candidate is judged at
    every position up to its first rejection: its accepted prefix plus the first miss (positions after a miss
    were never judged). A confidence bin is no depth: ``rate(bin, prior=...)`` centres that bin on the prior
    given.

    >>> rates = DecayedAcceptance(prior=0.5, slots=4)
    >>> rates.observe(judged=3, accepted=2)
    >>> [round(rates.rate(i), 2) for i in (1, 2, 3, 4)]
    [0.67, 0.78, 0.52, 0.52]
    >>> copy = DecayedAcceptance(prior=0.45, slots=8)  # a lookup whose 5-token copies were mostly kept in full
    >>> for _ in range(8): copy.observe(judged=5, accepted=5)
    >>> copy.observe(judged=1, accepted=0); copy.observe(judged=3, accepted=2)
    >>> [round(rate, 2) for rate in copy.rates(7)]  # depths 6 and 7, never judged: as depth 5, not 0.45
    [0.83, 0.97, 0.9, 0.98, 1.0, 1.0, 1.0]
    >>> calibration = DecayedAcceptance(prior=0.0, slots=10)  # per confidence bin, prior given per lookup
    >>> calibration.observe_slots([(9, True)]); round(calibration.rate(9, prior=0.95), 3)
    0.967
    """

    __slots__ = ("prior", "weight", "decay", "judged", "kept")

    def __init__(self, prior: float, weight: float = 2.0, decay: float = 1.0, slots: int = 32) -> None:
        self.prior, self.weight, self.decay = prior, weight, decay
        self.judged = [0.0] * slots
        self.kept = [0.0] * slots

    def rate(self, slot: int, prior: float | None = None) -> float:
        """The estimate for ``slot`` (1-based; slots past the last share the last); with ``prior``, centred on it
        alone (a confidence bin's)."""
        if prior is None:
            return self.rates(max(1, slot))[-1]
        i = min(slot, len(self.judged)) - 1
        return beta_rate(self.kept[i], self.judged[i], prior, self.weight)

    def rates(self, count: int) -> list[float]:
        """``rate(1) .. rate(count)``, each centred on the larger of the prior and the one before."""
        found, centre = [], self.prior
        for i in range(min(count, len(self.judged))):
            found.append(beta_rate(self.kept[i], self.judged[i], centre, self.weight))
            centre = max(self.prior, found[-1])
        return found + found[-1:] * (count - len(found))

    def observe(self, judged: int, accepted: int) -> None:
        """One candidate: positions 1..judged were judged, 1..accepted kept."""
        self.observe_slots([(i, i <= accepted) for i in range(1, judged + 1)])

    def observe_slots(self, outcomes: Sequence[tuple[int, bool]], decays: int = 1) -> None:
        """Decay ``decays`` times (once per round, or once per candidate judged), then add one (slot, kept)
        observation each."""
        if self.decay != 1.0:
            factor = self.decay ** decays
            self.judged = [x * factor for x in self.judged]
            self.kept = [x * factor for x in self.kept]
        last = len(self.judged)
        for slot, kept in outcomes:
            i = min(slot, last) - 1
            self.judged[i] += 1.0
            if kept:
                self.kept[i] += 1.0


def prefix_gains(rates: Sequence[float]) -> list[float]:
    """P(the first i guesses are all accepted) for i = 1..len(rates), from conditional rates.

    >>> prefix_gains([0.5, 0.5, 1.0])
    [0.5, 0.25, 0.25]
    """
    gains, all_kept = [], 1.0
    for rate in rates:
        all_kept *= rate
        gains.append(all_kept)
    return gains


def expected_tokens(gains: Sequence[float], base: float = 1.0) -> float:
    """Tokens a round emits on average: ``base`` (the target's own token) plus the chance of every guess.

    >>> expected_tokens(prefix_gains([0.5, 0.5]))
    1.75
    """
    return base + sum(gains)


def agreement_runs(matches: Sequence[bool]) -> list[int]:
    """For each position of a teacher-forced continuation, how many positions from there on the draft's argmax
    agrees with the target's token: a greedy chain drafted there is accepted that far.

    >>> agreement_runs([True, True, False, True])
    [2, 1, 0, 1]
    """
    run, runs = 0, [0] * len(matches)
    for i in range(len(matches) - 1, -1, -1):
        run = run + 1 if matches[i] else 0
        runs[i] = run
    return runs


def runs_that_fit(runs: Sequence[Sequence[int]], k: int) -> list[int]:
    """The runs at the positions where a round of ``k`` drafts fits in its continuation (every position when
    none does)."""
    return [r[i] for r in runs for i in range(len(r) - k + 1)] or [x for r in runs for x in r]


def run_length_tokens(runs: Sequence[Sequence[int]], k: int) -> float:
    """Mean tokens per round of greedy speculative decoding with ``k`` drafts, from measured agreement runs
    (``agreement_runs`` per continuation): 1 + the mean of min(run, k) where a k-round fits.

    >>> run_length_tokens([agreement_runs([True, True, False, True])], 2)  # rounds fit at the first three
    2.0
    """
    fits = runs_that_fit(runs, k)
    return 1.0 + sum(min(r, k) for r in fits) / len(fits) if fits else 1.0


def best_count(gains: Sequence[float], seconds: Callable[[int], float | None], limit: int | None = None,
               base: float = 1.0) -> int:
    """The n in [0, limit] that maximises expected tokens per second, ``(base + sum(gains[:n])) / seconds(n)``.

    ``gains[i]``: what the (i+1)-th guess adds to the expected tokens (the chance it and every guess before it
    is accepted); ``seconds(n)``: the measured time of a round with n guesses (None: unknown, never chosen).
    Ties go to the smaller n: a guess must pay for itself.

    >>> flat, steep = (lambda n: 1.0), (lambda n: 1.0 + 0.5 * n)
    >>> best_count([0.9, 0.8, 0.1], flat), best_count([0.9, 0.8, 0.1], steep), best_count([0.3], steep)
    (3, 2, 0)
    """
    limit = len(gains) if limit is None else min(limit, len(gains))
    best, best_rate, emitted = 0, -1.0, base
    for n in range(limit + 1):
        if n:
            emitted += gains[n - 1]
        cost = seconds(n)
        if cost is None or cost <= 0:
            continue
        if emitted / cost > best_rate:
            best, best_rate = n, emitted / cost
    return best


@dataclass(frozen=True)
class BestRound:
    """The round that maximises expected tokens per second: ``k`` draft tokens (0: a plain step), ``tokens``
    expected from it, in ``seconds``."""

    k: int
    tokens: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def best_round(price: "RoundCost", gains: Sequence[float], limit: int | None = None,
               bound: Bound = Bound.EXPECTED) -> BestRound | None:
    """Does speculation pay, and how much: the one answer for the policy, ``check``, the profile's dtype choice
    and eval. ``gains[i]``: what draft token i + 1 adds to a round's expected tokens (``prefix_gains``); a round of
    k tokens takes ``price.round(k, bound=bound)``. None while a plain step is unpriced.

    >>> price = RoundCost(ForwardCost.from_table({1: 1.0, 4: 1.1, 8: 1.3}), t_draft=0.1)  # in plain steps
    >>> best = best_round(price, prefix_gains([0.8] * 8))
    >>> best.k, round(best.tokens, 2), best.seconds  # 5 draft steps and t(6): 2.17 tokens a step
    (5, 3.69, 1.7)
    >>> best_round(RoundCost(price.cost, t_draft=0.9), prefix_gains([0.5] * 8)).k  # a dear draft: plain steps
    0
    """
    def seconds(k: int) -> float | None:
        return price.round(k, bound=bound)

    k = best_count(gains, seconds, limit)
    t = seconds(k)
    return None if t is None else BestRound(k, expected_tokens(gains[:k]), t)


class Regret:
    """Seconds speculation lost against plain decoding, so that probing it stays within a budget.

    Each round that guessed adds ``round_seconds - emitted * t(1)``: what it took minus what plain decoding
    would have taken for the tokens it emitted (negative when it paid). ``allows(cost)`` says whether a probe
    that may lose ``cost`` seconds keeps the total loss within ``budget`` (a share) of the plain-decoding time of
    everything emitted so far. Speculation that pays earns credit; one that does not is capped at the budget.

    The account is carried across calls with the estimates (a memory's): each call ``start``s with its budget
    and half of the earlier calls' account, so recent calls count most. A call after calls where guessing paid
    can afford its first misses (its early guesses, before its own text repeats, miss most); after calls where
    it did not, a call starts at the budget and does not explore again from nothing.

    >>> regret = Regret(budget=0.03)
    >>> regret.observe(round_seconds=0.3, emitted=1, step=0.2, guessed=True)  # a probe that lost 0.1 s
    >>> regret.observe(round_seconds=0.2, emitted=1, step=0.2, guessed=False)
    >>> round(regret.lost, 3), regret.allows(0.05)
    (0.1, False)
    >>> for _ in range(100): regret.observe(0.2, 1, 0.2, guessed=False)  # 20 s of plain steps later
    >>> regret.allows(0.05)
    True
    >>> regret.observe(round_seconds=0.2, emitted=4, step=0.2, guessed=True)  # a round that paid 0.6 s
    >>> regret.start(budget=0.03); round(regret.lost, 3), round(regret.plain_seconds, 3)  # the next call
    (-0.25, 10.6)
    """

    __slots__ = ("budget", "lost", "plain_seconds")

    def __init__(self, budget: float = 0.03) -> None:
        self.budget, self.lost, self.plain_seconds = budget, 0.0, 0.0

    def start(self, budget: float) -> None:
        """A new call with this budget: the earlier calls' account counts half."""
        self.budget, self.lost, self.plain_seconds = budget, 0.5 * self.lost, 0.5 * self.plain_seconds

    def observe(self, round_seconds: float, emitted: int, step: float, guessed: bool) -> None:
        self.plain_seconds += emitted * step
        if guessed:
            self.lost += round_seconds - emitted * step

    def allowance(self) -> float:
        """Seconds a round may still lose, at worst, with the total loss staying within the budget (negative
        once it is spent)."""
        return self.budget * self.plain_seconds - self.lost

    def allows(self, cost: float) -> bool:
        return cost <= self.allowance()


@dataclass
class Estimates:
    """Everything measured or learned while decoding that sizing decisions read.

    ``forward``: t(n) of the target; ``draft_step``: seconds per draft-model forward by the rows it steps (one
    new token each: a batch of 8 steps 8 inputs, priced apart from a batch of 4), measured in chain rounds;
    ``tree_step``: seconds of a tree's draft forward by the inputs it reads (every row's frontier at one depth),
    measured in tree rounds (``tree_draft_seconds``);
    ``draft_rows``: the hardware profile's draft step by rows, whose shape scales a measured step to a batch
    size not measured yet (empty: the target's t(n) scales it); ``draft_read``: the draft model's prompt read,
    a learned share of the target's prefill (``ReadCost``); ``regret``:
    what guessing lost against plain decoding (``Regret``, carried across calls with the rest);
    ``acceptance``: one ``DecayedAcceptance`` per source of guesses, keyed ``(kind, variant)`` (see
    ``round.SourceKind``), created with its prior the first time a policy asks for it; ``calibration``: the draft
    model's acceptance per bin of its own confidence; ``emas``: other running averages a policy keeps by name
    (lookahead: tokens per round, what its pool adds); ``host``: seconds of a round's host work per
    ``RoundKind`` (``RoundOutcome.host_time``). One per call, or carried across calls.
    """

    forward: ForwardCost = field(default_factory=ForwardCost)
    draft_step: ForwardCost = field(default_factory=ForwardCost)
    tree_step: ForwardCost = field(default_factory=ForwardCost)
    draft_rows: ForwardCost = field(default_factory=ForwardCost)
    draft_read: ReadCost = field(default_factory=ReadCost)
    regret: Regret = field(default_factory=Regret)
    acceptance: dict[tuple[SourceKind, int], DecayedAcceptance] = field(default_factory=dict)
    calibration: DecayedAcceptance | None = None
    emas: dict[str, Ema] = field(default_factory=dict)
    host: dict[RoundKind, Ema] = field(default_factory=lambda: {kind: Ema() for kind in RoundKind})

    def host_seconds(self, kind: RoundKind) -> float | None:
        """The host work of a round of this kind, as measured; before its first, that of the kind it does the work
        of (``RoundKind.within``: a tree not grown yet costs at least a chain's); None before any.

        >>> estimates = Estimates()
        >>> estimates.host[RoundKind.CHAIN].update(0.002)
        >>> estimates.host_seconds(RoundKind.TREE), estimates.host_seconds(RoundKind.TRIE)
        (0.002, None)
        """
        while kind is not None and self.host[kind].value is None:
            kind = kind.within
        return None if kind is None else self.host[kind].value

    def source(self, key: tuple[SourceKind, int], prior: float, weight: float = 2.0, decay: float = 1.0,
               slots: int = 32) -> DecayedAcceptance:
        """The estimator of one source of guesses, made with this prior on first use."""
        found = self.acceptance.get(key)
        if found is None:
            found = self.acceptance[key] = DecayedAcceptance(prior, weight, decay, slots)
        return found

    def ema(self, name: str) -> Ema:
        """The running average ``name``, made on first use (to update it)."""
        return self.emas.setdefault(name, Ema())

    def ema_value(self, name: str) -> float | None:
        """The value of the running average ``name`` (None before its first sample): a query, never makes one."""
        found = self.emas.get(name)
        return found.value if found is not None else None

    def confidence_bins(self, bins: int, decay: float = 1.0) -> DecayedAcceptance:
        """P(a draft token is accepted) per bin of the draft's own confidence in it (no prior of its own: each
        lookup gives the bin's confidence as the prior), made on first use."""
        if self.calibration is None:
            self.calibration = DecayedAcceptance(prior=0.0, decay=decay, slots=bins)
        return self.calibration

    def draft_seconds(self, rows: int) -> float | None:
        """Seconds of one draft step over ``rows`` rows: measured at that many, or the most rows measured scaled
        as the profiled draft step grows by rows (without a profile, as the target's t(n) grows); None before
        any draft step was measured or seeded.

        >>> estimates = Estimates()
        >>> estimates.draft_step.observe(1, 0.05); estimates.forward.observe(1, 0.2); estimates.forward.observe(8, 0.21)
        >>> estimates.draft_seconds(8)  # scaled like the target's flat t(n): a guess
        0.0525
        >>> estimates.draft_rows = ForwardCost.from_table({1: 0.04, 2: 0.044, 4: 0.08, 8: 0.09})  # profiled
        >>> estimates.draft_seconds(8), estimates.draft_seconds(3)
        (0.1125, 0.0775)
        """
        return self.draft_step.scaled(rows, like=self._draft_growth())

    def tree_draft_seconds(self, inputs: int) -> float | None:
        """Seconds of a tree's draft forward over ``inputs`` inputs (every row's frontier at one depth): as tree
        rounds measured it (scaled past the widest measured as ``draft_seconds`` scales), else a chain's step
        over as many inputs (``draft_seconds``: a tree not grown yet is priced as a chain's steps, once).

        A tree's depth reads its frontier at slots of its own, under a 4-D mask (the store's general path); a
        chain's step continues the last written slot (the store's fast lane, ``KVStore.lane_steps``), which costs
        less at the same width: one estimator for both would price a tree with the chain's step, and, once a
        tree has run, the chain with the tree's.

        >>> estimates = Estimates()
        >>> estimates.draft_step.observe(1, 0.01)
        >>> estimates.tree_draft_seconds(1)  # no tree yet: a chain's step
        0.01
        >>> estimates.tree_step.observe(1, 0.018)
        >>> estimates.tree_draft_seconds(1), estimates.draft_seconds(1)  # each as measured
        (0.018, 0.01)
        """
        if not self.tree_step.largest:
            return self.draft_seconds(inputs)
        return self.tree_step.scaled(inputs, like=self._draft_growth())

    def _draft_growth(self) -> ForwardCost:
        """How a draft forward grows past the widest measured: the profile's draft step by rows, else the target's
        t(n)."""
        return self.draft_rows if self.draft_rows.largest else self.forward


def reads_wait(device: torch.device) -> bool:
    """Does reading a value the model computed on ``device`` back to the host wait for the device's queue? On a
    GPU (CUDA, and every accelerator torch queues kernels on) the host runs ahead of the kernels it launched, and a
    read stops it until they have run: a round that reads after every draft step cannot launch the next one
    early. On a CPU each op has run when it returns, and a read costs only itself.

    >>> reads_wait(torch.device("cpu")), reads_wait(torch.device("cuda", 0))
    (False, True)
    """
    return device.type != "cpu"


# -- offline measurement --------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def forward_times(model, prefix_ids: torch.LongTensor, sizes: Sequence[int], repeats: int = 5,
                  head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[int, float]:
    """Median seconds of one forward over n new tokens on top of a cached prefix (``prefix_ids``: [1, L]), per n.

    The cache is rolled back to the prefix after every timed forward; repeats are interleaved over n so that
    drift (other processes, clocks) spreads evenly over the sizes, and the first pass is a warm-up. CUDA work
    is synchronised before each clock read. ``head``: the output layer the forwards use instead of the model's
    (``cache.call_model``; a draft's narrowed head).
    """
    from . import cache as kv  # the one place that touches caches

    device = next(model.parameters()).device
    prefix_ids = prefix_ids.to(device)
    cache = kv.new_cache(model)
    kv.call_model(model, prefix_ids, cache, head=head)
    base = prefix_ids.shape[1]
    times: dict[int, list[float]] = {int(n): [] for n in sizes}
    for repeat in range(repeats + 1):
        for n in times:
            ids = prefix_ids[:, -1:].repeat(1, n)
            _sync(device)
            start = time.perf_counter()
            kv.call_model(model, ids, cache, logits_at=n, head=head)
            _sync(device)
            if repeat:
                times[n].append(time.perf_counter() - start)
            kv.rollback(cache, base)
    return {n: statistics.median(samples) for n, samples in times.items()}
