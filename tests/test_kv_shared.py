"""Cache layers that follow other columns: KV-shared layers (Gemma 3n, Gemma 4) and indexed attention (DeepSeek V3.2).

A KV-shared model's last layers keep no cache (``DummyLayer``): each reads the keys and values its producer (the
last earlier layer of its type) returned in the same forward, so it follows the producer's slots
(``backends.Stateless``). A DSA layer (``DynamicIndexedLayer``) caches one indexer key per column besides its keys
and values; the indexer picks the top k columns a query attends to, so its keys must follow every crop, gather and
compaction of the key columns (``backends.Indexed``). Each test compares token for token with plain greedy
``generate`` (fp32) and asserts that drafted tokens were accepted; the DSA model selects sparsely (top 8 of up to 47
columns), so a stale indexer key would change which columns a query reads.
"""

import pytest
import torch
from transformers import (DeepseekV32Config, DeepseekV32ForCausalLM, DynamicCache, Gemma3nForCausalLM,
                          Gemma3nTextConfig, Gemma4ForCausalLM, Gemma4TextConfig)
from transformers.cache_utils import DummyLayer, DynamicIndexedLayer

import hf_specdec
from hf_specdec.cache import KVStore
from hf_specdec.layout import BatchInputs
from hf_specdec.models.tiny import perturbed_copy
from hf_specdec.support import Unsupported, check_supported, tree_refusal
from tests.test_batch import PAD, left_padded

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24
SLIDING, FULL = "sliding_attention", "full_attention"
FIXED = {"policy": "fixed", "num_draft_tokens": 4}  # drafts every round, whatever this machine's timings
SHAPE = {"window": 4, "ngram": 3, "max_candidates": 4}  # lookahead verifies guesses every round
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, sliding_window=8, pad_token_id=PAD, bos_token_id=None,
              eos_token_id=None, tie_word_embeddings=False, initializer_range=0.1)
PROMPT = torch.tensor([[3, 4, 5, 6, 7] * 3])  # 15 tokens: with 24 new ones, past the sliding window of 8
DRAFT_NOISE = 0.005  # the draft: the target's weights plus this much noise (the target keeps 15-35% of its tokens here)


def _built(model_class, config, attention="sdpa"):
    torch.manual_seed(0)
    return model_class._from_config(config, attn_implementation=attention, dtype=torch.float32).eval()


def gemma3n(layer_types=(SLIDING, FULL, SLIDING, FULL), shared=2, attention="sdpa"):
    """Gemma 3n as its checkpoints have it (E2B: the last 10 of 30 layers share): the last ``shared`` layers read
    the keys and values of the last earlier layer of their type."""
    config = Gemma3nTextConfig(**COMMON, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                               num_kv_shared_layers=shared, hidden_size_per_layer_input=8,
                               vocab_size_per_layer_input=128, laurel_rank=8,
                               activation_sparsity_pattern=[0.0] * len(layer_types))
    return _built(Gemma3nForCausalLM, config, attention)


def gemma4(layer_types=(SLIDING, FULL, SLIDING, FULL), shared=2):
    """Gemma 4 as its E2B/E4B checkpoints have it: shared layers with double-wide MLPs, per-layer inputs."""
    config = Gemma4TextConfig(**COMMON, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                              num_kv_shared_layers=shared, hidden_size_per_layer_input=8,
                              vocab_size_per_layer_input=128, global_head_dim=16, use_double_wide_mlp=True)
    return _built(Gemma4ForCausalLM, config)


def deepseek_v32():
    """DeepSeek V3.2 (DSA): the indexer keeps the top 8 columns per query, scored by 8 heads (ties of its ReLU
    scores at exactly 0 are then rare, so plain generate's one-token steps select what a full forward selects)."""
    config = DeepseekV32Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, index_head_dim=16, index_n_heads=8, index_topk=8, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=512, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=False, initializer_range=0.1)
    return _built(DeepseekV32ForCausalLM, config)


MODELS = {"gemma3n": gemma3n, "gemma4": gemma4, "deepseek_v32": deepseek_v32}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request):
    """(name, target, draft): the draft a perturbed copy of the target, so it agrees with it often, not always."""
    target = MODELS[request.param]()
    return request.param, target, perturbed_copy(target, scale=DRAFT_NOISE)


def plain(model, ids, mask):
    return type(model).generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                pad_token_id=PAD)


def speculative(model, draft, ids, mask):
    return model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate,
                          draft_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)


def lookahead(model, ids, mask):
    return model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.lookahead_generate,
                          lookahead_memory=None, lookahead_config=SHAPE, max_new_tokens=NEW, do_sample=False,
                          pad_token_id=PAD)


def drafted_and_accepted(model, mode="speculative"):
    """The call's draft tokens judged and kept: the draft model's (prompt lookup's left out), or lookahead's."""
    stats = model.last_spec_stats.get()
    if mode == "speculative":
        return stats.drafted - stats.lookup_drafted, stats.accepted - stats.lookup_accepted
    return stats.drafted, stats.accepted


def test_the_models_have_the_layers_under_test():
    kinds = {name: [type(layer) for layer in DynamicCache(config=build().config).layers]
             for name, build in MODELS.items()}
    assert kinds["gemma3n"][2:] == [DummyLayer, DummyLayer] and kinds["gemma4"][2:] == [DummyLayer, DummyLayer]
    assert kinds["deepseek_v32"] == [DynamicIndexedLayer, DynamicIndexedLayer]
    for build in MODELS.values():  # all of them read tries: lookahead verifies trees, not chains
        assert tree_refusal(build()) is None


def test_speculative_equals_plain(pair):
    name, target, draft = pair
    ids, mask = PROMPT, torch.ones_like(PROMPT)
    assert torch.equal(speculative(target, draft, ids, mask), plain(target, ids, mask))
    drafted, accepted = drafted_and_accepted(target)
    assert 0 < accepted < drafted, (name, drafted, accepted)  # drafts kept and rolled back


def test_lookahead_equals_plain(pair):
    name, target, _ = pair
    ids, mask = PROMPT, torch.ones_like(PROMPT)
    assert torch.equal(lookahead(target, ids, mask), plain(target, ids, mask))
    drafted, accepted = drafted_and_accepted(target, "lookahead")
    assert 0 < accepted < drafted, (name, drafted, accepted)


BATCH = [[3, 4, 5, 6, 7] * 3, [9, 10, 11, 9, 10, 11, 9, 10], [60, 2, 60, 2, 60, 2]]


@pytest.mark.parametrize("build", [lambda: gemma4((FULL,) * 4, 2), deepseek_v32], ids=["gemma4_full", "deepseek_v32"])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_a_left_padded_batch_equals_plain(build, mode):
    """Rows advancing by different numbers of tokens a round leave holes that are masked and compacted: the shared
    layers follow their producer's columns, the indexer keys follow the keys. (A full-attention Gemma 4: batches of
    sliding-window models are refused, next test.)"""
    target = build()
    ids, mask = left_padded(BATCH)
    expected = plain(target, ids, mask)
    if mode == "speculative":
        out = speculative(target, perturbed_copy(target, scale=DRAFT_NOISE), ids, mask)
    else:
        out = lookahead(target, ids, mask)
    assert torch.equal(out, expected)
    drafted, accepted = drafted_and_accepted(target, mode)
    assert 0 < accepted < drafted, (drafted, accepted)


def test_a_batch_of_a_sliding_window_gemma_3n_is_refused_with_the_reason():
    with pytest.raises(Unsupported, match="sliding-window attention layers"):
        check_supported(gemma3n(), "speculative", rows=2)
    check_supported(gemma3n(), "speculative", rows=1)


def test_indexer_keys_follow_a_kept_path_and_compaction():
    """A trie round (a, then b or c after a) keeps a -> c: in a batch the hole at b is masked, then compacted
    away; one row gathers its path at the keep. Either way the indexer keys of the store are then those a forward
    over the kept tokens alone computes."""
    model = deepseek_v32()
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.cat([PROMPT, torch.tensor([[8, 10]])], dim=1), past_key_values=reference, use_cache=True)
    for rows in (2, 1):
        store = KVStore(model)
        store.prefill(PROMPT.expand(rows, -1), None)
        inner = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool).expand(rows, -1, -1)
        trie = BatchInputs(torch.tensor([[8, 9, 10]]).expand(rows, -1), torch.tensor([[0, 1, 1]]).expand(rows, -1),
                           None, inner)
        slots = store.forward(trie).slots.tolist()
        store.keep([[row[0], row[2]] for row in slots])
        assert (store.valid is not None) == (rows == 2) and store.gathers == (rows == 1)  # a batch: masked hole
        store.compact()
        assert store.dense
        for ours, theirs in zip(store.layers, reference.layers):
            torch.testing.assert_close(ours.indexer_keys[:1], theirs.indexer_keys)
            torch.testing.assert_close(ours.keys[:1], theirs.keys)


def test_the_attentions_of_a_shared_sliding_layer_are_plains():
    """``output_attentions``: a KV-shared layer of sliding type attends within its producer's window, and plain
    returns its weights over that window only, as it does the producer's."""
    target = gemma3n(attention="eager")  # sdpa returns no weights
    ids, mask = PROMPT, torch.ones_like(PROMPT)
    flags = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True,
                 output_attentions=True)
    expected = type(target).generate(target, ids, attention_mask=mask, **flags)
    out = target.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate,
                          draft_model=perturbed_copy(target, scale=DRAFT_NOISE), spec_config=FIXED, **flags)
    assert torch.equal(out.sequences, expected.sequences)
    assert drafted_and_accepted(target)[1] > 0
    for ours, theirs in zip(out.attentions, expected.attentions):
        for layer, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"layer {layer}")
