"""Greedy speculative decoding returns exactly what plain greedy generate returns (fp32, tiny models)."""

import pytest
import torch

import hf_specdec
from hf_specdec.round import Offer, Proposal, Source, SourceKind
from tests.conftest import perturbed_copy, tiny_model

POLICIES = ["fixed", "heuristic", "adaptive"]
NEW = 48


def plain(model, prompt, **kwargs):
    return type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False, **kwargs)


def by_draft_model(stats):
    """(drafted, accepted) counting only the draft model's tokens: prompt-lookup tokens riding along are left out."""
    return stats.drafted - stats.lookup_drafted, stats.accepted - stats.lookup_accepted


def paying(draft):
    """Injected costs under which drafting clearly pays (flat target forwards, a draft step 1% of one), so the
    adaptive policy drafts on any machine and a parity test cannot pass without drafting."""
    memory = hf_specdec.SpeculativeMemory()
    memory.seed(draft, forward_seconds={n: 1.0 for n in range(1, 17)}, draft_step_seconds=0.01)
    return memory


def speculative(model, draft, prompt, policy, seeded=True, tree="auto", **kwargs):
    return model.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                          spec_config=hf_specdec.SpecConfig(policy=policy, num_draft_tokens=4, tree=tree),
                          speculative_memory=paying(draft) if seeded else None,
                          max_new_tokens=NEW, do_sample=False, **kwargs)


@pytest.mark.parametrize("policy", POLICIES)
def test_draft_equal_to_target_accepts_everything(target, prompt, policy):
    out = speculative(target, target, prompt, policy)
    assert torch.equal(out, plain(target, prompt))
    stats = target.last_spec_stats.get()
    # every first choice the draft model proposed is accepted (prompt-lookup tokens riding along may not be, nor
    # the second choices of a tree, which the adaptive policy grows under these flat costs)
    assert by_draft_model(stats)[0] > 0
    first_choices = [key for key in stats.judged_by_depth_rank if key[1] == 0]
    assert first_choices and all(stats.accepted_by_depth_rank[key] == stats.judged_by_depth_rank[key]
                                 for key in first_choices)
    if not stats.tree_rounds:
        assert stats.accepted - stats.lookup_accepted == stats.drafted - stats.lookup_drafted
    if policy == "fixed":  # every round but the last drafts 4 and keeps them: K + 1 tokens per round
        assert stats.round_log[1] == (4, 5)


@pytest.mark.parametrize("policy", POLICIES)
def test_random_draft_accepts_almost_nothing(target, random_draft, prompt, policy):
    out = speculative(target, random_draft, prompt, policy)
    assert torch.equal(out, plain(target, prompt))
    stats = target.last_spec_stats.get()
    drafted, accepted = by_draft_model(stats)
    assert stats.new_tokens == NEW and drafted > 0 and accepted <= 0.05 * drafted, (drafted, accepted)


@pytest.mark.parametrize("policy", POLICIES)
def test_perturbed_draft_partial_acceptance(target, close_draft, prompt, policy):
    out = speculative(target, close_draft, prompt, policy)
    assert torch.equal(out, plain(target, prompt))
    drafted, accepted = by_draft_model(target.last_spec_stats.get())
    assert 0 < accepted < drafted, (drafted, accepted)  # adaptive too: the injected costs make drafting pay


class ScriptedDrafter:
    """Right for ``right`` tokens, then wrong: knows the plain greedy continuation and corrupts it on purpose."""

    def __init__(self, reference: torch.LongTensor, right: int, k: int):
        self.reference, self.right, self.k = reference[0], right, k
        self.rounds: list[tuple[int, int]] = []  # (drafted, accepted) of every round, as the drafter is told

    def prefill(self, views):
        pass

    def offer(self, views):
        return [Offer(model_tokens=view.budget) for view in views]

    def propose(self, views, plans):
        (view,), (plan,) = views, plans
        start = view.ids.shape[0]
        tokens = self.reference[start: start + plan.model_tokens].clone()
        tokens[self.right:] = (tokens[self.right:] + 1) % 96  # wrong from position right+1 on
        return [Proposal.chain(tokens.tolist(), [Source(SourceKind.DRAFT, 0, i + 1) for i in range(len(tokens))],
                               draft_forwards=len(tokens))]

    def update(self, outcomes):
        self.rounds.extend((outcome.proposal.num_tokens, outcome.num_accepted) for outcome in outcomes)

    def cache_bytes(self):
        return 0

    def release(self):
        pass


@pytest.mark.parametrize("right", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("policy", ["fixed", "heuristic"])
def test_scripted_partial_acceptance(target, prompt, right, policy):
    reference = type(target).generate(target, prompt, max_new_tokens=NEW + 8, do_sample=False)
    drafter = ScriptedDrafter(reference, right, k=4)
    out = speculative(target, drafter, prompt, policy)
    assert torch.equal(out, reference[:, : prompt.shape[1] + NEW])
    stats = target.last_spec_stats.get()
    # round by round: the target keeps exactly the draft's first `right` tokens, or all of them if it drafted fewer
    drafting = [(drafted, accepted) for drafted, accepted in drafter.rounds if drafted]
    assert drafting and [accepted for _, accepted in drafting] == [min(right, drafted) for drafted, _ in drafting]
    assert any(drafted > right for drafted, _ in drafting) or right == 4  # a wrong token was drafted and refused
    assert stats.accepted == sum(accepted for _, accepted in drafter.rounds)
    assert stats.accepted_per_position[0] == (stats.drafted_per_position[0] if right >= 1 else 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_parity_across_architectures(arch, prompt, monkeypatch):
    from tests.clock import VirtualClock

    model = tiny_model(arch, seed=4)
    draft = perturbed_copy(model, 0.005)  # close enough that each architecture's draft has tokens kept
    clock = VirtualClock(monkeypatch)  # the adaptive policy drafts on any machine: flat 1-s target, 0.05-s draft step
    clock.charge(monkeypatch, model, lambda n: 1.0, name="target")
    clock.charge(monkeypatch, draft, lambda n: 0.05, name="draft")
    for policy in POLICIES:
        assert torch.equal(speculative(model, draft, prompt, policy), plain(model, prompt)), policy
        drafted, accepted = by_draft_model(model.last_spec_stats.get())
        assert drafted > 0 and accepted > 0, (policy, drafted, accepted)


def test_parity_with_processors_repetition_penalty(target, close_draft, prompt):
    kwargs = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    penalized = plain(target, prompt, **kwargs)
    assert not torch.equal(penalized, plain(target, prompt))  # the processors change this model's output
    assert torch.equal(speculative(target, close_draft, prompt, "adaptive", **kwargs), penalized)
    drafted, accepted = by_draft_model(target.last_spec_stats.get())
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_enable_routes_assistant_model_and_leaves_plain_calls_alone(prompt):
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    before = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    hf_specdec.enable(model)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), before)
    assert model.last_spec_stats.get() is None  # the plain call did not go through hf_specdec
    out = model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, before)
    assert out.spec_stats is model.last_spec_stats.get() and out.spec_stats.new_tokens == NEW
    other = tiny_model("llama", seed=0)
    assert "generate" not in vars(other)  # other instances untouched
    hf_specdec.disable(model)
    assert "generate" not in vars(model)


def test_left_padded_single_prompt(target, close_draft, prompt):
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    out = speculative(target, close_draft, padded, "adaptive", attention_mask=mask)
    assert torch.equal(out[:, 3:], plain(target, prompt))
    drafted, accepted = by_draft_model(target.last_spec_stats.get())
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_adaptive_policy_turns_speculation_off_for_a_useless_draft(target, random_draft, prompt, monkeypatch):
    """Costs injected (tests/clock.py), not this CPU's: t(n) = 1 s for any n, a draft step 0.3 s. A random draft
    almost never agrees, so drafting only costs: the policy turns speculation off for most rounds."""
    from tests.clock import VirtualClock

    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, target, lambda n: 1.0, name="target")
    clock.charge(monkeypatch, random_draft, lambda n: 0.3, name="draft")
    out = target.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=random_draft,
                          spec_config=hf_specdec.SpecConfig(policy="adaptive", history_lookup=False),
                          max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, plain(target, prompt))
    stats = target.last_spec_stats.get()
    assert stats.rounds_spec_off > stats.rounds // 2, stats.round_log


@pytest.mark.parametrize("draft_vocab_size", [None, 256, 40])
def test_narrow_draft_head_keeps_output(target, close_draft, prompt, draft_vocab_size):
    """draft_vocab_size narrows what the draft can propose, never what is returned."""
    config = hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4, draft_vocab_size=draft_vocab_size)
    out = target.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=close_draft,
                          spec_config=config, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, plain(target, prompt))


def test_narrow_draft_head_only_proposes_kept_tokens(target, close_draft, prompt):
    from transformers import LogitsProcessorList

    from hf_specdec.drafters.draft_model import DraftModelDrafter
    from hf_specdec.round import RoundOutcome, RoundPlan, RowView

    drafter = DraftModelDrafter(close_draft, LogitsProcessorList(), do_sample=True, vocab_size=96, draft_vocab_size=20)
    view = RowView(0, prompt[0], 6)
    drafter.prefill([view])
    kept = set(range(20)) | set(prompt[0].tolist())
    for _ in range(5):
        (proposal,) = drafter.propose([view], [RoundPlan(model_tokens=6, max_tokens=6)])
        assert proposal.num_tokens == 6 and set(proposal.tokens) <= kept
        outside = [t for t in range(96) if t not in kept]
        assert float(proposal.draft_probs[:, outside].sum()) == 0.0
        drafter.update([RoundOutcome.discarded(view, proposal)])  # as if nothing was accepted


def test_history_lookup_appends_repeated_text_and_keeps_output(monkeypatch):
    """This model (seed 5) falls into a 4-token cycle after the prompt; prompt-lookup tokens ride along after
    the draft's (or alone), get accepted, and the output stays plain greedy's. Costs injected (a draft step
    5% of a flat target forward), so the policy's choices are the same on any machine."""
    from tests.clock import VirtualClock

    model = tiny_model("llama", seed=5)
    draft = perturbed_copy(model, 0.05)
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, lambda n: 1.0, name="target")
    clock.charge(monkeypatch, draft, lambda n: 0.05, name="draft")
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38] * 4])
    expected = plain(model, prompt)
    assert expected[0, 46:58].tolist() == expected[0, 50:62].tolist()  # the output repeats itself
    # the virtual clock's costs decide; chains, which carry prompt-lookup tails (a tree carries none: where
    # verifying is free, as here, a tree of the draft's choices would take the round)
    out = speculative(model, draft, prompt, "adaptive", seeded=False, tree="off")
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.lookup_drafted > 0 and stats.lookup_accepted > 0
