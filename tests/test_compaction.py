"""Compaction as a step of its own: the decoding loop's store compacts outside the timed forward, and the planner
prices each hole a round leaves by what compacting measured."""

import dataclasses

import torch

import hf_specdec
from hf_specdec import cache as kv
from hf_specdec.config import LookaheadConfig
from hf_specdec.costmodel import ForwardCost
from hf_specdec.layout import BatchInputs
from hf_specdec.policy import EmaName, Planner
from hf_specdec.round import Proposal, RoundOutcome
from tests.conftest import tiny_model

PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 2, 9, 30, 31]])


def _tree_round(store, width):
    """A trie of ``width`` siblings after the prompt in every row; each row keeps the last, so the others are
    holes."""
    rows = store.num_rows
    tokens = torch.arange(70, 70 + width).expand(rows, width)
    inner = torch.eye(width, dtype=torch.bool).expand(rows, width, width)
    written = store.forward(BatchInputs(tokens, torch.zeros(rows, width, dtype=torch.long), None, inner))
    store.keep([[int(written.slots[r, -1])] for r in range(rows)])
    return written


def test_a_store_that_compacts_explicitly_leaves_its_holes_to_its_owner():
    model = tiny_model("llama", seed=0)
    by_itself, explicit = kv.KVStore(model), kv.KVStore(model, compacts_on_keep=False)
    for store in (by_itself, explicit):
        store.prefill(PROMPT.expand(2, -1), None)  # a batch: holes stay, masked, until compacted
        _tree_round(store, 14)  # 13 holes in 24 columns: past COMPACT_FRACTION
    assert by_itself.gathers == 1 and by_itself.dense and not by_itself.compaction_due()
    assert explicit.gathers == 0 and explicit.compaction_due() and explicit.width == 24
    assert explicit.compact() == 26 and explicit.dense and not explicit.compaction_due()
    assert explicit.width == by_itself.width == 11
    for a, b in zip(explicit.cache.layers, by_itself.cache.layers):
        torch.testing.assert_close(a.keys, b.keys)


def test_one_row_gathers_its_path_at_the_keep_and_stays_in_the_fast_lane():
    model = tiny_model("llama", seed=0)
    store, reference = kv.KVStore(model, compacts_on_keep=False), kv.KVStore(model)
    store.prefill(PROMPT, None)
    _tree_round(store, 14)  # keeps the 14th sibling: gathered to the first written column, no hole left
    assert store.gathers == 1 and store.dense and store.valid is None and store.width == 11
    assert not store.compaction_due()
    reference.prefill(torch.cat([PROMPT, torch.tensor([[83]])], dim=1), None)  # the kept token read in a chain
    for a, b in zip(store.cache.layers, reference.cache.layers):
        torch.testing.assert_close(a.keys, b.keys)
    lanes = store.lane_forwards
    store.forward(BatchInputs(torch.tensor([[9, 10]]), torch.arange(2)[None], None, None), logits_at=1)
    assert store.lane_forwards == lanes + 1  # dense again: the next chain takes the fast lane


def test_the_planner_prices_holes_by_what_compacting_measured():
    planner = Planner.lookahead(LookaheadConfig())
    assert planner.price().hole == 0.0  # nothing measured: holes are free
    outcome = RoundOutcome(Proposal(), accepted=(), next_token=0, emitted=(0,), start_length=10, forward_tokens=1,
                           verify_time=0.1, compacted=40, compact_time=0.002)
    planner.observe([outcome])
    assert planner.estimates.ema_value(EmaName.HOLE_SECONDS) == 0.002 / 40
    assert planner.estimates.forward.estimate(1) == 0.1  # the forward's cost is the forward's alone
    price = dataclasses.replace(planner.price(rows=2), cost=ForwardCost.from_table({1: 0.1, 8: 0.1}))
    assert price(8, holes=3) == round(0.1 + 2 * 3 * 0.002 / 40, 12)


def test_the_decoding_loop_times_compaction_apart_from_the_forward():
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    long = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 10, 5, 6, 7, 11, 5, 6, 7]
    ids = torch.tensor([[0] * 17 + [5, 6], long])  # the short row's padding: holes from the start
    mask = (torch.arange(19) >= torch.tensor([[17], [0]])).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
    out = model.generate(ids, decoding="lookahead", lookahead_config={"max_candidates": 8, "window": 4, "ngram": 3},
                         return_dict_in_generate=True, **kwargs)
    plain = model.generate(ids, **kwargs)
    stats = out.spec_stats
    assert out.sequences.tolist() == plain.tolist()
    assert stats.tree_rounds > 0 and stats.compactions > 0 and stats.compact_time_s > 0
