"""Static caches: ``cache_implementation="static"`` and a ``StaticCache`` passed in run in the cache's own
preallocated buffers (``backends.StaticAttention``, ``backends.Buffers``).

Plain ``generate`` with the same cache is the reference, and hf_specdec's dynamic store gives the same tokens. Each
case, speculative (a close draft, fixed k) and lookahead (a seeded memory, tries), one prompt and a left-padded
batch: the same sequences as plain (static and dynamic), a call that drafted, and the cache plain returns (the
caller's own object and its own tensors when one was passed in; a StaticCache of plain's width from
``cache_implementation``). A verify forward's shapes repeat round after round: its keys and masks span the buffer's
whole width, which never grows where the call fits it. Sliding-window layers run where the static cache is no
longer than their window and are refused, before any forward, where it is; so are a cache too short for the call
and an encoder-decoder's static caches (before its encoder runs).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (BartConfig, BartForConditionalGeneration, DynamicCache, MistralConfig,
                          MistralForCausalLM, StaticCache)

import hf_specdec
from hf_specdec.drafters.early_exit import EarlyExit
from hf_specdec.models.tiny import perturbed_copy, tiny_model
from hf_specdec.stats import last_spec_stats
from hf_specdec.support import Unsupported
from tests.clock import VirtualClock
from tests.test_cache_in import BATCH, BATCH_MASK, FIXED, PROMPT, assert_drafted, mode

NEW = 16
MODES = ["speculative", "lookahead"]


def _mistral(window: int, seed: int = 0):
    """A tiny Mistral whose every layer slides over ``window`` columns (StaticSlidingWindowLayer in a static cache)."""
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                           max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = MistralForCausalLM(config).eval()
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return model


def _pair(model):
    """(the model enabled, a close draft: 5% noise on every weight)."""
    draft = perturbed_copy(model, 0.05, relative=True)
    return hf_specdec.enable(model), draft


@pytest.fixture(scope="module")
def llama_pair():
    return _pair(tiny_model("llama", seed=0))


def plain(model, ids, **kwargs):
    return type(model).generate(model, ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                                **kwargs)


def ours(model, ids, name, draft, **kwargs):
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **kwargs,
                         **mode(name, draft))
    assert_drafted(model, name)
    return out


def assert_same_static_cache(mine: StaticCache, theirs: StaticCache, mask: torch.Tensor) -> None:
    """Both static, as wide, as long; equal keys and values (1e-4) at every column plain's final mask attends to,
    zeros past the last column (plain never wrote there)."""
    assert type(mine) is type(theirs) is StaticCache
    columns = mask.shape[1] + NEW - 1
    assert int(mine.get_seq_length()) == int(theirs.get_seq_length()) == columns
    final = torch.cat([mask.bool(), torch.ones(mask.shape[0], NEW - 1, dtype=torch.bool)], dim=1)
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        assert a.keys.shape == b.keys.shape and a.max_cache_len == b.max_cache_len
        for name in ("keys", "values"):
            ours_, plains = getattr(a, name), getattr(b, name)
            for row in range(final.shape[0]):
                attended = final[row]
                torch.testing.assert_close(ours_[row][:, :columns][:, attended], plains[row][:, :columns][:, attended],
                                           atol=1e-4, rtol=0)
            assert not ours_[:, :, columns:].any() and not plains[:, :, columns:].any()


def prefilled_static(model, ids, mask, columns: int, width: int) -> StaticCache:
    """A StaticCache of ``width`` columns holding the first ``columns`` columns of ``ids`` (a chat's earlier turn)."""
    cache = StaticCache(config=model.config, max_cache_len=width)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        model(ids[:, :columns], attention_mask=mask[:, :columns], position_ids=positions[:, :columns], cache=cache)
    return cache


def prefilled_dynamic(model, ids, mask, columns: int) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        model(ids[:, :columns], attention_mask=mask[:, :columns], position_ids=positions[:, :columns], cache=cache)
    return cache


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("batch", [False, True])
def test_cache_implementation_static(llama_pair, name, batch):
    """The same tokens as plain generate (static and dynamic) and as hf_specdec's dynamic store; the cache plain
    returns (a StaticCache of its width)."""
    model, draft = llama_pair
    ids, mask = (BATCH, BATCH_MASK) if batch else (PROMPT, None)
    given = {} if mask is None else {"attention_mask": mask}
    reference = plain(model, ids, cache_implementation="static", **given)
    assert torch.equal(reference.sequences, plain(model, ids, **given).sequences)
    dynamic = ours(model, ids, name, draft, **given)
    static = ours(model, ids, name, draft, cache_implementation="static", **given)
    assert torch.equal(static.sequences, reference.sequences)
    assert torch.equal(dynamic.sequences, reference.sequences)
    assert_same_static_cache(static.cache, reference.cache, mask if mask is not None else torch.ones_like(ids))


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("batch", [False, True])
def test_a_static_cache_passed_in_continues(llama_pair, name, batch, monkeypatch):
    """A StaticCache of 48 columns holding the prompt's first columns (8 of 12; a batch's first 6): continued in its
    own tensors and handed back as plain hands it back; the same tokens as from a DynamicCache holding them. (On a
    virtual clock where a forward costs 1 s and the host nothing, so that guessing pays on any machine: a tiny
    model's real forwards cost less than a round's host work.)"""
    model, draft = llama_pair
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, lambda n: 1.0)
    clock.charge(monkeypatch, draft, lambda n: 0.01)
    ids, mask, columns = (BATCH, BATCH_MASK, 6) if batch else (PROMPT, torch.ones_like(PROMPT), 8)
    reference = plain(model, ids, attention_mask=mask, cache=prefilled_static(model, ids, mask, columns, 48))
    cache = prefilled_static(model, ids, mask, columns, 48)
    buffers = [(layer.keys, layer.values) for layer in cache.layers]
    out = ours(model, ids, name, draft, attention_mask=mask, cache=cache)
    assert out.cache is cache and all(layer.keys is keys and layer.values is values
                                      for layer, (keys, values) in zip(cache.layers, buffers))
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_static_cache(cache, reference.cache, mask)
    dynamic = ours(model, ids, name, draft, attention_mask=mask, cache=prefilled_dynamic(model, ids, mask, columns))
    assert torch.equal(dynamic.sequences, reference.sequences)


class Shapes:
    """Per target forward after the prompt's: (input_ids' shape, the attention mask's shape or None, the first
    layer's key buffer's shape and address), as the model receives them."""

    def __init__(self, model):
        self.seen: list[tuple] = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layer = cache.layers[0]
        if not layer.is_initialized:  # the prompt's forward
            return
        mask = kwargs.get("attention_mask")
        self.seen.append((tuple(kwargs["input_ids"].shape), None if mask is None else tuple(mask.shape),
                          tuple(layer.keys.shape), layer.keys.data_ptr()))


def test_a_verify_forwards_shapes_repeat(llama_pair):
    """A batch, speculative, k = 4: every verify forward of both rows reads [2, 5] inputs under a [2, W] mask over
    the buffer of W = 12 + 16 - 1 columns, the same buffer every round; the dynamic store's masks grow instead."""
    model, draft = llama_pair
    width = BATCH.shape[1] + NEW - 1
    seen = {}
    for implementation in ("static", None):
        shapes = Shapes(model)
        try:
            ours(model, BATCH, "speculative", draft, attention_mask=BATCH_MASK, cache_implementation=implementation)
        finally:
            shapes.handle.remove()
        seen[implementation] = [entry for entry in shapes.seen if entry[0] == (2, 5)]  # the full rounds
    assert len(seen["static"]) >= 2
    assert {entry[1:] for entry in seen["static"]} == {((2, width), (2, 2, width, 16), seen["static"][0][3])}
    assert len({entry[1] for entry in seen[None]}) == len(seen[None])  # dynamic: a new width every round


def test_lookahead_masks_span_the_buffer(llama_pair):
    """Lookahead's tries (4-D masks) over a static cache: every mask spans the buffer's whole width, which grows
    by steps where a trie's holes need more columns than the call's (and is handed back at the width given)."""
    model, draft = llama_pair
    width = PROMPT.shape[1] + NEW - 1
    cache = StaticCache(config=model.config, max_cache_len=width)
    reference = plain(model, PROMPT, cache_implementation="static")
    shapes = Shapes(model)
    try:
        out = ours(model, PROMPT, "lookahead", draft, cache=cache)
    finally:
        shapes.handle.remove()
    assert torch.equal(out.sequences, reference.sequences)
    assert all(mask is None or mask[-1] == keys[2] for _, mask, keys, _ in shapes.seen)
    assert any(mask is not None and len(mask) == 4 for _, mask, _, _ in shapes.seen)  # tries were read
    assert any(keys[2] > width for _, _, keys, _ in shapes.seen)  # grown (64 columns a step) ...
    assert_same_static_cache(cache, reference.cache, torch.ones_like(PROMPT))  # ... and handed back at 27


@pytest.mark.parametrize("name", MODES)
def test_sliding_window_layers_within_their_window(name):
    """Mistral, window 64, a static cache of 27 columns: its StaticSlidingWindowLayers never drop a column."""
    model, draft = _pair(_mistral(64))
    reference = plain(model, PROMPT, cache_implementation="static")
    assert torch.equal(reference.sequences, plain(model, PROMPT).sequences)
    out = ours(model, PROMPT, name, draft, cache_implementation="static")
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_static_cache(out.cache, reference.cache, torch.ones_like(PROMPT))


def test_mixed_layer_types_in_a_static_cache():
    """Qwen2 with a full and a sliding layer (window 64): one mask over the buffer for both, tries included."""
    model, draft = _pair(tiny_model("qwen2", seed=0, use_sliding_window=True, sliding_window=64,
                                    layer_types=["full_attention", "sliding_attention"]))
    reference = plain(model, PROMPT, cache_implementation="static")
    for name in MODES:
        out = ours(model, PROMPT, name, draft, cache_implementation="static")
        assert torch.equal(out.sequences, reference.sequences)
        assert_same_static_cache(out.cache, reference.cache, torch.ones_like(PROMPT))


def _refused_before_any_forward(model, match: str, **kwargs) -> None:
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(Unsupported, match=match):
            model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, **kwargs)
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("name", MODES)
def test_a_static_cache_longer_than_the_window_is_refused_before_any_forward(name):
    """Mistral, window 8: its static layers keep only their window and roll it, which no crop undoes (plain
    generate's assisted decoding fails after its first round)."""
    model, draft = _pair(_mistral(8))
    reason = r"its sliding-window layers keep only their window's last 8 columns of a longer static cache"
    _refused_before_any_forward(model, reason, cache_implementation="static", **mode(name, draft))
    _refused_before_any_forward(model, reason, cache=StaticCache(config=model.config, max_cache_len=64),
                                **mode(name, draft))


def test_a_static_cache_too_short_for_the_call_is_refused_before_any_forward(llama_pair):
    """Plain generate fails part-way (index_copy_ past the buffer); hf_specdec says so up front."""
    model, draft = llama_pair
    _refused_before_any_forward(model, r"the static cache holds 20 columns and the call needs 27 .* Pass a "
                                       r"StaticCache whose max_cache_len holds the call",
                                cache=StaticCache(config=model.config, max_cache_len=20), **mode("speculative", draft))


@pytest.mark.parametrize("name", MODES)
def test_output_flags_and_rows_that_stop_early(name):
    """Eager attention, a batch whose first row meets EOS early: scores, logits, hidden states and attention
    weights (over the static cache's whole width, as plain returns them) and the cache, as plain's."""
    model, draft = _pair(tiny_model("llama", seed=0, attn_implementation="eager"))
    rows = type(model).generate(model, BATCH, attention_mask=BATCH_MASK, max_new_tokens=NEW, do_sample=False)[:, 12:]
    eos = next(int(t) for t in rows[0, 1:6] if t not in rows[1].tolist())  # row 0 stops early, row 1 runs on
    flags = dict(attention_mask=BATCH_MASK, cache_implementation="static", eos_token_id=eos, pad_token_id=0,
                 output_scores=True, output_logits=True, output_hidden_states=True, output_attentions=True)
    reference = plain(model, BATCH, **flags)
    out = ours(model, BATCH, name, draft, **flags)
    assert torch.equal(out.sequences, reference.sequences) and reference.sequences[0, -1] == 0
    for field in ("scores", "logits"):
        for a, b in zip(getattr(out, field), getattr(reference, field), strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    for field in ("hidden_states", "attentions"):
        for step_a, step_b in zip(getattr(out, field), getattr(reference, field), strict=True):
            for a, b in zip(step_a, step_b, strict=True):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert_same_static_cache(out.cache, reference.cache, BATCH_MASK)


def test_an_early_exit_draft_keeps_a_cache_of_its_own():
    """The target's static buffers are written in place, so an early-exit draft cannot share them: it reads the
    prompt into a cache of its own, and the tokens are plain's."""
    model = hf_specdec.enable(tiny_model("llama", seed=0, num_hidden_layers=4))
    reference = plain(model, PROMPT, cache_implementation="static")
    out = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                         assistant_model=EarlyExit(2), spec_config=FIXED)
    assert torch.equal(out, reference.sequences)
    stats = last_spec_stats(model)
    assert stats.drafted > 0 and stats.accepted > 0


@pytest.mark.parametrize("name", MODES)
def test_an_encoder_decoders_static_cache_is_refused_before_its_encoder_runs(name):
    """generate() would make the cross-attention cache static too: refused before the encoder runs."""
    torch.manual_seed(0)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)).eval()
    model, draft = _pair(model)
    calls = []
    handle = model.get_encoder().register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(Unsupported, match=r"cache_implementation='static': an encoder-decoder's static caches "
                                              r"are not supported\. Use the default dynamic cache"):
            model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                           **mode(name, draft))
    finally:
        handle.remove()
    assert calls == []
