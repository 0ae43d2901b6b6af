"""Every sizing decision: how many tokens to draft, when to stop drafting, how many lookup tokens, which trie
nodes, how wide the Jacobi window. The policy answers one question per round and learns from every round:

- ``plan(views, offers) -> [RoundPlan]``: the sizes of this round for each row of the batch (``round.py``), from
  what the drafter offers and what was measured; a plan with nothing in it is a plain target step (speculation
  off);
- ``observe(outcomes)``: what the round cost and what the target kept in each row (the same ``RoundOutcome``s
  the stats and the drafter get).

With B rows in a batch, every forward reads all of them: a round of n inputs per row costs t(B n), which grows
with B much sooner than with n alone, so every rule below prices a row's guesses at t(B n) (for one row,
t(n)) and the draft model's step at t_d of the batched draft forward. The acceptance estimates are shared by
the rows (they are drawn from one text distribution). A batch drafts one k for all its rows (no confidence
stop, no prompt-lookup rounds or tails): the draft steps until its longest row stops and the forward is padded
to its widest row, and one k measured faster than per-row lengths at every B > 1.

Policies:

``FixedPolicy``      always k draft-model tokens.
``HeuristicPolicy``  transformers' ``num_assistant_tokens_schedule="heuristic"``: k += 2 after a round in which
                     every draft token was accepted, else k = max(1, k - 1). Kept as a reference. (transformers
                     also adds 2 after a round that drafted nothing; that quirk is not copied.)
``AdaptivePolicy``   the default for a draft model: expected tokens per second from measured costs.
``TreePolicy``       lookahead: the trie nodes and the window that maximise expected tokens per second.

Every rule is the same argmax (``costmodel.best_count``) over the same estimates (``costmodel.Estimates``):
a_i, the chance that guess i of a source is accepted given the ones before it were (``DecayedAcceptance``),
t(n), the measured seconds of a target forward over n new tokens (``ForwardCost``), and t_d, the measured
seconds of one draft-model step.

The adaptive rule
-----------------
A round that drafts k tokens emits on average E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens in
T(k) = k t_d + t(k + 1); a plain step (k = 0) emits 1 token in t(1). k* = argmax E(k) / T(k) over 0..budget.
t is measured, never assumed: on a CPU with bf16 units t(1..8) is nearly flat, in fp32 it roughly doubles, on a
GPU it is flat much further. When k* = 0 speculation is off; every ``probe_interval`` plain rounds one round
drafts anyway so that the estimates can recover when the text becomes predictable again.

With ``confidence_stop`` (the default) k* only decides whether to speculate at all; a speculating round may
then run up to ``max_draft_tokens`` and stops where the draft's confidence says the next token is not worth its
cost (``AdaptiveChainRule.keep_drafting``). With P_i the calibrated probability that draft tokens 1..i are all
accepted, the round so far is worth E_i = 1 + sum_{j<=i} P_j tokens for T_i = i t_d + t(i+1). Token i+1 adds
about P_i * a_{i+1} tokens for t_d + t(i+2) - t(i+1) more time, with a_{i+1} predicted by the calibrated
confidence of token i (confidence comes in stretches), so drafting goes on only while

    P_i * a_{i+1} / (t_d + t(i+2) - t(i+1))  >  E_i / T_i .

P_i multiplies calibrated confidences: the draft's probability of its own token, mapped to an acceptance
probability through decayed per-bin acceptance counts (10 bins, Beta prior centred on the raw confidence).

After the draft, prompt lookup may append the continuation that followed the same tokens earlier in the prompt
or output: lookup token j adds P_k * prod_{l<=j} b_l expected tokens (b_l learned like a_j), and the count m
maximises the round's E / T with the measured t(k + 1 + m) (``lookup_tokens``). When the history alone offers a
continuation whose expected rate beats the best draft round, the round verifies that continuation without
running the draft at all: in an edit that copies its input, the draft's forwards are pure cost.

The in-round parts are a value (``AdaptiveChainRule``, frozen, made by ``plan``) that the drafter reads: it
never reaches the policy, and the policy learns the round's confidences from the proposal, not from calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from .config import LookaheadConfig, SpecConfig
from .costmodel import (Bound, DecayedAcceptance, Estimates, ForwardPrice, Regret, best_count, best_round,
                        prefix_gains)
from .layout import merge_candidates
from .round import Candidate, Offer, RoundOutcome, RoundPlan, RowView, SourceKind, prior_acceptance

PLAIN = RoundPlan()


class Policy(Protocol):
    def plan(self, views: Sequence[RowView], offers: Sequence[Offer]) -> list[RoundPlan]:
        """The sizes of each row's next round (``view.budget``: the most tokens it may propose)."""

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        """Learn from one round: one outcome per row."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target read the call's prompts (``tokens``: rows x padded width) in ``seconds`` (round 0)."""


def judged_slots(outcomes: Sequence[RoundOutcome], kind: SourceKind) -> list[tuple[int, bool]]:
    """(position, kept) of every judged token offered by a source of this ``kind`` (see ``Source``), all rows."""
    slots = []
    for outcome in outcomes:
        kept, judged = set(outcome.accepted), outcome.judged()
        slots += [(source.position, node in kept)
                  for node, sources in enumerate(outcome.proposal.sources) if judged[node]
                  for source in sources if source.kind == kind]
    return slots


# ----------------------------------------------------------------------------------------------------------------
# Draft-model policies
# ----------------------------------------------------------------------------------------------------------------


class FixedPolicy:
    def __init__(self, k: int) -> None:
        self.k = k

    def plan(self, views: Sequence[RowView], offers: Sequence[Offer]) -> list[RoundPlan]:
        return [RoundPlan(model_tokens=min(self.k, view.budget, offer.model_tokens), max_tokens=view.budget)
                for view, offer in zip(views, offers)]

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        pass

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        pass


class HeuristicPolicy(FixedPolicy):
    """+2 after a round in which every row kept all it drafted, else -1 (one k for the batch)."""

    def __init__(self, k: int, max_k: int) -> None:
        super().__init__(k)
        self.max_k = max_k

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        drafted = [outcome for outcome in outcomes if outcome.proposal.draft_forwards]
        if not drafted:
            return
        all_kept = all(outcome.num_accepted == outcome.proposal.num_tokens for outcome in drafted)
        self.k = min(self.max_k, self.k + 2) if all_kept else max(1, self.k - 1)


@dataclass(frozen=True)
class AdaptiveChainRule:
    """The in-round rules of one adaptive round, over a snapshot of the estimates (see the module docstring).

    t_step: the round's price (``ForwardPrice``, ``Bound.EXPECTED``) of a forward over n = 1.. inputs (index
    n - 1); t_extrapolated: the same at ``Bound.WORST``; bin_kept / bin_judged: the confidence calibration counts;
    lookup_rates: b_1..b_m.
    """

    t_draft: float | None
    t_step: tuple[float | None, ...]
    t_extrapolated: tuple[float | None, ...]
    bin_kept: tuple[float, ...]
    bin_judged: tuple[float, ...]
    lookup_rates: tuple[float, ...]
    confidence_stop: bool
    max_tokens: int

    def calibrated(self, confidence: float) -> float:
        """P(accepted) of a draft token the draft gave probability ``confidence`` (Beta prior weight 2)."""
        b = min(int(confidence * len(self.bin_kept)), len(self.bin_kept) - 1)
        return (self.bin_kept[b] + 2.0 * confidence) / (self.bin_judged[b] + 2.0)

    def _t(self, n: int, extrapolate: bool = False) -> float | None:
        table = self.t_extrapolated if extrapolate else self.t_step
        return table[min(n, len(table)) - 1]

    def _worth(self, confidences: Sequence[float]) -> tuple[float, float]:
        """(P(all drafted tokens accepted), expected tokens of the chain so far)."""
        gains = prefix_gains([self.calibrated(c) for c in confidences])
        return (gains[-1] if gains else 1.0), 1.0 + sum(gains)

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        n = len(confidences)
        if not self.confidence_stop or n >= self.max_tokens or self.t_draft is None or not confidences:
            return True
        t_now, t_next = self._t(n + 1), self._t(n + 2)
        if t_now is None or t_next is None:
            return True
        all_kept, emitted = self._worth(confidences)
        gain = all_kept * self.calibrated(confidences[-1])
        extra_time = self.t_draft + max(0.0, t_next - t_now)
        if extra_time <= 0.0:  # one more token costs nothing measurable: it can only add
            return True
        return gain / extra_time > emitted / (n * self.t_draft + t_now)

    def lookup_tokens(self, confidences: Sequence[float]) -> int:
        if self.t_draft is None or not self.lookup_rates:
            return 0
        n = len(confidences) + 1  # the forward reads the last token and the drafted ones
        if self._t(n) is None:
            return 0
        all_kept, emitted = self._worth(confidences)
        draft_time = len(confidences) * self.t_draft

        def seconds(m: int) -> float | None:
            t = self._t(n) if m == 0 else self._t(n + m, extrapolate=True)
            return None if t is None else draft_time + t

        gains = [all_kept * g for g in prefix_gains(self.lookup_rates)]
        return best_count(gains, seconds, base=emitted)


READ_NOT_REPAID = "draft prompt read not repaid"


@dataclass(frozen=True)
class Decision:
    """What ``AdaptivePolicy`` decided for a round before per-row details: k (0: a plain step), whether it is a
    probe, and why a plain step was chosen."""

    k: int
    probe: bool = False
    why: str = ""


class Exploration:
    """When speculation that does not pay is tried again: the regret account and the probe schedule, in one place.

    A probe drafts although the estimates say it does not pay, so that they can recover when the text becomes
    predictable again. One is due every ``interval`` plain rounds in a row, and it runs only while what it may
    lose fits in the regret budget (``Regret``); each probe after which drafting still does not pay doubles the
    interval, and a round that drafts because it pays resets it. Queries (``due``, ``regret.allows``) never
    change state; ``observe`` does, once per round.

    >>> exploration = Exploration(Regret(0.03), interval=2)
    >>> exploration.observe(drafted=False, probe=False, pays=False); exploration.due()
    False
    >>> exploration.observe(drafted=False, probe=False, pays=False); exploration.due()
    True
    >>> exploration.observe(drafted=True, probe=True, pays=False); exploration.interval  # the probe did not pay
    4
    """

    MAX_INTERVAL = 1024

    def __init__(self, regret: Regret, interval: int) -> None:
        self.regret, self.start_interval, self.interval = regret, interval, interval
        self.plain_in_a_row = 0

    def due(self) -> bool:
        return self.plain_in_a_row >= self.interval

    def observe(self, drafted: bool, probe: bool, pays: bool) -> None:
        """One round: did it draft, was it a probe, does drafting pay now that it was learned from."""
        self.plain_in_a_row = 0 if drafted else self.plain_in_a_row + 1
        if probe and not pays:
            self.interval = min(self.MAX_INTERVAL, 2 * self.interval)
        elif drafted:
            self.interval = self.start_interval


class AdaptivePolicy:
    """k from expected tokens per second; an in-round confidence stop; prompt-lookup tails and lookup-only
    rounds (module docstring)."""

    NUM_BINS = 10  # confidence calibration bins
    MAX_LOOKUP = 16  # longest prompt-lookup tail after the draft model's tokens
    LEADING_LOOKUP = 10  # longest lookup-only round (transformers' prompt lookup uses 10)

    def __init__(self, config: SpecConfig, estimates: Estimates | None = None) -> None:
        self.config = config
        self.max_k = config.max_draft_tokens
        self.estimates = estimates if estimates is not None else Estimates()
        # P(draft position i accepted | the ones before were): Beta(2, 1) prior; lookup tokens: Beta(1, 1)
        self.draft = self.estimates.source((SourceKind.DRAFT, 0), prior=prior_acceptance((SourceKind.DRAFT, 0)),
                                           weight=3.0, decay=config.decay, slots=self.max_k)
        self.lookup = self.estimates.source((SourceKind.LOOKUP, 0), prior=prior_acceptance((SourceKind.LOOKUP, 0)),
                                            decay=config.decay, slots=self.MAX_LOOKUP)
        self.calibration = self.estimates.confidence_bins(self.NUM_BINS, decay=config.decay)
        # what probing lost against plain decoding in this call: a probe pays the draft's prompt read, and credit
        # earned at other batch sizes or prompts says nothing of that bet (carried, it paid a read at B = 8)
        self.exploration = Exploration(Regret(config.max_regret), config.probe_interval)
        self.estimates.draft_read.start_call()
        self.prefill: tuple[int, float] | None = None  # (tokens, seconds) of the target's read of this call's prompts

    @property
    def regret(self) -> Regret:
        return self.exploration.regret

    # -- prices -------------------------------------------------------------------------------------------------
    def price(self, rows: int = 1) -> ForwardPrice:
        """The one price of this round's forward for ``rows`` rows (``costmodel.ForwardPrice``)."""
        return ForwardPrice(self.estimates.forward, rows, self.regret.allowance(), self.estimates.draft_seconds(rows))

    def read_seconds(self, setup_tokens: int) -> float:
        """What the draft reading ``setup_tokens`` prompt tokens would cost: its learned share of the target's
        read of this call's prompts, per token past them (0 once read, or while nothing prices it: the first call
        that drafts measures it)."""
        if not setup_tokens or self.prefill is None:
            return 0.0
        tokens, seconds = self.prefill
        return self.estimates.draft_read.estimate(seconds * max(1.0, setup_tokens / max(tokens, 1))) or 0.0

    def _best_draft_rate(self, price: ForwardPrice) -> float:
        """The best expected tokens per second of a round that drafts 1..max_k tokens."""
        gains = prefix_gains(self.draft.rates(self.max_k))
        rates = [(1 + sum(gains[:k])) / t for k in range(1, self.max_k + 1) if (t := price.round(k)) is not None]
        return max(rates, default=0.0)

    def _prefer_lookup(self, price: ForwardPrice, num_lookup: int) -> bool:
        """Is a round of ``num_lookup`` prompt-lookup tokens alone (no draft forward) worth more per second than
        the best draft round? (Copying the input, as in edits, the draft is not needed.)"""
        t_v = price(num_lookup + 1, Bound.WORST)
        if t_v is None:
            return False
        return (1 + sum(prefix_gains(self.lookup.rates(num_lookup)))) / t_v > self._best_draft_rate(price)

    def rule(self, price: ForwardPrice | None = None) -> AdaptiveChainRule:
        price = price if price is not None else self.price()
        longest = self.max_k + 2 + self.MAX_LOOKUP
        lookup = self.config.history_lookup and price.rows == 1
        return AdaptiveChainRule(
            t_draft=price.t_draft, t_step=price.table(longest), t_extrapolated=price.table(longest, Bound.WORST),
            bin_kept=tuple(self.calibration.kept), bin_judged=tuple(self.calibration.judged),
            lookup_rates=tuple(self.lookup.rates(self.MAX_LOOKUP)) if lookup else (),
            confidence_stop=self._confidence_stop(price.rows), max_tokens=self.max_k,
        )

    # -- decisions (queries: nothing here changes state) ----------------------------------------------------------
    def plan(self, views: Sequence[RowView], offers: Sequence[Offer]) -> list[RoundPlan]:
        rows = len(views)
        price = self.price(rows)
        room = [view.budget for view in views]
        budget = min(self.max_k, max(min(view.budget, offer.model_tokens) for view, offer in zip(views, offers)))
        if rows > 1:  # a B x (k + 1) forward grows with B long before it does at B = 1: rounds grow to at most
            # twice the largest forward measured so far
            budget = min(budget, max(1, 2 * self.estimates.forward.largest // rows - 1))
        decision = self.decide(price, budget, max(room, default=0), sum(offer.setup_tokens for offer in offers))
        if decision.k == 0:
            return [RoundPlan(max_tokens=r, why=decision.why) for r in room]
        if price.t_draft is None:  # t_d unknown: draft the starting k once, measure it
            return [RoundPlan(model_tokens=min(decision.k, r), max_tokens=r, probe=decision.probe) for r in room]
        rule, plans = self.rule(price), []
        lookup = self.config.history_lookup and rows == 1
        for view, offer in zip(views, offers):
            leading = next((c for c in offer.candidates if c.source == (SourceKind.LOOKUP, 0)), None)
            if lookup and leading is not None and self._prefer_lookup(price, len(leading.tokens[: self.LEADING_LOOKUP])):
                plans.append(RoundPlan(candidates=(Candidate(leading.tokens[: self.LEADING_LOOKUP], leading.source),),
                                       max_tokens=view.budget))
            else:
                plans.append(RoundPlan(model_tokens=min(decision.k, view.budget, offer.model_tokens),
                                       max_tokens=view.budget, rule=rule, probe=decision.probe))
        return plans

    def _saved(self, price: ForwardPrice, k: int, gains: Sequence[float], remaining: int) -> float:
        """Seconds drafting k a round saves over the ``remaining`` tokens against plain steps, every row advancing
        together: remaining x (t(1) - T(k) / E[tokens a round]), T(k) at its worst (the read cannot be undone)."""
        return remaining * (price.step() - price.round(k, bound=Bound.WORST) / (1 + sum(gains[:k])))

    def decide(self, price: ForwardPrice, budget: int, remaining: int, setup_tokens: int) -> Decision:
        """The most draft-model tokens this round: 0 (a plain step, with why) while t(1) or the draft's worth is
        unknown or does not pay, or while the draft has not read the prompts and the ``remaining`` tokens cannot
        repay ``setup_margin`` times reading them; with ``confidence_stop`` the cap (the in-round rule decides),
        else k*.

        >>> policy = AdaptivePolicy(SpecConfig(confidence_stop=False))  # setup_margin=2.0
        >>> policy.estimates.forward.observe(1, 0.10); policy.estimates.forward.observe(4, 0.12)
        >>> policy.estimates.draft_step.observe(1, 0.02); policy.estimates.draft_read.ratio.update(0.25)
        >>> policy.observe_prefill(tokens=200, seconds=4.0)  # the draft would read it in 1 s
        >>> [policy.decide(policy.price(), 3, remaining, 200).k for remaining in (64, 128)]  # k* = 2 a round
        [0, 2]
        >>> policy.decide(policy.price(), 3, 64, 200).why
        'draft prompt read not repaid: 1.00 s to read, ~1.75 s saved over the 64 tokens left'
        """
        if budget <= 0:
            return Decision(0, why="no room left: the length limit")
        if not self.estimates.forward.measured(price.rows):
            return Decision(0, why="a plain step first: the reference of every other size")
        if price.t_draft is None:
            return Decision(min(self.config.num_draft_tokens, budget))
        gains = prefix_gains(self.draft.rates(budget))
        best = best_round(price, gains, budget)
        best_k = best.k if best is not None else 0
        read = self.read_seconds(setup_tokens)
        if best_k > 0:
            saved = self._saved(price, best_k, gains, remaining) if read else 0.0
            if read and saved <= self.config.setup_margin * read:
                return Decision(0, why=f"{READ_NOT_REPAID}: {read:.2f} s to read, ~{saved:.2f} s saved "
                                       f"over the {remaining} tokens left")
            # with confidence_stop, speculation pays: the round may run to the cap, and the in-round rule, which
            # sees each token's confidence, decides where it stops
            return Decision(budget if self._confidence_stop(price.rows) else best_k)
        step, one = price.step(), price.round(1)
        if self.exploration.due() and one is not None and self.regret.allows(one - step + read):
            probe = 1 + best_count(gains[1:], lambda n: price.round(n + 1), budget - 1, base=1 + gains[0])
            return Decision(probe, probe=True)  # the best round that drafts at all
        return Decision(0, why=f"drafting does not pay: {self._best_draft_rate(price):.1f} tok/s expected, "
                               f"{1 / step if step else 0.0:.1f} plain")

    # The confidence stop and prompt lookup (tails, lookup-only rounds) size each row apart, which pays for one
    # row. In a batch the draft steps until its longest row stops and the forward is padded to its widest row,
    # so one k for the batch (k*) measured faster at every B > 1 (docs/benchmarks.md, batch runs).
    def _confidence_stop(self, rows: int) -> bool:
        return self.config.confidence_stop and rows == 1

    # -- learning -----------------------------------------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target read this call's prompts (``tokens``, every row's padded width) in ``seconds``."""
        self.prefill = (int(tokens), float(seconds))

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        first = outcomes[0]
        self.estimates.forward.observe(first.forward_tokens, first.verify_time)
        _observe_regret(self.regret, self.estimates, outcomes)
        lookup = judged_slots(outcomes, SourceKind.LOOKUP)
        if lookup:
            self.lookup.observe_slots(lookup)
        forwards = max(outcome.proposal.draft_forwards for outcome in outcomes)
        probe = any(outcome.plan.probe for outcome in outcomes)
        if any(outcome.plan.why.startswith(READ_NOT_REPAID) for outcome in outcomes):
            self.estimates.draft_read.blocked = True
        if forwards:
            self._observe_draft(outcomes, forwards)
        best = best_round(self.price(len(outcomes)), prefix_gains(self.draft.rates(self.max_k))) if probe else None
        pays = best is not None and best.k > 0
        self.exploration.observe(drafted=bool(forwards), probe=probe, pays=pays)

    def _observe_draft(self, outcomes: Sequence[RoundOutcome], forwards: int) -> None:
        proposals = [outcome.proposal for outcome in outcomes]
        setup, setup_tokens = sum(p.setup_time for p in proposals), sum(p.setup_tokens for p in proposals)
        if setup > 0 and setup_tokens and self.prefill is not None:
            tokens, seconds = self.prefill
            self.estimates.draft_read.observe(setup, seconds * max(1.0, setup_tokens / max(tokens, 1)))
        drafting = sum(p.draft_time for p in proposals)  # the batch's, over its rows
        self.estimates.draft_step.observe(len(outcomes), drafting / forwards)
        self.draft.observe_slots(judged_slots(outcomes, SourceKind.DRAFT))
        bins = []
        for outcome in outcomes:
            drafted = judged_slots([outcome], SourceKind.DRAFT)
            bins += [(min(int(c * self.NUM_BINS), self.NUM_BINS - 1) + 1, kept)
                     for c, (_, kept) in zip(outcome.proposal.confidences, drafted)]
        self.calibration.observe_slots(bins)


def _observe_regret(regret: Regret, estimates: Estimates, outcomes: Sequence[RoundOutcome]) -> None:
    """What this round took against what plain decoding would have taken for the tokens it emitted."""
    step = estimates.forward.estimate(len(outcomes))  # a plain step of these rows
    if step is None:
        return
    proposals = [outcome.proposal for outcome in outcomes]
    seconds = outcomes[0].verify_time + sum(p.draft_time + p.setup_time for p in proposals)
    emitted = sum(len(outcome.emitted) for outcome in outcomes)
    regret.observe(seconds, emitted, step / len(outcomes),
                   guessed=any(p.num_tokens or p.draft_forwards or _has_window(p) for p in proposals))


def _has_window(proposal) -> bool:
    """Does the proposal carry Jacobi window inputs (an empty window, W = 1 and N = 2, carries none)?"""
    return proposal.extra is not None and proposal.extra.token_ids.numel() > 0


class CappedPolicy:
    """Another policy's plans, cut to at most ``cap`` guessed tokens per row and no Jacobi window: what the loop
    runs after a round's forward ran out of memory, before it gives up speculation altogether.

    >>> plan = CappedPolicy(FixedPolicy(8), cap=2).plan([RowView(0, None, 16)], [Offer(model_tokens=16)])
    >>> plan[0].model_tokens, plan[0].max_tokens
    (2, 2)
    """

    def __init__(self, policy: Policy, cap: int) -> None:
        self.policy, self.cap = policy, max(1, cap)

    def plan(self, views: Sequence[RowView], offers: Sequence[Offer]) -> list[RoundPlan]:
        return [self._cut(plan) for plan in self.policy.plan(views, offers)]

    def _cut(self, plan: RoundPlan) -> RoundPlan:
        candidates, room = [], self.cap
        for candidate in plan.candidates:  # best first, until the cap is used up
            if room <= 0:
                break
            candidates.append(Candidate(candidate.tokens[:room], candidate.source))
            room -= len(candidates[-1].tokens)
        return dataclasses.replace(plan, model_tokens=min(plan.model_tokens, self.cap),
                                   max_tokens=min(plan.max_tokens, self.cap), candidates=tuple(candidates),
                                   window=(1, 2))

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        self.policy.observe(outcomes)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.policy.observe_prefill(tokens, seconds)


def make_policy(config: SpecConfig, estimates: Estimates | None = None) -> Policy:
    if config.policy == "fixed":
        return FixedPolicy(config.num_draft_tokens)
    if config.policy == "heuristic":
        return HeuristicPolicy(config.num_draft_tokens, config.max_draft_tokens)
    return AdaptivePolicy(config, estimates)


# ----------------------------------------------------------------------------------------------------------------
# Lookahead: a trie of ready-made candidates and a Jacobi window
# ----------------------------------------------------------------------------------------------------------------

def rank_prefixes(candidates: Sequence[tuple[Sequence[int], Sequence[float]]]) -> list[tuple[tuple[int, ...], float]]:
    """Every distinct prefix of the candidates with its gain, best first.

    ``candidates``: (tokens, per-depth acceptance rates). The gain of a prefix is the probability that all of it
    is accepted (the product of its candidate's rates; a prefix shared by several candidates takes the highest),
    i.e. what its last token adds to the expected number of accepted tokens. A parent's gain is never below its
    child's, and ties go to the shorter prefix, so every prefix comes after its parent: the first n prefixes
    always form a trie.

    >>> rank_prefixes([((7, 8, 9), (0.9, 0.5, 0.5)), ((3,), (0.6,))])
    [((7,), 0.9), ((3,), 0.6), ((7, 8), 0.45), ((7, 8, 9), 0.225)]
    """
    gains: dict[tuple[int, ...], float] = {}
    for tokens, rates in candidates:
        tokens = tuple(map(int, tokens))  # once per candidate: its prefixes are slices of it
        for depth, gain in enumerate(prefix_gains(rates[: len(tokens)]), start=1):
            prefix = tokens[:depth]
            if gain > gains.get(prefix, -1.0):
                gains[prefix] = gain
    return sorted(gains.items(), key=lambda item: (-item[1], len(item[0])))


def free_extra_tokens(forward_seconds: Callable[[int], float], used: int, limit: int, tolerance: float) -> int:
    """The most tokens that can join a forward of ``used`` tokens while it stays within ``tolerance`` of its cost.

    >>> free_extra_tokens(lambda n: 1.0 if n <= 8 else 2.0, used=3, limit=20, tolerance=0.15)
    5
    """
    base = forward_seconds(used)
    return max((e for e in range(limit + 1) if forward_seconds(used + e) <= (1.0 + tolerance) * base), default=0)


def window_shape(extra_tokens: int) -> tuple[int, int]:
    """(W, N) spending ``extra_tokens`` on the Jacobi window: off below 5 (W=1, N=2: just the last token), N=3
    below 24 extra tokens, N=4 below 48, else N=5, and as many columns as fit.

    >>> window_shape(3), window_shape(5), window_shape(15), window_shape(30)
    ((1, 2), (3, 3), (8, 3), (10, 4))
    """
    if extra_tokens < 5:
        return 1, 2
    ngram = 3 if extra_tokens < 24 else 4 if extra_tokens < 48 else 5
    return (extra_tokens + 1) // (ngram - 1), ngram


def _truncate_to_trie(candidates: Sequence[Candidate], prefixes: set[tuple[int, ...]]) -> tuple[Candidate, ...]:
    """Each candidate cut to its longest prefix in ``prefixes`` (dropped if none): merged, they are that trie."""
    kept = []
    for candidate in candidates:
        depth = 0
        while depth < len(candidate.tokens) and tuple(candidate.tokens[: depth + 1]) in prefixes:
            depth += 1
        if depth:
            kept.append(Candidate(tuple(candidate.tokens[:depth]), candidate.source))
    return tuple(kept)


class TreePolicy:
    """Lookahead sizing: the trie nodes that maximise expected tokens per second (learned acceptance per source
    and depth, measured forward cost), then a Jacobi window from whatever extra inputs keep the forward within
    ``window_tolerance`` of its cost, and only while its pool adds tokens. Explicit W/N/G are used as given
    (explicit G: G*(N-1) trie nodes, candidates in priority order)."""

    def __init__(self, config: LookaheadConfig, estimates: Estimates) -> None:
        self.config = config
        self.estimates = estimates
        self.regret = self.estimates.regret  # what guessing lost against plain decoding (earlier calls' at half)
        self.regret.start(config.max_regret)
        self.rounds = 0  # rounds observed
        self.last_plain_round = 0  # the round that last measured t(1)

    def acceptance(self, key: tuple[SourceKind, int]) -> DecayedAcceptance:
        return self.estimates.source(key, prior_acceptance(key), decay=self.config.acceptance_decay,
                                     slots=self.config.max_depth)

    def price(self, rows: int = 1) -> ForwardPrice:
        """The one price of this round's forward for ``rows`` rows (``costmodel.ForwardPrice``)."""
        return ForwardPrice(self.estimates.forward, rows, self.regret.allowance())

    def _affordable(self, price: ForwardPrice, limit: int) -> int:
        """The widest forward (inputs per row, at most ``limit``) whose worst case stays within the regret budget.

        At worst every guess is rejected and the round emits what a plain step does, so it loses t(n) - t(1),
        with t(n) at ``Bound.WORST``. Sizing each round by that, instead of guessing while the account is within
        budget, bounds the loss of every call, not only its average (docs/benchmarks.md: one round over 24
        inputs on a CPU without bf16 units lost more than a whole 64-token call's budget). Where t(n) is flat
        the first sizes are affordable after a few plain steps, and every round that pays widens what the next
        may try. 1: nothing is affordable, a plain step earns the budget back."""
        allowance, step = price.allowance, price.step() or 0.0

        def loses(n: int) -> bool:  # t(n) is monotone from n = 2 on, so the affordable sizes are 1..some n
            return (price(n, Bound.WORST) or 0.0) - step > allowance

        if limit <= 1 or not loses(limit):  # the usual case once guessing has paid: one estimate, not one a size
            return limit
        return next(n for n in range(2, limit + 1) if loses(n)) - 1

    def plan(self, views: Sequence[RowView], offers: Sequence[Offer]) -> list[RoundPlan]:
        rows = len(views)
        if not self.estimates.forward.measured(rows):  # a plain step first: every other size is compared to it
            return [RoundPlan(max_tokens=view.budget, offered=bool(offer.candidates),
                              why="a plain step first: the reference of every other size")
                    for view, offer in zip(views, offers)]
        return self._plan_rows(self.price(rows), [view.budget for view in views], offers)

    def _plan_rows(self, price: ForwardPrice, budgets: Sequence[int], offers: Sequence[Offer]) -> list[RoundPlan]:
        """One width for the batch: the forward is padded to its widest row, so a node in one row costs every row
        its slot. The i-th slot adds the sum over rows of each row's i-th best prefix gain, the round emits
        B + that sum in t(B (1 + n)), and n maximises the ratio (for one row, the row's own argmax)."""
        config, cost, rows = self.config, self.estimates.forward, price.rows
        seconds = lambda n: price(n) or 0.0  # noqa: E731 - the round's price, 0 before anything is measured
        # sizes above twice the largest measured are not considered yet: exploration grows one doubling a round
        # (from 8 inputs at B = 1, where t(1..8) is flat on every device measured; from the plain step at B > 1,
        # where a B x 8 forward is far past anything measured)
        limit = min(config.max_forward_tokens, max(8 if rows == 1 else 1, 2 * cost.largest // rows))
        auto = config.window == "auto" and config.max_candidates == "auto"
        if auto:
            limit = self._affordable(price, limit)
        candidates = [tuple(Candidate(c.tokens[:budget], c.source) for c in offer.candidates if budget > 0)
                      for budget, offer in zip(budgets, offers)]
        chosen: list[tuple[Candidate, ...]] = [()] * len(offers)
        num_nodes = 0
        if config.max_candidates == "auto":
            rates: dict[tuple[SourceKind, int], list[float]] = {}  # per source, to the deepest candidate: once a round
            for row in candidates:
                for c in row:
                    if len(rates.get(c.source, ())) < len(c.tokens):
                        rates[c.source] = self.acceptance(c.source).rates(len(c.tokens))
            ranked = [rank_prefixes([(c.tokens, rates[c.source]) for c in row]) for row in candidates]
            slots = [sum(row[i][1] for row in ranked if i < len(row)) for i in range(max(map(len, ranked)))]
            nodes = best_count(slots, lambda n: seconds(1 + n), limit - 1, base=float(len(offers)))
            chosen = [_truncate_to_trie(row, {prefix for prefix, _ in prefixes[:nodes]})
                      for row, prefixes in zip(candidates, ranked)]
            num_nodes = nodes  # best_count never goes past len(slots)
        if config.window != "auto":
            window = config.window
            ngram = config.ngram if config.ngram != "auto" else (3 if window > 1 else 2)
        else:
            used = 1 + num_nodes
            pool_gain = self.estimates.ema("pool_gain").value
            round_tokens = self.estimates.ema("round_tokens").value
            worth = min(config.window_tolerance,
                        (config.prior_pool_gain if pool_gain is None else pool_gain) / (round_tokens or 1.0))
            extra = free_extra_tokens(seconds, used, limit - used, worth)
            if used == 1 and self.rounds + 1 - self.last_plain_round >= config.remeasure_interval:
                extra = 0  # nothing to verify: a plain step, which keeps t(1), the reference of every size, fresh
            window, ngram = window_shape(extra)
            if config.ngram != "auto":
                ngram = config.ngram
                window = max(1, (extra + 1) // (ngram - 1)) if extra >= 5 else 1
        plans = []
        for budget, offer, row, kept in zip(budgets, offers, candidates, chosen):
            if config.max_candidates != "auto":
                trie = merge_candidates(row, config.max_candidates * (ngram - 1))
                kept = _truncate_to_trie(row, {tuple(trie.tokens[n] for n in trie.path(node))
                                               for node in range(trie.num_tokens)})
            shape = (window, ngram)
            if offer.positions_left is not None and (ngram - 2) + (window - 1) >= offer.positions_left:
                shape = (1, 2)  # the window would run past the position table
            plans.append(RoundPlan(max_tokens=budget, candidates=kept, window=shape, offered=bool(offer.candidates),
                                   why="" if kept or shape != (1, 2) else "no guess worth its cost"))
        return plans

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Nothing to learn: lookahead has no draft model that would read the prompts."""

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        """Learn each source's acceptance per depth, what the pool adds, tokens per round, and the cost."""
        first = outcomes[0]
        self.rounds += 1
        if all(outcome.plan.is_plain for outcome in outcomes):
            self.last_plain_round = self.rounds
        self.estimates.forward.observe(first.forward_tokens, first.verify_time)
        _observe_regret(self.regret, self.estimates, outcomes)
        by_source: dict[tuple[SourceKind, int], list[tuple[int, bool]]] = {}
        for outcome in outcomes:
            if outcome.plan.offered:  # tokens per round of the rounds that had something to guess from, verified or not
                self.estimates.ema("round_tokens").update(len(outcome.emitted))
            self._observe_row(outcome, by_source)
        for key, slots in by_source.items():  # counts fade once per candidate judged (one first token each)
            self.acceptance(key).observe_slots(slots, decays=max(1, sum(position == 1 for position, _ in slots)))

    def _observe_row(self, outcome: RoundOutcome, by_source: dict) -> None:
        proposal = outcome.proposal
        if not proposal.num_tokens:
            return
        kept, judged = set(outcome.accepted), outcome.judged()
        for node, sources in enumerate(proposal.sources):
            if judged[node]:
                for source in sources:
                    by_source.setdefault(source.key, []).append((source.position, node in kept))
        # tokens only the pool offered: how deep the accepted path goes with a pool source vs with any other
        depth_by = {True: 0, False: 0}
        for depth, node in enumerate(outcome.accepted, start=1):
            for source in proposal.sources[node]:
                depth_by[source.kind == SourceKind.POOL] = depth
        if any(source.kind == SourceKind.POOL for sources in proposal.sources for source in sources):
            self.estimates.ema("pool_gain").update(max(0, depth_by[True] - depth_by[False]))
