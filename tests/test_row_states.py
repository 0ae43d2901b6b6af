"""A row's states leaving the batch and coming back, in every kind of cache layer (``backends.RowStates``).

When a row of a batch stops before the others, the store parks its states (``row_states``), cuts off the tokens it
kept after its stop (``RowStates.cut``), runs the padding plain ``generate`` feeds it after its stop in a cache of
its own (``restore``), and hands the cache back in plain's columns (``set_states``). Each test compares with plain
greedy ``generate`` (fp32): the sequences, the per-step outputs asked for, and the cache handed back (keys, values
and indexer keys wherever plain's final mask attends; a recurrent layer's conv and recurrent states whole), and
asserts that drafted tokens were kept.

- DeepSeek V3.2 (DSA, ``DynamicIndexedLayer``): the indexer keys of the cache handed back are plain's, with the
  padding of a left-padded batch, trie holes (lookahead) and rows that stop early (their padding is read over the
  row's own indexer keys).
- Recurrent and hybrid models (Mamba, FalconH1, Jamba, Qwen3-Next): a batch whose rows stop apart returns its
  scores, logits, hidden states and cache; a row that stopped inside a round goes back to its stop over the states
  the layer kept per input (``Recurrent._retained``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_specdec
from hf_specdec.cache import KVStore
from hf_specdec.layout import BatchInputs
from tests import test_kv_shared as shared
from tests import test_recurrent as recurrent

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 0
FLAGS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True)


def stop_token(new: torch.Tensor) -> int:
    """An end-of-sequence token that stops row 0 of plain's continuations ``new`` [B, N] at its 4th to 12th token
    (inside a round) while every other row runs at least four tokens longer."""
    for i in range(3, 12):
        token = int(new[0, i])
        if token != PAD and token not in new[0, :i].tolist() and \
                all(token not in new[r, : i + 4].tolist() for r in range(1, new.shape[0])):
            return token
    raise AssertionError(f"no token stops row 0 alone: {new.tolist()}")


def assert_same_outputs(ours, plain) -> None:
    assert torch.equal(ours.sequences, plain.sequences)
    for name in ("scores", "logits"):
        if getattr(plain, name) is None:
            assert getattr(ours, name) is None, name
            continue
        assert len(getattr(ours, name)) == len(getattr(plain, name))
        for mine, theirs in zip(getattr(ours, name), getattr(plain, name)):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    if plain.hidden_states is not None:
        assert len(ours.hidden_states) == len(plain.hidden_states)
        for step, (mine, theirs) in enumerate(zip(ours.hidden_states, plain.hidden_states)):
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"hidden states, step {step}")


def assert_same_cache(ours, plain, final: torch.Tensor) -> None:
    """Same length, recording flag and states: keys, values and indexer keys at every column plain's final mask
    ``final`` [B, S] attends to (masked columns are never read), conv and recurrent states whole."""
    assert len(ours.layers) == len(plain.layers)
    for index, (mine, theirs) in enumerate(zip(ours.layers, plain.layers)):
        where = f"layer {index}"
        assert int(mine.get_seq_length()) == int(theirs.get_seq_length()), where
        assert getattr(mine, "record_past", None) == getattr(theirs, "record_past", None), where
        for name, axis in (("keys", 2), ("values", 2), ("indexer_keys", 1)):
            a, b = getattr(theirs, name, None), getattr(mine, name, None)
            if a is None:
                continue
            assert b is not None and a.shape == b.shape, (where, name)
            attended = final[:, final.shape[1] - a.shape[axis]:]
            for row in range(final.shape[0]):
                torch.testing.assert_close(b[row].index_select(axis - 1, attended[row].nonzero()[:, 0]),
                                           a[row].index_select(axis - 1, attended[row].nonzero()[:, 0]),
                                           atol=1e-4, rtol=0, msg=f"{where} {name} row {row}")
        for name in ("conv_states", "recurrent_states"):
            for state, value in (getattr(theirs, name, None) or {}).items():
                if value is not None:
                    torch.testing.assert_close(getattr(mine, name)[state], value, atol=1e-4, rtol=1e-4,
                                               msg=f"{where} {name}[{state}]")


def final_mask(mask: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
    """[B, columns plain's cache holds]: the prompt's mask, then every new token but the last."""
    new = sequences.shape[1] - mask.shape[1]
    return torch.cat([mask.bool(), torch.ones(mask.shape[0], new - 1, dtype=torch.bool)], dim=1)


# ----------------------------------------------------------------------------------------------------------------
# Indexed attention (DeepSeek V3.2): the indexer keys of the cache handed back
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dsa():
    target = shared.deepseek_v32()
    return target, shared.perturbed_copy(target, scale=shared.DRAFT_NOISE)


def dsa_modes(draft) -> dict:
    return {"speculative": dict(custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                                spec_config=shared.FIXED),
            "lookahead": dict(custom_generate=hf_specdec.lookahead_generate, lookahead_memory=None,
                              lookahead_config=shared.SHAPE)}


@pytest.mark.parametrize("cached", [0, 6], ids=["fresh", "cache_passed_in"])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_dsa_rows_that_stop_early_hand_back_plains_cache(dsa, mode, cached):
    """A left-padded batch of three whose first row stops early: its padding is read over its own indexer keys, and
    the cache handed back (a fresh one, or one passed in holding the prompts' first columns) has plain's keys,
    values and indexer keys. Lookahead verifies tries: their rejected branches are holes until compacted."""
    target, draft = dsa
    ids, mask = shared.left_padded(shared.BATCH)
    base = dict(max_new_tokens=shared.NEW, do_sample=False, pad_token_id=PAD)
    eos = stop_token(type(target).generate(target, ids, attention_mask=mask, **base)[:, ids.shape[1]:])
    flags = dict(base, eos_token_id=eos, return_dict_in_generate=True, output_scores=True, output_logits=True)
    outputs = []
    for extra in ({}, dsa_modes(draft)[mode]):
        cache = None
        if cached:  # a chat's earlier turn: the prompts' first columns, read by a forward of their own
            cache = DynamicCache(config=target.config)
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            with torch.no_grad():
                target(ids[:, :cached], attention_mask=mask[:, :cached], position_ids=positions[:, :cached],
                       cache=cache)
        if extra:
            outputs.append(target.generate(ids, attention_mask=mask, cache=cache, **flags, **extra))
        else:
            outputs.append(type(target).generate(target, ids, attention_mask=mask, cache=cache, **flags))
    plain, ours = outputs
    assert plain.sequences[0, -1] == PAD and plain.sequences.shape[1] == ids.shape[1] + shared.NEW  # row 0 stopped
    assert_same_outputs(ours, plain)
    assert_same_cache(ours.past_key_values, plain.past_key_values, final_mask(mask, plain.sequences))
    drafted, accepted = shared.drafted_and_accepted(target, mode)
    assert 0 < accepted < drafted, (drafted, accepted)
    if mode == "lookahead":
        assert target.last_spec_stats.get().tree_rounds > 0


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_dsa_holes_in_the_cache_handed_back(dsa, mode):
    """One row whose mask has holes, and (lookahead) the rejected branches of tries: the cache handed back is
    assembled in plain's columns, the mask's holes included, the tries' dropped."""
    target, draft = dsa
    ids = shared.left_padded(shared.BATCH[:1])[0]
    mask = torch.ones_like(ids)
    mask[0, [2, 5, 6]] = 0
    flags = dict(max_new_tokens=shared.NEW, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True,
                 output_scores=True)
    plain = type(target).generate(target, ids, attention_mask=mask, **flags)
    ours = target.generate(ids, attention_mask=mask, **flags, **dsa_modes(draft)[mode])
    assert_same_outputs(ours, plain)
    assert_same_cache(ours.past_key_values, plain.past_key_values, final_mask(mask, plain.sequences))
    assert shared.drafted_and_accepted(target, mode)[1] > 0


# ----------------------------------------------------------------------------------------------------------------
# Recurrent and hybrid layers: a batch whose rows stop apart
# ----------------------------------------------------------------------------------------------------------------


PROMPTS = torch.tensor([[3, 4, 5, 6, 7, 9, 11] * 2, [PAD] * 4 + [20, 31, 42, 53] * 2 + [20, 31]])
PROMPT_MASK = (PROMPTS != PAD).long()


@pytest.mark.parametrize("model_type", recurrent.MODELS)
def test_a_recurrent_batch_whose_rows_stop_apart_returns_plains_outputs_and_cache(model_type):
    """Two rows, the second left-padded; the first stops inside a round, several tokens before the second. Its
    states go back to its stop and read the padding plain feeds it; every step's scores, logits and hidden states,
    and the cache handed back, are plain's. The target drafts for itself (every guess kept) and a perturbed copy
    drafts (rejections roll each row's states back)."""
    model = recurrent.tiny(model_type)
    eos = stop_token(recurrent.plain(model, PROMPTS, PROMPT_MASK)[:, PROMPTS.shape[1]:])
    flags = dict(FLAGS, eos_token_id=eos)
    plain = recurrent.plain(model, PROMPTS, PROMPT_MASK, **flags)
    assert plain.sequences[0, -1] == PAD and plain.sequences[1, -1] != PAD  # row 0 stopped first
    for draft in (model, recurrent.noisy(model_type)):
        ours = recurrent.speculative(model, draft, PROMPTS, PROMPT_MASK, **flags)
        assert_same_outputs(ours, plain)
        assert_same_cache(ours.past_key_values, plain.past_key_values, final_mask(PROMPT_MASK, plain.sequences))
        assert recurrent.drafted_and_kept(model)[1] > 0


def test_a_recurrent_batch_through_lookahead():
    """Lookahead verifies one chain a round per row (a memory that has seen plain's output): the same outputs."""
    model = recurrent.tiny("qwen3_next")
    eos = stop_token(recurrent.plain(model, PROMPTS, PROMPT_MASK)[:, PROMPTS.shape[1]:])
    flags = dict(FLAGS, eos_token_id=eos)
    plain = recurrent.plain(model, PROMPTS, PROMPT_MASK, **flags)
    memory = hf_specdec.LookaheadMemory()
    memory.seed({n: 1.0 for n in range(1, 65)})
    for row in plain.sequences:
        memory.remember(row.tolist())
    ours = model.generate(PROMPTS, attention_mask=PROMPT_MASK, custom_generate=hf_specdec.lookahead_generate,
                          lookahead_memory=memory, lookahead_config={"window": 4, "ngram": 3},
                          max_new_tokens=recurrent.NEW, do_sample=False, pad_token_id=PAD, **flags)
    assert_same_outputs(ours, plain)
    assert_same_cache(ours.past_key_values, plain.past_key_values, final_mask(PROMPT_MASK, plain.sequences))
    assert model.last_spec_stats.get().accepted > 0


@pytest.mark.parametrize("model_type", ["mamba", "falcon_h1"])
def test_the_cache_of_a_padded_recurrent_prompt(model_type):
    """One left-padded prompt: the cache handed back is assembled in plain's columns (the hybrid's keys) and holds
    plain's recurrent states."""
    model = recurrent.tiny(model_type)
    ids, mask = PROMPTS[1:], PROMPT_MASK[1:]
    plain = recurrent.plain(model, ids, mask, **FLAGS)
    ours = recurrent.speculative(model, model, ids, mask, **FLAGS)
    assert_same_outputs(ours, plain)
    assert_same_cache(ours.past_key_values, plain.past_key_values, final_mask(mask, plain.sequences))
    assert recurrent.drafted_and_kept(model)[1] > 0


@pytest.mark.parametrize("model_type", ["mamba", "qwen3_next"])
def test_a_recurrent_row_cut_back_holds_the_states_of_its_kept_tokens(model_type):
    """Two rows write three inputs; row 0 keeps all three, row 1 two. Parked and cut back (row 0 by two inputs,
    row 1 by one), each row's last states are those of a store that read its prompt and the inputs it kept
    alone; uncut, those of all its kept inputs."""
    model = recurrent.tiny(model_type)
    prompt = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    written = torch.tensor([[11, 12, 13], [14, 15, 16]])
    store = KVStore(model, returns_cache=True)
    with torch.no_grad():
        store.prefill(prompt, None)
        store.forward(BatchInputs(written, torch.arange(3).repeat(2, 1), None, None))
        store.keep([[4, 5, 6], [4, 5]])
        for row, kept, cut in ((0, 3, 2), (0, 3, 0), (1, 2, 1), (1, 2, 0)):
            parked = store._park(row)
            assert parked.count == 4 + kept
            states = parked.committed(4 + kept - cut).states
            alone = KVStore(model)
            alone.prefill(torch.cat([prompt[row: row + 1], written[row: row + 1, : kept - cut]], dim=1), None)
            compared = 0
            for layer, parts in zip(alone.layers, states):
                if hasattr(layer, "conv_states"):
                    torch.testing.assert_close(parts.parts[0][:, -1], layer.conv_states[0], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(parts.parts[1][:, -1], layer.recurrent_states[0], atol=1e-5,
                                               rtol=1e-5)
                    compared += 1
            assert compared > 0
