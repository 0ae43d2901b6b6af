"""Sampling through ``generate`` has exactly the target's processed distribution, end to end.

A tiny target (vocabulary of 8, one layer) samples ``NEW`` = 4 new tokens with temperature, top-k, top-p and a
repetition penalty. Its exact distribution over all 8^4 continuations is enumerated from the target itself: the
probability of a continuation is the product of the processed target probabilities at each of its prefixes
(``exact_distribution``; the processors built by hand in the order transformers applies them, and checked
against the list transformers builds). ``DRAWS`` continuations sampled by each mode are then compared with it by
a chi-square goodness-of-fit test (``p_value``: cells with expected count below 5 pooled into one; a draw of a
continuation of probability 0 is a p-value of 0). Every mode must give p > ``ALPHA``; the negative controls, run
with the same draws and the same test, must give p < ``ALPHA``.

Modes: plain ``generate(do_sample=True)`` (checks the enumeration itself); speculative with the draft equal to
the target (every round accepts its 2 draft tokens and ends with a bonus token), with a perturbed draft
(partial acceptance: recovered tokens from the residual), with a model-free drafter that reports its true
draft distribution, with the adaptive policy's prompt-lookup tail (one sampled draft token, then a one-hot
lookup token); lookahead with a memory that has seen the prompt (deterministic tries from the first round on).
Negative controls: a drafter that samples from one distribution and reports another; sampling without the
processors, tested against the processed target; and the loop's processors run at the wrong prefix (every trie
row processed with the committed tokens only, ignoring the node's own path).

Statistics: alpha = 1e-3 per test, fixed seeds (and a virtual clock, ``tests/clock.py``, so that the policies'
decisions and hence the random draws are the same on every CPU): a correct mode fails by chance with
probability 1e-3 for an unlucky seed, and then fails deterministically until the seed changes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

import hf_specdec
from hf_specdec import integration, loop
from hf_specdec import verify as verify_module
from hf_specdec.costmodel import Estimates
from hf_specdec.drafters.base import PerRow
from hf_specdec.policy import Planner
from hf_specdec.round import Offer, Proposal, Source, SourceKind
from hf_specdec.stats import last_spec_stats
from hf_specdec.verify import Verdict
from tests.clock import VirtualClock
from tests.conftest import perturbed_copy

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V = 8
NEW = 4
PROMPT = torch.tensor([[6, 2, 4, 6, 2, 4, 6, 2]])  # repetitive: prompt lookup and lookahead find continuations
SAMPLING = dict(temperature=1.2, top_k=4, top_p=0.9, repetition_penalty=1.3)
RAW = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)  # every processor a no-op
ALPHA = 1e-3
DRAWS = 1200
MIN_EXPECTED = 5.0


def sampling_model(seed: int = 0, head_scale: float = 20.0, layers: int = 1):
    """One layer (or ``layers``), vocabulary V; the output layer scaled up so that the logits spread over a few
    units (random init gives an almost uniform distribution, on which temperature, top-k/p and penalties do
    little)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return model


def processors(temperature, top_k, top_p, repetition_penalty) -> LogitsProcessorList:
    """What transformers' ``_get_logits_processor`` builds for these settings, in its order."""
    built = LogitsProcessorList()
    if repetition_penalty != 1.0:
        built.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        built.append(TemperatureLogitsWarper(temperature))
    if top_k:
        built.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        built.append(TopPLogitsWarper(top_p))
    return built


@torch.no_grad()
def exact_distribution(model, prompt, num_new, logits_processor) -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation of positive probability: the product over its prefixes of the
    processed target distribution (a full forward per prefix, no cache)."""
    found: dict[tuple[int, ...], float] = {}

    def extend(ids, probability):
        if ids.shape[1] - prompt.shape[1] == num_new:
            found[tuple(ids[0, prompt.shape[1]:].tolist())] = probability
            return
        scores = logits_processor(ids, model(ids).logits[:, -1].float())
        probs = torch.softmax(scores.double(), dim=-1)[0]
        for token in probs.nonzero()[:, 0].tolist():
            extend(torch.cat([ids, torch.tensor([[token]])], dim=1), probability * float(probs[token]))

    extend(prompt, 1.0)
    return found


def p_value(counts: Counter, probs: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit of ``counts`` (continuation -> draws) to ``probs`` (continuation -> exact
    probability). Cells whose expected count is below MIN_EXPECTED are pooled into one (merged into the smallest
    kept cell if the pool itself is below it); the pooling depends on the expected counts only. A draw of a
    continuation of probability 0 gives 0.0."""
    total = sum(counts.values())
    if any(probs.get(seq, 0.0) <= 0.0 for seq in counts):
        return 0.0
    observed, expected, pool_observed, pool_expected = [], [], 0, 0.0
    for seq in sorted(probs, key=probs.get, reverse=True):
        if total * probs[seq] >= MIN_EXPECTED:
            observed.append(counts[seq])
            expected.append(total * probs[seq])
        else:
            pool_observed += counts[seq]
            pool_expected += total * probs[seq]
    if pool_expected > 0:
        if pool_expected >= MIN_EXPECTED or not expected:
            observed.append(pool_observed)
            expected.append(pool_expected)
        else:
            observed[-1] += pool_observed
            expected[-1] += pool_expected
    dof = len(expected) - 1
    if dof < 1:
        return 1.0
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def assert_fits(counts, probs):
    p = p_value(counts, probs)
    print(f"p = {p:.3g} over {sum(counts.values())} draws (must be > {ALPHA})")
    assert p > ALPHA, f"p = {p:.3g}: the draws do not follow the distribution"


def assert_rejected(counts, probs):
    p = p_value(counts, probs)
    print(f"p = {p:.3g} over {sum(counts.values())} draws (must be < {ALPHA})")
    assert p < ALPHA, f"p = {p:.3g}: the test cannot tell these draws from the distribution"


@pytest.fixture(scope="module")
def target():
    return sampling_model()


@pytest.fixture(scope="module")
def exact(target):
    return exact_distribution(target, PROMPT, NEW, processors(**SAMPLING))


@pytest.fixture(scope="module")
def exact_raw(target):
    return exact_distribution(target, PROMPT, NEW, processors(**RAW))


@pytest.fixture(scope="module")
def draft(target):
    """A perturbed copy (about 2/3 of its sampled tokens accepted); made before any clock wraps the target's
    forward, which a deep copy would share."""
    return perturbed_copy(target, 0.01)


@pytest.fixture
def clock(monkeypatch, target):
    """Flat virtual costs: any forward 1 s, so verifying more tokens is free and every decision is reproducible."""
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, target, lambda n: 1.0, name="target")
    return clock


def draw(model, draws, seed, **kwargs):
    """``draws`` continuations sampled by ``model.generate(PROMPT, ...)``; returns (counts, per-call stats)."""
    torch.manual_seed(seed)
    counts, stats = Counter(), []
    for _ in range(draws):
        out = model.generate(PROMPT, do_sample=True, max_new_tokens=NEW, **kwargs)
        counts[tuple(out[0, PROMPT.shape[1]:].tolist())] += 1
        stats.append(last_spec_stats(model))
    return counts, stats


def speculative(draft, policy="fixed", **config):
    return dict(custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                spec_config=hf_specdec.SpecConfig(policy=policy, **config))


class FixedDistributionDrafter:
    """A model-free row drafter (``drafters/base.py``, ``RowDrafter``): each draft token is drawn from
    ``sample_from`` [V]; its Proposal reports ``reported`` as the distribution the tokens were drawn from. Honest
    when the two agree. ``fixed_distribution(...)`` runs one per row of the batch."""

    def __init__(self, sample_from: torch.Tensor, reported: torch.Tensor) -> None:
        self.sample_from, self.reported = sample_from, reported

    def prefill(self, view):
        pass

    def offer(self, view):
        return Offer(model_tokens=view.budget)

    def propose(self, view, plan):
        n = plan.model_tokens
        tokens = torch.multinomial(self.sample_from, n, replacement=True) if n else torch.zeros(0, dtype=torch.long)
        return Proposal.chain(tokens.tolist(), [Source(SourceKind.DRAFT, 0, i) for i in range(1, n + 1)],
                              self.reported.expand(n, V).clone() if n else None, draft_forwards=n)

    def update(self, outcome):
        pass

    def release(self):
        pass


def fixed_distribution(sample_from: torch.Tensor, reported: torch.Tensor) -> PerRow:
    return PerRow(lambda: FixedDistributionDrafter(sample_from, reported))


DRAFT_LOGITS = torch.tensor([2.0, 1.5, 0.0, 1.0, -1.0, 0.5, 1.0, 0.0])
HONEST_Q = torch.softmax(DRAFT_LOGITS, -1)


def sum_stats(stats, name):
    return sum(getattr(s, name) for s in stats)


# -- the helper itself ------------------------------------------------------------------------------------------------
def test_p_value_helper():
    probs = {(0,): 0.5, (1,): 0.3, (2,): 0.15, (3,): 0.05}
    assert p_value(Counter({(0,): 500, (1,): 300, (2,): 150, (3,): 50}), probs) == pytest.approx(1.0)
    # 60 : 40 against 1/2 : 1/2 is a chi-square of 4 on one degree of freedom: p = 0.0455
    assert p_value(Counter({(0,): 60, (1,): 40}), {(0,): 0.5, (1,): 0.5}) == pytest.approx(0.0455, abs=1e-4)
    assert p_value(Counter({(0,): 999, (4,): 1}), probs) == 0.0  # an impossible draw
    assert p_value(Counter({(0,): 600, (1,): 250, (2,): 120, (3,): 30}), probs) < ALPHA


def test_hand_built_processors_are_what_transformers_builds(target):
    config = GenerationConfig(do_sample=True, **SAMPLING)
    built = target._get_logits_processor(generation_config=config, input_ids_seq_length=PROMPT.shape[1],
                                         device="cpu")
    mine = processors(**SAMPLING)
    assert [type(p) for p in built] == [type(p) for p in mine]
    ids, logits = torch.tensor([[1, 2, 5, 2]]), torch.randn(3, V) * 3
    for row in logits:
        assert torch.equal(built(ids, row[None].clone()), mine(ids, row[None].clone()))


def test_the_processors_matter_for_this_target(target, exact, exact_raw):
    """Each processor changes the target's distribution noticeably (else the tests below could not see it)."""
    assert 10 <= len(exact) < len(exact_raw)  # top-k/p cut the support, and leave enough cells to test
    for name, neutral in RAW.items():
        without = exact_distribution(target, PROMPT, NEW, processors(**{**SAMPLING, name: neutral}))
        tv = 0.5 * sum(abs(exact.get(s, 0.0) - without.get(s, 0.0)) for s in set(exact) | set(without))
        assert tv > 0.05, (name, tv)


# -- modes that must reproduce the target ---------------------------------------------------------------------------
def test_plain_generate_matches_the_enumerated_distribution(target, exact):
    """Checks the enumeration (and the processors' order) against transformers' own sampler."""
    counts, _ = draw(target, DRAWS, seed=1, **SAMPLING)
    assert_fits(counts, exact)


def test_speculative_draft_equal_to_target(target, exact, clock):
    """k = 4 >= what is left after the first token: every round drafts 2, accepts both and adds a bonus token."""
    counts, stats = draw(target, DRAWS, seed=2, **SAMPLING, **speculative(target, num_draft_tokens=4))
    assert all(s.round_log[1:] == [(2, 3)] for s in stats[:100]), stats[0].round_log
    assert sum_stats(stats, "accepted") >= 0.99 * sum_stats(stats, "drafted") > 0
    assert_fits(counts, exact)


def test_speculative_perturbed_draft(target, draft, exact, clock):
    """A draft that mostly agrees: rejections, recovered tokens from the residual, and bonus tokens."""
    counts, stats = draw(target, DRAWS, seed=3, **SAMPLING, **speculative(draft, num_draft_tokens=4))
    accepted, drafted = sum_stats(stats, "accepted"), sum_stats(stats, "drafted")
    assert 0.3 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
    assert_fits(counts, exact)


def test_speculative_honest_model_free_drafter(target, exact, clock):
    drafter = fixed_distribution(HONEST_Q, HONEST_Q)
    counts, stats = draw(target, DRAWS, seed=4, **SAMPLING, **speculative(drafter, num_draft_tokens=4))
    assert 0 < sum_stats(stats, "accepted") < sum_stats(stats, "drafted")
    assert_fits(counts, exact)


def seeded_adaptive(monkeypatch):
    """The adaptive policy, starting from measurements (flat t(n) = 1 s, t_d = 0.01 s, as the virtual clock
    charges) instead of measuring a plain step and a draft round first: with NEW = 4 tokens it would never get
    to a round with a prompt-lookup tail."""

    def make_policy(config, estimates=None, width=None, reads_wait=False):
        seeded = Estimates()
        for n in range(1, 40):
            seeded.forward.observe(n, 1.0)
        seeded.draft_step.observe(1, 0.01)
        return Planner.speculative(config, seeded, width, reads_wait)

    monkeypatch.setattr(integration, "make_policy", make_policy)


def test_speculative_adaptive_with_prompt_lookup_tail(target, draft, exact, clock, monkeypatch):
    """One sampled draft token (max_draft_tokens=1), then prompt lookup's continuation of the repetitive prompt
    as a one-hot row in draft_probs, then the bonus token. A chain's tail (``tree="off"``): at these flat costs
    ``tree="auto"`` verifies the draft's siblings instead (tests/test_tree.py samples those)."""
    seeded_adaptive(monkeypatch)
    clock.charge(monkeypatch, draft, lambda n: 0.01, name="draft")
    counts, stats = draw(target, DRAWS, seed=5, **SAMPLING,
                         **speculative(draft, policy="adaptive", num_draft_tokens=1, max_draft_tokens=1, tree="off"))
    assert sum_stats(stats, "draft_forwards") > 0
    print(f"lookup tokens: {sum_stats(stats, 'lookup_drafted')} drafted, {sum_stats(stats, 'lookup_accepted')} accepted")
    assert sum_stats(stats, "lookup_drafted") > 0.05 * DRAWS, sum_stats(stats, "lookup_drafted")
    assert sum_stats(stats, "lookup_accepted") > 0
    assert_fits(counts, exact)


def test_lookahead_with_a_memory_of_the_prompt(target, exact, clock):
    """Tries (prompt lookup, the memory of an earlier call, recycled choices) from the first round on."""
    memory = hf_specdec.LookaheadMemory()
    target.generate(PROMPT, custom_generate=hf_specdec.lookahead_generate, lookahead_memory=memory,
                    max_new_tokens=16, do_sample=False)  # the prompt seen once, t(1) measured
    counts, stats = draw(target, DRAWS, seed=6, **SAMPLING, custom_generate=hf_specdec.lookahead_generate,
                         lookahead_memory=memory)
    # the first round always verifies a trie; a plain round only comes last, when no room is left for guesses
    assert all(s.draft_length_hist[0] == 0 or s.round_log[-1] == (0, 1) for s in stats)
    assert all(s.drafted_per_position and s.drafted_per_position[0] >= 1 for s in stats)
    assert sum(s.round_log[1] == (2, 3) for s in stats) > DRAWS / 2  # two guesses kept, then the bonus token
    assert sum_stats(stats, "accepted") > 0.2 * DRAWS
    assert_fits(counts, exact)


# -- negative controls: the same test must reject these ---------------------------------------------------------------
def test_rejects_a_drafter_that_reports_other_draft_probs(target, exact, clock):
    """Tokens drawn from a sharper distribution than the one reported: rejection sampling is then biased."""
    sharper = torch.softmax(DRAFT_LOGITS * 3, -1)
    drafter = fixed_distribution(sharper, HONEST_Q)
    counts, stats = draw(target, DRAWS, seed=4, **SAMPLING, **speculative(drafter, num_draft_tokens=4))
    assert sum_stats(stats, "accepted") > 0
    assert_rejected(counts, exact)


def test_rejects_sampling_without_the_processors(target, exact, exact_raw, clock):
    """Speculative sampling with every processor off follows the raw target, which the test tells apart from
    the processed one (and accepts as the raw one: it is the processors it sees)."""
    counts, _ = draw(target, DRAWS, seed=7, **RAW, **speculative(target, num_draft_tokens=4))
    assert_rejected(counts, exact)
    assert_fits(counts, exact_raw)


def test_rejects_recovered_tokens_drawn_from_the_target_instead_of_the_residual(target, draft, exact, clock,
                                                                                monkeypatch):
    """The classic mistake in rejection sampling: after a rejection, the recovered token drawn from p instead of
    norm(max(0, p - q)). Accept/reject decisions stay the real ones; only the recovered token changes."""
    real = verify_module.verify_tree_sampled

    def recovered_from_p(tokens, parents, draft_probs, target_probs, uniforms=None):
        verdict = real(tokens, parents, draft_probs, target_probs, uniforms)
        if verdict.num_accepted == len(tokens):  # a bonus token: right as it is
            return verdict
        row = 1 + verdict.accepted[-1] if verdict.accepted else 0
        return Verdict(verdict.accepted, int(torch.multinomial(target_probs[row], 1)))

    monkeypatch.setattr(verify_module, "verify_tree_sampled", recovered_from_p)
    counts, stats = draw(target, DRAWS, seed=3, **SAMPLING, **speculative(draft, num_draft_tokens=4))
    assert sum_stats(stats, "accepted") < sum_stats(stats, "drafted")  # rejections happened
    assert_rejected(counts, exact)


def test_rejects_processors_at_the_wrong_prefix(target, exact, clock, monkeypatch):
    """A loop that processes every trie row with the committed tokens only (the repetition penalty then misses
    the round's own draft tokens) is caught: the processors must see each node's path."""

    def committed_prefix_only(inputs, requests):  # per request: (row, committed ids, proposal, logits)
        return [torch.cat([inputs.logits_processor(ids, logits[i: i + 1]) for i in range(logits.shape[0])])
                for _, ids, _, logits in requests]

    monkeypatch.setattr(loop, "_process", committed_prefix_only)
    counts, _ = draw(target, DRAWS, seed=2, **SAMPLING, **speculative(target, num_draft_tokens=4))
    assert_rejected(counts, exact)


# -- early-exit self-drafting (drafters/early_exit.py) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def two_layers():
    """Two layers, so that the first one can draft for both (``EarlyExit(1)``)."""
    return sampling_model(seed=1, layers=2)


@pytest.fixture(scope="module")
def exact_two_layers(two_layers):
    return exact_distribution(two_layers, PROMPT, NEW, processors(**SAMPLING))


class MisreportedEarlyExit:
    """The early-exit draft's chain with its distributions misreported: each row sharpened (q^3, normalised), while
    the tokens were drawn from q itself. A negative control: rejection sampling is then biased."""

    def __init__(self, target) -> None:
        from hf_specdec.drafters.draft_model import DraftModelDrafter
        from hf_specdec.drafters.early_exit import early_exit_model

        self.inner = DraftModelDrafter(early_exit_model(target, 1), processors(**SAMPLING), do_sample=True,
                                       vocab_size=V)

    def propose(self, views, plans):
        def sharpened(q):
            return None if q is None else q.pow(3) / q.pow(3).sum(-1, keepdim=True)

        return [dataclasses.replace(p, draft_probs=sharpened(p.draft_probs)) for p in self.inner.propose(views, plans)]

    def __getattr__(self, name):  # prefill, offer, update, cache_bytes, release: the early-exit drafter's own
        return getattr(self.inner, name)


def test_speculative_early_exit_draft(two_layers, exact_two_layers, monkeypatch):
    """The first layer of two drafts (its own processed distribution, sampled): rejections, recovered tokens and
    bonus tokens, and exactly the two-layer target's distribution."""
    from hf_specdec.drafters.early_exit import EarlyExit

    VirtualClock(monkeypatch).charge(monkeypatch, two_layers, lambda n: 1.0, name="target")
    counts, stats = draw(two_layers, DRAWS, seed=8, **SAMPLING, **speculative(EarlyExit(1), num_draft_tokens=4))
    accepted, drafted = sum_stats(stats, "accepted"), sum_stats(stats, "drafted")
    print(f"early exit: {accepted} of {drafted} draft tokens accepted")  # 2160 of 2527
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert_fits(counts, exact_two_layers)


def test_rejects_an_early_exit_draft_with_misreported_probs(two_layers, exact_two_layers, monkeypatch):
    VirtualClock(monkeypatch).charge(monkeypatch, two_layers, lambda n: 1.0, name="target")
    counts, stats = draw(two_layers, DRAWS, seed=8, **SAMPLING,
                         **speculative(MisreportedEarlyExit(two_layers), num_draft_tokens=4))
    assert sum_stats(stats, "accepted") > 0
    assert_rejected(counts, exact_two_layers)
