"""The three ways in: enable(model), the custom_generate callable, and the Hub-style custom_generate/ folder."""

from pathlib import Path

import torch

import hf_specdec
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
        stats = model.last_spec_stats
        assert stats.rounds == 1 and stats.new_tokens == 1
        assert 0 < stats.prefill_time_s <= stats.total_time_s
        assert stats.ttft_s == stats.prefill_time_s
