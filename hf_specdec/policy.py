"""Every sizing decision, made by one planner: how many tokens the draft model drafts and when it stops, which
ready-made candidates (prompt lookup, the lookahead pool, history, memory, recycled choices) are verified as a
trie, how wide the Jacobi window is. The planner answers one question per round and learns from every round:

- ``plan(views, offers) -> [RoundPlan]``: the sizes of this round for each row of the batch (``round.py``), from
  what the drafter offers and what was measured; a plan with nothing in it is a plain target step (speculation
  off), and says why;
- ``observe(outcomes)``: what the round cost and what the target kept in each row (the same ``RoundOutcome``s
  the stats and the drafter get).

One planner (``Planner``), whatever the drafter: a round is a trie over typed sources (``round.SourceKind``). The
draft model's source is a chain sized inside the round (its tokens are not known when the round is planned);
every other source is offered ready-made and sized as a trie before the round. One price for a forward
(``price()``: ``costmodel.RoundCost``), one acceptance estimator per (source, depth) (``acceptance()``), one
regret account and probe schedule (``Exploration``, over the account carried with the estimates), one
``observe``. What a call may use comes from its config (``PlannerSettings``: a draft model's chain and prompt
lookup, or ready-made candidates and a Jacobi window).

A round, in order (``plan``; queries only, nothing changes state until ``observe``):

1. Nothing measured at this batch size: a plain step, the reference every other size is compared to.
2. The draft model (when the drafter has one): k from the adaptive rule below, or 0 with why (does not pay, its
   prompt read is not repaid, no room), or a probe when one is due and the regret budget covers it. Where it
   drafts (and is measured, and this is no probe), a tree of its continuations instead of the chain when the
   tree is expected to emit more tokens per second (below: trees).
3. The ready-made candidates (one row, or any batch without a draft model): the trie of their best prefixes by
   learned acceptance, sized by the same price, no wider than its worst case fits in the regret allowance
   (``_affordable``).
4. Whichever of the draft's chain (or tree) and the trie is expected to emit more tokens per second runs (the
   trie also when the chain does not pay: an edit that copies its input needs no draft); neither: a plain step.
5. A lookahead drafter's Jacobi window takes whatever inputs keep the forward within ``window_tolerance`` of its
   cost, while its pool adds tokens.

With B rows in a batch, every forward reads all of them: a round of n inputs per row costs t(B n), which grows
with B much sooner than with n alone, so every rule prices a row's guesses at t(B n) (for one row, t(n)) and the
draft model's step at t_d of the batched draft forward. The acceptance estimates are shared by the rows (they
are drawn from one text distribution). A batch with a draft model drafts one k for all its rows (no confidence
stop, no prompt-lookup rounds or tails): the draft steps until its longest row stops and the forward is padded
to its widest row, and one k measured faster than per-row lengths at every B > 1.

Policies besides the planner, kept as references:

``FixedPolicy``      always k draft-model tokens.
``HeuristicPolicy``  transformers' ``num_assistant_tokens_schedule="heuristic"``: k += 2 after a round in which
                     every draft token was accepted, else k = max(1, k - 1). (transformers also adds 2 after a
                     round that drafted nothing; that quirk is not copied.)

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
cost (``AdaptiveChainRule.keep_drafting``); it reads the draft's token after every step, so where a read waits
for the device's queue (a GPU: ``costmodel.reads_wait``) a round drafts k* on the device instead and reads once
(so does a batch, which has no in-round rule). With P_i the calibrated probability that draft tokens 1..i are all
accepted, the round so far is worth E_i = 1 + sum_{j<=i} P_j tokens for T_i = i t_d + t(i+1). A longer round of m
tokens is worth about E_m = E_i + sum_{j=1..m-i} P_i a^j for T_m, with a predicted by the calibrated confidence of
token i (confidence comes in stretches), so drafting goes on only while

    max_{i < m <= max_draft_tokens} E_m / T_m  >  E_i / T_i

(every longer round, not only the next token: t(n) is measured per size, and one size priced above its
neighbours must not stop every chain at it when the planner's k*, which looks at every size, runs past it).

P_i multiplies calibrated confidences: the draft's probability of its own token, mapped to an acceptance
probability through decayed per-bin acceptance counts (10 bins, Beta prior centred on the raw confidence).

After the draft, prompt lookup may append the continuation that followed the same tokens earlier in the prompt
or output: lookup token j adds P_k * prod_{l<=j} b_l expected tokens (b_l learned like a_j), and the count m
maximises the round's E / T with the measured t(k + 1 + m) (``lookup_tokens``). When the history alone offers a
continuation whose expected rate beats the best draft round (step 4), the round verifies that continuation
without running the draft at all: in an edit that copies its input, the draft's forwards are pure cost.

The in-round parts are a value (``AdaptiveChainRule``, frozen, made by ``plan``) that the drafter reads: it
never reaches the policy, and the policy learns the round's confidences from the proposal, not from calls.

Trees of the draft's continuations
----------------------------------
Where a forward over more inputs costs about what one costs, a round may verify a tree instead of the chain:
the draft's second and third choices where it is unsure (``drafters/draft_tree.py`` grows it). Its size comes
from the same price and the acceptance learned per (depth, rank among siblings):
the draft's node of rank r at depth d is ``Source(DRAFT, variant=r, position=d)``, so a_{r,d} is the one
estimator of (DRAFT, r) at slot d (rank 0 is the chain's), judged when its parent was kept. The expected tree
(``expected_tree``) takes nodes best first by the product of a along their path; its first m nodes emit
E(m) = 1 + sum of those products in T(m) = sum over depths of t_d(nodes the draft reads there) + t(1 + m), and m
maximises E / T (``Planner.tree``); the drafter ranks its nodes by the same products (``TreeShape.rates``), so
it grows the tree that was priced. The first m nodes of a chain are one such tree, so the tree is chosen
(``SpecConfig.tree="auto"``) only where it branches and its E / T beats the chain's at the same depth by more than
``TREE_MARGIN``; where t(n)
is steep (fp32 on a CPU: t(2) = 1.75 t(1)) a second choice, accepted a few times in a hundred, never pays for its
input, and rounds stay chains, or plain steps. ``tree="on"`` takes the best tree that branches.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

from .config import LookaheadConfig, PolicyKind, SpecConfig, TreeMode
from .costmodel import (Bound, DecayedAcceptance, Estimates, Regret, RoundCost, best_count, best_round, beta_rate,
                        expected_tokens, prefix_gains)
from .layout import merge_candidates
from .round import (PRIOR_WEIGHT, Candidate, Offer, PlainReason, PlainWhy, RoundKind, RoundOutcome, RoundPlan,
                    RowView, SourceKind, TreeShape, prior_acceptance)

PLAIN = RoundPlan()


class Policy(Protocol):
    def plan(self, views: Sequence[RowView], offers: Sequence[Offer]) -> list[RoundPlan]:
        """The sizes of each row's next round (``view.budget``: the most tokens it may propose)."""

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        """Learn from one round: one outcome per row."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target read the call's prompts (``tokens``: rows x padded width) in ``seconds`` (round 0)."""


# ----------------------------------------------------------------------------------------------------------------
# Reference policies; the draft model's in-round rule; exploration
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
    """The in-round rules of one adaptive round (see the module docstring).

    price: the round's price (``costmodel.RoundCost``; the estimates it reads change only in ``observe``, after
    the round); bin_kept / bin_judged / bin_weight: the draft's confidence bins (``DecayedAcceptance``, one slot
    per bin), as values; lookup_rates: b_1..b_m.
    """

    price: RoundCost
    bin_kept: tuple[float, ...]
    bin_judged: tuple[float, ...]
    bin_weight: float
    lookup_rates: tuple[float, ...]
    confidence_stop: bool
    max_tokens: int

    def calibrated(self, confidence: float) -> float:
        """P(accepted) of a draft token the draft gave probability ``confidence``: its bin's estimate, centred on
        that probability."""
        b = min(int(confidence * len(self.bin_kept)), len(self.bin_kept) - 1)
        return beta_rate(self.bin_kept[b], self.bin_judged[b], confidence, self.bin_weight)

    def _worth(self, confidences: Sequence[float]) -> tuple[float, float]:
        """(P(all drafted tokens accepted), expected tokens of the chain so far)."""
        gains = prefix_gains([self.calibrated(c) for c in confidences])
        return (gains[-1] if gains else 1.0), 1.0 + sum(gains)

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        """Draft one more token after ``confidences`` (one per token drafted so far)? While some longer round,
        up to ``max_tokens``, beats the rate of the round so far: E_m / T_m > E_n / T_n for an m > n, each token
        after the n-th accepted with the calibrated confidence of the n-th (confidence comes in stretches).

        Longer rounds, not only the next token: t(n) is measured per size, so one size priced above its
        neighbours (a slow sample, a size last measured in a tree round) would stop every chain at it, although
        the planner's k*, which looks at every size, says that a round past it pays; the rule and the planner read
        the same price the same way.

        >>> from hf_specdec.costmodel import ForwardCost
        >>> price = RoundCost(ForwardCost.from_table({1: 1.0, 3: 1.0, 4: 2.0, 16: 2.0}), t_draft=0.05)  # t(4) jumps
        >>> rule = AdaptiveChainRule(price, (0.0,), (0.0,), 2.0, (), True, 16)  # nothing judged: P(kept) = confidence
        >>> rule.keep_drafting([0.9, 0.9]), rule.keep_drafting([0.3, 0.3])  # 16 pay past the jump; doubted ones not
        (True, False)
        """
        n = len(confidences)
        if not self.confidence_stop or n >= self.max_tokens or self.price.t_draft is None or not confidences:
            return True
        seconds = self.price.round(n)
        if seconds is None:
            return True
        all_kept, emitted = self._worth(confidences)
        rate, reached, gain = self.calibrated(confidences[-1]), all_kept, 0.0
        for m in range(n + 1, self.max_tokens + 1):
            longer = self.price.round(m)
            if longer is None:
                return True
            reached *= rate
            gain += reached
            if longer <= seconds or (emitted + gain) / longer > emitted / seconds:  # (free: it can only add)
                return True
        return False

    def lookup_tokens(self, confidences: Sequence[float]) -> int:
        """Prompt-lookup tokens to verify after the drafted ones: m maximising the round's E / T, the tail priced
        at ``Bound.WORST``."""
        price, k = self.price, len(confidences)
        if price.t_draft is None or not self.lookup_rates or price(k + 1) is None:
            return 0
        all_kept, emitted = self._worth(confidences)

        def seconds(m: int) -> float | None:
            return price.round(k) if m == 0 else price.round(k, extra=m, bound=Bound.WORST)

        gains = [all_kept * g for g in prefix_gains(self.lookup_rates)]
        return best_count(gains, seconds, base=emitted)


NO_ROOM = PlainWhy(PlainReason.NO_ROOM, "the length limit")  # one token left: the round's own, nothing to guess
FIRST_STEP = PlainWhy(PlainReason.FIRST_STEP, "the reference of every other size")
NO_GUESS = PlainWhy(PlainReason.NO_GUESS)


class EmaName(enum.StrEnum):
    """The running averages the planner keeps in ``Estimates.emas`` (carried across calls with the estimates)."""

    POOL_GAIN = "pool_gain"  # tokens only the Jacobi window's pool added to a round's accepted path
    HOLE_SECONDS = "hole_seconds"  # seconds compacting the cache took per hole it removed
    ROUND_TOKENS = "round_tokens"  # tokens emitted by a round that had ready-made candidates to guess from


@dataclass(frozen=True)
class Decision:
    """What ``Planner.decide`` chose for a draft model's round before per-row details: k (0: a plain step),
    whether it is a probe, and why a plain step was chosen (``plain_why``; ``why`` is its wording)."""

    k: int
    probe: bool = False
    plain_why: PlainWhy | None = None

    @property
    def why(self) -> str:
        return "" if self.plain_why is None else str(self.plain_why)


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


# ----------------------------------------------------------------------------------------------------------------
# The planner
# ----------------------------------------------------------------------------------------------------------------

MAX_LOOKUP = 16  # longest prompt-lookup tail after the draft model's tokens
LEADING_LOOKUP = 10  # longest round of ready-made candidates beside a draft model (transformers' prompt lookup: 10)
NUM_BINS = 10  # confidence calibration bins of the draft model
DRAFT, LOOKUP = (SourceKind.DRAFT, 0), (SourceKind.LOOKUP, 0)  # the sources beside a draft model
TREE_CHILDREN = 4  # the most children of one node of a draft-model tree (ranks 0..3 among siblings)
MAX_TREE_NODES = 32  # the most nodes of a draft-model tree
# with tree="auto", a tree is grown where its expected rate beats the chain's by more than this share: its siblings'
# rates rest on the few rounds that judged them, its forwards on masked widths seldom run, so a tree within 1% of
# the chain is a tie in the estimates' noise, and the chain (which the in-round rule can stop early) is the round
# that was measured
TREE_MARGIN = 0.01


@dataclass(frozen=True)
class PlannerSettings:
    """What a ``Planner`` may size and its tunables, from the call's config (``speculative`` / ``lookahead``).

    max_regret: the share of plain decoding's time guessing may lose (``Regret``); decay: weight old acceptance
    observations keep per observation; max_depth: the deepest guess whose acceptance is learned apart.
    The draft model's chain (only with a drafter that offers ``model_tokens``): num_draft_tokens, the first k
    before the draft step is measured; max_draft_tokens, the cap; confidence_stop, the in-round stop (one row);
    probe_interval, plain rounds before a probe; setup_margin, how many times drafting must repay the draft's
    prompt read; lookup_tail, prompt-lookup tokens after the chain (one row); tree, whether a round may verify a
    tree of the draft's continuations instead (``TreeMode``; only with a drafter whose offer says it can).
    Ready-made candidates (prompt lookup, pool, history, memory, recycled choices): max_forward_tokens, the most
    inputs per row of such a round; max_candidates, "auto" (by expected rate) or G (G x (N - 1) nodes in
    priority order); batch_candidates, whether a batch round verifies them (a draft model's batch drafts one k).
    The Jacobi window (``window`` None: the drafter has none): window, ngram ("auto" or fixed W, N),
    window_tolerance, prior_pool_gain, remeasure_interval (a round with nothing to verify is a plain step when
    t(1) was last measured this many rounds ago).

    >>> PlannerSettings.speculative(SpecConfig()).window is None, PlannerSettings.lookahead(LookaheadConfig()).window
    (True, 'auto')
    """

    max_regret: float
    decay: float
    max_depth: int
    max_forward_tokens: int
    num_draft_tokens: int = 0
    max_draft_tokens: int = 0
    confidence_stop: bool = False
    probe_interval: int = 16
    setup_margin: float = 2.0
    lookup_tail: bool = False
    tree: TreeMode = TreeMode.OFF
    max_candidates: int | str = "auto"
    batch_candidates: bool = True
    window: int | str | None = None
    ngram: int | str = "auto"
    window_tolerance: float = 0.0
    prior_pool_gain: float = 0.0
    remeasure_interval: int = 16

    @classmethod
    def speculative(cls, config: SpecConfig, reads_wait: bool = False) -> "PlannerSettings":
        """A draft model's chain, with prompt lookup beside it when ``config.history_lookup``. ``reads_wait``: the
        model runs where reading a value back waits for the device's queue (``costmodel.reads_wait``): the chain
        has no in-round rule (no confidence stop, no lookup tail, each of which reads the draft's tokens after
        every step), so its k draft steps run on the device and the round reads once."""
        return cls(max_regret=config.max_regret, decay=config.decay,
                   max_depth=max(config.max_draft_tokens, MAX_LOOKUP),
                   max_forward_tokens=1 + LEADING_LOOKUP if config.history_lookup else 1,
                   num_draft_tokens=config.num_draft_tokens, max_draft_tokens=config.max_draft_tokens,
                   confidence_stop=config.confidence_stop and not reads_wait, probe_interval=config.probe_interval,
                   setup_margin=config.setup_margin, lookup_tail=config.history_lookup and not reads_wait,
                   batch_candidates=False,
                   tree=TreeMode(config.tree) if config.policy == PolicyKind.ADAPTIVE else TreeMode.OFF)

    @classmethod
    def lookahead(cls, config: LookaheadConfig) -> "PlannerSettings":
        """Ready-made candidates and a Jacobi window, no draft model."""
        return cls(max_regret=config.max_regret, decay=config.acceptance_decay, max_depth=config.max_depth,
                   max_forward_tokens=config.max_forward_tokens, max_candidates=config.max_candidates,
                   window=config.window, ngram=config.ngram, window_tolerance=config.window_tolerance,
                   prior_pool_gain=config.prior_pool_gain, remeasure_interval=config.remeasure_interval)


@dataclass(frozen=True)
class TreeChoice:
    """A draft-model tree a round would grow: its ``shape``, the ``tokens`` a row is expected to emit from it and
    the ``seconds`` of the round (its draft forwards and the target's)."""

    shape: TreeShape
    tokens: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class TrieChoice:
    """The ready-made candidates a round would verify: per row the kept prefixes (``chosen``), ``nodes`` slots per
    row, and ``emitted``, the tokens the batch is expected to emit (B plus every row's kept gains)."""

    chosen: tuple[tuple[Candidate, ...], ...]
    nodes: int
    emitted: float


class Planner:
    """The sizes of every round, for every drafter: one price, one acceptance estimator per (source, depth), one
    regret account, learned from the same round outcomes (module docstring). ``width``: the inputs per row the
    target's forward runs for n (``RoundCost.width``: a compiled verify's buckets; None: n itself)."""

    def __init__(self, settings: PlannerSettings, estimates: Estimates | None = None,
                 width: Callable[[int], int] | None = None) -> None:
        self.settings, self.width = settings, width
        self.estimates = estimates if estimates is not None else Estimates()
        self.estimates.regret.start(settings.max_regret)  # earlier calls' account at half
        self.exploration = Exploration(self.estimates.regret, settings.probe_interval)
        self.calibration = self.estimates.confidence_bins(NUM_BINS, decay=settings.decay)
        self.estimates.draft_read.start_call()
        self.prefill: tuple[int, float] | None = None  # (tokens, seconds) of the target's read of this call's prompts
        self.rounds = 0  # rounds observed
        self.last_plain_round = 0  # the round that last measured t(1)

    @classmethod
    def speculative(cls, config: SpecConfig, estimates: Estimates | None = None,
                    width: Callable[[int], int] | None = None, reads_wait: bool = False) -> "Planner":
        return cls(PlannerSettings.speculative(config, reads_wait), estimates, width)

    @classmethod
    def lookahead(cls, config: LookaheadConfig, estimates: Estimates | None = None,
                  width: Callable[[int], int] | None = None) -> "Planner":
        return cls(PlannerSettings.lookahead(config), estimates, width)

    @property
    def regret(self) -> Regret:
        return self.exploration.regret

    # -- what was learned ---------------------------------------------------------------------------------------
    def acceptance(self, key: tuple[SourceKind, int]) -> DecayedAcceptance:
        """a_i of one source by depth: the one estimator of its acceptance (its prior alone, not stored, before
        ``observe`` first learns from it: a query)."""
        found = self.estimates.acceptance.get(key)
        if found is not None:
            return found
        return DecayedAcceptance(prior_acceptance(key), PRIOR_WEIGHT[key[0]], self.settings.decay,
                                 self.settings.max_depth)

    def learned(self, key: tuple[SourceKind, int]) -> DecayedAcceptance:
        """The stored estimator ``observe`` updates (made with its prior on first use)."""
        return self.estimates.source(key, prior_acceptance(key), weight=PRIOR_WEIGHT[key[0]],
                                     decay=self.settings.decay, slots=self.settings.max_depth)


    # -- prices -------------------------------------------------------------------------------------------------
    def price(self, rows: int = 1) -> RoundCost:
        """The one price of this round for ``rows`` rows (``costmodel.RoundCost``), with the regret account's
        decision of what a round may lose against it."""
        estimates = self.estimates
        return RoundCost(estimates.forward, rows, estimates.draft_seconds(rows),
                         estimates.ema_value(EmaName.HOLE_SECONDS) or 0.0, estimates.tree_draft_seconds, self.width,
                         self.regret.allows, host=estimates.host_seconds)

    def read_seconds(self, setup_tokens: int) -> float:
        """What the draft reading ``setup_tokens`` prompt tokens would cost: its learned share of the target's
        read of this call's prompts, per token past them (0 once read, or while nothing prices it: the first call
        that drafts measures it)."""
        if not setup_tokens or self.prefill is None:
            return 0.0
        tokens, seconds = self.prefill
        return self.estimates.draft_read.estimate(seconds * max(1.0, setup_tokens / max(tokens, 1))) or 0.0

    def _best_draft_rate(self, price: RoundCost) -> float:
        """The best expected tokens per second of a round that drafts 1..max_draft_tokens tokens."""
        most = self.settings.max_draft_tokens
        gains = prefix_gains(self.acceptance(DRAFT).rates(most))
        rates = [(1 + sum(gains[:k])) / t for k in range(1, most + 1) if (t := price.round(k)) is not None]
        return max(rates, default=0.0)

    def rule(self, price: RoundCost | None = None) -> AdaptiveChainRule:
        """The in-round rule of a chain drafted this round, over this round's price."""
        price = price if price is not None else self.price()
        most = self.settings.max_draft_tokens
        lookup = self._lookup_tail(price.rows)
        return AdaptiveChainRule(
            price=price, bin_kept=tuple(self.calibration.kept), bin_judged=tuple(self.calibration.judged),
            bin_weight=self.calibration.weight,
            lookup_rates=tuple(self.acceptance(LOOKUP).rates(MAX_LOOKUP)) if lookup else (),
            confidence_stop=self._confidence_stop(price.rows), max_tokens=most,
        )

    # -- decisions (queries: nothing here changes state) ----------------------------------------------------------
    def plan(self, views: Sequence[RowView], offers: Sequence[Offer]) -> list[RoundPlan]:
        """Each row's round: a plain step first (the reference of every size); then the draft model's chain where
        it pays (its tree where that pays more), the trie of ready-made candidates where that pays more still (or
        the chain does not pay), else a plain step that says why; the Jacobi window (a lookahead drafter's)
        spends what the forward has spare."""
        rows = len(views)
        if not self.estimates.forward.measured(rows):  # a plain step first: every other size is compared to it
            return [RoundPlan(max_tokens=view.budget, offered=bool(offer.candidates), plain_why=FIRST_STEP)
                    for view, offer in zip(views, offers)]
        budgets = [view.budget for view in views]
        if not any(budgets):  # one token left: the round's own token, no room for a guess of any source
            return [RoundPlan(max_tokens=0, plain_why=NO_ROOM) for _ in views]
        price = self.price(rows)
        model = self.settings.max_draft_tokens > 0 and any(offer.model_tokens for offer in offers)
        decision = self._decide_chain(price, views, offers) if model else Decision(0)
        trie = self._trie(price, budgets, offers) if self._candidates(rows) else None
        if decision.k and (price.t_draft is None or decision.probe):  # measure the draft: nothing to compare yet
            return self._chain_plans(price, decision, budgets, offers)
        tree = self.tree(price, max(budgets)) if decision.k and all(offer.trees for offer in offers) else None
        if tree is not None and not (trie and trie.nodes and self._trie_rate(price, trie) > tree.rate):
            return [RoundPlan(model_tokens=min(tree.shape.depth, budget), max_tokens=budget,  # each row's depth
                              tree=tree.shape if budget > 0 else None) for budget in budgets]
        if decision.k and not (trie and trie.nodes and self._trie_rate(price, trie) > self._best_draft_rate(price)):
            return self._chain_plans(price, decision, budgets, offers)
        if trie is None:
            return [RoundPlan(max_tokens=budget, plain_why=decision.plain_why) for budget in budgets]
        return self._trie_plans(price, trie, budgets, offers, decision.plain_why or NO_GUESS)

    def _candidates(self, rows: int) -> bool:
        """Are ready-made candidates verified in a round of ``rows`` rows?"""
        return self.settings.max_forward_tokens > 1 and (rows == 1 or self.settings.batch_candidates)

    # The confidence stop and prompt lookup (tails, rounds of candidates) size each row apart, which pays for one
    # row. In a batch the draft steps until its longest row stops and the forward is padded to its widest row,
    # so one k for the batch (k*) measured faster at every B > 1 (docs/benchmarks.md, batch runs).
    def _confidence_stop(self, rows: int) -> bool:
        return self.settings.confidence_stop and rows == 1

    def _lookup_tail(self, rows: int) -> bool:
        return self.settings.lookup_tail and rows == 1

    # -- the draft model's chain ----------------------------------------------------------------------------------
    def _decide_chain(self, price: RoundCost, views: Sequence[RowView], offers: Sequence[Offer]) -> Decision:
        room = max((view.budget for view in views), default=0)
        budget = min(self.settings.max_draft_tokens,
                     max(min(view.budget, offer.model_tokens) for view, offer in zip(views, offers)))
        if price.rows > 1:  # a B x (k + 1) forward grows with B long before it does at B = 1: rounds grow to at
            # most twice the largest forward measured so far
            budget = min(budget, max(1, 2 * self.estimates.forward.largest // price.rows - 1))
        return self.decide(price, budget, room, sum(offer.setup_tokens for offer in offers))

    def _chain_plans(self, price: RoundCost, decision: Decision, budgets: Sequence[int],
                     offers: Sequence[Offer]) -> list[RoundPlan]:
        if price.t_draft is None:  # t_d unknown: draft the starting k once, measure it
            return [RoundPlan(model_tokens=min(decision.k, budget), max_tokens=budget, probe=decision.probe)
                    for budget in budgets]
        rule = self.rule(price) if self._confidence_stop(price.rows) or self._lookup_tail(price.rows) else None
        return [RoundPlan(model_tokens=min(decision.k, budget, offer.model_tokens), max_tokens=budget, rule=rule,
                          probe=decision.probe) for budget, offer in zip(budgets, offers)]

    def decide(self, price: RoundCost, budget: int, remaining: int, setup_tokens: int) -> Decision:
        """The most draft-model tokens this round: 0 (a plain step, with why) while the draft's worth is unknown
        or does not pay, or while the draft has not read the prompts and the ``remaining`` tokens cannot repay
        ``setup_margin`` times reading them; with ``confidence_stop`` the cap (the in-round rule decides), else
        k*; a probe when one is due and affordable.

        >>> policy = Planner.speculative(SpecConfig(confidence_stop=False))  # setup_margin=2.0
        >>> policy.estimates.forward.observe(1, 0.10); policy.estimates.forward.observe(4, 0.12)
        >>> policy.estimates.draft_step.observe(1, 0.02); policy.estimates.draft_read.ratio.update(0.25)
        >>> policy.observe_prefill(tokens=200, seconds=4.0)  # the draft would read it in 1 s
        >>> [policy.decide(policy.price(), 3, remaining, 200).k for remaining in (64, 128)]  # k* = 2 a round
        [0, 2]
        >>> policy.decide(policy.price(), 3, 64, 200).why
        'draft prompt read not repaid: 1.00 s to read, ~1.75 s saved over the 64 tokens left'
        """
        if budget <= 0:
            return Decision(0, plain_why=NO_ROOM)
        if price.t_draft is None:
            return Decision(min(self.settings.num_draft_tokens, budget))
        gains = prefix_gains(self.acceptance(DRAFT).rates(budget))
        best = best_round(price, gains, budget)
        best_k = best.k if best is not None else 0
        read = self.read_seconds(setup_tokens)
        if read:
            price = dataclasses.replace(price, read=read)
        if best_k > 0:
            saved = price.saved(best_k, expected_tokens(gains[:best_k]), remaining) if read else 0.0
            if read and saved <= self.settings.setup_margin * read:
                gain = f"~{saved:.2f} s saved" if saved > 0 else "nothing saved at the worst verify cost"
                detail = f"{read:.2f} s to read, {gain} over the {remaining} tokens left"
                return Decision(0, plain_why=PlainWhy(PlainReason.READ_NOT_REPAID, detail))
            # with confidence_stop, speculation pays: the round may run to the cap, and the in-round rule, which
            # sees each token's confidence, decides where it stops
            return Decision(budget if self._confidence_stop(price.rows) else best_k)
        step, one = price.step(), price.round(1, with_read=True)
        if self.exploration.due() and one is not None and self.regret.allows(one - step):
            probe = 1 + best_count(gains[1:], lambda n: price.round(n + 1), budget - 1, base=1 + gains[0])
            return Decision(probe, probe=True)  # the best round that drafts at all
        rates = f"{self._best_draft_rate(price):.1f} tok/s expected, {1 / step if step else 0.0:.1f} plain"
        return Decision(0, plain_why=PlainWhy(PlainReason.DOES_NOT_PAY, rates))

    # -- the draft model's tree -----------------------------------------------------------------------------------
    def tree(self, price: RoundCost, depth: int) -> TreeChoice | None:
        """The draft-model tree this round grows, at most ``depth`` deep, or None for the chain (module docstring):
        of the first m nodes of the expected tree, the m with the best expected tokens per second; with
        ``tree="auto"`` only where that tree branches and beats the best chain as deep; with ``"on"``, the best
        that branches. None while ``tree="off"``, or a draft step or forward size it needs is unpriced.

        >>> policy = Planner.speculative(SpecConfig(tree="auto"))
        >>> policy.estimates.draft_step.observe(1, 0.01)
        >>> for n in range(1, 34): policy.estimates.forward.observe(n, 0.10)  # flat t(n): a GPU, bf16 units
        >>> choice = policy.tree(policy.price(), 8)
        >>> choice.shape.branches, choice.shape.depth, choice.shape.num_nodes
        (True, 8, 32)
        >>> choice.shape.rates == tuple(map(tuple, sibling_rates(  # what the drafter ranks its nodes by
        ...     [policy.acceptance((SourceKind.DRAFT, rank)).rates(8) for rank in range(TREE_CHILDREN)])))
        True
        >>> for n in range(1, 34): policy.estimates.forward.observe(n, 0.10 * (1 + 0.75 * (n - 1)))  # steep
        >>> policy.tree(policy.price(), 8) is None  # the chain (or nothing)
        True
        """
        mode, rows = self.settings.tree, price.rows
        depth = min(depth, self.settings.max_draft_tokens)
        if mode is TreeMode.OFF or depth <= 0:
            return None
        limit = min(MAX_TREE_NODES, max(8 if rows == 1 else 1, 2 * self.estimates.forward.largest // rows) - 1)
        rates = sibling_rates([self.acceptance((SourceKind.DRAFT, rank)).rates(depth) for rank in range(TREE_CHILDREN)])
        nodes = expected_tree(rates, limit)
        # the first m nodes branch from the first node of rank > 0 on (nodes come best first); fewer are a chain,
        # which the chain's own price sizes
        branching = next((m for m, node in enumerate(nodes) if node.rank > 0), len(nodes))
        floor = 0.0  # "on": the best tree that branches; "auto": only one that beats the best chain as deep
        if mode is TreeMode.AUTO:
            chain = best_round(price, prefix_gains(rates[0]), depth)
            if chain is None:
                return None
            floor = chain.rate * (1.0 + TREE_MARGIN)
        bounds = tree_rate_bounds(price, nodes, start=branching)
        if mode is TreeMode.AUTO and max(bounds[branching:], default=0.0) <= floor:
            return None  # no tree can beat the chain: the shapes need not be priced
        best = None

        def priced(m: int) -> bool:  # not a chain, nor a shape that cannot change the answer
            return m >= branching and not (m < len(bounds) and bounds[m] <= max(floor, best.rate if best else 0.0))

        for m, (shape, tokens) in enumerate(tree_prefixes(nodes, TREE_CHILDREN, wanted=priced)):
            if shape is None:
                continue
            seconds = price.tree(shape)
            if seconds is None:
                break
            choice = TreeChoice(shape, tokens, seconds)
            if best is None or choice.rate > best.rate:
                best = choice
        if best is None or best.rate <= floor:
            return None
        # the drafter ranks its nodes by the rates the tree was priced with: it grows the expected tree
        return dataclasses.replace(best, shape=dataclasses.replace(
            best.shape, rates=tuple(tuple(rank_rates) for rank_rates in rates)))

    # -- ready-made candidates: a trie ----------------------------------------------------------------------------
    def _affordable(self, price: RoundCost, limit: int) -> int:
        """The widest forward (inputs per row, at most ``limit``) whose worst case stays within the regret budget.

        At worst every guess is rejected and the round emits what a plain step does, so it loses t(n) - t(1),
        with t(n) at ``Bound.WORST``. Sizing each round by that, instead of guessing while the account is within
        budget, bounds the loss of every call, not only its average (docs/benchmarks.md: one round over 24
        inputs on a CPU without bf16 units lost more than a whole 64-token call's budget). Where t(n) is flat
        the first sizes are affordable after a few plain steps, and every round that pays widens what the next
        may try. 1: nothing is affordable, a plain step earns the budget back. A round that cannot lose (t(n) no
        more than t(1), at worst) is affordable even when the account is spent (say, by a draft model's misses)."""
        allowance, step = max(0.0, self.regret.allowance()), price.step() or 0.0
        host = price.host_seconds(RoundKind.TRIE)

        def loses(n: int) -> bool:  # t(n) is monotone from n = 2 on, so the affordable sizes are 1..some n
            return (price(n, Bound.WORST) or 0.0) + host - step > allowance

        if limit <= 1 or not loses(limit):  # the usual case once guessing has paid: one estimate, not one a size
            return limit
        return next(n for n in range(2, limit + 1) if loses(n)) - 1

    def _limit(self, price: RoundCost) -> int:
        """The most inputs per row a round of candidates (and window) may read: sizes above twice the largest
        measured are not considered yet, so exploration grows one doubling a round (from 8 inputs at B = 1,
        where t(1..8) is flat on every device measured; from the plain step at B > 1, where a B x 8 forward is
        far past anything measured); with "auto" sizes, only what the regret budget covers at worst."""
        settings, rows = self.settings, price.rows
        limit = min(settings.max_forward_tokens, max(8 if rows == 1 else 1, 2 * self.estimates.forward.largest // rows))
        if settings.max_candidates == "auto" and settings.window in ("auto", None):
            limit = self._affordable(price, limit)
        return limit

    def _trie(self, price: RoundCost, budgets: Sequence[int], offers: Sequence[Offer]) -> TrieChoice:
        """One width for the batch: the forward is padded to its widest row, so a node in one row costs every row
        its slot. The i-th slot adds the sum over rows of each row's i-th best prefix gain, the round emits
        B + that sum in t(1 + n) per row, and n maximises the ratio (for one row, the row's own argmax)."""
        candidates = tuple(tuple(Candidate(c.tokens[:budget], c.source) for c in offer.candidates if budget > 0)
                           for budget, offer in zip(budgets, offers))
        if self.settings.max_candidates != "auto":
            return TrieChoice(candidates, 0, float(len(offers)))
        rates: dict[tuple[SourceKind, int], list[float]] = {}  # per source, to the deepest candidate: once a round
        for row in candidates:
            for c in row:
                if len(rates.get(c.source, ())) < len(c.tokens):
                    rates[c.source] = self.acceptance(c.source).rates(len(c.tokens))
        ranked = [rank_prefixes([(c.tokens, rates[c.source]) for c in row]) for row in candidates]
        ranked = [best_path(row) if offer.one_path else row for row, offer in zip(ranked, offers)]
        slots = [sum(row[i][1] for row in ranked if i < len(row)) for i in range(max(map(len, ranked), default=0))]
        nodes = best_count(slots, lambda n: price(1 + n) or 0.0, self._limit(price) - 1, base=float(len(offers)))
        chosen = tuple(_truncate_to_trie(row, {prefix for prefix, _ in prefixes[:nodes]})
                       for row, prefixes in zip(candidates, ranked))
        return TrieChoice(chosen, nodes, len(offers) + sum(slots[:nodes]))

    def _trie_rate(self, price: RoundCost, trie: TrieChoice) -> float:
        """Expected tokens per second of the round that verifies ``trie`` alone (no draft forward)."""
        deepest = max((len(c.tokens) for row in trie.chosen for c in row), default=0)
        t = price.trie(trie.nodes, deepest)  # at least the nodes off the deepest path are holes
        return trie.emitted / price.rows / t if t else 0.0

    def _window(self, price: RoundCost, nodes: int) -> tuple[int, int]:
        """(W, N) of the Jacobi window: explicit W/N as given; "auto", from whatever extra inputs keep the forward
        within ``window_tolerance`` of its cost, and only while its pool adds tokens."""
        settings = self.settings
        if settings.window is None:
            return 1, 2
        if settings.window != "auto":
            return settings.window, settings.ngram if settings.ngram != "auto" else (3 if settings.window > 1 else 2)
        used, limit = 1 + nodes, self._limit(price)
        pool_gain = self.estimates.ema_value(EmaName.POOL_GAIN)
        round_tokens = self.estimates.ema_value(EmaName.ROUND_TOKENS)
        worth = min(settings.window_tolerance,
                    (settings.prior_pool_gain if pool_gain is None else pool_gain) / (round_tokens or 1.0))
        extra = free_extra_tokens(lambda n: price(n) or 0.0, used, limit - used, worth)
        if used == 1 and self.rounds + 1 - self.last_plain_round >= settings.remeasure_interval:
            extra = 0  # nothing to verify: a plain step, which keeps t(1), the reference of every size, fresh
        window, ngram = window_shape(extra)
        if settings.ngram != "auto":
            ngram = settings.ngram
            window = max(1, (extra + 1) // (ngram - 1)) if extra >= 5 else 1
        return window, ngram

    def _trie_plans(self, price: RoundCost, trie: TrieChoice, budgets: Sequence[int], offers: Sequence[Offer],
                    why: PlainWhy) -> list[RoundPlan]:
        window, ngram = self._window(price, trie.nodes)
        plans = []
        for budget, offer, kept in zip(budgets, offers, trie.chosen):
            if self.settings.max_candidates != "auto":
                if offer.one_path:  # one chain: the best-ranked candidate (candidates come best first)
                    kept = kept[:1]
                trie_nodes = merge_candidates(kept, self.settings.max_candidates * (ngram - 1))
                kept = _truncate_to_trie(kept, {tuple(trie_nodes.tokens[n] for n in trie_nodes.path(node))
                                                for node in range(trie_nodes.num_tokens)})
            shape = (1, 2) if offer.one_path else (window, ngram)
            if offer.positions_left is not None and (ngram - 2) + (window - 1) >= offer.positions_left:
                shape = (1, 2)  # the window would run past the position table
            plans.append(RoundPlan(max_tokens=budget, candidates=kept, window=shape, offered=bool(offer.candidates),
                                   plain_why=None if kept or shape != (1, 2) else why))
        return plans

    # -- learning -----------------------------------------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target read this call's prompts (``tokens``, every row's padded width) in ``seconds``."""
        self.prefill = (int(tokens), float(seconds))

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        """Learn from one round: the forward's cost, what guessing lost, each source's acceptance per depth, the
        draft's step, read and calibration, what the pool adds, and the probe schedule."""
        first = outcomes[0]
        self.rounds += 1
        if all(outcome.plan.is_plain for outcome in outcomes):
            self.last_plain_round = self.rounds
        self.estimates.forward.observe(first.forward_tokens, first.verify_time)
        self.estimates.host[RoundKind.of([outcome.plan for outcome in outcomes])].update(first.host_time)
        if first.compacted:
            self.estimates.ema(EmaName.HOLE_SECONDS).update(first.compact_time / first.compacted)
        observed = RoundCost(self.estimates.forward, len(outcomes), width=self.width, may_lose=_as_planned,
                             host=self.estimates.host_seconds)
        _observe_regret(self.regret, observed, outcomes)
        by_source: dict[tuple[SourceKind, int], list[tuple[int, bool]]] = {}
        for outcome in outcomes:
            if outcome.plan.offered:  # tokens per round of the rounds that had something to guess from
                self.estimates.ema(EmaName.ROUND_TOKENS).update(len(outcome.emitted))
            self._observe_row(outcome, by_source)
        for key, slots in by_source.items():  # counts fade once per candidate judged (one first token each)
            self.learned(key).observe_slots(slots, decays=max(1, sum(position == 1 for position, _ in slots)))
        forwards = max(outcome.proposal.draft_forwards for outcome in outcomes)
        probe = any(outcome.plan.probe for outcome in outcomes)
        if any(outcome.plan.plain_why is not None and outcome.plan.plain_why.kind is PlainReason.READ_NOT_REPAID
               for outcome in outcomes):
            self.estimates.draft_read.blocked = True
        if forwards:
            self._observe_draft(outcomes, forwards)
        most = self.settings.max_draft_tokens
        best = best_round(self.price(len(outcomes)), prefix_gains(self.acceptance(DRAFT).rates(most))) if probe else None
        self.exploration.observe(drafted=bool(forwards), probe=probe, pays=best is not None and best.k > 0)

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
        if any(source.kind == SourceKind.POOL for sources in proposal.sources for source in sources):
            depth_by = {True: 0, False: 0}
            for depth, node in enumerate(outcome.accepted, start=1):
                for source in proposal.sources[node]:
                    depth_by[source.kind == SourceKind.POOL] = depth
            self.estimates.ema(EmaName.POOL_GAIN).update(max(0, depth_by[True] - depth_by[False]))

    def _observe_draft(self, outcomes: Sequence[RoundOutcome], forwards: int) -> None:
        proposals = [outcome.proposal for outcome in outcomes]
        setup, setup_tokens = sum(p.setup_time for p in proposals), sum(p.setup_tokens for p in proposals)
        if setup > 0 and setup_tokens and self.prefill is not None:
            tokens, seconds = self.prefill
            self.estimates.draft_read.observe(setup, seconds * max(1.0, setup_tokens / max(tokens, 1)))
        steps = next((p.draft_steps for p in proposals if p.draft_steps), ())
        for width, seconds in steps:  # a tree's forwards, by the inputs they read (every row's): priced apart
            self.estimates.tree_step.observe(len(outcomes) * width, seconds)
        if not steps:  # a chain's: one input a row each
            drafting = sum(p.draft_time for p in proposals)  # the batch's, over its rows
            self.estimates.draft_step.observe(len(outcomes), drafting / forwards)
        bins = []  # the draft's first choices (a chain's tokens, a tree's rank-0 nodes) that were judged
        for outcome in outcomes:
            kept, judged, sources = set(outcome.accepted), outcome.judged(), outcome.proposal.sources
            bins += [(min(int(c * NUM_BINS), NUM_BINS - 1) + 1, node in kept)
                     for node, c in enumerate(outcome.proposal.confidences)
                     if judged[node] and any(source.key == DRAFT for source in sources[node])]
        self.calibration.observe_slots(bins)


def _as_planned(seconds: float) -> bool:
    """The regret account's plain step is the forward's estimate as it stands (a size still priced by its seed
    keeps its seed): no credit is taken against it."""
    return False


def _observe_regret(regret: Regret, price: RoundCost, outcomes: Sequence[RoundOutcome]) -> None:
    """What this round took (``RoundCost.spent``) against what plain decoding would have taken for the tokens it
    emitted (``price``: of this round's rows, its forward already learned)."""
    step = price.step()  # a plain step of these rows
    if step is None:
        return
    emitted = sum(len(outcome.emitted) for outcome in outcomes)
    regret.observe(price.spent(outcomes), emitted, step / len(outcomes),
                   guessed=any(o.proposal.num_tokens or o.proposal.draft_forwards or _has_window(o.proposal)
                               for o in outcomes))


def _has_window(proposal) -> bool:
    """Does the proposal carry Jacobi window inputs (an empty window, W = 1 and N = 2, carries none)?"""
    return proposal.extra is not None and proposal.extra.token_ids.numel() > 0


class CappedPolicy:
    """Another policy's plans, cut to at most ``cap`` guessed tokens per row, no Jacobi window and no tree: what the
    loop runs after a round's forward ran out of memory, before it gives up speculation altogether.

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
                                   window=(1, 2), tree=None)  # a chain: at most cap guesses

    def observe(self, outcomes: Sequence[RoundOutcome]) -> None:
        self.policy.observe(outcomes)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.policy.observe_prefill(tokens, seconds)


def make_policy(config: SpecConfig | LookaheadConfig, estimates: Estimates | None = None,
                width: Callable[[int], int] | None = None, reads_wait: bool = False) -> Policy:
    """The policy a call's config asks for: the planner (``width``: ``Planner``'s; ``reads_wait``:
    ``PlannerSettings.speculative``'s), or a draft model's fixed or heuristic k."""
    if isinstance(config, LookaheadConfig):
        return Planner.lookahead(config, estimates, width)
    if config.policy == PolicyKind.FIXED:
        return FixedPolicy(config.num_draft_tokens)
    if config.policy == PolicyKind.HEURISTIC:
        return HeuristicPolicy(config.num_draft_tokens, config.max_draft_tokens)
    return Planner.speculative(config, estimates, width, reads_wait)


# ----------------------------------------------------------------------------------------------------------------
# Ready-made candidates: ranking a trie, sizing the Jacobi window (pure)
# ----------------------------------------------------------------------------------------------------------------

class ExpectedNode(NamedTuple):
    """A node of the expected tree: its parent (index into the list, -1: the last token), rank among its
    siblings, depth, and gain (the product of the acceptance rates along its path)."""

    parent: int
    rank: int
    depth: int
    gain: float


def expected_tree(rates: Sequence[Sequence[float]], max_nodes: int) -> list[ExpectedNode]:
    """The draft-model tree expected to emit the most tokens for its size, best node first.

    ``rates[r][d - 1]``: the acceptance of a node of rank r at depth d given its parent was kept (``Source(DRAFT,
    r, d)``); ``len(rates[0])`` caps the depth. A node's gain is the product of the rates along its path, what it
    adds to the expected tokens of the round; taking nodes best first (a node's first child and next sibling
    become candidates when it is taken) gives, for every m, a tree of m nodes with the largest sum of gains when
    gains fall with depth and rank (they do: rates are at most 1 and a later sibling is accepted only where the
    earlier ones were not).

    Siblings are exclusive: of the children of a kept parent at most one is kept (greedy, the target's token is
    one token; sampled, a round accepts one child at most), so at each depth the ranks' rates sum to at most 1,
    and a rank counts only what the ranks before it leave (``sibling_rates``). The estimators of the ranks are
    apart and need not say so: a draft that agrees with the target on every token has rank 0 learned at 1.0
    while a rank-1 depth its trees seldom reached still holds its prior, and a tree of such siblings would be
    priced as if it gained tokens it cannot.

    >>> [(n.parent, n.rank, n.depth, round(n.gain, 3)) for n in expected_tree([[0.7, 0.6], [0.2, 0.2]], 4)]
    [(-1, 0, 1, 0.7), (0, 0, 2, 0.42), (-1, 1, 1, 0.2), (0, 1, 2, 0.14)]
    >>> [round(n.gain, 3) for n in expected_tree([[1.0, 0.9], [0.15, 0.15]], 4)]  # rank 1: at most 0.0, 0.1
    [1.0, 0.9, 0.1, 0.0]
    """
    rates = sibling_rates(rates)
    depth_cap, children = len(rates[0]) if rates else 0, len(rates)
    frontier: list[tuple[float, int, int, int, int]] = []  # (-gain, order, parent, rank, depth)
    order = 0

    def offer(parent: int, rank: int, depth: int, parent_gain: float) -> None:
        nonlocal order
        if rank < children and depth <= depth_cap:
            heapq.heappush(frontier, (-parent_gain * rates[rank][depth - 1], order, parent, rank, depth))
            order += 1

    nodes: list[ExpectedNode] = []
    offer(-1, 0, 1, 1.0)
    while frontier and len(nodes) < max_nodes:
        negative, _, parent, rank, depth = heapq.heappop(frontier)
        nodes.append(ExpectedNode(parent, rank, depth, -negative))
        offer(parent, rank + 1, depth, 1.0 if parent < 0 else nodes[parent].gain)  # its next sibling
        offer(len(nodes) - 1, 0, depth + 1, -negative)  # its first child
    return nodes


def sibling_rates(rates: Sequence[Sequence[float]]) -> list[list[float]]:
    """``rates`` (per rank, per depth) with each rank's rate at most what the ranks before it leave at that depth:
    the acceptances of a parent's children are exclusive events (``expected_tree``), so they sum to at most 1.

    >>> sibling_rates([[0.75, 0.5], [0.5, 0.25], [0.25, 0.25]])
    [[0.75, 0.5], [0.25, 0.25], [0.0, 0.25]]
    """
    capped: list[list[float]] = []
    left: list[float] = [1.0] * max(map(len, rates), default=0)  # per depth, what the ranks so far leave
    for rank_rates in rates:
        capped.append([max(0.0, min(rate, room)) for rate, room in zip(rank_rates, left)])
        left = [room - rate for room, rate in zip(left, capped[-1])] + left[len(capped[-1]):]
    return capped


def tree_rate_bounds(price: RoundCost, nodes: Sequence[ExpectedNode], start: int = 0) -> list[float]:
    """For each m, at most the expected tokens per second of the tree of the first m of ``nodes`` (best first): its
    tokens over the least its round costs as ``RoundCost.tree`` prices it: a tree's host work, the target's forward
    over the last token and the m nodes at the same bound with the nodes off its deepest path as holes, and one
    tree draft forward of one input per depth (a depth's forward reads at least one). Empty while unpriced; cut
    where a forward size is unpriced; 0.0 (not priced) for the first ``start`` (the chains before the first sibling
    node).

    >>> from hf_specdec.costmodel import ForwardCost
    >>> price = RoundCost(ForwardCost.from_table({1: 0.1, 8: 0.1}), t_draft=0.01)
    >>> nodes = expected_tree([[0.7, 0.6], [0.2, 0.2]], 4)
    >>> [round(bound, 2) for bound in tree_rate_bounds(price, nodes)]  # 4 nodes, depth 2: 2.46 tokens in 0.12 s
    [15.45, 17.67, 19.33, 20.5]
    >>> tree_rate_bounds(price, nodes, start=2)[:2]  # the first two nodes are a chain: not priced
    [0.0, 0.0]
    """
    step = price.draft_forward(1)
    if step is None:
        return []
    host, tokens, depth, bounds = price.host_seconds(RoundKind.TREE), 1.0, 0, []
    for m, node in enumerate(nodes, start=1):
        tokens, depth = tokens + node.gain, max(depth, node.depth)
        if m <= start:
            bounds.append(0.0)
            continue
        verify = price(1 + m, Bound.WORST, holes=m - depth)
        if verify is None:
            break
        bounds.append(tokens / (host + verify + depth * step))
    return bounds


def tree_prefixes(nodes: Sequence[ExpectedNode], children: int,
                  wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[TreeShape | None, float]]:
    """(shape, expected tokens) of the first m nodes of ``nodes`` (best first, a parent before its children), for
    m = 1, 2, ...: nodes per depth, the nodes the draft reads per depth (those with a child among the m) and 1 +
    the sum of the gains. ``wanted(m - 1)`` False: that prefix's shape is not made (a shape the caller would not
    price); its place in the sequence is None.

    >>> nodes = expected_tree([[0.7, 0.6], [0.2, 0.2]], 4)
    >>> [(shape.nodes, shape.expanded, round(tokens, 2)) for shape, tokens in tree_prefixes(nodes, 2)]
    [((1,), (1,), 1.7), ((1, 1), (1, 1), 2.12), ((2, 1), (1, 1), 2.32), ((2, 2), (1, 1), 2.46)]
    """
    per_depth: list[int] = []
    read: list[set[int]] = [{-1}]  # per depth, the parents of the next depth's nodes
    tokens = 1.0
    for index, node in enumerate(nodes):
        if node.depth > len(per_depth):
            per_depth.append(0)
            read.append(set())
        per_depth[node.depth - 1] += 1
        read[node.depth - 1].add(node.parent)
        tokens += node.gain
        if wanted is not None and not wanted(index):
            yield None, tokens
            continue
        yield TreeShape(tuple(per_depth), tuple(len(parents) for parents in read[: len(per_depth)]), children), tokens


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


def best_path(ranked: Sequence[tuple[tuple[int, ...], float]]) -> list[tuple[tuple[int, ...], float]]:
    """The prefixes of ``rank_prefixes`` on one path, best first: from the root, each step to the best-ranked child
    of the last kept prefix (the chain a model that reads no trie verifies; parents come before their children, so
    one pass finds it).

    >>> best_path(rank_prefixes([((7, 8, 9), (0.9, 0.5, 0.5)), ((3,), (0.6,)), ((7, 5), (0.9, 0.4))]))
    [((7,), 0.9), ((7, 8), 0.45), ((7, 8, 9), 0.225)]
    """
    path: list[tuple[tuple[int, ...], float]] = []
    for prefix, gain in ranked:
        if prefix[:-1] == (path[-1][0] if path else ()):
            path.append((prefix, gain))
    return path


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
