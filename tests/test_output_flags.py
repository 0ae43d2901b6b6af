"""Output flags (``return_dict_in_generate=True`` with ``output_scores`` / ``output_logits`` /
``output_hidden_states`` / ``output_attentions``) are plain ``generate``'s, per step, in both modes, for one prompt
and for a left-padded batch, greedy and sampled; ``num_beams > 1`` runs transformers' beam search as plain
``generate`` does with an assistant. Plain ``generate`` is the reference (not transformers' assisted output, whose
first round's hidden states and attentions are read at the wrong rows)."""

import copy
from collections import Counter

import pytest
import torch

import hf_specdec
from hf_specdec import SpecConfig
from hf_specdec import cache as kv
from tests.conftest import perturbed_copy, tiny_model
from tests.test_inputs import modes
from tests.test_sampling import (DRAWS, NEW as SAMPLED_NEW, PROMPT as SAMPLED_PROMPT, SAMPLING, assert_fits,
                                 exact_distribution, processors, sampling_model)
from tests.test_tree import charged, paying

NEW = 12
FLAGS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True,
             output_attentions=True)
FIELDS = ("scores", "logits", "hidden_states", "attentions")
FIXED = SpecConfig(policy="fixed", num_draft_tokens=4)  # drafts every round, whatever this machine's timings
TREE = SpecConfig(tree="on", history_lookup=False)  # a trie every drafting round (on the virtual clock of test_tree)
PAD = 0

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: thousands of tiny forwards


@pytest.fixture(scope="module")
def eager():
    """The tiny Llama with the attention kernel that returns weights (sdpa returns none, in plain generate too)."""
    model = tiny_model("llama", seed=0)
    model.set_attn_implementation("eager")
    return hf_specdec.enable(model)


@pytest.fixture(scope="module")
def unsure_draft(eager):
    """Its second choices are the target's now and then: a trie round keeps a path that skips a sibling (a hole)."""
    return perturbed_copy(eager, 0.02)


@pytest.fixture(scope="module")
def draft(eager):
    """Right about half the time here: rounds accept some guesses and reject others."""
    return perturbed_copy(eager, 0.1, relative=True)


def prompts(batch: int):
    """One prompt, or three of different lengths left-padded (the longest sets P)."""
    if batch == 1:
        return torch.tensor([[5, 17, 42, 8, 23, 61, 2, 9]]), None
    rows = [[5, 17, 42, 8, 23, 61, 2, 9], [11, 12, 13, 11, 12], [7, 3, 7, 3, 7, 3, 7]]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


@pytest.fixture
def clocked(monkeypatch):
    """Flat virtual costs (test_tree's: a target forward 1 s for any size, a draft step 0.01 s), so that what each
    call drafts never depends on this machine's timings."""
    return lambda model, draft: charged(monkeypatch, model, draft)


def routed(mode, model, draft):
    """One call's hf_specdec arguments, with a memory of its own (one call's text and measurements change what
    the next call drafts)."""
    if mode == "speculative":
        return dict(assistant_model=draft, spec_config=FIXED)
    if mode == "tree":
        return dict(assistant_model=draft, spec_config=TREE, speculative_memory=paying(draft))
    return modes(model)["lookahead"]


def assert_drafted(mode, stats):
    if mode != "lookahead":
        assert stats.drafted - stats.lookup_drafted > 0, stats
    if mode == "tree":
        assert stats.tree_rounds > 0, stats
    assert stats.accepted > 0, stats


def entries(value):
    """A step's entry as a flat list of tensors (scores: one; hidden states, attentions: one per layer)."""
    return list(value) if isinstance(value, tuple) else [value]


def assert_same_steps(out, expected, fields=FIELDS):
    for name in fields:
        ours, theirs = getattr(out, name), getattr(expected, name)
        assert theirs is not None and len(ours) == len(theirs), (name, len(ours or ()), len(theirs))
        for step, (mine, plain) in enumerate(zip(ours, theirs)):
            mine, plain = entries(mine), entries(plain)
            assert len(mine) == len(plain), (name, step)
            for layer, (a, b) in enumerate(zip(mine, plain)):
                assert a.shape == b.shape, (name, step, layer, a.shape, b.shape)
                assert torch.allclose(a, b, atol=1e-4), (name, step, layer, float((a - b).abs().max()))


# -- greedy: every flag, per step -----------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode", ["speculative", "tree", "lookahead"])
def test_every_flag_equals_plain_generate_per_step(eager, draft, unsure_draft, mode, batch, clocked):
    """Scores, raw logits, hidden states (prompt step [B, P, D], then [B, 1, D] per token) and attentions (prompt
    step [B, H, P, P], then [B, H, 1, P + t]: padding columns at weight 0, no holes, no other branch) as plain
    generate returns them, split from the verify forwards; rows advancing at their own pace are stacked per step."""
    ids, mask = prompts(batch)
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **FLAGS)
    draft = unsure_draft if mode == "tree" else draft
    clocked(eager, draft)
    expected = type(eager).generate(eager, ids, **call)
    out = eager.generate(ids, **call, **routed(mode, eager, draft))
    if mode == "tree":  # a second choice kept: its first-choice sibling's columns are a hole of the cache
        assert any(kept for (_, rank), kept in out.spec_stats.accepted_by_depth_rank.items() if rank > 0)
    assert isinstance(out, hf_specdec.integration.SpecGenerateOutput)
    assert torch.equal(out.sequences, expected.sequences)
    assert_drafted(mode, out.spec_stats)
    assert out.hidden_states[0][0].shape == (batch, ids.shape[1], 64)
    assert out.attentions[0][0].shape == (batch, 4, ids.shape[1], ids.shape[1])
    assert out.attentions[-1][0].shape == (batch, 4, 1, ids.shape[1] + NEW - 1)
    assert_same_steps(out, expected)


def one_prompt_both_ways(model, draft, mode):
    """One greedy call asking every flag, through hf_specdec and plain: (prompt, hf_specdec's output, plain's),
    the sequences checked equal and the call checked to draft."""
    ids, _ = prompts(1)
    call = dict(max_new_tokens=NEW, do_sample=False, **FLAGS)
    expected = type(model).generate(model, ids, **call)
    out = model.generate(ids, **call, **routed(mode, model, draft))
    assert torch.equal(out.sequences, expected.sequences)
    assert_drafted(mode, out.spec_stats)
    return ids, out, expected


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_sdpa_returns_no_attentions_as_plain_generate(mode, draft, clocked):
    """With the kernel as loaded (sdpa), plain generate returns an empty tuple per step for attentions (and
    transformers warns); so does hf_specdec, with the hidden states of every step."""
    model = hf_specdec.enable(tiny_model("llama", seed=0))
    assert model.config._attn_implementation == "sdpa"
    clocked(model, draft)
    ids, out, expected = one_prompt_both_ways(model, draft, mode)
    assert out.attentions == expected.attentions == ((),) * NEW
    assert_same_steps(out, expected, ("scores", "hidden_states"))


# -- sampled: the flags only read ------------------------------------------------------------------------------------
SAMPLED = dict(do_sample=True, max_new_tokens=SAMPLED_NEW, **SAMPLING)


@pytest.fixture(scope="module")
def sampler():
    model = sampling_model()
    model.set_attn_implementation("eager")
    return hf_specdec.enable(model)


@pytest.fixture(scope="module")
def sampler_draft(sampler):
    return perturbed_copy(sampler, 0.01)


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_sampled_with_flags_follows_the_target_distribution(sampler, sampler_draft, mode, clocked):
    """With every flag on, the draws follow the exact processed distribution (chi-square) and guesses were
    accepted; lookahead with a memory that has seen the prompt (tries from the first round, as test_sampling)."""
    exact = exact_distribution(sampler, SAMPLED_PROMPT, SAMPLED_NEW, processors(**SAMPLING))
    clocked(sampler, sampler_draft)
    call = dict(assistant_model=sampler_draft, spec_config=FIXED)
    if mode == "lookahead":
        call = dict(decoding="lookahead", lookahead_memory=hf_specdec.LookaheadMemory())
        sampler.generate(SAMPLED_PROMPT, max_new_tokens=16, do_sample=False, **call)
    torch.manual_seed(5)
    counts, accepted = Counter(), 0
    for _ in range(DRAWS // 2):
        out = sampler.generate(SAMPLED_PROMPT, **SAMPLED, **FLAGS, **call)
        counts[tuple(out.sequences[0, SAMPLED_PROMPT.shape[1]:].tolist())] += 1
        accepted += out.spec_stats.accepted
        assert len(out.hidden_states) == len(out.attentions) == SAMPLED_NEW
    assert accepted > 0.2 * DRAWS // 2, accepted
    assert_fits(counts, exact)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_the_flags_do_not_change_what_is_sampled(eager, draft, mode, batch, clocked):
    """Same seed, same tokens with and without the flags (they only read the forwards); the flags have plain's
    shapes per step, and scores and logits are those of the forwards that gave the tokens."""
    ids, mask = prompts(batch)
    call = dict(attention_mask=mask, do_sample=True, temperature=0.5, top_k=3, max_new_tokens=NEW,
                pad_token_id=PAD)
    clocked(eager, draft)

    def arguments():  # lookahead: a memory that has seen the greedy continuation, which sampling often follows
        routes = routed(mode, eager, draft)
        if mode == "lookahead":
            eager.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **routes)
        return routes

    torch.manual_seed(11)
    bare = eager.generate(ids, **call, **arguments())
    stats = eager.last_spec_stats.get()
    torch.manual_seed(11)
    out = eager.generate(ids, **call, **FLAGS, **arguments())
    assert torch.equal(out.sequences, bare)
    assert_drafted(mode, stats)
    assert_drafted(mode, out.spec_stats)
    width = ids.shape[1]
    assert len(out.scores) == len(out.logits) == len(out.hidden_states) == len(out.attentions) == NEW
    for step in range(NEW):
        assert out.scores[step].shape == out.logits[step].shape == (batch, 96)
        rows = width if step == 0 else 1
        assert [h.shape for h in out.hidden_states[step]] == [(batch, rows, 64)] * 3  # embeddings, 2 layers
        assert [a.shape for a in out.attentions[step]] == [(batch, 4, rows, width + step)] * 2
        tokens = out.sequences[:, width + step]
        assert bool((out.scores[step].gather(1, tokens[:, None]) > float("-inf")).all())  # drawn where allowed


# -- nothing computed unless asked -----------------------------------------------------------------------------------
class ForwardFlags:
    """The output flags every forward of a model was called with."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.calls.append((bool(kwargs.get("output_hidden_states")), bool(kwargs.get("output_attentions"))))


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_no_flag_asked_records_nothing(eager, draft, mode, clocked):
    """Without the flags (scores and logits alone included) no forward is asked for hidden states or attention
    weights, and the forwards are as many; with them, every target forward is."""
    ids, _ = prompts(1)
    call = dict(max_new_tokens=NEW, do_sample=False)
    clocked(eager, draft)
    spy = ForwardFlags(eager)
    try:
        eager.generate(ids, **call, **routed(mode, eager, draft))
        eager.generate(ids, **call, return_dict_in_generate=True, output_scores=True, output_logits=True,
                       **routed(mode, eager, draft))
        bare = list(spy.calls)
        spy.calls.clear()
        eager.generate(ids, **call, return_dict_in_generate=True, output_hidden_states=True, output_attentions=True,
                       **routed(mode, eager, draft))
        flagged = list(spy.calls)
    finally:
        spy.handle.remove()
    assert bare and not any(hidden or attentions for hidden, attentions in bare)
    assert 2 * len(flagged) == len(bare) and all(hidden and attentions for hidden, attentions in flagged)


def test_call_model_records_only_when_asked(eager):
    cache = kv.new_cache(eager)
    plain = kv.call_model(eager, torch.tensor([[5, 6, 7]]), cache)
    assert plain.hidden_states is None and plain.attentions is None
    recorded = kv.call_model(eager, torch.tensor([[8]]), cache, record=kv.Recording(True, True))
    assert [h.shape for h in recorded.hidden_states] == [(1, 1, 64)] * 3
    assert [a.shape for a in recorded.attentions] == [(1, 4, 1, 4)] * 2


# -- beam search ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_beams_run_transformers_beam_search_with_one_warning(eager, draft, mode, caplog):
    ids, _ = prompts(1)
    call = dict(num_beams=2, num_return_sequences=2, max_new_tokens=NEW, do_sample=False,
                return_dict_in_generate=True, output_scores=True)
    expected = type(eager).generate(eager, ids, **call)
    with caplog.at_level("INFO"):
        out = eager.generate(ids, **call, **routed(mode, eager, draft))
    assert torch.equal(out.sequences, expected.sequences)
    assert torch.allclose(out.sequences_scores, expected.sequences_scores)
    unused = "decoding='lookahead'" if mode == "lookahead" else "the draft (assistant_model=)"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"hf_specdec: num_beams=2 runs transformers' beam search, as generate() does with an assistant; "
                    f"{unused} is unused.")]
    assert eager.last_spec_stats.get() is None


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_sliding_window_layers_return_plain_generates_columns(mode, clocked):
    """A full-attention layer and a sliding-window one (window 4, shorter than the prompt): a sliding layer's row
    is the last 4 columns, as plain's layer returns them."""
    model = tiny_model("qwen2", seed=0, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model.set_attn_implementation("eager")
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    hf_specdec.enable(model)
    draft = copy.deepcopy(model)  # the same weights: its guesses are kept
    clocked(model, draft)
    ids, out, expected = one_prompt_both_ways(model, draft, mode)
    assert [a.shape[-1] for a in out.attentions[5]] == [ids.shape[1] + 5, 4]
    assert_same_steps(out, expected)


@pytest.mark.parametrize("processors", [{}, {"bad_words_ids": [[PAD, 5]]}])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_rows_that_stop_first_return_plain_generates_entries_after_their_stop(eager, draft, mode, processors,
                                                                              clocked, caplog):
    """Plain generate feeds a row that stopped (EOS) padding until the others stop and returns those forwards'
    entries; so does hf_specdec (one forward per stopped row over its padding): every flag of every row is plain's
    at every step, after a row's stop included (scores processed over the row's ids with the pads, attentions
    over its padding, tokens and the pads so far), with no warning. Rows 2 and 0 stop at their 3rd and 5th token,
    row 1 runs on; with a processor that reads the ids (5 banned after a pad), a stopped row's later scores see the
    pads it was fed."""
    ids, mask = prompts(3)
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=[63, 23],
                **processors, **FLAGS)
    clocked(eager, draft)
    expected = type(eager).generate(eager, ids, **call)
    spy = ForwardFlags(eager)
    try:
        bare = eager.generate(ids, **{k: v for k, v in call.items() if k not in FLAGS}, **routed(mode, eager, draft))
        forwards = len(spy.calls)
        spy.calls.clear()
        with caplog.at_level("WARNING"):
            out = eager.generate(ids, **call, **routed(mode, eager, draft))
    finally:
        spy.handle.remove()
    assert len(spy.calls) == forwards + 2  # one forward over each stopped row's padding, only when asked
    assert torch.equal(out.sequences, expected.sequences) and torch.equal(bare, expected.sequences)
    assert_drafted(mode, out.spec_stats)
    width = ids.shape[1]
    assert [int(out.sequences[2, width + 2]), int(out.sequences[0, width + 4])] == [63, 23]
    assert bool((out.sequences[2, width + 3:] == PAD).all()) and bool((out.sequences[0, width + 5:] == PAD).all())
    assert len(out.scores) == NEW and out.attentions[-1][0].shape == (3, 4, 1, width + NEW - 1)
    assert_same_steps(out, expected)
    assert not caplog.records
