"""``costmodel.RoundCost`` is the one price of a round: each kind of round it prices equals the arithmetic the
planner's decisions were made on (a chain, a tree, a trie with holes, a finished round), the regret allowance is
the planner's decision, and a compiled verify's buckets (``width``) reach every price."""

import pytest
import torch

import hf_specdec
from hf_specdec.config import LookaheadConfig, SpecConfig
from hf_specdec.costmodel import Bound, ForwardCost, RoundCost, best_round, prefix_gains
from hf_specdec.models.profile import HardwareProfile
from hf_specdec.policy import EmaName, Planner, TrieChoice, expected_tree, tree_rate_bounds
from hf_specdec.round import (Candidate, Proposal, RoundKind, RoundOutcome, RoundPlan, Source, SourceKind,
                              TreeShape)
from hf_specdec.stats import SpecStats
from tests.clock import VirtualClock
from tests.conftest import perturbed_copy, tiny_model

FLAT = {1: 0.10, 2: 0.10, 4: 0.11, 8: 0.12, 16: 0.20}
STEEP = {1: 0.10, 2: 0.175, 4: 0.30, 8: 0.55}


@pytest.mark.parametrize("table", [FLAT, STEEP])
def test_a_chain_is_k_draft_steps_and_a_forward_over_k_plus_one(table):
    cost = ForwardCost.from_table(table)
    price = RoundCost(cost, t_draft=0.02)
    for k in range(0, 10):
        assert price.round(k) == pytest.approx(k * 0.02 + cost.estimate(k + 1))
        assert price.round(k, extra=3, bound=Bound.WORST) == pytest.approx(
            k * 0.02 + cost.estimate(k + 4, extrapolate=True))
    assert RoundCost(cost).round(2) is None and RoundCost(cost).round(0) == cost.estimate(1)  # no draft step known
    assert RoundCost(cost, t_draft=0.02, read=0.5).round(2, with_read=True) == pytest.approx(price.round(2) + 0.5)


def test_a_tree_is_a_draft_forward_per_depth_and_the_verify_with_its_holes():
    cost = ForwardCost.from_table(STEEP)
    draft = ForwardCost.from_table({1: 0.01, 2: 0.012, 8: 0.03})
    price = RoundCost(cost, rows=2, t_draft=draft.estimate(2), hole=1e-3, draft=draft.estimate)
    shape = TreeShape(nodes=(2, 2, 1), expanded=(1, 2, 1), children=2)
    drafts = draft.estimate(2) + draft.estimate(4) + draft.estimate(2)  # every row's inputs
    verify = cost.estimate(2 * 6, extrapolate=True) + 2 * (5 - 3) * 1e-3  # 2 nodes per row off the deepest path
    assert price.tree(shape) == pytest.approx(drafts + verify)
    assert RoundCost(cost, rows=2, t_draft=0.01).tree(shape) is None  # a depth reads 2 a row: unpriced


def test_the_planner_s_tree_is_priced_by_the_round_cost():
    policy = Planner.speculative(SpecConfig(tree="on"))
    policy.estimates.draft_step.observe(1, 0.01)
    for n in range(1, 34):
        policy.estimates.forward.observe(n, 0.10 + 0.001 * n)
    price = policy.price()
    choice = policy.tree(price, 8)
    assert choice is not None and choice.seconds == price.tree(choice.shape)


def test_a_trie_leaves_its_nodes_off_the_deepest_candidate_as_holes():
    planner = Planner.lookahead(LookaheadConfig())
    for n, seconds in FLAT.items():
        planner.estimates.forward.observe(n, seconds)
    planner.estimates.ema(EmaName.HOLE_SECONDS).update(2e-3)
    price = planner.price()
    assert price.trie(5, deepest=3) == pytest.approx(planner.estimates.forward.estimate(6) + 2 * 2e-3)
    assert price.trie(3, deepest=3) == planner.estimates.forward.estimate(4)
    rows = ((Candidate((1, 2, 3), (SourceKind.HISTORY, 2)), Candidate((1, 5), (SourceKind.HISTORY, 2))),)
    trie = TrieChoice(rows, nodes=4, emitted=2.5)
    assert planner._trie_rate(price, trie) == pytest.approx(2.5 / price.trie(4, deepest=3))


def test_the_regret_allowance_is_the_planner_s_decision():
    """A size priced by a profile's seed past the largest measured is priced as measured only when the planner
    says a round may lose the difference; the price holds no allowance of its own."""
    cost = ForwardCost.from_table({1: 0.10, 4: 0.20, 8: 0.30}, prior=True)
    cost.observe(1, 0.10)
    cost.observe(4, 0.11)
    assert RoundCost(cost)(8) == pytest.approx(0.2325)  # the seed, at the level measured here
    assert RoundCost(cost, may_lose=lambda seconds: seconds <= 0.2)(8) == 0.11
    planner = Planner.speculative(SpecConfig())
    planner.estimates.forward = cost
    assert planner.price().may_lose == planner.regret.allows
    assert planner.price()(8) == pytest.approx(0.2325)  # nothing earned yet
    for _ in range(100):  # plain steps earn credit
        planner.regret.observe(0.1, 1, 0.1, guessed=False)
    assert planner.regret.allows(0.2325 - 0.11) and planner.price()(8) == 0.11


def outcome(row: int, rows: int, drafted: int, kept: int, verify: float, draft: float, setup: float = 0.0,
            compact: float = 0.0) -> RoundOutcome:
    proposal = Proposal(tokens=tuple(range(drafted)), parents=tuple(range(-1, drafted - 1)),
                        sources=tuple((Source(SourceKind.DRAFT, 0, d + 1),) for d in range(drafted)),
                        confidences=(0.9,) * drafted, draft_time=draft, draft_forwards=drafted, setup_time=setup)
    return RoundOutcome(proposal, accepted=tuple(range(kept)), next_token=7, emitted=tuple(range(kept + 1)),
                        start_length=4, forward_tokens=rows * (drafted + 1), verify_time=verify, row=row, rows=rows,
                        plan=RoundPlan(model_tokens=drafted), compact_time=compact)


def test_a_finished_round_costs_what_it_took_against_plain_steps_of_its_rows():
    planner = Planner.speculative(SpecConfig())
    for n, seconds in {2: 0.2, 4: 0.22, 8: 0.3}.items():
        planner.estimates.forward.observe(n, seconds)
    planner.regret.lost = planner.regret.plain_seconds = 0.0
    outcomes = [outcome(0, 2, 3, 2, verify=0.25, draft=0.03, setup=0.1, compact=0.01),
                outcome(1, 2, 3, 0, verify=0.25, draft=0.03)]
    spent = 0.25 + 0.01 + 0.03 + 0.1 + 0.03
    assert RoundCost.spent(outcomes) == pytest.approx(spent)
    planner.observe(outcomes)
    step = planner.estimates.forward.estimate(2) / 2  # a plain step of 2 rows, per row (after this round's forward)
    assert planner.regret.lost == pytest.approx(spent - 4 * step)
    assert planner.regret.plain_seconds == pytest.approx(4 * step)


def test_a_compiled_verify_prices_each_forward_at_its_bucket():
    cost = ForwardCost.from_table({1: 0.10, 4: 0.12, 8: 0.16, 16: 0.3})

    def bucket(n: int) -> int:
        return next(width for width in (1, 4, 8, 16) if width >= n)

    price = RoundCost(cost, t_draft=0.01, width=bucket)
    assert price(5) == cost.estimate(8) and price(3) == cost.estimate(4) and price.step() == cost.estimate(1)
    assert price.round(4) == pytest.approx(0.04 + cost.estimate(8))
    planner = Planner.speculative(SpecConfig(), width=bucket)
    for n, seconds in {1: 0.10, 4: 0.12, 8: 0.16, 16: 0.3}.items():
        planner.estimates.forward.observe(n, seconds)
    planner.estimates.draft_step.observe(1, 0.01)
    assert planner.price().width is bucket and planner.price()(2) == cost.estimate(4)
    assert planner.rule().price.round(2) == pytest.approx(0.02 + cost.estimate(4))


def test_the_hardware_profile_prices_by_the_round_cost():
    profile = HardwareProfile.from_numbers({"bf16": {1: 0.2, 4: 0.21, 8: 0.26}}, prefill_per_token={"bf16": 0.002})
    price = RoundCost(profile.target_cost("bf16"))
    assert profile.verify_cost("bf16", 16) == pytest.approx(price(16, Bound.WORST) / price.step())
    assert profile.prefill_seconds("bf16", 4) == pytest.approx(price(4))  # a short prompt reads every weight once
    bare = HardwareProfile.from_numbers({"bf16": {1: 0.2, 4: 0.21, 8: 0.26}})
    assert bare.prefill_seconds("bf16", 64) == pytest.approx(price(64, Bound.WORST))


def test_each_round_kind_pays_its_host_work_and_the_planner_learns_it_per_kind():
    cost = ForwardCost.from_table(FLAT)
    host = {RoundKind.PLAIN: 0.001, RoundKind.CHAIN: 0.002, RoundKind.TREE: 0.004, RoundKind.TRIE: 0.003}
    bare, price = RoundCost(cost, t_draft=0.02), RoundCost(cost, t_draft=0.02, host=host.get)
    shape = TreeShape(nodes=(2, 1), expanded=(1, 1), children=2)
    assert price.step() == pytest.approx(bare.step() + 0.001)
    assert price.round(0) == pytest.approx(bare.round(0) + 0.001)
    assert price.round(3) == pytest.approx(bare.round(3) + 0.002)
    assert price.tree(shape) == pytest.approx(bare.tree(shape) + 0.004)
    assert price.trie(4, 2) == pytest.approx(bare.trie(4, 2) + 0.003)

    planner = Planner.speculative(SpecConfig())
    for n in (1, 4):
        planner.estimates.forward.observe(n, 0.1)
    plans = {RoundKind.PLAIN: RoundPlan(), RoundKind.CHAIN: RoundPlan(model_tokens=3),
             RoundKind.TREE: RoundPlan(model_tokens=2, tree=shape)}
    for kind, plan in plans.items():
        planner.observe([RoundOutcome(Proposal(), accepted=(), next_token=0, emitted=(0,), start_length=10,
                                      forward_tokens=1, verify_time=0.1, plan=plan, host_time=host[kind])])
    assert {kind: planner.estimates.host_seconds(kind) for kind in plans} == {k: host[k] for k in plans}
    assert planner.estimates.host_seconds(RoundKind.TRIE) == host[RoundKind.PLAIN]  # no trie round yet: a plain one's
    assert planner.price().round(3) == pytest.approx(planner.price().round(3, bound=Bound.EXPECTED))
    assert planner.price().host_seconds(RoundKind.TREE) == 0.004


def test_a_tree_whose_host_work_costs_more_than_its_extra_tokens_is_not_grown():
    """A flat t(n) (a GPU, a tiny model): a tree beats the chain on forwards alone; with the tree's host work a
    round priced in (a shape search, masks, gathers: measured), the chain wins, and the shapes are not priced."""
    policy = Planner.speculative(SpecConfig(tree="auto"))
    policy.estimates.draft_step.observe(1, 0.01)
    for n in range(1, 34):
        policy.estimates.forward.observe(n, 0.10)
    assert policy.tree(policy.price(), 8) is not None  # no host work measured: the tree (the priors' acceptance)
    policy.estimates.host[RoundKind.CHAIN].update(0.002)
    policy.estimates.host[RoundKind.TREE].update(0.08)  # as much as a forward
    price = policy.price()
    assert policy.tree(price, 8) is None
    rates = [policy.acceptance((SourceKind.DRAFT, rank)).rates(8) for rank in range(4)]
    chain = best_round(price, prefix_gains(rates[0]), 8)
    assert max(tree_rate_bounds(price, expected_tree(rates, 31))) <= chain.rate  # decided by the bounds alone


def test_the_loop_measures_each_round_s_host_work_for_the_planner(monkeypatch):
    """On a virtual clock (forwards 1 s, draft steps 0.05 s: drafting pays on any machine) where each round's
    learning (``SpecStats.record``) takes 0.25 s and nothing else outside the forwards takes any: every round's
    host time is the learning of the round before, learned per kind, and the price holds it."""
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    draft = perturbed_copy(model, 0.02)
    prompt = torch.tensor([[5, 17, 42, 8, 23, 61, 2, 9]])
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, lambda n: 1.0)
    clock.charge(monkeypatch, draft, lambda n: 0.05)
    record = SpecStats.record

    def slow_record(self, outcomes):
        clock.now += 0.25
        return record(self, outcomes)

    monkeypatch.setattr(SpecStats, "record", slow_record)
    out = model.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, model.generate.__wrapped__(prompt, max_new_tokens=24, do_sample=False))
    assert model.last_spec_stats.get().accepted > 0  # it drafted: chain rounds were timed
    estimates = model.speculative_memory.estimates(draft)
    assert estimates.host_seconds(RoundKind.CHAIN) == pytest.approx(0.25)
    assert Planner.speculative(SpecConfig(), estimates).price().host_seconds(RoundKind.CHAIN) == pytest.approx(0.25)
