"""Out of memory while generating: fewer guesses first, then plain decoding; nothing lost or duplicated."""

import logging

import pytest
import torch

import hf_specdec
from tests.conftest import perturbed_copy, tiny_model

NEW = 30


class FailAfter:
    """Wraps a module's forward to raise out-of-memory from the n-th call on (test-only injection)."""

    def __init__(self, module, calls_before_failure, error):
        self.forward, self.left, self.error = module.forward, calls_before_failure, error

    def __call__(self, *args, **kwargs):
        self.left -= 1
        if self.left < 0:
            raise self.error
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")])
def test_draft_oom_falls_back_to_plain(prompt, error, caplog):
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    draft.forward = FailAfter(draft, 6, error)
    with caplog.at_level(logging.WARNING):
        out = hf_specdec.enable(model).generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False,
                                                spec_config=hf_specdec.SpecConfig(policy="fixed"))
    assert torch.equal(out, expected)
    assert model.last_spec_stats.fell_back.startswith("out of memory")
    assert "4-bit draft" in caplog.text


def test_target_oom_while_verifying_falls_back_to_plain(prompt):
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    forward = model.forward

    def fail_on_wide_inputs(*args, **kwargs):  # verifying several tokens fails, single steps work
        input_ids = kwargs.get("input_ids")
        if input_ids is not None and 1 < input_ids.shape[1] < prompt.shape[1]:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return forward(*args, **kwargs)

    model.forward = fail_on_wide_inputs
    out = hf_specdec.enable(model).generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False,
                                            spec_config=hf_specdec.SpecConfig(policy="fixed"))
    assert torch.equal(out, expected)
    assert model.last_spec_stats.fell_back is not None


def test_target_oom_on_a_wide_verify_goes_on_with_half_the_guesses(prompt, caplog):
    """k = 8 (9 inputs a round) runs out of memory above 6 inputs: the round is redone with at most 4 guesses,
    which fit, and the call speculates on with that cap; the draft's cache is brought back to the committed
    tokens (the output is plain greedy's)."""
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    forward, widths = model.forward, []

    def fail_above_six_inputs(*args, **kwargs):  # after the prefill
        width = kwargs["input_ids"].shape[1]
        if widths and width > 6:
            raise torch.OutOfMemoryError("CUDA out of memory")
        widths.append(width)
        return forward(*args, **kwargs)

    model.forward = fail_above_six_inputs
    with caplog.at_level(logging.WARNING):
        out = hf_specdec.enable(model).generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False,
                                                spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=8))
    stats = model.last_spec_stats.get()
    assert torch.equal(out, expected)
    assert stats.guess_cap == 4 and stats.fell_back is None
    assert "going on with at most 4" in caplog.text
    assert max(widths[1:]) == 5 and stats.accepted > 0  # after the prefill: 1 + 4 guesses at most, accepted
    assert stats.cache_bytes > 0 and stats.draft_cache_bytes > 0


def test_other_errors_are_not_swallowed(prompt):
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    draft.forward = FailAfter(draft, 2, ValueError("a real bug"))
    with pytest.raises(ValueError, match="a real bug"):
        hf_specdec.enable(model).generate(prompt, assistant_model=draft, max_new_tokens=NEW,
                                          spec_config=hf_specdec.SpecConfig(policy="fixed"))
