"""The fast lane of one row's chains (issue 41's host time): ``KVStore``'s chain forwards and prefix keeps without
the slot table, and ``call_model``'s head bypass (``cache.PLAIN_HEADS``).

- the lane is taken (the store's ``lane_forwards`` / ``lane_keeps``) by a B = 1 greedy chain, in the target's store
  and the draft's, and not by trees, batches or a row with holes (a padded prompt); each case greedy-identical to
  plain ``generate`` (fp32) and provably drafting;
- in the store itself: the lane's logits, slots and state equal the general path's, and a non-chain operation
  after lane forwards (a tree continuing a written slot, a keep that leaves a hole) sees the slot table the general
  path would have built;
- the head bypass gives bit-identical logits to the model's own forward for every registered class (tiny
  configs), and a model with logit softcapping (Gemma 2) or a hook on the model itself is not bypassed.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_specdec
from hf_specdec import cache
from hf_specdec.cache import PLAIN_HEADS, Continue, KVStore, call_model, plain_head
from hf_specdec.layout import BatchInputs, positions
from tests.conftest import VOCAB, perturbed_copy, tiny_model

NEW = 24


@pytest.fixture
def stores(monkeypatch):
    """Every ``KVStore`` made while the test runs (the target's and the draft's), in order."""
    made = []

    class Recorded(KVStore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(cache, "KVStore", Recorded)
    return made


def _speculative(target, draft, prompt, **kwargs):
    return target.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                           max_new_tokens=NEW, do_sample=False, **kwargs)


def _plain(target, prompt, **kwargs):
    return type(target).generate(target, prompt, max_new_tokens=NEW, do_sample=False, **kwargs)


@pytest.fixture
def pair():
    target = tiny_model("llama", seed=0)
    return target, perturbed_copy(target, 0.1, relative=True)  # accepts some, rejects some


def test_greedy_chain_at_one_row_takes_the_lane(pair, stores):
    target, draft = pair
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    widths = []  # inputs of each draft forward
    draft.model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)
    out = _speculative(target, draft, prompt, spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4))
    assert torch.equal(out, _plain(target, prompt))
    stats = target.last_spec_stats.get()
    assert stats.accepted - stats.lookup_accepted > 0 and stats.accepted < stats.drafted  # drafts, some rejected
    target_store, draft_store = stores
    assert target_store.lane_forwards == stats.forwards  # every verify forward, and every keep (prefix crops)
    assert target_store.lane_keeps == stats.forwards
    assert draft_store.lane_forwards == stats.draft_forwards and draft_store.lane_keeps > 0
    # the draft keeps what its chain wrote and the target kept: after the prompt read (the 12 tokens before the
    # target's first), a round's first step feeds the target's token and, after a round kept in full, the last draft
    # token; every other step one token
    assert widths[0] == 12 and max(widths[1:]) == 2 and widths.count(2) < len(widths) // 2


def test_tree_rounds_leave_the_lane(pair, stores):
    target, draft = pair
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    memory = hf_specdec.SpeculativeMemory()  # flat target forwards: the adaptive policy grows trees
    memory.seed(draft, forward_seconds={n: 1.0 for n in range(1, 81)}, draft_step_seconds=0.01, draft_read_share=0.01)
    out = _speculative(target, draft, prompt, spec_config=hf_specdec.SpecConfig(tree="on", history_lookup=False),
                       speculative_memory=memory)
    assert torch.equal(out, _plain(target, prompt))
    stats = target.last_spec_stats.get()
    assert stats.tree_rounds > 0 and stats.accepted > 0
    target_store, draft_store = stores
    assert target_store.lane_forwards <= stats.forwards - stats.tree_rounds  # a tree's forward has an inner mask
    assert target_store.lane_keeps <= stats.forwards - stats.tree_rounds
    assert draft_store.lane_forwards < stats.draft_forwards  # each depth of a tree: a forward of the general path


def test_batch_and_holes_leave_the_lane(pair, stores):
    target, draft = pair
    spec = hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4)
    prompts = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # row 1 left-padded
    out = _speculative(target, draft, prompts, attention_mask=mask, spec_config=spec, pad_token_id=0)
    assert torch.equal(out, _plain(target, prompts, attention_mask=mask, pad_token_id=0))
    assert target.last_spec_stats.get().accepted > 0
    assert all(store.lane_forwards == 0 and store.lane_keeps == 0 for store in stores)  # two rows
    stores.clear()
    one = prompts[1:]  # one row with holes: its padding columns stay masked
    out = _speculative(target, draft, one, attention_mask=mask[1:], spec_config=spec, pad_token_id=0)
    assert torch.equal(out, _plain(target, one, attention_mask=mask[1:], pad_token_id=0))
    assert target.last_spec_stats.get().accepted > 0
    assert stores[0].lane_forwards == 0 and stores[0].lane_keeps == 0


def _chain(tokens) -> BatchInputs:
    return BatchInputs(torch.tensor([tokens]), positions(len(tokens))[None], None, None)


def test_lane_equals_the_general_path_in_the_store():
    model = tiny_model("llama", seed=0)
    prompt = torch.tensor([[5, 6, 7, 8]])
    lane, general = KVStore(model), KVStore(model)
    for store in (lane, general):
        store.prefill(prompt, None)
    with torch.no_grad():
        a = lane.forward(_chain([9, 10]))
        b = general.forward(_chain([9, 10]), after=None)
        assert lane.lane_forwards == 1 and general.lane_forwards == 1  # (no after: both in the lane so far)
        c = lane.forward(_chain([11]), after=Continue.LAST)
        d = general.forward(_chain([11]), after=torch.tensor([general.width + 1]))  # the general path
        assert lane.lane_forwards == 2 and general.lane_forwards == 1
        for x, y in ((a, b), (c, d)):
            assert torch.equal(x.logits, y.logits) and torch.equal(x.slots, y.slots)
        # a tree continuing slot 5 (positions 6, 6): the slot table the lane builds on demand is the general one
        tree = BatchInputs(torch.tensor([[12, 13]]), torch.zeros(1, 2, dtype=torch.long), None,
                           torch.eye(2, dtype=torch.bool)[None])
        e = lane.forward(tree, after=torch.tensor([[5, 5]]))
        f = general.forward(tree, after=torch.tensor([[5, 5]]))
    assert torch.equal(e.logits, f.logits)
    assert torch.equal(lane._positions, general._positions) and torch.equal(lane._sees, general._sees)
    for store in (lane, general):
        store.keep([[4, 5, 8]])  # 9, 10 and the tree's second node: one row gathers it after them, no holes
    assert lane.lengths.tolist() == general.lengths.tolist() == [7]
    assert lane.valid is None and general.valid is None and lane.width == general.width == 7
    for mine, theirs in zip(lane.layers, general.layers):
        assert torch.equal(mine.keys, theirs.keys)


def test_lane_steps_from_the_kept_tokens_equal_forwards_one_by_one():
    """A round's chain from its first input on (``starts_lane``): a first forward of 2 inputs after the kept tokens,
    then one token a step, each what ``choose`` made of the last logits: the logits, slots and cache of the same
    forwards made one by one through ``forward``."""
    model = tiny_model("llama", seed=0)
    chained, single = KVStore(model), KVStore(model)
    with torch.no_grad():
        for store in (chained, single):
            store.prefill(torch.tensor([[5, 6, 7, 8]]), None)
            assert not store.starts_lane()  # no lane forward yet: its call is made by the first
            store.forward(_chain([9]))
            store.keep([[4]])
        assert chained.starts_lane() and not chained.continues_lane()
        seen = []

        def choose(logits):  # [1, V] -> the next input [1, 1], or None after 3
            seen.append(logits)
            return logits.argmax(-1, keepdim=True) if len(seen) < 3 else None

        ran = chained.lane_steps(torch.tensor([[10, 11]]), 4, choose)
        one_by_one = [single.forward(_chain([10, 11]), logits_at=1)]
        for _ in range(2):
            token = int(one_by_one[-1].logits[0, -1].argmax())
            one_by_one.append(single.forward(_chain([token]), after=Continue.LAST, logits_at=1))
    assert ran == 3 and chained.num_written == single.num_written == 4 and chained.lane_forwards == 4
    for logits, forward in zip(seen, one_by_one, strict=True):
        assert torch.equal(logits, forward.logits[:, -1])
    assert [s for forward in one_by_one for s in forward.slots[0].tolist()] == [5, 6, 7, 8]
    for store in (chained, single):
        store.keep([[5, 6, 7]])
    assert chained.lengths.tolist() == single.lengths.tolist() == [8] and chained.lane_keeps == 2
    for mine, theirs in zip(chained.layers, single.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_lane_keep_is_a_crop():
    model = tiny_model("llama", seed=0)
    store = KVStore(model)
    store.prefill(torch.tensor([[5, 6, 7]]), None)
    with torch.no_grad():
        store.forward(_chain([8, 9, 10]))
        store.forward(_chain([11]), after=Continue.LAST)
    store.keep([[3, 4]])
    assert store.lane_keeps == 1 and store.dense and store.width == 5 and store.lengths.tolist() == [5]
    assert store.layers[0].keys.shape[2] == 5 and store.num_written == 0
    with torch.no_grad():
        result = store.forward(_chain([12]))
    assert result.slots.tolist() == [[5]] and store.lane_forwards == 3
    store.keep([[]])  # nothing kept: still a crop
    assert store.width == 5 and store.layers[0].keys.shape[2] == 5


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "GemmaForCausalLM": "gemma",
               "Olmo2ForCausalLM": "olmo2", "SmolLM3ForCausalLM": "smollm3"}


def _tiny(model_type: str, **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    return AutoModelForCausalLM.from_config(config).eval()


def _logits_both_ways(model, logits_at):
    """(``call_model``'s logits, the model's own forward's logits) over the same cache state and inputs."""
    from transformers import DynamicCache

    prompt, step = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[7, 8, 9]])
    results = []
    for _ in range(2):
        kv = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, cache=kv, use_cache=True)
            results.append(kv)
    with torch.no_grad():
        mine = call_model(model, step, results[0], logits_at=logits_at).logits
        own = model(input_ids=step, cache=results[1], use_cache=True,
                    logits_to_keep=0 if logits_at is None else logits_at).logits.float()
    return mine, own


def test_registry_is_what_the_test_covers():
    assert {name for _, name in PLAIN_HEADS} == set(MODEL_TYPES)


@pytest.mark.parametrize("name", sorted(MODEL_TYPES))
def test_head_bypass_is_bit_identical(name):
    model = _tiny(MODEL_TYPES[name])
    assert type(model).__name__ == name and plain_head(model) is model.lm_head
    for logits_at in (1, 2, None, torch.tensor([0, 2])):
        mine, own = _logits_both_ways(model, logits_at)
        assert torch.equal(mine, own), (name, logits_at)


def test_softcapping_and_hooks_are_not_bypassed():
    gemma2 = _tiny("gemma2", final_logit_softcapping=30.0, attn_logit_softcapping=None, sliding_window=64,
                   query_pre_attn_scalar=16)
    assert plain_head(gemma2) is None
    mine, own = _logits_both_ways(gemma2, 2)
    assert torch.equal(mine, own)
    model = _tiny("llama")
    handle = model.register_forward_hook(lambda module, args, output: None)
    assert plain_head(model) is None  # a hook on the model itself runs only in its own forward
    handle.remove()
    assert plain_head(model) is model.lm_head


def test_a_forward_patched_onto_the_class_is_not_bypassed(monkeypatch):
    """A forward patched onto the class (a library's hook, a test's clock) runs: the model is not bypassed."""
    model = _tiny("llama")
    own = type(model).forward
    calls = []

    def patched(self, *args, **kwargs):
        calls.append(1)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", patched)
    assert plain_head(model) is None
    mine, theirs = _logits_both_ways(model, 2)
    assert torch.equal(mine, theirs) and len(calls) == 4  # two prompt reads, call_model's forward, the model's own
