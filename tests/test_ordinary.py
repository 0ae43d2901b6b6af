"""A call decodes in inference mode and hands back ordinary tensors (``hf_specdec/ordinary.py``).

Every target and draft forward runs in inference mode (the speed it buys is the point); what the caller gets back
can be used as plain ``generate``'s output can: trained on with gradients, and a cache it passed in or got back
written in place by a later plain call, with plain's tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_specdec
from hf_specdec.models.tiny import perturbed_copy, tiny_model
from hf_specdec.stats import last_spec_stats

PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 5, 17, 42, 8, 23, 61]])
FIXED = {"policy": "fixed", "num_draft_tokens": 4}
NEW = 12


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("llama", seed=0)
    return hf_specdec.enable(model), perturbed_copy(model, 0.05, relative=True)


def _drafted(model) -> None:
    """The call's draft model drafted tokens the target kept (prompt lookups not counted)."""
    stats = last_spec_stats(model)
    assert stats.accepted - stats.lookup_accepted > 0, "the call must keep tokens the draft model drafted"


def test_every_forward_of_a_call_runs_in_inference_mode(pair):
    model, draft = pair
    seen = []
    hooks = [m.register_forward_pre_hook(lambda module, args, name=name: seen.append(
        (name, torch.is_inference_mode_enabled()))) for name, m in (("target", model), ("draft", draft))]
    try:
        model.generate(PROMPT, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    _drafted(model)
    assert {name for name, _ in seen} == {"target", "draft"}
    assert all(inference for _, inference in seen), seen


def test_what_a_call_returns_is_ordinary_and_trainable(pair):
    model, draft = pair
    out = model.generate(PROMPT, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False,
                         return_dict_in_generate=True, output_scores=True, output_logits=True,
                         output_hidden_states=True)
    _drafted(model)
    plain = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out.sequences, plain)
    tensors = [out.sequences, *out.scores, *out.logits, *(s for step in out.hidden_states for s in step)]
    tensors += [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    assert not any(t.is_inference() for t in tensors)
    # a trainer's step over the returned sequences: the embedding saves them for backward
    loss = model(out.sequences, labels=out.sequences).loss
    loss.backward()
    assert model.get_input_embeddings().weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_a_dynamic_cache_passed_in_is_continued_by_plain_generate(pair):
    model, draft = pair
    cache = DynamicCache(config=model.config)
    first = model.generate(PROMPT, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False,
                           cache=cache)
    _drafted(model)
    assert not any(layer.keys.is_inference() for layer in cache.layers)
    more = model.generate(first, max_new_tokens=NEW, do_sample=False, cache=cache)  # plain, same cache
    assert torch.equal(more, model.generate(PROMPT, max_new_tokens=2 * NEW, do_sample=False))


def test_a_static_cache_keeps_its_buffers_and_takes_plain_writes_after(pair):
    model, draft = pair
    cache = StaticCache(config=model.config, max_cache_len=64)
    model(PROMPT[:, :2], cache=cache)  # its buffers made outside any call, as a caller makes them
    buffers = [layer.keys for layer in cache.layers]
    cache.reset()
    first = model.generate(PROMPT, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False,
                           cache=cache)
    _drafted(model)
    assert all(layer.keys is buffer for layer, buffer in zip(cache.layers, buffers))
    more = model.generate(first, max_new_tokens=NEW, do_sample=False, cache=cache)  # plain writes in place
    assert torch.equal(more, model.generate(PROMPT, max_new_tokens=2 * NEW, do_sample=False))


def test_a_static_cache_made_in_the_call_is_returned_ordinary(pair):
    """A static cache whose buffers the call itself made (lazily, at its first forward, in inference mode): the
    caller gets buffers it can write in place."""
    model, draft = pair
    cache = StaticCache(config=model.config, max_cache_len=64)
    first = model.generate(PROMPT, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False,
                           cache=cache)
    _drafted(model)
    assert not any(layer.keys.is_inference() or layer.values.is_inference() for layer in cache.layers)
    more = model.generate(first, max_new_tokens=NEW, do_sample=False, cache=cache)
    assert torch.equal(more, model.generate(PROMPT, max_new_tokens=2 * NEW, do_sample=False))


def test_a_caller_in_inference_mode_gets_what_plain_gives_it_there(pair):
    model, draft = pair
    with torch.inference_mode():
        out = model.generate(PROMPT, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False)
        _drafted(model)
        plain = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, plain) and out.is_inference() == plain.is_inference()


def test_a_cache_passed_in_is_ordinary_after_a_call_that_raised(pair):
    """A stopping criterion that raises after a few rounds: the caller's cache, written as far as the call got, still
    takes plain's in-place writes (a static cache's buffers made in the call)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Fails(StoppingCriteria):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if self.calls > 3:
                raise RuntimeError("a caller's criterion failed")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model, draft = pair
    cache = StaticCache(config=model.config, max_cache_len=64)
    widths, drafts = [], []  # the target's forwards' inputs (a round that verified draft tokens reads more than
    # one), and the draft model's forwards: a call that raises keeps no stats
    hooks = [model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True),
             draft.model.layers[0].register_forward_pre_hook(lambda *args: drafts.append(1))]
    try:
        with pytest.raises(RuntimeError, match="a caller's criterion failed"):
            model.generate(PROMPT, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False,
                           cache=cache, stopping_criteria=StoppingCriteriaList([Fails()]))
    finally:
        for hook in hooks:
            hook.remove()
    assert drafts and any(1 < width < PROMPT.shape[1] for width in widths), (len(drafts), widths)
    assert cache.layers[0].is_initialized
    assert not any(layer.keys.is_inference() or layer.values.is_inference() for layer in cache.layers)
    cache.reset()  # plain's own in-place reset and writes
    assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, cache=cache),
                       model.generate(PROMPT, max_new_tokens=NEW, do_sample=False))
