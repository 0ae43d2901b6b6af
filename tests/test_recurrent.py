"""Recurrent and hybrid models (Mamba, FalconH1, Jamba, Qwen3-Next): token-identical to plain greedy ``generate``.

Their cache layers carry a conv state and a recurrent (SSM / delta-rule) state through the inputs
(``backends.Recurrent``): every forward that may be rolled back records the state before each of its inputs, and a
keep gives each row the states after its last kept input, so the rows of a batch keep different numbers of tokens
a round. They read no trie (one state per row): lookahead verifies one chain a round, a draft model drafts chains.
The tiny configs are the architecture sweep's (tests/arch_sweep.py: width 64, one layer of each kind, fp32).

Every parity test drafts and keeps draft tokens: the target as its own draft (a recurrent draft: one token per
forward, then a keep), a perturbed copy (rejections roll states back), or lookahead with a memory that has seen the
plain output (its candidates are right). A sampled run on a tiny Mamba follows the target's distribution
(chi-square, as tests/test_sampling.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

import hf_specdec
from hf_specdec.cache import KVStore
from hf_specdec.layout import BatchInputs
from hf_specdec.support import Unsupported, tree_refusal
from tests import arch_sweep
from tests.clock import VirtualClock
from tests.conftest import perturbed_copy, tiny_model
from tests.test_sampling import PROMPT, SAMPLING, assert_fits, draw, exact_distribution, processors

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MODELS = ["mamba", "falcon_h1", "jamba", "qwen3_next"]
NEW = 20
PAD = 0


@functools.cache
def tiny(model_type: str):
    classes = {arch: model_class for arch, _, model_class in arch_sweep.causal_lm_architectures()}
    return arch_sweep.build_model(model_type, classes[model_type])


@functools.cache
def noisy(model_type: str):
    """A copy whose weights carry noise of 5% of their spread: it agrees with the target often, not always."""
    return perturbed_copy(tiny(model_type), 0.05, relative=True)


def prompts(batch: int):
    """A repetitive prompt; for two rows, a second one three tokens shorter, left-padded."""
    phrase = [3, 4, 5, 6, 7, 9, 11]
    ids = torch.tensor([phrase * 2])
    if batch == 1:
        return ids, None
    second = torch.tensor([[PAD] * 3 + (phrase * 2)[3:]])
    return torch.cat([ids, second]), (torch.cat([ids, second]) != PAD).long()


def plain(model, ids, mask, **flags):
    return type(model).generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                pad_token_id=PAD, **flags)


def speculative(model, draft, ids, mask, config=None, **flags):
    config = config or hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4)
    return model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate,
                          draft_model=draft, spec_config=config, max_new_tokens=NEW, do_sample=False,
                          pad_token_id=PAD, **flags)


def drafted_and_kept(model) -> tuple[int, int]:
    stats = model.last_spec_stats.get()
    return stats.drafted - stats.lookup_drafted, stats.accepted - stats.lookup_accepted


# ----------------------------------------------------------------------------------------------------------------
# The store: each row's states after its kept inputs
# ----------------------------------------------------------------------------------------------------------------


def test_a_keep_restores_each_rows_states_to_its_last_kept_input():
    """Two rows write three inputs; row 0 keeps one, row 1 all three. Each row's states are then those of a store
    that read its prompt and kept inputs only, and the next forward continues each row from there."""
    model = tiny("mamba")
    prompt = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    written = torch.tensor([[11, 12, 13], [14, 15, 16]])
    store = KVStore(model)
    with torch.no_grad():
        store.prefill(prompt, None)
        store.forward(BatchInputs(written, torch.arange(3).repeat(2, 1), None, None))
        store.keep([[4], [4, 5, 6]])
        after = store.forward(BatchInputs(torch.tensor([[20], [21]]), torch.zeros(2, 1, dtype=torch.long), None,
                                          None)).logits
    for row, kept in enumerate([1, 3]):
        alone = KVStore(model)
        with torch.no_grad():
            alone.prefill(torch.cat([prompt[row: row + 1], written[row: row + 1, :kept]], dim=1), None)
            expected = alone.forward(BatchInputs(torch.tensor([[20 + row]]), torch.zeros(1, 1, dtype=torch.long),
                                                 None, None)).logits
        torch.testing.assert_close(after[row: row + 1], expected, atol=1e-5, rtol=1e-5)
    assert store.lengths.tolist() == [5, 7]


def test_discard_and_a_second_forward_before_the_keep():
    """A draft store writes forward after forward (one token each) before keeping a prefix; ``discard`` forgets
    what was written: the states are the prompt's again, bit for bit."""
    model = tiny("qwen3_next")
    store = KVStore(model)
    with torch.no_grad():
        store.prefill(torch.tensor([[3, 4, 5, 6, 7]]), None)
        before = [state.clone() for state in states_of(store)]
        first = store.forward(BatchInputs(torch.tensor([[8]]), torch.zeros(1, 1, dtype=torch.long), None, None))
        store.forward(BatchInputs(torch.tensor([[9]]), torch.zeros(1, 1, dtype=torch.long), None, None),
                      after=first.slots[:, -1])
        store.discard()
        assert all(torch.equal(a, b) for a, b in zip(before, states_of(store)))
        first = store.forward(BatchInputs(torch.tensor([[8]]), torch.zeros(1, 1, dtype=torch.long), None, None))
        store.forward(BatchInputs(torch.tensor([[9]]), torch.zeros(1, 1, dtype=torch.long), None, None),
                      after=first.slots[:, -1])
        store.keep([[5]])  # the first of the two
        alone = KVStore(model)
        alone.prefill(torch.tensor([[3, 4, 5, 6, 7]]), None)
        alone.forward(BatchInputs(torch.tensor([[8]]), torch.zeros(1, 1, dtype=torch.long), None, None))
        alone.keep([[5]])
    for mine, theirs in zip(states_of(store), states_of(alone)):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


def states_of(store: KVStore) -> list[torch.Tensor]:
    """The recurrent layers' conv and recurrent states (a hybrid's attention layers left out)."""
    return [state for layer in store.layers if hasattr(layer, "conv_states")
            for state in (layer.conv_states[0], layer.recurrent_states[0])]


# ----------------------------------------------------------------------------------------------------------------
# Greedy parity: speculative and lookahead, one row and a batch
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODELS)
def test_the_target_as_its_own_recurrent_draft_keeps_every_guess(model_type):
    model = tiny(model_type)
    ids, mask = prompts(1)
    assert torch.equal(speculative(model, model, ids, mask), plain(model, ids, mask))
    drafted, kept = drafted_and_kept(model)
    assert drafted > 0 and kept == drafted, (drafted, kept)


@pytest.mark.parametrize("model_type", MODELS)
def test_adaptive_policy_on_a_virtual_clock_with_a_perturbed_draft(model_type, monkeypatch):
    """The default (adaptive) policy under flat target forwards and cheap draft steps drafts every round; a copy
    that is sometimes wrong makes rounds reject guesses, whose states are rolled back."""
    model, draft = tiny(model_type), noisy(model_type)
    ids, mask = prompts(1)
    expected = plain(model, ids, mask)
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, lambda n: 1.0, name="target")
    clock.charge(monkeypatch, draft, lambda n: 0.05, name="draft")
    out = speculative(model, draft, ids, mask, config=hf_specdec.SpecConfig())
    assert torch.equal(out, expected)
    drafted, kept = drafted_and_kept(model)
    assert 0 < kept <= drafted and any(name == "draft" for name, _ in clock.forwards), (drafted, kept)


@pytest.mark.parametrize("model_type", MODELS)
def test_a_batch_whose_rows_keep_different_counts(model_type):
    """Two rows, one left-padded, a perturbed draft: rows accept different numbers of guesses each round."""
    model = tiny(model_type)
    ids, mask = prompts(2)
    for draft in (model, noisy(model_type)):
        assert torch.equal(speculative(model, draft, ids, mask), plain(model, ids, mask))
        drafted, kept = drafted_and_kept(model)
        assert kept > 0, (drafted, kept)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("model_type", MODELS)
def test_lookahead_runs_chains(model_type, batch):
    """A memory that has seen the plain output finds right candidates from the first round: chains are kept."""
    model = tiny(model_type)
    assert tree_refusal(model) is not None
    ids, mask = prompts(batch)
    expected = plain(model, ids, mask)
    memory = hf_specdec.LookaheadMemory()
    memory.seed({n: 1.0 for n in range(1, 65)})  # t(n) flat: every guess pays
    for row in expected:
        memory.remember(row.tolist())
    out = model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.lookahead_generate,
                         lookahead_memory=memory, lookahead_config={"window": 4, "ngram": 3}, max_new_tokens=NEW,
                         do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, expected)
    stats = model.last_spec_stats.get()
    assert stats.accepted > 0 and stats.tree_rounds == 0, (stats.drafted, stats.accepted)


def test_a_hybrid_target_with_a_llama_draft_of_its_vocabulary():
    """A draft of another family (a tiny Llama over the same 128 tokens) drafts for a hybrid target; its right
    guesses are those the target agrees with, and the output is plain's either way."""
    model = tiny("jamba")
    draft = tiny_model("llama", vocab=model.config.vocab_size, seed=3)
    ids, mask = prompts(2)
    assert torch.equal(speculative(model, draft, ids, mask), plain(model, ids, mask))
    assert drafted_and_kept(model)[0] > 0


# ----------------------------------------------------------------------------------------------------------------
# The cache handed back, and what stays refused
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["mamba", "falcon_h1", "qwen3_next"])
def test_the_returned_cache_is_plains_after_a_stop_inside_a_round(model_type):
    """An end-of-sequence token accepted inside a round: the store kept tokens after it, and the cache it hands
    back goes back over them to plain's (prompt and every emitted token but the last)."""
    model = tiny(model_type)
    ids, _ = prompts(1)
    eos = int(plain(model, ids, None)[0, ids.shape[1] + 9])  # the tenth new token
    flags = dict(return_dict_in_generate=True, output_scores=True, eos_token_id=eos)
    expected = plain(model, ids, None, **flags)
    out = speculative(model, model, ids, None, **flags)
    assert torch.equal(out.sequences, expected.sequences) and drafted_and_kept(model)[1] > 0
    assert expected.sequences.shape[1] < ids.shape[1] + NEW  # it stopped early
    for mine, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(out.past_key_values.layers, expected.past_key_values.layers):
        assert int(mine.get_seq_length()) == int(theirs.get_seq_length())
        assert getattr(mine, "record_past", False) == getattr(theirs, "record_past", False)
        if hasattr(theirs, "conv_states"):
            torch.testing.assert_close(mine.conv_states[0], theirs.conv_states[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(mine.recurrent_states[0], theirs.recurrent_states[0], atol=1e-4, rtol=1e-4)
        if getattr(theirs, "keys", None) is not None:
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-4, rtol=1e-4)


def test_trees_are_refused_with_the_reason():
    model = tiny("qwen3_next")
    ids, mask = prompts(1)
    assert "keep one state per row" in tree_refusal(model)
    with pytest.raises(Unsupported, match="keep one state per row"):
        speculative(model, model, ids, mask, config=hf_specdec.SpecConfig(tree="on"))


# ----------------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def sampling_mamba():
    """One Mamba layer over a vocabulary of 8, its output layer scaled up (logits over a few units)."""
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=8, hidden_size=32, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = MambaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return model


def test_sampling_follows_the_targets_distribution():
    """A perturbed Mamba drafts for a Mamba target, sampled with temperature, top-k/p and a repetition penalty:
    rejections, residual draws and bonus tokens, each row's states rolled back; the continuations fit the
    target's exact distribution (enumerated with full forwards)."""
    target = sampling_mamba()
    draft = perturbed_copy(target, 0.1, relative=True)
    exact = exact_distribution(target, PROMPT, 4, processors(**SAMPLING))
    counts, stats = draw(target, 600, seed=5, **SAMPLING, custom_generate=hf_specdec.speculative_generate,
                         draft_model=draft, spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=4))
    accepted, drafted = sum(s.accepted for s in stats), sum(s.drafted for s in stats)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert_fits(counts, exact)
