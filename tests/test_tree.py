"""Draft-model trees (``SpecConfig(tree=...)``, ``drafters/draft_tree.py``): exact output, sized by measured cost.

- greedy parity (fp32, tiny models) with ``tree="on"``: a draft equal to the target, a random draft, a perturbed
  draft (partial acceptance), a batch of two left-padded rows and a stop string inside an accepted branch; each
  proves it verified trees (``stats.tree_rounds``: rounds whose guesses branched) under injected costs
  (``tests/clock.py``), so the planner's choices are the same on every machine;
- sampling: the draft's siblings are drawn without replacement, each reported as the distribution it was drawn
  from, and the sampled continuations follow the target's processed distribution exactly (the chi-square test of
  ``tests/test_sampling.py``), with sibling nodes provably accepted; the negative control reports q itself for
  every sibling (the mistake recursive rejection sampling must not make) and is rejected by the same test;
- the planner: ``tree="auto"`` picks the chain (or a plain step) where t(n) is steep and a tree where it is flat,
  never a tree where the chain is faster (an expensive wide draft forward, siblings that are never kept).
"""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM

import hf_specdec
from hf_specdec.config import SpecConfig
from hf_specdec.costmodel import Bound, ForwardCost, RoundKind
from hf_specdec.drafters import draft_tree
from hf_specdec import policy as policy_module
from hf_specdec.policy import Planner, expected_tree, tree_prefixes
from hf_specdec.round import Offer, Proposal, RoundOutcome, RoundPlan, RowView, Source, SourceKind, TreeShape
from hf_specdec.stats import SpecStats
from hf_specdec.support import Unsupported
from tests.clock import VirtualClock
from tests.conftest import char_tokenizer, perturbed_copy, tiny_model
from tests.test_sampling import (DRAWS, NEW, PROMPT, SAMPLING, V, assert_fits, assert_rejected, exact_distribution,
                                 processors, sampling_model)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TREE = SpecConfig(tree="on", history_lookup=False)  # trees in every drafting round, no prompt-lookup rounds
LENGTH = 40


def paying(draft, largest=80):
    """Flat target forwards (1 s for any size) and a draft step of 0.01 s (its prompt read 1% of the target's), as
    the virtual clock charges them."""
    memory = hf_specdec.SpeculativeMemory()
    memory.seed(draft, forward_seconds={n: 1.0 for n in range(1, largest + 1)}, draft_step_seconds=0.01,
                draft_read_share=0.01)
    return memory


def charged(monkeypatch, target, draft):
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, target, lambda n: 1.0, name="target")
    clock.charge(monkeypatch, draft, lambda n: 0.01, name="draft")
    return clock


def plain(model, prompt, **kwargs):
    return type(model).generate(model, prompt, max_new_tokens=LENGTH, do_sample=False, **kwargs)


def trees(model, draft, prompt, config=TREE, **kwargs):
    return model.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                          spec_config=config, speculative_memory=paying(draft), max_new_tokens=LENGTH,
                          do_sample=False, **kwargs)


def assert_every_drafting_round_was_a_tree(stats):
    drafting = stats.rounds - stats.rounds_spec_off - stats.rows  # the prefill is round 0 of each row
    assert stats.tree_rounds == drafting > 0, (stats.tree_rounds, drafting)


# -- greedy parity ------------------------------------------------------------------------------------------------
def test_a_draft_equal_to_the_target_has_its_first_choices_kept(target, prompt, monkeypatch):
    draft = copy.deepcopy(target)  # the same weights, its own forward to charge
    charged(monkeypatch, target, draft)
    out = trees(target, draft, prompt)
    assert torch.equal(out, plain(target, prompt))
    stats = target.last_spec_stats.get()
    assert_every_drafting_round_was_a_tree(stats)
    ranks = {rank for _, rank in stats.judged_by_depth_rank}
    assert ranks >= {0, 1}  # siblings were verified ...
    assert all(stats.accepted_by_depth_rank[depth, rank] == (stats.judged_by_depth_rank[depth, rank] if rank == 0
                                                             else 0) for depth, rank in stats.judged_by_depth_rank)


def test_a_random_draft(target, random_draft, prompt, monkeypatch):
    charged(monkeypatch, target, random_draft)
    out = trees(target, random_draft, prompt)
    assert torch.equal(out, plain(target, prompt))
    stats = target.last_spec_stats.get()
    assert stats.tree_rounds > 0 and stats.drafted > 0


def test_a_perturbed_draft_partial_acceptance_of_first_and_second_choices(target, close_draft, prompt, monkeypatch):
    charged(monkeypatch, target, close_draft)
    out = trees(target, close_draft, prompt)
    assert torch.equal(out, plain(target, prompt))
    stats = target.last_spec_stats.get()
    assert_every_drafting_round_was_a_tree(stats)
    assert 0 < stats.accepted < stats.drafted
    kept_by_rank = {rank: 0 for rank in range(4)}
    for (_, rank), kept in stats.accepted_by_depth_rank.items():
        kept_by_rank[rank] += kept
    assert kept_by_rank[0] > 0 and kept_by_rank[1] > 0, kept_by_rank  # a second choice was the target's
    reported = json.loads(json.dumps(stats.to_dict()))  # as the eval harness writes it
    assert reported["acceptance_by_depth_rank"]["1/0"] == stats.acceptance_by_depth_rank[1, 0]
    assert reported["tree_rounds"] == stats.tree_rounds and reported["tokens_per_forward"] > 1.0
    assert "tree rounds" in stats.summary()


def test_streamed_rounds_say_which_were_trees_and_the_demo_plot_marks_them(target, close_draft, prompt,
                                                                           monkeypatch):
    from hf_specdec.demo import panes
    from hf_specdec.harness.streaming import RoundStreamer

    charged(monkeypatch, target, close_draft)
    chunks = []
    streamer = RoundStreamer(on_chunk=lambda *chunk: chunks.append(chunk))
    out = trees(target, close_draft, prompt, spec_streamer=streamer)  # custom_generate: generate keeps streamer=
    assert torch.equal(out, plain(target, prompt))
    stats = target.last_spec_stats.get()
    assert sum(1 for paths in streamer.paths if paths > 1) == stats.tree_rounds > 0
    assert streamer.paths[0] == 0  # the prefill's token: nothing verified
    run = panes.PaneRun("hf_specdec", "hf_specdec", drafts=True)
    run.start(0.0, lambda ids: " ".join(map(str, ids)))
    for chunk in chunks:
        run.add_round(*chunk)
    assert panes.tree_rounds(run) == [i for i, paths in enumerate(streamer.paths) if paths > 1]
    labels = panes.rounds_figure([run]).axes[0].get_legend_handles_labels()[1]
    assert f"hf_specdec: tree rounds ({stats.tree_rounds} of {len(chunks)})" in labels


def test_batch_rows_each_grow_their_own_tree(target, close_draft, monkeypatch):
    """Two left-padded rows: every round in which a row drafted verified a tree of that row's own (per row, from the
    outcomes the loop hands to the call's stats: ``stats.tree_rounds`` alone sums the rows), some of each row's
    nodes were kept, and each row's output is plain ``generate``'s row."""
    charged(monkeypatch, target, close_draft)
    forwards = []  # per target forward: the outcome of each row it decoded (``RoundOutcome.row``)
    record = SpecStats.record

    def recording(stats, outcomes):
        forwards.append(list(outcomes))
        record(stats, outcomes)

    monkeypatch.setattr(SpecStats, "record", recording)
    prompts = torch.tensor([[0, 0, 5, 17, 42, 8, 23], [3, 9, 11, 61, 2, 9, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    out = trees(target, close_draft, prompts, attention_mask=mask, pad_token_id=0)
    expected = plain(target, prompts, attention_mask=mask, pad_token_id=0)
    assert out.shape == expected.shape
    for row in range(2):
        assert torch.equal(out[row], expected[row]), row
    stats = target.last_spec_stats.get()
    assert stats.rows == 2
    by_row = {row: [o for outcomes in forwards for o in outcomes if o.row == row] for row in range(2)}
    for row, outcomes in by_row.items():
        drafting = [o for o in outcomes if o.proposal.num_tokens]
        assert drafting and all(o.proposal.branches and o.plan.tree is not None for o in drafting), row
        assert sum(o.num_accepted for o in drafting) > 0, row
    assert sum(o.proposal.branches for outcomes in by_row.values() for o in outcomes) == stats.tree_rounds
    # each row's own tree: where both rows drafted in one forward, their trees differ (each grew from its tokens)
    assert any(len(outcomes) == 2 and all(o.proposal.num_tokens for o in outcomes)
               and outcomes[0].proposal.tokens != outcomes[1].proposal.tokens for outcomes in forwards)


def test_a_stop_string_inside_an_accepted_branch(target, prompt, monkeypatch):
    draft = copy.deepcopy(target)
    charged(monkeypatch, target, draft)
    tokenizer = char_tokenizer()
    free = plain(target, prompt)[0, prompt.shape[1]:]
    stop = tokenizer.decode(free[11:13])  # a two-token string
    expected = plain(target, prompt, stop_strings=[stop], tokenizer=tokenizer)
    hf_specdec.enable(target)
    try:
        out = target.generate(prompt, assistant_model=draft, spec_config=TREE, speculative_memory=paying(draft),
                              max_new_tokens=LENGTH, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
        stats = target.last_spec_stats.get()
    finally:
        hf_specdec.disable(target)
    assert torch.equal(out, expected) and tokenizer.decode(out[0, prompt.shape[1]:]).endswith(stop)
    assert_every_drafting_round_was_a_tree(stats)
    accepted, emitted = stats.round_log[-1]
    assert emitted == accepted >= 1  # the stop cut the last round inside its accepted tokens, before its bonus


def test_tree_on_is_refused_where_the_target_cannot_read_a_tree(prompt):
    """Bloom (ALiBi) derives positions from the cache length: no tree; "auto" runs chains there."""
    torch.manual_seed(0)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=2)).eval()
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(bloom.generation_config, name, None)
    with pytest.raises(Unsupported, match=r"SpecConfig\(tree='on'\) needs a target model that reads a tree of "
                                          r"guesses in one forward, and this one cannot \(.*derives positions"):
        bloom.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=bloom, spec_config=TREE,
                       max_new_tokens=4, do_sample=False)
    out = bloom.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=bloom,
                         spec_config=SpecConfig(tree="auto"), speculative_memory=paying(bloom),
                         max_new_tokens=LENGTH, do_sample=False)
    assert torch.equal(out, plain(bloom, prompt))
    assert bloom.last_spec_stats.drafted > 0 and bloom.last_spec_stats.tree_rounds == 0


def test_the_config_refuses_unknown_tree_modes_with_the_fix():
    with pytest.raises(ValueError, match=r"SpecConfig.tree='yes' is invalid: choose one of \['auto', 'on', 'off'\]"):
        SpecConfig(tree="yes")
    with pytest.raises(ValueError, match="use policy='adaptive' with tree='on'"):
        SpecConfig(policy="fixed", tree="on")
    assert SpecConfig().tree == "auto" and SpecConfig.from_dict({"tree": "off"}).tree == "off"


# -- sampling -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampler():
    return sampling_model()


@pytest.fixture(scope="module")
def sampler_exact(sampler):
    return exact_distribution(sampler, PROMPT, NEW, processors(**SAMPLING))


@pytest.fixture(scope="module")
def unsure_draft(sampler):
    """A draft that often ranks the target's choice second: its first choice is rejected often enough for the
    siblings to matter. Made before any clock wraps the target's forward, which a deep copy would share."""
    return perturbed_copy(sampler, 0.03)


def sample_trees(model, draft, seed, draws=DRAWS):
    """``draws`` continuations sampled with trees in every drafting round; (counts, summed stats of interest)."""
    torch.manual_seed(seed)
    memory = paying(draft)
    counts, totals = {}, {"tree_rounds": 0, "sibling_kept": 0, "drafted": 0, "accepted": 0}
    for _ in range(draws):
        out = model.generate(PROMPT, do_sample=True, max_new_tokens=NEW, custom_generate=hf_specdec.speculative_generate,
                             draft_model=draft, spec_config=TREE, speculative_memory=memory, **SAMPLING)
        key = tuple(out[0, PROMPT.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
        stats = model.last_spec_stats.get()
        totals["tree_rounds"] += stats.tree_rounds
        totals["sibling_kept"] += sum(kept for (_, rank), kept in stats.accepted_by_depth_rank.items() if rank > 0)
        totals["drafted"] += stats.drafted
        totals["accepted"] += stats.accepted
    return Counter(counts), totals


def test_sampled_trees_follow_the_target_distribution(sampler, unsure_draft, sampler_exact, monkeypatch):
    charged(monkeypatch, sampler, unsure_draft)
    counts, totals = sample_trees(sampler, unsure_draft, seed=11)
    print(totals)
    assert totals["tree_rounds"] >= DRAWS  # every call verified at least one tree ...
    assert totals["sibling_kept"] > 0.05 * DRAWS  # ... and kept second (or later) choices
    assert_fits(counts, sampler_exact)


def test_rejects_siblings_reported_as_drawn_from_q_itself(sampler, unsure_draft, sampler_exact, monkeypatch):
    """Siblings drawn without replacement but each reported as q: the accept test and the residual then use the
    wrong distribution, and the output drifts from the target's."""
    real = draft_tree.draw_without_replacement

    def reported_as_q(q, count):
        return [(token, q.float() / q.float().sum()) for token, _ in real(q, count)]

    monkeypatch.setattr(draft_tree, "draw_without_replacement", reported_as_q)
    charged(monkeypatch, sampler, unsure_draft)
    counts, totals = sample_trees(sampler, unsure_draft, seed=11, draws=DRAWS // 3)  # p ~ 1e-200 at DRAWS
    print(totals)
    assert totals["tree_rounds"] >= DRAWS // 3
    assert_rejected(counts, sampler_exact)


def test_draws_without_replacement_report_what_they_were_drawn_from():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    torch.manual_seed(0)
    draws = draft_tree.draw_without_replacement(q, 4)
    assert len(draws) == 3 and len({token for token, _ in draws}) == 3  # the support ran out
    first, second = draws[0], draws[1]
    assert torch.allclose(first[1], q)
    expected = q.clone()
    expected[first[0]] = 0.0
    assert torch.allclose(second[1], expected / expected.sum())


def test_sampled_children_counts_are_fixed_before_any_child_is_drawn():
    """The count of each node's children comes from slot scores (the parent's score times the r-th largest
    probability), the same whatever tokens the draws give."""
    shape = TreeShape(nodes=(3, 2), expanded=(1, 2), children=4)
    q = torch.tensor([0.4, 0.35, 0.15, 0.1, 0.0, 0.0, 0.0, 0.0])
    shapes = set()
    for seed in range(20):
        torch.manual_seed(seed)
        tree = draft_tree.GrownTree(distributions={-1: q})
        calls = []

        def read(frontiers, tree=tree, calls=calls):
            calls.append([len(row) for row in frontiers])
            return [(list(range(100, 100 + len(row))), [q.roll(node) for node, _, _ in row]) for row in frontiers]

        draft_tree.grow([tree], [shape], [99], read, do_sample=True)
        shapes.add((tuple(tree.depths), tuple(tree.parents)))
        assert calls == [[2]]  # one forward over the two best depth-1 nodes
    assert all(depths == (1, 1, 1, 2, 2) for depths, _ in shapes)


# -- greedy tree growth ---------------------------------------------------------------------------------------------
def test_greedy_trees_verify_the_best_nodes_and_read_only_those_that_can_lead_to_them():
    """The draft is unsure after its first choice: every continuation of it scores 0.6 x 0.1 = 0.06, below the
    root's third choice (0.1), so the three verified nodes are the root's three best choices, and the forward of
    depth 2 is not run (no descendant of a node scoring at most the third best candidate can be verified)."""
    root = torch.zeros(16)
    root[:4] = torch.tensor([0.6, 0.12, 0.1, 0.08])
    root[4:] = 0.1 / 12
    unsure = torch.zeros(16)
    unsure[4:14] = 0.1
    shape = TreeShape(nodes=(1, 1, 1), expanded=(1, 1, 1), children=4)
    tree = draft_tree.GrownTree(distributions={-1: root})
    reads = []

    def read(frontiers):
        reads.append([[token for _, token, _ in row] for row in frontiers])
        return [(list(range(200, 200 + len(row))), [unsure for _ in row]) for row in frontiers]

    draft_tree.grow([tree], [shape], [99], read, do_sample=False)
    proposal, slots = draft_tree.proposal(tree, draft_tree.verified(tree, shape, do_sample=False))
    assert reads == [[[0]]]  # depth 1 read its best node; depth 2 read nothing
    assert proposal.tokens == (0, 1, 2) and proposal.parents == (-1, -1, -1) and proposal.branches
    assert [s[0] for s in proposal.sources] == [Source(SourceKind.DRAFT, rank, 1) for rank in range(3)]
    assert slots == {0: 200}


# -- the planner ----------------------------------------------------------------------------------------------------
TREES = Offer(model_tokens=64, trees=True)


def planner(t, t_draft=0.01, tree="auto", draft_by_width=None):
    """A planner whose t(n) and draft step are injected (no model, no clock)."""
    policy = Planner.speculative(SpecConfig(tree=tree, confidence_stop=False))
    for n in range(1, 34):
        policy.estimates.forward.observe(n, t(n))
    policy.estimates.draft_step = ForwardCost.from_table(draft_by_width or {1: t_draft})
    return policy


def plan(policy, offer=TREES, budget=16):
    return policy.plan([RowView(0, torch.arange(10), budget)], [offer])[0]


def flat(n):
    return 0.10


def steep(n):  # fp32 on an AVX2 CPU: t(2) = 1.75 t(1)
    return 0.10 * (1 + 0.75 * (n - 1))


def moderate(n):  # steep enough that a second choice never pays, flat enough that the chain does
    return 0.10 * (1 + 0.25 * (n - 1))


def test_auto_grows_a_tree_where_t_n_is_flat():
    chosen = plan(planner(flat))
    assert chosen.tree is not None and chosen.tree.branches and chosen.model_tokens == chosen.tree.depth


def test_auto_collapses_to_the_chain_or_nothing_where_t_n_is_steep():
    steep_plan, moderate_plan = plan(planner(steep)), plan(planner(moderate))
    assert steep_plan.tree is None and steep_plan.model_tokens == 0  # fp32 CPU: not even the chain pays
    assert moderate_plan.tree is None and moderate_plan.model_tokens > 0  # the chain


def test_on_grows_a_tree_that_branches_even_where_the_chain_is_faster():
    chosen = plan(planner(moderate, tree="on"))
    assert chosen.tree is not None and chosen.tree.branches


def test_off_and_drafters_without_trees_get_chains():
    assert plan(planner(flat, tree="off")).tree is None
    assert plan(planner(flat), offer=Offer(model_tokens=64)).tree is None


def test_where_a_wide_draft_forward_is_dear_the_tree_reads_one_node_a_depth():
    """Flat target forwards, but each extra input of a draft forward costs as much as the verify step itself: a
    draft forward over a frontier wider than one node costs more than its siblings bring. The plan still branches
    (the siblings of the one node read at a depth come with its distribution, and verifying them is free) but
    every draft forward reads one node, where the cheap draft's plan reads several a depth and verifies more."""
    costly = {1: 0.01, 2: 0.11, 4: 0.31, 8: 0.71, 16: 1.51, 32: 3.11}
    chosen, cheap = plan(planner(flat, draft_by_width=costly)), plan(planner(flat))
    assert chosen.model_tokens > 0 and chosen.tree is not None and chosen.tree.branches
    assert all(width == 1 for width in chosen.tree.expanded), chosen.tree
    assert max(cheap.tree.expanded) > 1 and cheap.tree.num_nodes > chosen.tree.num_nodes, (cheap.tree, chosen.tree)


def batch_planner(t, rows, **kwargs):
    """``planner`` with t(n) measured up to ``rows`` x 33 inputs, so that the price sizes a batch's tree, not the
    exploration cap (twice the largest size measured, over the rows)."""
    policy = planner(t, **kwargs)
    for n in range(34, 33 * rows + 1):
        policy.estimates.forward.observe(n, t(n))
    return policy


def plan_rows(policy, rows, offer=TREES, budget=16):
    plans = policy.plan([RowView(row, torch.arange(10), budget) for row in range(rows)], [offer] * rows)
    assert len(plans) == rows and len(set(plans)) == 1  # one tree (or chain) for the whole batch
    return plans[0]


def test_a_batch_prices_its_tree_by_rows_x_width_and_gets_a_narrower_one_or_the_chain():
    """B rows verify B x (1 + nodes) inputs and the draft reads B x width at each depth: where the target's t(n)
    grows with its inputs (1% of a forward each) and the draft's step with the inputs it reads (a quarter of a step
    each), the tree of 2 rows is narrower than one row's and 4 rows draft the chain (either price taken for one row
    alone would leave them a tree); where t(n) and the draft step are flat, a batch grows the tree one row grows."""
    def growing(n):
        return 0.10 * (1 + 0.01 * (n - 1))

    by_inputs = {n: 0.01 * (1 + 0.25 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    one, two, four = (plan_rows(batch_planner(growing, rows, draft_by_width=by_inputs), rows) for rows in (1, 2, 4))
    assert one.tree is not None and one.tree.branches and one.model_tokens == one.tree.depth
    narrower = two.tree is None or (two.tree.num_nodes < one.tree.num_nodes  # 5 nodes against 8, or the chain
                                    and max(two.tree.nodes) <= max(one.tree.nodes))
    assert two.model_tokens > 0 and narrower, (two.tree, one.tree)
    assert four.tree is None and four.model_tokens > 0  # the chain: it still drafts, without siblings
    flat_one, flat_four = (plan_rows(batch_planner(flat, rows), rows) for rows in (1, 4))
    assert flat_four.tree is not None and flat_four.tree.branches and flat_four.tree == flat_one.tree


def test_siblings_that_are_never_kept_turn_trees_back_into_chains():
    """Tree rounds whose later choices the target never keeps (the first choices always): the acceptance of ranks
    1-3 falls at every depth, and the planner goes back to chains, although an extra input costs only 1% of a
    forward."""
    cost = lambda n: 0.10 * (1 + 0.01 * (n - 1))  # noqa: E731
    policy = planner(cost)
    first = plan(policy)
    assert first.tree is not None and first.tree.branches
    chosen = first
    for _ in range(100):
        if chosen.tree is None:
            break
        tokens, parents, sources, chain_nodes = [], [], [], []
        for depth, count in enumerate(chosen.tree.nodes, start=1):  # each depth: the first choice and siblings
            parent = chain_nodes[-1] if chain_nodes else -1
            for rank in range(min(count, 4)):
                if rank == 0:
                    chain_nodes.append(len(tokens))
                tokens.append(10 * depth + rank)
                parents.append(parent)
                sources.append((Source(SourceKind.DRAFT, rank, depth),))
        proposal = Proposal(tokens=tuple(tokens), parents=tuple(parents), sources=tuple(sources),
                            draft_time=0.01 * chosen.tree.depth, draft_forwards=chosen.tree.depth)
        policy.observe([RoundOutcome(proposal, accepted=tuple(chain_nodes), next_token=0,
                                     emitted=(0,) * (len(chain_nodes) + 1), start_length=10,
                                     forward_tokens=1 + len(tokens), verify_time=cost(1 + len(tokens)),
                                     plan=chosen)])
        chosen = plan(policy)
    assert chosen.tree is None and chosen.model_tokens > 0
    # learned below the prior (0.15), where a sibling stops paying for its input
    assert all(policy.acceptance((SourceKind.DRAFT, 1)).rate(depth) < 0.1 for depth in range(1, 4))


def test_a_tree_round_prices_its_draft_forwards_by_the_inputs_they_read():
    """A tree's depth forwards are learned by the inputs they read, apart from a chain's steps: a depth reads its
    frontier through the store's general path, a chain's step takes the fast lane, and neither prices the other."""
    policy = planner(flat)
    chain = Proposal.chain([1, 2], [Source(SourceKind.DRAFT, 0, 1), Source(SourceKind.DRAFT, 0, 2)],
                           draft_time=0.01, draft_forwards=2)  # 5 ms a step
    policy.observe([RoundOutcome(chain, accepted=(0, 1), next_token=0, emitted=(1, 2, 0), start_length=10,
                                 forward_tokens=3, verify_time=0.10, plan=RoundPlan(model_tokens=2))])
    chain_step = policy.estimates.draft_step.table()
    tree = Proposal(tokens=(1, 2), parents=(-1, -1), sources=((Source(SourceKind.DRAFT, 0, 1),),
                                                             (Source(SourceKind.DRAFT, 1, 1),)),
                    draft_time=0.05, draft_forwards=2, draft_steps=((1, 0.01), (3, 0.04)))
    policy.observe([RoundOutcome(tree, accepted=(0,), next_token=0, emitted=(1, 0), start_length=10,
                                 forward_tokens=3, verify_time=0.10, plan=RoundPlan(model_tokens=2))])
    assert policy.estimates.tree_step.table() == pytest.approx({1: 0.01, 3: 0.04})
    assert policy.estimates.draft_step.table() == chain_step and chain_step[1] < 0.01  # the chain's own, untouched
    price = policy.price()
    assert price.t_draft == pytest.approx(chain_step[1]) and price.draft_forward(1) == pytest.approx(0.01)
    shape = TreeShape(nodes=(2, 1), expanded=(1, 1), children=2)  # two depth forwards of one input each
    assert price.tree(shape) == pytest.approx(price(4, Bound.WORST, holes=1) + price.host_seconds(RoundKind.TREE)
                                              + 2 * 0.01)


def test_the_expected_tree_takes_second_choices_where_they_beat_deeper_first_choices():
    rates = [[0.6] * 4, [0.3] * 4]
    nodes = expected_tree(rates, 6)
    # 0.6, 0.36 (depth 2), 0.3 (second at the root), 0.216, 0.18 (the root's second, then its child), ...
    assert [(node.rank, node.depth) for node in nodes][:4] == [(0, 1), (0, 2), (1, 1), (0, 3)]
    shapes = [shape for shape, _ in tree_prefixes(nodes, 2)]
    assert shapes[2] == TreeShape(nodes=(2, 1), expanded=(1, 1), children=2)


def chains_kept_in_full(slope: float) -> Planner:
    """A planner after 40 rounds of 16-token chains kept in full, t(n) = 0.1 s (1 + slope (n - 1))."""
    cost = lambda n: 0.10 * (1 + slope * (n - 1))  # noqa: E731
    policy = planner(cost)
    chain = RoundPlan(model_tokens=16)
    sources = tuple((Source(SourceKind.DRAFT, 0, depth),) for depth in range(1, 17))
    proposal = Proposal(tokens=tuple(range(16)), parents=tuple(range(-1, 15)), sources=sources, draft_time=0.16,
                        draft_forwards=16)
    for _ in range(40):
        policy.observe([RoundOutcome(proposal, accepted=tuple(range(16)), next_token=0, emitted=(0,) * 17,
                                     start_length=10, forward_tokens=17, verify_time=cost(17), plan=chain)])
    return policy


def test_a_tree_priced_within_the_margin_of_the_chain_is_not_grown(monkeypatch):
    """Second choices priced at what the first leave (a few hundredths each) on a t(n) that grows 0.65% an input:
    the best tree, 16 siblings beside the chain, is priced 0.6% above the chain, a tie within the estimates' noise
    (``policy.TREE_MARGIN``, 1%): the round is the chain. Without the margin it would be the tree."""
    chosen = plan(chains_kept_in_full(slope=0.0065))
    assert chosen.tree is None and chosen.model_tokens == 16
    monkeypatch.setattr(policy_module, "TREE_MARGIN", 0.0)
    tree = plan(chains_kept_in_full(slope=0.0065)).tree
    assert tree is not None and tree.num_nodes == 32


def test_a_draft_whose_first_choices_are_always_kept_grows_no_tree():
    """Chains of 16 kept in full, round after round: rank 0 is learned near 1.0 at every depth, while rank 1, never
    judged, still holds its prior (0.15) at each. Of a kept parent's children at most one is kept, so a second
    choice can gain only what the first leaves (``policy.sibling_rates``): a few hundredths, less than an input
    costs here (1% of a forward), and the planner keeps drafting chains. Priced at its prior instead, each second
    choice would add 0.15 tokens for that input and every round would grow a tree of siblings that cannot be kept."""
    policy = chains_kept_in_full(slope=0.01)
    first = policy.acceptance((SourceKind.DRAFT, 0)).rates(16)
    assert first[0] > 0.95 and min(first[1:]) > 0.99
    assert policy.acceptance((SourceKind.DRAFT, 1)).rates(16) == [0.15] * 16  # never judged: the prior
    chosen = plan(policy)
    assert chosen.tree is None and chosen.model_tokens == 16


def test_the_drafter_grows_the_tree_the_planner_priced():
    """A draft that agrees with the target while giving each token 6-8% (a tiny random model): ranked by its own
    cumulative probability, its tree is a bush of shallow siblings that cuts the priced chain at depth 3; ranked by
    the rates the planner priced the shape with (``TreeShape.rates``), it is the priced chain of 4 and a sibling."""
    q = torch.softmax(torch.linspace(0.3, 0.0, 16), dim=0)  # 0.077 ... 0.057: unsure of every token

    def read(frontiers):  # every node read gives the same unsure distribution
        return [([100 + node for node, _, _ in row], [q] * len(row)) for row in frontiers]

    priced = TreeShape(nodes=(2, 1, 1, 1), expanded=(1, 1, 1, 1), children=2, rates=((1.0,) * 4, (0.05,) * 4))
    grown = {}
    for rates in (None, priced.rates):
        tree = draft_tree.GrownTree(distributions={-1: q}, rates=rates)
        draft_tree.grow([tree], [priced], [0], read, do_sample=False)
        grown[rates] = sorted((tree.depths[node], tree.ranks[node])
                              for node in draft_tree.verified(tree, priced, do_sample=False))
    assert grown[priced.rates] == [(1, 0), (1, 1), (2, 0), (3, 0), (4, 0)]  # (depth, rank) of each verified node
    assert grown[None] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
