"""The three ways in: enable(model), the custom_generate callable, and the Hub-style custom_generate/ folder."""

from pathlib import Path

import torch

import hf_specdec
from hf_specdec.round import PlainReason, SourceKind
from tests.clock import VirtualClock
from tests.conftest import perturbed_copy, tiny_model

REPO = Path(__file__).resolve().parent.parent
NEW = 24


def test_hub_style_custom_generate_folder(prompt):
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    out = model.generate(prompt, custom_generate=str(REPO), trust_remote_code=True, assistant_model=draft,
                         max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert model.last_spec_stats.drafted > 0
    # without assistant_model the folder falls through to transformers' own generate
    del model.last_spec_stats
    out = model.generate(prompt, custom_generate=str(REPO), trust_remote_code=True, max_new_tokens=NEW,
                         do_sample=False)
    assert torch.equal(out, expected) and not hasattr(model, "last_spec_stats")


def test_callable_without_enable_and_dict_output(prompt):
    model = tiny_model("qwen2", seed=0)
    draft = perturbed_copy(model, 0.02)
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
    out = model.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                         max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == NEW
    assert torch.allclose(torch.cat(out.scores), torch.cat(expected.scores), atol=1e-4)
    stats = out.spec_stats
    assert stats.new_tokens == NEW
    assert abs(stats.mean_accepted_length - NEW / stats.rounds) < 1e-9
    assert stats.rounds == 1 + sum(stats.draft_length_hist.values())
    data = stats.to_dict()
    for key in ("rounds", "drafted", "accepted", "mean_accepted_length", "acceptance_per_position",
                "draft_length_hist", "draft_time_s", "verify_time_s", "cost_ratio_c", "rounds_spec_off"):
        assert key in data


def test_prefill_time_is_reported_once(prompt):
    """A call that only reads the prompt: its prefill cannot take longer than the whole call (it was counted
    twice once, which made it twice the call)."""
    model = tiny_model("llama", seed=0)
    for kwargs in (dict(custom_generate=hf_specdec.speculative_generate, draft_model=model),
                   dict(custom_generate=hf_specdec.lookahead_generate)):
        model.generate(prompt, max_new_tokens=1, do_sample=False, **kwargs)
        stats = model.last_spec_stats.get()
        assert stats.rounds == 1 and stats.new_tokens == 1
        assert 0 < stats.prefill_time_s <= stats.total_time_s
        assert stats.ttft_s == stats.prefill_time_s


def test_a_profile_that_says_drafting_cannot_pay_means_no_draft_work_at_all(prompt, monkeypatch):
    """Seeded with a hardware profile where a draft step costs two target steps and verifying k tokens costs k
    steps (AVX2-like fp32 with a slow 4-bit draft), not one draft forward runs, the draft never even reads the
    prompt, and the output is plain greedy's. (The forwards cost what the profile says: a virtual clock.)"""
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    draft = perturbed_copy(model, 0.02)
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, lambda n: 0.1 * n)
    clock.charge(monkeypatch, draft, lambda n: 0.2)
    calls = []
    draft.register_forward_pre_hook(lambda module, args: calls.append(1))
    model.speculative_memory.seed(draft, forward_seconds={n: 0.1 * n for n in range(1, 33)}, draft_step_seconds=0.2)
    out = model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, model.generate.__wrapped__(prompt, max_new_tokens=NEW, do_sample=False))
    stats = model.last_spec_stats.get()
    assert calls == [] and stats.draft_forwards == 0 and stats.draft_setup_time_s == 0.0
    assert stats.rounds_spec_off == stats.rounds - 1


def test_a_profile_that_says_drafting_pays_drafts_from_the_first_round(prompt, monkeypatch):
    """Seeded with a flat verify cost and a cheap draft, the first round after the prefill already drafts (no
    plain step to measure t(1), no first probe), and later calls keep what the first measured. (The forwards
    cost what the profile says: a virtual clock; the tiny model's own timings are kernel cold starts and noise.)"""
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    draft = perturbed_copy(model, 0.02)
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, lambda n: 0.1)
    clock.charge(monkeypatch, draft, lambda n: 0.01)
    model.speculative_memory.seed(draft, forward_seconds={n: 0.1 for n in range(1, 33)}, draft_step_seconds=0.01)
    out = model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, model.generate.__wrapped__(prompt, max_new_tokens=NEW, do_sample=False))
    stats = model.last_spec_stats.get()
    # never a plain round but, when one token is left, the last (no room for a guess)
    assert stats.draft_length_hist[0] == stats.plain_reasons[PlainReason.NO_ROOM] <= 1, stats.plain_reasons
    assert model.speculative_memory.estimates(draft).acceptance[(SourceKind.DRAFT, 0)].judged[0] > 0  # kept for later calls
    assert model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False,
                          speculative_memory=None).shape == out.shape  # a call on its own


def test_stats_say_why_rounds_were_plain_and_serialise(prompt):
    """Every plain round of a call is counted under the planner's reason, and the stats go to JSON as they are."""
    import json

    model = hf_specdec.enable(tiny_model("llama", seed=0))
    model.generate(prompt, assistant_model=perturbed_copy(model, 0.02), max_new_tokens=NEW, do_sample=False)
    stats = model.last_spec_stats.get()
    assert sum(stats.plain_reasons.values()) == stats.rounds_spec_off > 0  # the first round at least: t(1)
    assert stats.plain_reasons["a plain step first"] == 1
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["plain_reasons"] == dict(stats.plain_reasons) and set(data["plain_wording"]) == set(data["plain_reasons"])


def test_stats_count_plain_rounds_by_their_kind_not_their_text():
    """A plain round counts under its plan's kind (a ``PlainReason`` member, never words cut from the text), even
    when its detail holds colons or another kind's words; people read the newest wording, JSON gets the kinds'
    words as keys."""
    import json

    from hf_specdec.round import PlainWhy, Proposal, RoundOutcome, RoundPlan
    from hf_specdec.stats import SpecStats

    stats = SpecStats()
    for why in (PlainWhy(PlainReason.DOES_NOT_PAY, "1.0 tok/s expected: 4.0 plain"),
                PlainWhy(PlainReason.NO_GUESS, "no room left: not the planner's words"),
                PlainWhy(PlainReason.DOES_NOT_PAY, "2.0 tok/s expected: 4.0 plain")):
        stats.record([RoundOutcome(Proposal(), (), 7, (7,), 10, 1, 0.1, plan=RoundPlan(max_tokens=4, plain_why=why))])
    assert stats.rounds_spec_off == 3 and stats.plain_reasons == {PlainReason.DOES_NOT_PAY: 2, PlainReason.NO_GUESS: 1}
    assert all(type(kind) is PlainReason for kind in stats.plain_reasons)
    assert stats.why_plain() == ("2 rounds: drafting does not pay: 2.0 tok/s expected: 4.0 plain; "
                                 "1 round: no guess worth its cost: no room left: not the planner's words")
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["plain_reasons"] == {"drafting does not pay": 2, "no guess worth its cost": 1}
    assert data["plain_wording"]["drafting does not pay"] == "drafting does not pay: 2.0 tok/s expected: 4.0 plain"
