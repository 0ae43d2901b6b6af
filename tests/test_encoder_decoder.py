"""Encoder-decoders (BART, T5, Whisper from ``input_features``) decode exactly as plain ``generate`` does (fp32,
greedy), in speculative mode (a draft of the same family: a truncated copy of the target's decoder, which agrees
with it often, not always) and in lookahead; a decoder-only Whisper draft (``WhisperForCausalLM``, distil-whisper
style) reads the target's encoder states, an encoder-decoder draft runs its own encoder; Whisper's own generate()
runs hf_specdec after ``enable(model)``, and its plain call (no assistant, its own processors) is the reference.
Every parity test asserts that draft tokens were accepted. What stays refused is refused before any forward, with
its reason. Sampling: a chi-square test on a tiny BART (``tests/test_sampling.py``'s statistics).
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
from transformers import (BartConfig, BartForConditionalGeneration, LogitsProcessorList, T5Config,
                          T5ForConditionalGeneration, TemperatureLogitsWarper, TopKLogitsWarper, WhisperConfig,
                          WhisperForCausalLM, WhisperForConditionalGeneration)

import hf_specdec
from hf_specdec.encoder_decoder import EncoderReading, EncoderStates
from hf_specdec.stats import last_spec_stats
from hf_specdec.support import Unsupported
from tests.clock import VirtualClock
from tests.conftest import perturbed_copy
from tests.test_sampling import assert_fits, assert_rejected  # one statistic for every sampling test

NEW = 24
FIXED = hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=3)  # drafts every round: the test cannot pass idle
TEXT = torch.tensor([[5, 17, 42, 8, 23, 61, 9, 30]])


def bart(seed: int = 0, vocab: int = 96, layers: int = 2, damp: float = 0.3, **overrides):
    """A tiny BART whose last decoder layer's output projections are scaled by ``damp`` (at random init its greedy
    text repeats one token; damped, it varies and reads the encoder mask)."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=layers, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
                    init_std=0.3)
    model = BartForConditionalGeneration(BartConfig(**{**settings, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.model.decoder.layers[-1].named_parameters():
            if name.split(".")[-2] in ("fc2", "out_proj") and parameter.dim() == 2:
                parameter.mul_(damp)
    return model


def t5(seed: int = 0, layers: int = 2, factor: float = 8.0):
    """A tiny T5 (``factor``: its initializer's scale; at 8 its greedy text varies, and its hidden states reach
    ~1e3, so its outputs compare to plain's at fp32 rounding of that size; at 4 they stay near 1e1)."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=layers, num_heads=4,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, initializer_factor=factor)
    return T5ForConditionalGeneration(config).eval()


def whisper(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    settings = dict(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                    max_source_positions=30, max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None, init_std=0.3)
    return WhisperForConditionalGeneration(WhisperConfig(**{**settings, **overrides})).eval()


def features(rows: int = 1, seed: int = 0) -> torch.Tensor:
    """Log-mel-like input features of one 60-frame window (short-form: the encoder reads 2 * 30 frames)."""
    return torch.randn(rows, 16, 60, generator=torch.Generator().manual_seed(seed))


def truncated(model, layers: int = 1):
    """The same family and vocabulary, a smaller decoder: a copy of ``model`` keeping its first ``layers`` decoder
    layers (its own encoder kept whole). BART normalises after each layer, so its first layer alone disagrees with
    the whole decoder nearly always: its draft is a copy with noise instead (same sizes, agrees often)."""
    if isinstance(model, BartForConditionalGeneration):
        return perturbed_copy(model, 0.05, relative=True)
    draft = copy.deepcopy(model)
    if isinstance(draft, T5ForConditionalGeneration):
        draft.decoder.block = draft.decoder.block[:layers]
        draft.config.num_decoder_layers = layers
    else:
        draft.model.decoder.layers = draft.model.decoder.layers[:layers]
        draft.config.decoder_layers = layers
    return draft


def whisper_decoder_draft(target, layers: int = 1) -> WhisperForCausalLM:
    """distil-whisper's layout: a decoder-only ``WhisperForCausalLM`` of the target's first ``layers`` decoder layers
    that reads the target's encoder states (same encoder sizes)."""
    config = copy.deepcopy(target.config)
    config.decoder_layers = layers
    draft = WhisperForCausalLM(config).eval()
    state = {name: value for name, value in target.model.decoder.state_dict().items()
             if not name.startswith("layers.") or int(name.split(".")[1]) < layers}
    draft.model.decoder.load_state_dict(state)
    draft.proj_out.weight.data = target.proj_out.weight.data.clone()
    return draft


def seeded_lookahead():
    """A lookahead memory with flat costs (t(n) = 1 s for any n): every guess pays, from the first round on, on any
    machine (as tests/test_lookahead_chains.py seeds it)."""
    memory = hf_specdec.LookaheadMemory()
    memory.seed({n: 1.0 for n in range(1, 65)})
    return memory


@pytest.fixture
def clocked(monkeypatch):
    """``clocked(target, draft=None)``: flat virtual costs (tests/clock.py), every forward of the target 1 s
    whatever its size and of the draft 0.01 s, so that what a call drafts (lookahead's adaptive policy) never
    depends on this machine's timings. (``VirtualClock.charge`` counts ``input_ids``; a decoder's forward takes
    ``decoder_input_ids``, or encoder states alone.)"""
    clock = VirtualClock(monkeypatch)

    def charge(target, draft=None):
        for model, seconds in ((target, 1.0), (draft, 0.01)):
            if model is not None:
                monkeypatch.setattr(model, "forward", functools.partial(_charged, clock, seconds, model.forward))
        return clock

    return charge


def _charged(clock: VirtualClock, seconds: float, forward, *args, **kwargs):
    clock.now += seconds
    return forward(*args, **kwargs)


def plain(model, inputs, **kwargs):
    return type(model).generate(model, inputs, max_new_tokens=NEW, do_sample=False, **kwargs)


def drafted_and_accepted(model) -> tuple[int, int]:
    stats = model.last_spec_stats.get() if hasattr(model, "last_spec_stats") else last_spec_stats(model)
    return stats.drafted - stats.lookup_drafted, stats.accepted - stats.lookup_accepted


def assert_drafted(model, lookahead: bool = False):
    """Draft tokens were accepted: the draft model's (speculative), or lookahead's guesses (counted as lookups)."""
    stats = model.last_spec_stats.get() if hasattr(model, "last_spec_stats") else last_spec_stats(model)
    drafted, accepted = (stats.drafted, stats.accepted) if lookahead else drafted_and_accepted(model)
    assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)


# -- BART and T5 through custom_generate --------------------------------------------------------------------------
@pytest.mark.parametrize("family", [bart, t5])
def test_speculative_greedy_is_plain_with_a_smaller_draft(family):
    target = family()
    draft = truncated(target)
    out = target.generate(TEXT, custom_generate=hf_specdec.speculative_generate, draft_model=draft, spec_config=FIXED,
                          max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, plain(target, TEXT))
    assert_drafted(target)


@pytest.mark.parametrize("family", [bart, t5])
def test_lookahead_greedy_is_plain(family, clocked):
    target = family()
    clocked(target)
    out = target.generate(TEXT, custom_generate=hf_specdec.lookahead_generate, lookahead_memory=seeded_lookahead(),
                          max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, plain(target, TEXT))
    assert_drafted(target, lookahead=True)


def test_an_encoder_mask_with_padding_is_the_encoders():
    """The encoder's attention_mask (left padding of the encoder input) is every decoder forward's cross-attention
    mask, as plain's; the decoder's own has no padding."""
    target = bart()
    ids = torch.cat([torch.ones(1, 3, dtype=torch.long), TEXT], dim=1)
    mask = (ids != 1).long()
    out = target.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate,
                          draft_model=truncated(target), spec_config=FIXED, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, plain(target, ids, attention_mask=mask))
    assert not torch.equal(out, plain(target, ids))  # the mask changes the output: it was read
    assert_drafted(target)


def test_scores_and_the_cache_are_plains():
    """return_dict_in_generate: the encoder-decoder output type, per-step scores and logits, and the cache
    (self-attention as plain leaves it, the cross-attention the encoder's) as plain returns them."""
    target = bart()
    flags = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = plain(target, TEXT, **flags)
    out = target.generate(TEXT, custom_generate=hf_specdec.speculative_generate, draft_model=truncated(target),
                          spec_config=FIXED, max_new_tokens=NEW, do_sample=False, **flags)
    assert type(out).__mro__[1] is type(expected) and out.spec_stats is not None
    assert torch.equal(out.sequences, expected.sequences)
    for name in ("scores", "logits"):
        assert len(getattr(out, name)) == len(getattr(expected, name)) == NEW
        for mine, theirs in zip(getattr(out, name), getattr(expected, name)):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    for part in ("self_attention_cache", "cross_attention_cache"):
        for mine, theirs in zip(getattr(out.cache, part).layers, getattr(expected.cache, part).layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-5)
    assert_drafted(target)


# -- T5 batches: positions as distances -----------------------------------------------------------------------------
BATCH = torch.tensor([[5, 17, 42, 8, 23, 61, 9, 30], [11, 12, 13, 11, 12, 14, 15, 16], [7, 3, 7, 3, 7, 3, 7, 3]])
SCORES = dict(return_dict_in_generate=True, output_scores=True)


def t5_batch_both_ways(target, rows: int, mode: str, clocked):
    """(hf_specdec's output, plain's) for a greedy call over ``rows`` prompts, scores returned; the draft a
    truncated decoder (speculative), every forward on the virtual clock."""
    inputs = BATCH[:rows]
    expected = plain(target, inputs, **SCORES)
    if mode == "speculative":
        draft = truncated(target)
        clocked(target, draft)
        route = dict(custom_generate=hf_specdec.speculative_generate, draft_model=draft, spec_config=FIXED)
    else:
        clocked(target)
        route = dict(custom_generate=hf_specdec.lookahead_generate, lookahead_memory=seeded_lookahead())
    return target.generate(inputs, max_new_tokens=NEW, do_sample=False, **SCORES, **route), expected


def largest_difference(out, expected) -> float:
    """The largest difference of a step's scores from plain's, relative to the largest of them."""
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(out.scores, expected.scores))


# Scores are compared in float64, tokens in float32 as users decode. A round's forward reads several inputs where
# plain's reads one, and float32 rounds differently with the shapes a CPU's kernels block by (mt5 below: 1.08e-5 of
# the largest score on a Zen 4 EPYC with avx512, under 1e-5 on the AVX2 EPYCs); in float64 the two agree to this
# (measured: 0.0), where a position read wrongly (a relative bias off by one column) moves them by 1e-3 and more.
FLOAT64_SCORES = 1e-12


def batch_t5():
    """A T5 whose attention is not saturated (initializer scale 2), so that its relative bias moves its scores."""
    return t5(factor=2.0)


@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_t5_batch_greedy_is_plain(rows, mode, clocked):
    """T5's decoder reads positions only as column distances (its relative bias: key column - query column, the
    query at the cache's length): rows that advance at their own pace stay exact when each keep lays every row's
    tokens out as plain's, the next inputs of every row at one column (``KVStore._alignment``); the scores of every
    step are plain's."""
    target = batch_t5()
    out, expected = t5_batch_both_ways(target, rows, mode, clocked)
    assert torch.equal(out.sequences, expected.sequences)
    assert_drafted(target, lookahead=mode == "lookahead")
    target = batch_t5().double()
    out, expected = t5_batch_both_ways(target, rows, mode, clocked)
    assert torch.equal(out.sequences, expected.sequences)
    assert largest_difference(out, expected) < FLOAT64_SCORES
    assert_drafted(target, lookahead=mode == "lookahead")


@pytest.mark.parametrize("family", ["mt5", "umt5", "longt5"])
def test_t5_like_batches_are_plain(family, clocked):
    """The other models whose decoder reads positions only as column distances (``DISTANCE_POSITIONED``): a batch
    of rows apart, speculative, is plain's, scores included."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                  num_decoder_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
                                  decoder_start_token_id=0, initializer_factor=2.0)
    target = AutoModelForSeq2SeqLM.from_config(config).eval()
    draft = perturbed_copy(target, 0.05, relative=True)
    clocked(target, draft)
    for dtype in (torch.float32, torch.float64):  # tokens in float32; scores in float64 (``FLOAT64_SCORES``)
        target, draft = target.to(dtype), draft.to(dtype)
        expected = plain(target, BATCH, **SCORES)
        out = target.generate(BATCH, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                              spec_config=FIXED, max_new_tokens=NEW, do_sample=False, **SCORES)
        assert torch.equal(out.sequences, expected.sequences)
        assert_drafted(target)
    assert largest_difference(out, expected) < FLOAT64_SCORES


@pytest.mark.parametrize("mode", ["speculative", "lookahead"])
def test_t5_rows_apart_read_plains_distances(mode, clocked, monkeypatch):
    """The test above can tell: a store that leaves a row's rejected columns as masked holes (as for a model that
    numbers tokens by column) gives that row's next inputs longer distances than plain's, and the scores move."""
    monkeypatch.setattr(hf_specdec.cache.KVStore, "positions_are_distances", lambda self: False)
    out, expected = t5_batch_both_ways(batch_t5(), 3, mode, clocked)
    assert largest_difference(out, expected) > 1e-3


# -- Whisper through its own generate() after enable(model) ------------------------------------------------------
@pytest.fixture(scope="module")
def whisper_target():
    return whisper()


@pytest.mark.parametrize("kind", ["decoder-only sharing the encoder", "encoder-decoder"])
def test_whisper_assistant_greedy_is_plain(whisper_target, kind):
    target = copy.deepcopy(whisper_target)
    draft = whisper_decoder_draft(target) if kind.startswith("decoder") else truncated(target)
    inputs = features()
    expected = type(target).generate(target, inputs, max_new_tokens=NEW, do_sample=False)
    hf_specdec.enable(target)
    out = target.generate(inputs, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert_drafted(target)


def test_a_wrapped_whisper_generate_is_still_whispers(whisper_target):
    """A class whose generate() is Whisper's behind a wrapper that names it (``functools.wraps``: a library's
    decorator) is routed as Whisper's, not refused as a generate of its own."""

    class Wrapped(type(whisper_target)):
        @functools.wraps(type(whisper_target).generate)
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    target = copy.deepcopy(whisper_target)
    target.__class__ = Wrapped
    inputs = features()
    expected = type(whisper_target).generate(target, inputs, max_new_tokens=NEW, do_sample=False)
    hf_specdec.enable(target)
    out = target.generate(inputs, assistant_model=truncated(target), spec_config=FIXED, max_new_tokens=NEW,
                          do_sample=False)
    assert torch.equal(out, expected)
    assert_drafted(target)


def test_whisper_decoder_only_draft_reads_the_targets_encoder_states(whisper_target):
    """The WhisperForCausalLM draft's forwards get the very encoder states the target's got (no second encoder run)."""
    target = copy.deepcopy(whisper_target)
    draft = whisper_decoder_draft(target)
    seen = {"target": [], "draft": []}
    target.model.decoder.register_forward_hook(
        lambda module, args, kwargs, output: seen["target"].append(kwargs["encoder_hidden_states"]), with_kwargs=True)
    draft.model.decoder.register_forward_hook(
        lambda module, args, kwargs, output: seen["draft"].append(kwargs["encoder_hidden_states"]), with_kwargs=True)
    encoder_runs = []
    target.model.encoder.register_forward_hook(lambda *args: encoder_runs.append(1))
    hf_specdec.enable(target)
    target.generate(features(), assistant_model=draft, spec_config=FIXED, max_new_tokens=8, do_sample=False)
    assert seen["draft"] and len(encoder_runs) == 1
    assert all(states.data_ptr() == seen["target"][0].data_ptr() for states in seen["target"] + seen["draft"])


def test_whisper_lookahead_greedy_is_plain(whisper_target, clocked):
    target = copy.deepcopy(whisper_target)
    clocked(target)
    inputs = features()
    expected = type(target).generate(target, inputs, max_new_tokens=NEW, do_sample=False)
    hf_specdec.enable(target)
    out = target.generate(inputs, decoding="lookahead", lookahead_memory=seeded_lookahead(), max_new_tokens=NEW,
                          do_sample=False)
    assert torch.equal(out, expected)
    assert_drafted(target, lookahead=True)


def test_whisper_keeps_its_plain_processors():
    """Whisper's generate() clears begin_suppress_tokens when an assistant is passed; hf_specdec's route passes it
    none, so the processors are those of the plain call (the reference): a begin-suppressed token stays out of the
    first step, other suppressed tokens out of every step, exactly as plain."""
    target = whisper(suppress_tokens=[43, 75], begin_suppress_tokens=[92])
    draft = whisper_decoder_draft(target)
    inputs = features()
    expected = type(target).generate(target, inputs, max_new_tokens=NEW, do_sample=False)
    assert not ({43, 75} & set(expected[0].tolist())) and int(expected[0, 0]) != 92
    hf_specdec.enable(target)
    out = target.generate(inputs, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert_drafted(target)


def test_whisper_batch_greedy_is_plain(whisper_target, clocked):
    """Whisper's decoder takes decoder_position_ids: rows that advance at their own pace stay exact, in speculative
    mode (an encoder-decoder draft, which takes them too) and lookahead. WhisperForCausalLM's forward takes no
    position ids: as a batch's draft it is refused up front."""
    target = copy.deepcopy(whisper_target)
    inputs = features(rows=3, seed=1)
    expected = type(target).generate(target, inputs, max_new_tokens=NEW, do_sample=False)
    hf_specdec.enable(target)
    draft = truncated(target)
    clocked(target, draft)
    out = target.generate(inputs, assistant_model=draft, spec_config=FIXED, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert_drafted(target)
    out = target.generate(inputs, decoding="lookahead", lookahead_memory=seeded_lookahead(), max_new_tokens=NEW,
                          do_sample=False)
    assert torch.equal(out, expected)
    assert_drafted(target, lookahead=True)
    with pytest.raises(Unsupported, match="WhisperForCausalLM.*as a draft model: it takes no position ids"):
        target.generate(inputs, assistant_model=whisper_decoder_draft(target), max_new_tokens=4)


# -- refused, before any forward ------------------------------------------------------------------------------------
def no_forward(model):
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    for module in (getattr(model, "model", None), getattr(model, "encoder", None)):
        if module is not None:
            module.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls


def test_a_batch_of_a_decoder_numbering_tokens_by_column_is_refused():
    """BART numbers its decoder tokens by cache column (learned positions, no position ids): rows that advance at
    their own pace would sit at other columns than plain's. (T5 reads only distances: its batches run.)"""
    target = bart()
    calls = no_forward(target)
    hf_specdec.enable(target)
    with pytest.raises(Unsupported, match="takes no position ids.*one prompt at a time"):
        target.generate(TEXT.repeat(2, 1), assistant_model=truncated(target), max_new_tokens=4)
    assert not calls


def test_a_decoder_prompt_as_embeddings_is_refused():
    target = bart()
    calls = no_forward(target)
    hf_specdec.enable(target)
    with pytest.raises(Unsupported, match="decoder_inputs_embeds"):
        target.generate(TEXT, assistant_model=truncated(target), max_new_tokens=4,
                        decoder_inputs_embeds=torch.zeros(1, 1, 32))
    assert not calls


def test_an_encoder_decoder_draft_needs_an_encoder_decoder_target():
    from hf_specdec.models.tiny import tiny_model

    target = tiny_model("llama", vocab=96)
    with pytest.raises(Unsupported, match="encoder-decoder draft drafts for an encoder-decoder target"):
        target.generate(TEXT, custom_generate=hf_specdec.speculative_generate, draft_model=bart(),
                        max_new_tokens=4, do_sample=False)


def test_encoder_states_follow_the_rows():
    hidden, mask = torch.arange(3.0)[:, None, None].expand(3, 2, 4), torch.tensor([[1, 1], [0, 1], [1, 0]])
    states = EncoderStates(hidden, mask).select_rows(torch.tensor([2, 0]))
    assert states.hidden[:, 0, 0].tolist() == [2.0, 0.0] and states.mask.tolist() == [[1, 0], [1, 1]]
    assert set(states.kwargs()) == {"encoder_outputs", "attention_mask"}
    assert states.shared().reading is EncoderReading.SHARED and set(states.shared().kwargs()) == {"encoder_outputs"}


# -- sampling --------------------------------------------------------------------------------------------------------
V = 8
SAMPLED_NEW = 3
SAMPLING_PROCESSORS = LogitsProcessorList([TemperatureLogitsWarper(1.2), TopKLogitsWarper(5)])
DRAWS = 1000


def sampling_bart(seed: int = 0):
    """A one-layer BART over 8 tokens, its output layer scaled so that the distribution spreads; no EOS (every
    continuation has SAMPLED_NEW tokens)."""
    model = bart(seed=seed, vocab=V, layers=1, damp=1.0, init_std=0.02)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # (tied to the embeddings: both scaled)
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    return model


@torch.no_grad()
def exact_encoder_decoder(model, encoder_ids, num_new) -> dict[tuple[int, ...], float]:
    """P(continuation) of every decoder continuation: the product of the processed target distribution at each of
    its prefixes (a full forward per prefix, no cache)."""
    found: dict[tuple[int, ...], float] = {}
    start = torch.tensor([[model.config.decoder_start_token_id]])

    def extend(ids, probability):
        if ids.shape[1] - 1 == num_new:
            found[tuple(ids[0, 1:].tolist())] = probability
            return
        logits = model(input_ids=encoder_ids, decoder_input_ids=ids).logits[:, -1].float()
        probs = torch.softmax(SAMPLING_PROCESSORS(ids, logits).double(), dim=-1)[0]
        for token in probs.nonzero()[:, 0].tolist():
            extend(torch.cat([ids, torch.tensor([[token]])], dim=1), probability * float(probs[token]))

    extend(start, 1.0)
    return found


@pytest.mark.usefixtures("one_thread")
def test_sampling_follows_the_targets_distribution():
    target = sampling_bart()
    draft = perturbed_copy(target, 0.6, relative=True)  # agrees with the target about 85% of the time
    prompt = torch.tensor([[3, 6, 4, 7, 5]])
    exact = exact_encoder_decoder(target, prompt, SAMPLED_NEW)
    torch.manual_seed(0)
    counts, drafted, accepted = Counter(), 0, 0
    for _ in range(DRAWS):
        out = target.generate(prompt, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                              spec_config=hf_specdec.SpecConfig(policy="fixed", num_draft_tokens=2),
                              do_sample=True, temperature=1.2, top_k=5, max_new_tokens=SAMPLED_NEW)
        counts[tuple(out[0, 1:].tolist())] += 1
        stats = last_spec_stats(target)
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted  # partial acceptance: rejections resampled from the residual
    assert_fits(counts, exact)
    assert_rejected(counts, exact_encoder_decoder(sampling_bart(seed=1), prompt, SAMPLED_NEW))  # the test can tell
