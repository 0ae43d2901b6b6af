"""How many tokens to draft next: the draft-length policies.

A policy answers two questions for the loop and learns from every round:

- ``next_k(budget)``: the most draft tokens for this round (0 = a plain target step, speculation off);
- ``keep_drafting(i, confidence)``: after the drafter produced its i-th token with probability ``confidence``
  under the draft's own processed distribution, should it draft token i+1?
- ``observe(...)``: what the round cost and how much of it the target accepted.

Policies:

``FixedPolicy``      always k.
``HeuristicPolicy``  transformers' ``num_assistant_tokens_schedule="heuristic"``: k += 2 after a round in which
                     every draft token was accepted, else k = max(1, k - 1). Kept as a reference. (transformers
                     also adds 2 after a round that drafted nothing; that quirk is not copied.)
``AdaptivePolicy``   the default, a cost model fed by measurements.

The adaptive rule
-----------------
Let a_j be the probability that draft position j is accepted given that positions 1..j-1 were (estimated
online from exponentially decayed counts with a Beta prior), t_d the measured time of one draft forward and
t_v(n) the measured time of a target forward over n new tokens. A round that drafts k tokens emits on average

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j          tokens and costs    T(k) = k * t_d + t_v(k + 1),

and a plain step (k = 0) emits 1 token in t_v(1). Each round picks

    k* = argmax_{0 <= k <= budget}  E(k) / T(k)      (expected tokens per second).

t_v is measured, never assumed: on a CPU in bf16 t_v(1..8) is nearly flat, in fp32 it roughly doubles, on a GPU
it is flat much further. Estimates are made monotone in n >= 2 (a sample at m >= n bounds t_v(n) from above;
t_v(1), a matrix-vector step that can cost more than a few-row product, is taken as measured),
interpolated linearly between measured sizes and held flat beyond the largest (optimistic, so the policy tries a
longer draft once and learns its cost). When k* = 0 speculation is off; every ``probe_interval`` plain rounds one round drafts
anyway so that the estimates can recover when the text becomes predictable again.

With ``confidence_stop`` (the default) k* only decides whether to speculate at all; a speculating round may
then run up to ``max_draft_tokens`` and stops where the draft's confidence says the next token is not worth its
cost. With P_i the (calibrated) probability that draft tokens 1..i are all accepted, the round so far is worth
E_i = 1 + sum_{j<=i} P_j tokens for T_i = i t_d + t_v(i+1). Token i+1 adds about P_i * a_{i+1} tokens for
t_d + t_v(i+2) - t_v(i+1) more time, with a_{i+1} predicted by the calibrated confidence of token i
(confidence comes in stretches), so drafting goes on only while

    P_i * a_{i+1} / (t_d + t_v(i+2) - t_v(i+1))  >  E_i / T_i .

After the draft, ``free_tokens`` picks how many prompt-lookup tokens (the continuation that followed the same
tokens earlier in the prompt or output) to append: lookup token j adds P_k * prod_{l<=j} beta_l expected tokens,
with beta_l learned from decayed counts like a_j, and the count m maximises the round's E / T with the measured
t_v(k + 1 + m). When the history alone offers a continuation whose expected rate (same beta_l, measured
t_v) beats the best draft round, the round verifies that continuation without running the draft at all
(``prefer_lookup``): in an edit that copies its input, the draft's forwards are pure cost.

P_i multiplies calibrated confidences: the draft's probability of its own token, mapped to an acceptance
probability through online per-bin acceptance counts (10 bins, Beta prior centred on the raw confidence).
"""

from __future__ import annotations

import math
from typing import Protocol

from .config import SpecConfig


class DraftLengthPolicy(Protocol):
    def next_k(self, budget: int) -> int: ...

    def keep_drafting(self, num_drafted: int, confidence: float) -> bool: ...

    def observe(self, drafted: int, accepted: int, draft_time: float, draft_forwards: int,
                verify_tokens: int, verify_time: float) -> None: ...

    def free_tokens(self, num_tokens: int, limit: int) -> int: ...

    def observe_lookup(self, appended: int, accepted: int) -> None: ...

    def prefer_lookup(self, num_lookup: int) -> bool: ...


class FixedPolicy:
    needs_confidence = False

    def __init__(self, k: int) -> None:
        self.k = k

    def next_k(self, budget: int) -> int:
        return min(self.k, budget)

    def keep_drafting(self, num_drafted: int, confidence: float) -> bool:
        return True

    def observe(self, drafted, accepted, draft_time, draft_forwards, verify_tokens, verify_time) -> None:
        pass

    def free_tokens(self, num_tokens: int, limit: int) -> int:
        return 0

    def observe_lookup(self, appended: int, accepted: int) -> None:
        pass

    def prefer_lookup(self, num_lookup: int) -> bool:
        return False


class HeuristicPolicy(FixedPolicy):
    def __init__(self, k: int, max_k: int) -> None:
        super().__init__(k)
        self.max_k = max_k

    def observe(self, drafted, accepted, draft_time, draft_forwards, verify_tokens, verify_time) -> None:
        if drafted == 0:
            return
        self.k = min(self.max_k, self.k + 2) if accepted == drafted else max(1, self.k - 1)


class Ema:
    """Exponential moving average that starts at its first sample."""

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

    t(1) stands on its own: a one-token forward runs matrix-vector products, which can cost more than a product
    over a few rows (measured on this project's CPU in bf16, oneDNN: 0.22 s for one token, 0.19 s for two, 0.21 s
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
    """

    def __init__(self) -> None:
        self._by_size: dict[int, Ema] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._by_size.setdefault(int(num_tokens), Ema()).update(seconds)

    def measured(self, num_tokens: int) -> bool:
        return int(num_tokens) in self._by_size

    @property
    def largest(self) -> int:
        """The largest size measured so far (0 before any measurement)."""
        return max(self._by_size, default=0)

    def estimate(self, n: int, extrapolate: bool = False) -> float | None:
        """Seconds for a forward over n new tokens; None before anything was measured."""
        if not self._by_size:
            return None
        sizes = sorted(self._by_size)
        bounded, running = {}, float("inf")
        for m in reversed(sizes):
            running = min(running, self._by_size[m].value) if m >= 2 else self._by_size[m].value
            bounded[m] = running
        if n <= sizes[0]:
            return bounded[sizes[0]]
        if n >= sizes[-1]:
            if extrapolate and len(sizes) >= 2:  # continue the slope of the two largest measured sizes
                slope = (bounded[sizes[-1]] - bounded[sizes[-2]]) / (sizes[-1] - sizes[-2])
                return round(bounded[sizes[-1]] + max(0.0, slope) * (n - sizes[-1]), 12)
            return bounded[sizes[-1]]
        high = next(m for m in sizes if m >= n)
        low = max(m for m in sizes if m <= n)
        if high == low:
            return bounded[n]
        return round(bounded[low] + (bounded[high] - bounded[low]) * (n - low) / (high - low), 12)


class AdaptivePolicy:
    needs_confidence = True
    NUM_BINS = 10

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.max_k = config.max_draft_tokens
        self.initial_k = config.num_draft_tokens
        # decayed acceptance counts per draft position (index 0 = position 1), Beta(2, 1) prior
        self.reached = [0.0] * self.max_k
        self.kept = [0.0] * self.max_k
        # calibration of draft confidence: per confidence bin, decayed (accepted, seen) counts
        self.bin_kept = [0.0] * self.NUM_BINS
        self.bin_seen = [0.0] * self.NUM_BINS
        self.round_confidences: list[float] = []
        self.lookup_reached = [0.0] * self.MAX_LOOKUP  # prompt-lookup tokens after the draft, per position
        self.lookup_kept = [0.0] * self.MAX_LOOKUP
        self.draft_forward_time = Ema()
        self.verify_cost = ForwardCost()
        self.plain_rounds_in_a_row = 0

    # -- estimates ----------------------------------------------------------------------------------------------
    def alpha(self, position: int) -> float:
        """P(draft position ``position`` (1-based) accepted | all before it accepted)."""
        i = min(position, self.max_k) - 1
        return (self.kept[i] + 2.0) / (self.reached[i] + 3.0)

    def calibrated(self, confidence: float) -> float:
        b = min(int(confidence * self.NUM_BINS), self.NUM_BINS - 1)
        return (self.bin_kept[b] + 2.0 * confidence) / (self.bin_seen[b] + 2.0)

    def t_verify(self, n: int, extrapolate: bool = False) -> float | None:
        """Verify time for n new tokens (``ForwardCost.estimate``)."""
        return self.verify_cost.estimate(n, extrapolate)

    def expected_rate(self, k: int) -> float | None:
        """E(k) / T(k) in tokens per second, None before anything was measured."""
        t_d = self.draft_forward_time.value
        t_v = self.t_verify(k + 1)
        if t_v is None or (k > 0 and t_d is None):
            return None
        emitted, prefix = 1.0, 1.0
        for position in range(1, k + 1):
            prefix *= self.alpha(position)
            emitted += prefix
        return emitted / (k * (t_d or 0.0) + t_v)

    # -- decisions ------------------------------------------------------------------------------------------------
    def next_k(self, budget: int) -> int:
        self.round_confidences = []
        budget = min(budget, self.max_k)
        if budget <= 0:
            return 0
        if not self.verify_cost.measured(1):  # measure a plain step first: every other choice is compared to it
            return 0
        if self.draft_forward_time.value is None:
            return min(self.initial_k, budget)
        rates = [self.expected_rate(k) for k in range(budget + 1)]
        best_k = max(range(budget + 1), key=lambda k: rates[k] if rates[k] is not None else -1.0)
        if best_k == 0 and self.plain_rounds_in_a_row >= self.config.probe_interval:
            best_k = max(range(1, budget + 1), key=lambda k: rates[k] or -1.0)  # probe
        if best_k > 0 and self.config.confidence_stop:
            # speculation pays: let the round run up to the cap and let the in-round rule (keep_drafting),
            # which sees each token's confidence, decide where this round stops
            return budget
        return best_k

    def keep_drafting(self, num_drafted: int, confidence: float) -> bool:
        self.round_confidences.append(confidence)
        if not self.config.confidence_stop or num_drafted >= self.max_k:
            return True
        t_d = self.draft_forward_time.value
        if t_d is None:
            return True
        all_kept, emitted = 1.0, 1.0
        for c in self.round_confidences:
            all_kept *= self.calibrated(c)
            emitted += all_kept
        t_now = self.t_verify(num_drafted + 1)
        t_next = self.t_verify(num_drafted + 2)
        if t_now is None or t_next is None:
            return True
        # the next token's acceptance is predicted by the calibrated confidence of the latest one (confidence
        # runs in stretches: boilerplate is confidently right, a new identifier is not)
        gain = all_kept * self.calibrated(self.round_confidences[-1])
        extra_time = t_d + max(0.0, t_next - t_now)
        return gain / extra_time > emitted / (num_drafted * t_d + t_now)

    MAX_LOOKUP = 16

    def lookup_alpha(self, position: int) -> float:
        """P(prompt-lookup token ``position`` accepted | the draft and the lookup tokens before it were)."""
        i = min(position, self.MAX_LOOKUP) - 1
        return (self.lookup_kept[i] + 1.0) / (self.lookup_reached[i] + 2.0)

    def free_tokens(self, num_tokens: int, limit: int) -> int:
        """How many prompt-lookup tokens to append after this round's draft (``num_tokens`` - 1 tokens).

        The m that maximises the round's expected tokens per second: the draft part is worth E_k (from this
        round's calibrated confidences), lookup token j adds P(all before accepted) * beta_j, and the round
        costs k * t_d + t_v(k + 1 + m) with t_v measured.
        """
        t_d, base = self.draft_forward_time.value, self.t_verify(num_tokens)
        if not self.config.history_lookup or t_d is None or base is None:
            return 0
        all_kept, emitted = 1.0, 1.0
        for c in self.round_confidences:
            all_kept *= self.calibrated(c)
            emitted += all_kept
        draft_time = (num_tokens - 1) * t_d
        best, best_rate = 0, emitted / (draft_time + base)
        for extra in range(1, min(limit, self.MAX_LOOKUP) + 1):
            all_kept *= self.lookup_alpha(extra)
            emitted += all_kept
            rate = emitted / (draft_time + self.t_verify(num_tokens + extra, extrapolate=True))
            if rate > best_rate:
                best, best_rate = extra, rate
        return best

    def prefer_lookup(self, num_lookup: int) -> bool:
        """Is a round of ``num_lookup`` prompt-lookup tokens alone (no draft forward) worth more per second than
        the best draft round? (Copying the input, as in edits, the draft is not needed.)"""
        t_verify = self.t_verify(num_lookup + 1, extrapolate=True)
        if not self.config.history_lookup or t_verify is None:
            return False
        emitted, all_kept = 1.0, 1.0
        for position in range(1, num_lookup + 1):
            all_kept *= self.lookup_alpha(position)
            emitted += all_kept
        draft_rates = [self.expected_rate(k) or 0.0 for k in range(1, self.max_k + 1)]
        return emitted / t_verify > max(draft_rates, default=0.0)

    def observe_lookup(self, appended: int, accepted: int) -> None:
        """A round whose draft tokens were all accepted judged ``appended`` lookup tokens, keeping ``accepted``."""
        for i in range(min(appended, accepted + 1, self.MAX_LOOKUP)):
            self.lookup_reached[i] += 1.0
            if i < accepted:
                self.lookup_kept[i] += 1.0

    # -- learning -------------------------------------------------------------------------------------------------
    def observe(self, drafted, accepted, draft_time, draft_forwards, verify_tokens, verify_time) -> None:
        self.verify_cost.observe(verify_tokens, verify_time)
        if drafted == 0:
            self.plain_rounds_in_a_row += 1
            return
        self.plain_rounds_in_a_row = 0
        if draft_forwards:
            self.draft_forward_time.update(draft_time / draft_forwards)
        decay = self.config.decay
        self.reached = [x * decay for x in self.reached]
        self.kept = [x * decay for x in self.kept]
        for i in range(min(drafted, accepted + 1)):  # positions the target actually judged
            self.reached[i] += 1.0
            if i < accepted:
                self.kept[i] += 1.0
        self.lookup_reached = [x * decay for x in self.lookup_reached]
        self.lookup_kept = [x * decay for x in self.lookup_kept]
        self.bin_seen = [x * decay for x in self.bin_seen]
        self.bin_kept = [x * decay for x in self.bin_kept]
        for i, c in enumerate(self.round_confidences[: accepted + 1]):
            b = min(int(c * self.NUM_BINS), self.NUM_BINS - 1)
            self.bin_seen[b] += 1.0
            if i < accepted:
                self.bin_kept[b] += 1.0


def make_policy(config: SpecConfig) -> DraftLengthPolicy:
    if config.policy == "fixed":
        return FixedPolicy(config.num_draft_tokens)
    if config.policy == "heuristic":
        return HeuristicPolicy(config.num_draft_tokens, config.max_draft_tokens)
    return AdaptivePolicy(config)


def speedup_bound(alpha: float, c: float, k: int) -> float:
    """Leviathan et al. Thm 3.8: expected speedup for i.i.d. acceptance ``alpha``, cost ratio ``c``, flat v."""
    if alpha >= 1.0:
        return (k + 1) / (1 + k * c)
    return (1 - math.pow(alpha, k + 1)) / ((1 - alpha) * (1 + k * c))
