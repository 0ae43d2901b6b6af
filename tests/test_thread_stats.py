"""``model.last_spec_stats`` is the calling thread's latest call's, and a call that raises leaves none."""

import threading

import pytest
import torch

import hf_specdec
from hf_specdec.stats import LastSpecStats, SpecStats, last_spec_stats
from tests.conftest import perturbed_copy, tiny_model


@pytest.fixture(scope="module")
def pair():
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    return model, perturbed_copy(model, 0.02)


def test_each_thread_reads_its_own_stats(pair):
    """Both calls finish before either thread reads (a Barrier), so a shared attribute would show one of them the
    other's stats."""
    model, draft = pair
    barrier = threading.Barrier(2, timeout=120)
    jobs = {"a": (torch.tensor([[5, 17, 42, 8]]), 7), "b": (torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]), 19)}
    seen, errors = {}, []

    def run(name):
        prompt, new = jobs[name]
        try:
            out = model.generate(prompt, assistant_model=draft, max_new_tokens=new, do_sample=False,
                                 return_dict_in_generate=True)
            barrier.wait()  # the other thread's call has finished too
            seen[name] = (model.last_spec_stats.new_tokens, model.last_spec_stats.get(), out.spec_stats)
            barrier.wait()
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for name, (prompt, new) in jobs.items():
        new_tokens, stats, own = seen[name]
        assert new_tokens == new and stats is own and stats.new_tokens == new
    assert model.last_spec_stats.get() is None  # the main thread ran no call


def test_a_call_that_raises_leaves_no_stale_stats(pair, prompt):
    model, draft = pair

    def broken(input_ids, scores):
        raise RuntimeError("broken processor")

    from transformers import LogitsProcessorList

    for routed in (dict(assistant_model=draft), dict(decoding="lookahead")):
        model.generate(prompt, max_new_tokens=5, do_sample=False, **routed)
        assert isinstance(model.last_spec_stats.get(), SpecStats) and model.last_spec_stats.new_tokens == 5
        with pytest.raises(RuntimeError, match="broken processor"):
            model.generate(prompt, max_new_tokens=5, do_sample=False, logits_processor=LogitsProcessorList([broken]),
                           **routed)
        assert model.last_spec_stats.get() is None and not model.last_spec_stats
        assert last_spec_stats(model) is None
        with pytest.raises(AttributeError, match="no hf_specdec call on this model has finished on this thread"):
            model.last_spec_stats.new_tokens


def test_the_callable_without_enable_keeps_stats_per_thread_too(prompt):
    """``custom_generate=speculative_generate`` on a model hf_specdec was not enabled on: a call on another thread
    leaves this thread's stats alone, and that thread reads its own."""
    model = tiny_model("llama", seed=0)

    def call(new):
        model.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=model,
                       max_new_tokens=new, do_sample=False)
        return model.last_spec_stats.get()

    mine = call(4)
    assert isinstance(model.last_spec_stats, LastSpecStats) and model.last_spec_stats.new_tokens == 4
    theirs, errors = [], []

    def other():
        try:
            theirs.append(call(7))
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert not errors, errors
    assert theirs[0].new_tokens == 7 and theirs[0] is not mine  # the other thread read its own call's stats
    assert model.last_spec_stats.get() is mine and model.last_spec_stats.new_tokens == 4  # and left this thread's
    with pytest.raises(ValueError):
        model.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=model, max_new_tokens=4,
                       num_beams=2)
    assert last_spec_stats(model) is None
