"""Output flags of an encoder-decoder (``return_dict_in_generate=True`` with ``output_hidden_states`` /
``output_attentions``, besides scores and logits) are plain ``generate``'s: the encoder's hidden states and
attentions from its one run, and per generated step the decoder's hidden states and attentions and the
cross-attentions (per layer [B, heads, 1, S]: the step's query row over the encoder's S columns, split from the
verify forwards along the query dimension; transformers' assisted generation splits them along the heads), in
speculative mode and lookahead: one prompt (BART, T5), and a batch whose rows stop apart (Whisper through its own
generate(), T5). Greedy: every entry against plain's (fp32, to 1e-4). Sampled: the
same draws with and without the flags, and every entry that of one forward over the drawn tokens (what plain
returns for those tokens). Every test asserts that draft tokens were accepted.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation import GenerateEncoderDecoderOutput

import hf_specdec
from hf_specdec.encoder_decoder import SpecGenerateEncoderDecoderOutput
from tests.conftest import perturbed_copy
from tests.test_encoder_decoder import (BATCH, TEXT, assert_drafted, bart, clocked, features,  # noqa: F401
                                        seeded_lookahead, t5, truncated, whisper)

NEW = 24
FIXED = hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=3)  # drafts every round: the test cannot pass idle
FLAGS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True,
             output_attentions=True)
STEPS = ("scores", "logits", "decoder_hidden_states", "decoder_attentions", "cross_attentions")  # one entry per step
ENCODER = ("encoder_hidden_states", "encoder_attentions")  # one entry per layer, from the encoder's one run
STOPS = [2, 87, 86]  # Whisper's EOS and two tokens that end rows 2 and 1 of ``features(3, seed=1)`` early (greedy)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: many tiny forwards


def eager(model):
    """The attention kernel that returns weights (sdpa returns none, in plain generate too), routed."""
    model.set_attn_implementation("eager")
    return hf_specdec.enable(model)


def draft_of(model):
    """A draft that agrees with the target often, not always: a truncated decoder (T5, Whisper), a noisy copy
    (BART, whose first decoder layer alone disagrees nearly always: ``truncated``)."""
    return perturbed_copy(model, 0.05, relative=True) if model.config.model_type == "t5" else truncated(model)


def routed(mode: str, model, clocked):
    """A function giving a call's hf_specdec arguments (each call a lookahead memory of its own), every forward of
    the model and its draft on the virtual clock (``clocked``)."""
    draft = draft_of(model) if mode == "speculative" else None
    clocked(model, draft)
    if mode == "speculative":
        return lambda: dict(assistant_model=draft, spec_config=FIXED)
    return lambda: dict(decoding="lookahead", lookahead_memory=seeded_lookahead())


def close(mine, plain, what):
    """Same shape, values to fp32 rounding (1e-4 relative or absolute: T5's hidden states reach ~1e1)."""
    assert mine.shape == plain.shape, (what, mine.shape, plain.shape)
    torch.testing.assert_close(mine, plain, rtol=1e-4, atol=1e-4, msg=lambda message: f"{what}: {message}")


def entries(value) -> list[torch.Tensor]:
    """A step's entry as a list of tensors (scores: one; hidden states, attentions: one per layer)."""
    return list(value) if isinstance(value, tuple) else [value]


def assert_plains(out, expected):
    """Every step entry, the encoder's, and the cache (self-attention and cross-attention) as plain's."""
    for name in STEPS:
        ours, theirs = getattr(out, name), getattr(expected, name)
        assert theirs is not None and len(ours) == len(theirs), (name, len(ours or ()), len(theirs))
        for step, (mine, plain) in enumerate(zip(ours, theirs)):
            assert len(entries(mine)) == len(entries(plain)), (name, step)
            for layer, (a, b) in enumerate(zip(entries(mine), entries(plain))):
                close(a, b, (name, step, layer))
    for name in ENCODER:
        assert len(getattr(out, name)) == len(getattr(expected, name)), name
        for layer, (a, b) in enumerate(zip(getattr(out, name), getattr(expected, name))):
            assert a is b or torch.equal(a, b), (name, layer)  # the encoder ran once: its very outputs
    for part in ("self_attention_cache", "cross_attention_cache"):
        pairs = zip(getattr(out.cache, part).layers, getattr(expected.cache, part).layers)
        for layer, (mine, theirs) in enumerate(pairs):
            close(mine.keys, theirs.keys, (part, layer))
            close(mine.values, theirs.values, (part, layer))


# -- greedy: every entry, per step, as plain's ----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bart", "t5"])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_every_flag_is_plains_per_step(family, mode, clocked):
    model = eager(bart() if family == "bart" else t5(seed=2, factor=4.0))
    expected = type(model).generate(model, TEXT, max_new_tokens=NEW, do_sample=False, **FLAGS)
    out = model.generate(TEXT, max_new_tokens=NEW, do_sample=False, **FLAGS, **routed(mode, model, clocked)())
    assert type(out) is SpecGenerateEncoderDecoderOutput and out.spec_stats is not None
    assert torch.equal(out.sequences, expected.sequences)
    assert_drafted(model, lookahead=mode == "lookahead")
    width = TEXT.shape[1]
    assert [h.shape for h in out.encoder_hidden_states] == [(1, width, 32)] * 3  # embeddings, 2 layers
    assert [a.shape for a in out.encoder_attentions] == [(1, 4, width, width)] * 2
    for step in (0, len(out.scores) - 1):  # the decoder start token's forward, then one query row a step
        assert [h.shape for h in out.decoder_hidden_states[step]] == [(1, 1, 32)] * 3
        assert [a.shape for a in out.decoder_attentions[step]] == [(1, 4, 1, step + 1)] * 2
        assert [a.shape for a in out.cross_attentions[step]] == [(1, 4, 1, width)] * 2
    assert_plains(out, expected)


@pytest.fixture(scope="module")
def whisper_target():
    return whisper()


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_whisper_batch_flags_are_plains(whisper_target, mode, clocked):
    """Whisper's own generate() takes the output apart row by row and stacks it again (its fields by name): it
    gets plain's type, the stats stay in ``last_spec_stats``. Three rows; two stop early (plain feeds them padding
    after their stop, and returns those steps too); the cross-attention cache holds every row, as plain's."""
    model = eager(copy.deepcopy(whisper_target))
    inputs = features(rows=3, seed=1)
    call = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=STOPS, **FLAGS)
    expected = type(model).generate(model, inputs, **call)
    out = model.generate(inputs, **call, **routed(mode, model, clocked)())
    assert type(out) is GenerateEncoderDecoderOutput
    assert torch.equal(out.sequences, expected.sequences)
    assert (out.sequences[:, -1] == model.generation_config.pad_token_id).tolist() == [False, True, True]  # stopped
    assert_drafted(model, lookahead=mode == "lookahead")
    assert [a.shape for a in out.cross_attentions[-1]] == [(3, 4, 1, 30)] * 2  # 60 frames: 30 encoder columns
    assert_plains(out, expected)


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_t5_batch_flags_are_plains(mode, clocked):
    """Three T5 rows that advance apart (the store lays out each row's tokens at plain's distances:
    tests/test_encoder_decoder.py), row 0 stopping at its EOS half-way: every entry is plain's."""
    model = eager(t5(seed=2, factor=4.0))
    call = dict(max_new_tokens=NEW, do_sample=False, **FLAGS)
    expected = type(model).generate(model, BATCH, **call)
    out = model.generate(BATCH, **call, **routed(mode, model, clocked)())
    assert torch.equal(out.sequences, expected.sequences)
    assert (out.sequences[:, -1] == model.config.pad_token_id).tolist() == [True, False, False]  # row 0 stopped
    assert_drafted(model, lookahead=mode == "lookahead")
    assert [a.shape for a in out.decoder_attentions[-1]] == [(3, 4, 1, NEW)] * 2
    assert_plains(out, expected)


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_sdpa_returns_no_attentions_as_plain(mode, clocked):
    """With the kernel as loaded (sdpa), plain returns an empty tuple per step for the decoder's attentions and the
    cross-attentions, and for the encoder's; so does hf_specdec, with every hidden state."""
    model = hf_specdec.enable(bart())
    assert model.config._attn_implementation == "sdpa"
    expected = type(model).generate(model, TEXT, max_new_tokens=NEW, do_sample=False, **FLAGS)
    out = model.generate(TEXT, max_new_tokens=NEW, do_sample=False, **FLAGS, **routed(mode, model, clocked)())
    assert torch.equal(out.sequences, expected.sequences)
    assert_drafted(model, lookahead=mode == "lookahead")
    assert out.decoder_attentions == out.cross_attentions == expected.cross_attentions == ((),) * NEW
    assert out.encoder_attentions == expected.encoder_attentions == ()
    for step, (mine, plain) in enumerate(zip(out.decoder_hidden_states, expected.decoder_hidden_states)):
        for layer, (a, b) in enumerate(zip(mine, plain)):
            close(a, b, (step, layer))


# -- sampled: the flags only read; each entry is its drawn token's ---------------------------------------------------
SAMPLED = dict(do_sample=True, temperature=0.5, top_k=3, max_new_tokens=NEW)


@torch.no_grad()
def assert_entries_of_the_drawn_tokens(model, encoder_inputs: dict, out, starts: torch.Tensor):
    """Each step's logits, decoder hidden states, decoder attention row and cross-attention row are those of one
    forward over the decoder start tokens ``starts`` [B, 1] and the drawn tokens (what plain returns for them: a
    row that stopped is fed padding, as in ``out.sequences``); the encoder's are that forward's encoder's."""
    drawn = out.sequences[:, -len(out.logits):]
    full = model(**encoder_inputs, decoder_input_ids=torch.cat([starts, drawn[:, :-1]], dim=1),
                 output_hidden_states=True, output_attentions=True)
    for step in range(len(out.logits)):
        close(out.logits[step], full.logits[:, step].float(), ("logits", step))
        for layer, hidden in enumerate(full.decoder_hidden_states):
            close(out.decoder_hidden_states[step][layer], hidden[:, step: step + 1], ("hidden", step, layer))
        for layer, weights in enumerate(full.decoder_attentions):
            close(out.decoder_attentions[step][layer], weights[:, :, step: step + 1, : step + 1],
                  ("attentions", step, layer))
        for layer, weights in enumerate(full.cross_attentions):
            close(out.cross_attentions[step][layer], weights[:, :, step: step + 1], ("cross", step, layer))
    for name, theirs in (("encoder_hidden_states", full.encoder_hidden_states),
                         ("encoder_attentions", full.encoder_attentions)):
        for layer, (a, b) in enumerate(zip(getattr(out, name), theirs)):
            close(a, b, (name, layer))


@pytest.mark.parametrize("family", ["bart", "whisper"])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_sampled_flags_are_the_drawn_tokens_entries(whisper_target, family, mode, clocked):
    """Same seed, same draws with and without the flags (they only read the forwards: the distribution is the one
    tests/test_encoder_decoder.py's chi-square test checks); one prompt (BART) and three (Whisper). Lookahead with
    a memory that has seen the greedy continuation, which sampling at a low temperature often follows."""
    if family == "bart":
        model, inputs = eager(bart()), TEXT
        encoder_inputs, starts = dict(input_ids=TEXT), torch.full((1, 1), model.config.decoder_start_token_id)
    else:
        model, inputs = eager(copy.deepcopy(whisper_target)), features(rows=3, seed=1)
        encoder_inputs, starts = dict(input_features=inputs), torch.full((3, 1), model.config.decoder_start_token_id)
    routes = routed(mode, model, clocked)

    def arguments():  # each call its own, alike (a call's text changes what the next one guesses)
        call = routes()
        if mode == "lookahead":
            model.generate(inputs, max_new_tokens=NEW, do_sample=False, **call)
        return call

    torch.manual_seed(11)
    bare = model.generate(inputs, **SAMPLED, **arguments())
    assert_drafted(model, lookahead=mode == "lookahead")
    torch.manual_seed(11)
    out = model.generate(inputs, **SAMPLED, **FLAGS, **arguments())
    assert torch.equal(out.sequences[:, -bare.shape[1]:], bare)  # (Whisper's bare call drops its start token)
    assert_drafted(model, lookahead=mode == "lookahead")
    assert len(out.scores) == len(out.logits) == len(out.decoder_hidden_states) == len(out.cross_attentions)
    tokens = out.sequences[:, -len(out.scores):]
    for step, scores in enumerate(out.scores):  # each drawn where its processed scores allow it
        assert bool((scores.gather(1, tokens[:, step: step + 1]) > float("-inf")).all())
    assert_entries_of_the_drawn_tokens(model, encoder_inputs, out, starts)
