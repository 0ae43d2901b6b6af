"""A cache passed in, masks with holes and custom ``position_ids``: hf_specdec continues as plain ``generate`` does.

Plain ``generate`` is the reference (transformers' assisted decoding re-reads a cached prefix:
/work/shared/research/transformers_surface.md 10(b)). For each case, greedy, speculative (a close draft, fixed k)
and lookahead (a seeded memory): the same sequences as plain, and the cache plain returns (the caller's object
itself, extended in place, or a fresh one with ``return_dict_in_generate``) equal to plain's: same length, and the
same keys and values wherever plain's final mask attends (padding and holes are never read). A tiny Llama and a
tiny Mistral whose layers hold only their sliding window of 8.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DynamicCache, MBartConfig, MBartForCausalLM,
                          MistralConfig, MistralForCausalLM, StaticCache)

import hf_specdec
from hf_specdec.models.tiny import perturbed_copy, tiny_model
from hf_specdec.stats import last_spec_stats
from tests.clock import VirtualClock

NEW = 12
FIXED = {"policy": "fixed", "num_draft_tokens": 4}
PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 5, 17, 42, 8, 23, 61]])
BATCH = torch.tensor([[5, 17, 42, 8, 23, 61, 5, 17, 42, 8, 23, 61],
                      [0, 0, 0, 9, 33, 71, 12, 9, 33, 71, 12, 9]])
BATCH_MASK = torch.tensor([[1] * 12, [0, 0, 0] + [1] * 9])
HOLES = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1],
                      [0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1]])


def _mistral(seed: int = 0):
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8, max_position_embeddings=512,
                           eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = MistralForCausalLM(config).eval()
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return model


@pytest.fixture(scope="module")
def pairs():
    """Per architecture, (target, close draft: 5% noise on every weight), the target enabled; Mistral's layers slide
    over a window of 8 (one prompt at a time: hf_specdec refuses batches of sliding-window models up front)."""
    made = {}
    for arch, model in (("llama", tiny_model("llama", seed=0)), ("mistral", _mistral())):
        draft = perturbed_copy(model, 0.05, relative=True)
        made[arch] = (hf_specdec.enable(model), draft)
    return made


@pytest.fixture(scope="module")
def llama_pair(pairs):
    return pairs["llama"]


ONE_OR_TWO = [("llama", False), ("llama", True), ("mistral", False)]  # (architecture, batch)


def mode(name: str, draft) -> dict:
    """Each way into hf_specdec, set up to guess from the first round (tests/test_inputs.py ``modes``)."""
    if name == "speculative":
        return dict(assistant_model=draft, spec_config=FIXED)
    pool = hf_specdec.LookaheadMemory()
    pool.seed({n: 1.0 for n in range(1, 17)})
    return dict(decoding="lookahead", lookahead_memory=pool)


def assert_drafted(model, name: str) -> None:
    stats = last_spec_stats(model)
    assert stats is not None and stats.accepted > 0, stats
    if name == "speculative":
        assert stats.drafted - stats.lookup_drafted > 0, stats


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Plain generate's positions: ``cumsum(mask) - 1``, 0 where masked."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def prefilled(model, ids, mask, columns: int, positions=None) -> DynamicCache:
    """A cache holding the first ``columns`` columns of ``ids``, from an earlier forward (a chat's earlier turn)."""
    cache = DynamicCache(config=model.config)
    positions = positions_of(mask) if positions is None else positions
    with torch.no_grad():
        model(ids[:, :columns], attention_mask=mask[:, :columns], position_ids=positions[:, :columns], cache=cache)
    return cache


def assert_same_cache(ours, plain, mask: torch.Tensor, new: int) -> None:
    """Same type and length; equal keys and values (1e-4) at every column plain's final mask attends to."""
    assert type(ours) is type(plain)
    assert ours.get_seq_length() == plain.get_seq_length() == mask.shape[1] + new - 1
    final = torch.cat([mask.bool(), torch.ones(mask.shape[0], new - 1, dtype=torch.bool)], dim=1)
    assert len(ours.layers) == len(plain.layers)
    for mine, theirs in zip(ours.layers, plain.layers):
        assert mine.keys.shape == theirs.keys.shape and getattr(mine, "record_past", None) == \
            getattr(theirs, "record_past", None)
        attended = final[:, final.shape[1] - theirs.keys.shape[2]:]  # a sliding-window layer holds its window
        for row in range(final.shape[0]):
            for name in ("keys", "values"):
                a, b = getattr(mine, name)[row][:, attended[row]], getattr(theirs, name)[row][:, attended[row]]
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@contextlib.contextmanager
def paying(model, draft):
    """A virtual clock where a target forward costs 1 s, a draft step 0.01 s and the host nothing
    (``tests/clock.py``), so that guessing pays on any machine, however loaded: a tiny model's real forwards cost
    less than a round's host work, and a lookahead batch priced on the real clock may rightly never guess."""
    with pytest.MonkeyPatch.context() as patch:
        clock = VirtualClock(patch)
        clock.charge(patch, model, lambda n: 1.0)
        clock.charge(patch, draft, lambda n: 0.01)
        yield clock


def generate_both(model, ids, name, draft, *, mask=None, cache_columns=0, **kwargs):
    """(plain's output, hf_specdec's output), each with its own cache (prefilled alike when asked), ``paying``."""
    outputs = []
    with paying(model, draft):
        for extra in ({}, mode(name, draft)):
            cache = prefilled(model, ids, mask if mask is not None else torch.ones_like(ids), cache_columns,
                              kwargs.get("position_ids")) if cache_columns else None
            given = {} if mask is None else {"attention_mask": mask}
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                                 cache=cache, **given, **kwargs, **extra)
            if cache is not None:
                assert out.cache is cache  # the caller's own object, extended in place
            outputs.append(out)
    assert_drafted(model, name)
    return outputs


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_chat_turn_continues_from_the_cache(pairs, arch, name):
    """The first 8 of 12 prompt tokens cached by an earlier forward: the same tokens and cache as plain."""
    model, draft = pairs[arch]
    plain, ours = generate_both(model, PROMPT, name, draft, cache_columns=8)
    assert torch.equal(ours.sequences, plain.sequences)
    assert_same_cache(ours.cache, plain.cache, torch.ones_like(PROMPT), NEW)


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
@pytest.mark.parametrize("holes", [False, True])
def test_a_batch_continues_from_the_cache(llama_pair, name, holes):
    """Two left-padded rows (or rows with holes, some of them cached), their first 6 columns cached."""
    model, draft = llama_pair
    mask = HOLES if holes else BATCH_MASK
    plain, ours = generate_both(model, BATCH, name, draft, mask=mask, cache_columns=6)
    assert torch.equal(ours.sequences, plain.sequences)
    assert_same_cache(ours.cache, plain.cache, mask, NEW)


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
@pytest.mark.parametrize(("arch", "batch"), ONE_OR_TWO)
def test_the_cache_plain_returns_without_one_passed(pairs, arch, name, batch):
    model, draft = pairs[arch]
    ids, mask = (BATCH, BATCH_MASK) if batch else (PROMPT, None)
    plain, ours = generate_both(model, ids, name, draft, mask=mask)
    assert torch.equal(ours.sequences, plain.sequences)
    assert_same_cache(ours.cache, plain.cache, mask if mask is not None else torch.ones_like(ids), NEW)


def test_only_the_uncached_tokens_are_read(llama_pair):
    """The target's first forward reads the 4 uncached tokens (transformers' assisted decoding reads all 12)."""
    model, draft = llama_pair
    widths, cache = [], prefilled(model, PROMPT, torch.ones_like(PROMPT), 8)
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        model.generate(PROMPT, cache=cache, max_new_tokens=NEW, do_sample=False, **mode("speculative", draft))
    finally:
        handle.remove()
    assert widths[0] == 4


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
def test_a_cache_passed_with_only_the_new_tokens(llama_pair, name):
    """input_ids = the 4 uncached tokens, attention_mask over all 12 columns: plain reads the ids as new tokens."""
    model, draft = llama_pair
    outputs = []
    with paying(model, draft):
        for extra in ({}, mode(name, draft)):
            cache = prefilled(model, PROMPT, torch.ones_like(PROMPT), 8)
            outputs.append(model.generate(PROMPT[:, 8:], attention_mask=torch.ones_like(PROMPT), cache=cache,
                                          max_new_tokens=NEW, do_sample=False, **extra))
            assert cache.get_seq_length() == 12 + NEW - 1
    assert_drafted(model, name)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
@pytest.mark.parametrize(("arch", "batch"), ONE_OR_TWO)
def test_masks_with_holes(pairs, arch, name, batch):
    """Zeros after the first real token: masked at plain's positions (cumsum(mask) - 1), in the cache too."""
    model, draft = pairs[arch]
    ids, mask = (BATCH, HOLES) if batch else (PROMPT, HOLES[:1])
    plain, ours = generate_both(model, ids, name, draft, mask=mask)
    assert torch.equal(ours.sequences, plain.sequences)
    assert_same_cache(ours.cache, plain.cache, mask, NEW)
    unmasked = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert not torch.equal(unmasked, plain.sequences)  # the holes matter


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
@pytest.mark.parametrize(("arch", "batch"), ONE_OR_TWO)
def test_custom_position_ids(pairs, arch, name, batch):
    """Positions 3, 5, 7, ... (the batch's second row 3, 6, 9, ..., over its holes too): plain extends them by
    last + 1 per new token (a uniform shift would change nothing: rotary positions are relative)."""
    model, draft = pairs[arch]
    ids, mask = (BATCH, HOLES) if batch else (PROMPT, None)
    positions = torch.arange(ids.shape[1])[None] * torch.arange(2, 2 + ids.shape[0])[:, None] + 3
    plain, ours = generate_both(model, ids, name, draft, mask=mask, position_ids=positions)
    assert torch.equal(ours.sequences, plain.sequences)
    assert_same_cache(ours.cache, plain.cache, mask if mask is not None else torch.ones_like(ids), NEW)
    default = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True)
    assert not torch.allclose(default.cache.layers[0].keys, plain.cache.layers[0].keys)  # the positions reach the keys


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
def test_custom_positions_with_a_cache_passed_in(llama_pair, name):
    model, draft = llama_pair
    positions = torch.arange(12)[None] * 2 + 3
    plain, ours = generate_both(model, PROMPT, name, draft, cache_columns=8, position_ids=positions)
    assert torch.equal(ours.sequences, plain.sequences)
    assert_same_cache(ours.cache, plain.cache, torch.ones_like(PROMPT), NEW)


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
def test_rows_that_stop_early_leave_the_cache_plain_leaves(llama_pair, name):
    """A row that meets EOS early: plain feeds it padding until the last row stops, and its cache holds them."""
    model, draft = llama_pair
    rows = model.generate(BATCH, attention_mask=BATCH_MASK, max_new_tokens=NEW, do_sample=False)[:, 12:]
    eos = next(int(t) for t in rows[0, 1:6] if t not in rows[1].tolist())  # row 0 stops early, row 1 runs on
    plain, ours = generate_both(model, BATCH, name, draft, mask=BATCH_MASK, cache_columns=6, eos_token_id=eos,
                                pad_token_id=0)
    assert torch.equal(ours.sequences, plain.sequences)
    assert (plain.sequences[0, -1] == 0) and plain.sequences.shape[1] == 12 + NEW  # the precondition
    assert_same_cache(ours.cache, plain.cache, BATCH_MASK, NEW)


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
def test_the_padding_after_an_early_stop_gets_the_rows_token_types(name):
    """GPT-2 with token_type_ids: the padding plain feeds a row after its EOS carries the row's last token type,
    and so do the keys and values of the cache handed back."""
    model = tiny_model("gpt2", seed=0)
    draft = perturbed_copy(model, 0.05, relative=True)
    hf_specdec.enable(model)
    types = torch.ones_like(BATCH)
    types[:, :6], types[1, -1] = 0, 2
    rows = model.generate(BATCH, attention_mask=BATCH_MASK, token_type_ids=types, max_new_tokens=NEW,
                          do_sample=False)[:, 12:]
    eos = next(int(t) for t in rows[0, :6] if t not in rows[1].tolist())  # row 0 stops at once, row 1 runs on
    plain, ours = generate_both(model, BATCH, name, draft, mask=BATCH_MASK, token_type_ids=types, eos_token_id=eos,
                                pad_token_id=0)
    assert torch.equal(ours.sequences, plain.sequences) and plain.sequences[0, -1] == 0
    assert_same_cache(ours.cache, plain.cache, BATCH_MASK, NEW)


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
def test_a_short_static_cache_is_refused_before_any_forward(llama_pair, name):
    """What stays refused names the input and what to do, before the target runs anything (a static cache runs
    where it holds the call: tests/test_static_cache.py)."""
    model, draft = llama_pair
    static, full = StaticCache(config=model.config, max_cache_len=16), prefilled(model, PROMPT, torch.ones_like(PROMPT),
                                                                                12)
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"the static cache holds 16 columns and the call needs 23 .*Pass a "
                                             r"StaticCache whose max_cache_len holds the call"):
            model.generate(PROMPT, cache=static, max_new_tokens=NEW, do_sample=False, **mode(name, draft))
        with pytest.raises(ValueError, match=r"The cache passed in already holds 12 columns, and input_ids has 12: "
                                             r"nothing of the prompt is left to read\. Pass input_ids with at least"):
            model.generate(PROMPT, cache=full, max_new_tokens=NEW, do_sample=False, **mode(name, draft))
    finally:
        handle.remove()
    assert calls == []


def test_sampling_from_a_cache_has_the_targets_distribution():
    """Chi-square (tests/test_sampling.py): speculative sampling that continues from a cached prefix of the prompt
    follows plain's exact processed distribution."""
    from tests.test_sampling import DRAWS, NEW as SAMPLED, PROMPT as SHORT, SAMPLING, assert_fits, \
        exact_distribution, processors, sampling_model
    model = sampling_model()
    draft = perturbed_copy(model, 0.01)
    exact = exact_distribution(model, SHORT, SAMPLED, processors(**SAMPLING))
    hf_specdec.enable(model)
    torch.manual_seed(7)
    counts, drafted, accepted = Counter(), 0, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(DRAWS):
            cache = prefilled(model, SHORT, torch.ones_like(SHORT), 5)
            out = model.generate(SHORT, cache=cache, do_sample=True, max_new_tokens=SAMPLED, assistant_model=draft,
                                 spec_config=FIXED, **SAMPLING)
            counts[tuple(out[0, SHORT.shape[1]:].tolist())] += 1
            stats = last_spec_stats(model)
            drafted, accepted = drafted + stats.drafted - stats.lookup_drafted, accepted + stats.accepted
    finally:
        torch.set_num_threads(threads)
    assert drafted > 0 and accepted > 0
    assert_fits(counts, exact)


def _without_special_tokens(model):
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id"):
        setattr(model.generation_config, name, None)
    return model


def _deepseek_v2():
    """Transformers' tester config for DeepseekV2 (multi-head latent attention): cached keys [.., 32] and values
    [.., 64] have head dims of their own."""
    torch.manual_seed(0)
    config = DeepseekV2Config(vocab_size=99, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                              num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=16, qk_nope_head_dim=64,
                              qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=512, eos_token_id=None,
                              bos_token_id=None, pad_token_id=None)
    return _without_special_tokens(DeepseekV2ForCausalLM(config).eval())


def _mbart_decoder():
    """A tiny MBartForCausalLM: it takes no position_ids; its learned positions are cache column numbers (plain
    generate's prompt token j sits at position j, masked or not). Weights at std 0.3 so positions matter."""
    torch.manual_seed(0)
    config = MBartConfig(vocab_size=99, d_model=32, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
                         decoder_ffn_dim=64, max_position_embeddings=100, init_std=0.3, is_decoder=True,
                         is_encoder_decoder=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                         decoder_start_token_id=None)
    return _without_special_tokens(MBartForCausalLM(config).eval())


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
def test_a_batch_of_a_model_that_counts_positions_by_column_is_refused_before_any_forward(name):
    """MBartForCausalLM takes no position_ids: a batch's rows, advancing at their own pace, would write later tokens
    at other columns (other positions) than plain's, so a batch is refused up front; one prompt runs."""
    model = _mbart_decoder()
    draft = perturbed_copy(model, 0.05, relative=True)
    hf_specdec.enable(model)
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"it takes no position ids, so a token's position is its cache column "
                                             r"\(as in plain generate\), and the 2 rows of a batch advance"):
            model.generate(PROMPT.repeat(2, 1), max_new_tokens=NEW, do_sample=False,
                           **({"assistant_model": draft} if name == "speculative" else {"decoding": "lookahead"}))
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
def test_keys_and_values_of_different_head_dims(name):
    """A batch with holes on DeepseekV2, whose cached values are wider than its keys: the cache handed back is
    plain's, keys and values each in their own shape."""
    model = _deepseek_v2()
    draft = perturbed_copy(model, 0.05, relative=True)
    hf_specdec.enable(model)
    plain, ours = generate_both(model, BATCH, name, draft, mask=HOLES)
    layer = plain.cache.layers[0]
    assert layer.keys.shape[-1] != layer.values.shape[-1]
    assert torch.equal(ours.sequences, plain.sequences)
    assert_same_cache(ours.cache, plain.cache, HOLES, NEW)


@pytest.mark.parametrize("name", ["speculative", "lookahead"])
def test_holes_keep_their_columns_where_positions_count_columns(name):
    """MBartForCausalLM numbers its inputs by cache column: a prompt mostly holes keeps every column where plain
    has it (none compacted away), so each new token sits at plain's position."""
    model = _mbart_decoder()
    draft = perturbed_copy(model, 0.05, relative=True)
    hf_specdec.enable(model)
    mask = torch.tensor([[1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 1]])
    plain, ours = generate_both(model, PROMPT, name, draft, mask=mask)
    assert torch.equal(ours.sequences, plain.sequences)
    assert_same_cache(ours.cache, plain.cache, mask, NEW)
    unmasked = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    assert not torch.equal(unmasked, plain.sequences)  # the holes matter
