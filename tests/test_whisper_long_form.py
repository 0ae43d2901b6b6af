"""Whisper's long-form transcription with a draft model or lookahead returns what plain long-form returns, token for
token (fp32, greedy): audio longer than one window (or ``return_timestamps=True``) is transcribed window by window by
Whisper's own generate(), which calls ``GenerationMixin.generate`` once per window (and once more per temperature
fallback) with the caller's keyword arguments, so each window is one hf_specdec call. Covered: one audio and a batch
of two of different lengths (the shorter one leaves the batch first), ``condition_on_prev_tokens`` (the previous
windows' text as a left-padded decoder prompt), ``return_segments``, ``return_dict_in_generate`` (each segment's
per-step scores), language and task tokens, ``prompt_ids``, temperature fallback on ``logprob_threshold`` and
``compression_ratio_threshold`` (greedy reruns, and a sampled one made deterministic with ``top_k=1``),
``no_speech_threshold``, token-level timestamps (cross-attentions), and the three ways in: ``enable(model)`` with
``assistant_model=``, ``decoding="lookahead"``, and ``custom_generate=speculative_generate``. Plain long-form (no
assistant) is the reference; every test asserts that draft tokens were accepted over the windows' calls.

The tiny Whisper reads a window of 60 frames (``max_source_positions`` 30, the encoder's strides 1 and 2), so a
240-frame audio is four windows or more (a window whose text ends in a single timestamp moves on by less).
"""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec.stats import LastSpecStats
from tests.test_encoder_decoder import clocked  # noqa: F401  (a fixture: flat virtual costs)
from tests.test_encoder_decoder import FIXED, seeded_lookahead, truncated, whisper, whisper_decoder_draft

WINDOW = 60  # frames one encoder run reads: 2 * max_source_positions
LONG = (240, 130)  # two audios of different lengths: the second leaves the batch windows before the first
WINDOW_TOKENS = 24  # max_new_tokens per window where a test needs no window's whole text (reruns: windows twice)
MULTILINGUAL = dict(lang_to_id={"<|en|>": 47}, task_to_id={"transcribe": 48, "translate": 49}, is_multilingual=True)


def long_whisper(seed: int = 0, **generation):
    """A tiny Whisper that transcribes long-form: timestamp tokens (``no_timestamps_token_id`` 50, so 51..95 are
    timestamps, more than one window's 30 positions), the previous-text token that heads a conditioned prompt
    (``prev_sot_token_id``), a decoder long enough for a window's text after the previous ones' (128 positions), and
    ``generation``'s generation-config fields (``MULTILINGUAL``: language and task tokens)."""
    model = whisper(seed, max_target_positions=128)
    config = model.generation_config
    config.no_timestamps_token_id = 50
    config.prev_sot_token_id = 46
    for name, value in generation.items():
        setattr(config, name, value)
    return model


def audio(lengths=LONG, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-mel-like features [B, 16, longest] of audios of ``lengths`` frames, zero past each one's end, and their
    attention mask (None for one audio: plain needs one only for a batch)."""
    features = torch.randn(len(lengths), 16, max(lengths), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        features[row, :, length:] = 0
    return features, mask if len(lengths) > 1 else None


class WindowStats(LastSpecStats):
    """``model.last_spec_stats`` that also keeps every call's stats: a long-form call makes one hf_specdec call per
    window (and per fallback rerun), and the holder keeps only the latest."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def set(self, stats) -> None:
        super().set(stats)
        if stats is not None:
            self.calls.append(stats)


def watched(model) -> WindowStats:
    holder = WindowStats()
    model.__dict__["last_spec_stats"] = holder  # (``stats.stats_holder`` and ``enable`` keep a holder already there)
    return holder


def assert_drafted(holder: WindowStats, windows: int = 2, lookahead: bool = False) -> None:
    """At least ``windows`` hf_specdec calls were made, and draft tokens were accepted over them (a draft model's,
    not prompt lookup's, unless ``lookahead``)."""
    drafted = sum(s.drafted - (0 if lookahead else s.lookup_drafted) for s in holder.calls)
    accepted = sum(s.accepted - (0 if lookahead else s.lookup_accepted) for s in holder.calls)
    assert len(holder.calls) >= windows and drafted > 0 and 0 < accepted <= drafted, (len(holder.calls), drafted,
                                                                                      accepted)


def plain(model, features, **call):
    return type(model).generate(model, features, **call)  # the class's generate(): plain even after enable(model)


def assert_same(out, expected, where: str = "out") -> None:
    """``out`` is ``expected``: integer tensors (tokens) equal, float tensors (scores, attentions, times) equal to
    fp32 rounding, dicts, lists and outputs field by field."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(out, torch.Tensor) and out.shape == expected.shape, (where, out, expected)
        if expected.is_floating_point():
            assert torch.allclose(out, expected, atol=1e-4), (where, out, expected)
        else:
            assert torch.equal(out, expected), (where, out, expected)
    elif isinstance(expected, dict):  # a plain dict or a ModelOutput
        assert set(out.keys()) == set(expected.keys()), (where, set(out.keys()) ^ set(expected.keys()))
        for name in expected.keys():
            assert_same(out[name], expected[name], f"{where}.{name}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(out, (list, tuple)) and len(out) == len(expected), (where, out, expected)
        for index, (mine, theirs) in enumerate(zip(out, expected)):
            assert_same(mine, theirs, f"{where}[{index}]")
    else:
        assert out == expected, (where, out, expected)


def encoder_runs(model) -> list:
    runs = []
    model.model.encoder.register_forward_hook(lambda *args: runs.append(1))
    return runs


# -- greedy, the three ways in --------------------------------------------------------------------------------------
@pytest.mark.parametrize("way", ["enable, encoder-decoder draft", "enable, decoder-only draft sharing the encoder",
                                 "custom_generate"])
def test_long_form_is_plain(way):
    target = long_whisper()
    features, _ = audio((240,))
    call = dict(return_timestamps=True, condition_on_prev_tokens=True, do_sample=False)
    expected = plain(target, features, **call)
    draft = whisper_decoder_draft(target) if "decoder-only" in way else truncated(target)
    holder = watched(target)
    runs = encoder_runs(target)
    if way == "custom_generate":
        out = target.generate(features, custom_generate=hf_specdec.speculative_generate, draft_model=draft,
                              spec_config=FIXED, **call)
    else:
        hf_specdec.enable(target)
        out = target.generate(features, assistant_model=draft, spec_config=FIXED, **call)
    assert_same(out, expected)
    assert len(runs) >= 240 // WINDOW  # one encoder run per window: the call went long-form
    assert_drafted(holder, windows=240 // WINDOW)
    if way != "custom_generate":  # enable's call: the windows' stats combined in model.last_spec_stats
        whole = holder.get()
        for name in ("new_tokens", "forwards", "drafted", "accepted"):
            assert getattr(whole, name) == sum(getattr(part, name) for part in holder.calls), name
        assert whole.ttft_s == holder.calls[0].ttft_s and whole.new_tokens > holder.calls[-1].new_tokens


@pytest.mark.parametrize("lengths", [(240,), LONG], ids=["one audio", "a batch of two lengths"])
def test_long_form_lookahead_is_plain(clocked, lengths):
    target = long_whisper()
    clocked(target)
    features, mask = audio(lengths)
    call = dict(attention_mask=mask, return_timestamps=True, condition_on_prev_tokens=True, do_sample=False)
    expected = plain(target, features, **call)
    holder = watched(target)
    hf_specdec.enable(target)
    out = target.generate(features, decoding="lookahead", lookahead_memory=seeded_lookahead(), **call)
    assert_same(out, expected)
    assert_drafted(holder, windows=240 // WINDOW, lookahead=True)


# -- a batch of two audios of different lengths ---------------------------------------------------------------------
@pytest.mark.parametrize("condition", [True, False], ids=["condition_on_prev_tokens", "no-conditioning"])
def test_a_batch_of_two_lengths_is_plain_with_its_segments(condition):
    """The rows' decoder prompts (the previous windows' text, left-padded to the longest) differ in length, the
    second audio leaves the batch first, and each segment (its tokens, times and span) is plain's."""
    target = long_whisper()
    features, mask = audio()
    call = dict(attention_mask=mask, return_timestamps=True, condition_on_prev_tokens=condition,
                return_segments=True, do_sample=False)
    expected = plain(target, features, **call)
    assert len(expected["segments"][0]) > len(expected["segments"][1]) > 1
    holder = watched(target)
    hf_specdec.enable(target)
    out = target.generate(features, attention_mask=mask, assistant_model=truncated(target), spec_config=FIXED,
                          **{name: value for name, value in call.items() if name != "attention_mask"})
    assert_same(out, expected)
    assert any(stats.rows == 1 for stats in holder.calls) and any(stats.rows == 2 for stats in holder.calls)
    assert_drafted(holder)


def test_return_dict_in_generate_gives_each_segment_plains_steps():
    """With ``return_dict_in_generate`` each segment carries its window's call's output (sequences, per-step
    scores), cut per row: the same as plain's, step for step."""
    target = long_whisper(**MULTILINGUAL)
    features, mask = audio()
    call = dict(attention_mask=mask, return_timestamps=True, condition_on_prev_tokens=True, language="en",
                return_dict_in_generate=True, output_scores=True, do_sample=False)
    expected = plain(target, features, **call)
    assert "scores" in expected["segments"][0][0]["result"]
    holder = watched(target)
    out = target.generate(features, custom_generate=hf_specdec.speculative_generate, draft_model=truncated(target),
                          spec_config=FIXED, **call)
    assert_same(out, expected)
    assert_drafted(holder)


def test_short_form_with_timestamps_is_plain():
    """``return_timestamps=True`` on one window takes the long-form path too (one window's call); without it the
    short-form call (tests/test_encoder_decoder.py)."""
    target = long_whisper()
    features, mask = audio((WINDOW, 50))
    call = dict(attention_mask=mask, return_timestamps=True, do_sample=False)
    expected = plain(target, features, **call)
    holder = watched(target)
    hf_specdec.enable(target)
    out = target.generate(features, assistant_model=truncated(target), spec_config=FIXED, **call)
    assert_same(out, expected)
    assert_drafted(holder, windows=1)


def test_long_form_without_timestamps_is_refused_as_plain_refuses_it():
    """Whisper's generate() itself refuses long-form audio with ``return_timestamps=False``, before any forward."""
    target = long_whisper()
    features, _ = audio((240,))
    with pytest.raises(ValueError, match="return_timestamps=True") as refused:
        plain(target, features, return_timestamps=False)
    draft = truncated(target)
    runs = encoder_runs(target)
    hf_specdec.enable(target)
    with pytest.raises(ValueError) as ours:
        target.generate(features, assistant_model=draft, return_timestamps=False)
    assert str(ours.value) == str(refused.value) and not runs


# -- what Whisper's long-form reads from each window's call ---------------------------------------------------------
FALLBACKS = {
    # (on long_whisper(0) and audio(), a threshold of -1.5 mean logprob leaves some windows' first pass and reruns
    # others: plain's scores decide which, and the rerun batch is those rows only)
    "logprob_threshold": dict(temperature=(0.0, 0.0), logprob_threshold=-1.5),
    # (the tiny model's text repeats: windows whose tokens compress past 0.85 are rerun, the others kept)
    "compression_ratio_threshold": dict(temperature=(0.0, 0.0), compression_ratio_threshold=0.85),
    # some windows judged silent (skipped) from the no-speech token's probability, which the detector
    # (``WhisperNoSpeechDetection``) reads from its own model run on the language and task tokens
    "no_speech_threshold": dict(temperature=(0.0, 0.0), logprob_threshold=-1.5, no_speech_threshold=0.01),
    # the reruns sample (temperature 0.5, do_sample set by Whisper per rerun); top_k=1 makes a sample the argmax, so
    # a sampled verify must still give plain's tokens
    "sampled rerun": dict(temperature=(0.0, 0.5), logprob_threshold=-1.5, top_k=1),
}


@pytest.mark.parametrize("fallback", list(FALLBACKS))
def test_temperature_fallback_is_plain(fallback):
    target = long_whisper(**MULTILINGUAL)
    features, mask = audio()
    call = dict(attention_mask=mask, return_timestamps=True, condition_on_prev_tokens=True, language="en",
                max_new_tokens=WINDOW_TOKENS, **FALLBACKS[fallback])
    assert drafted_as_plain(target, features, call).shape[-1] > 0


def test_prompt_ids_on_every_window_are_plain():
    target = long_whisper(**MULTILINGUAL)
    features, mask = audio()
    call = dict(attention_mask=mask, return_timestamps=True, condition_on_prev_tokens=True, language="en",
                prompt_ids=torch.tensor([46, 20, 21]), prompt_condition_type="all-segments", do_sample=False)
    drafted_as_plain(target, features, call)


def drafted_as_plain(target, features, call: dict):
    """``call`` with ``enable(target)`` and a truncated draft returns plain's output, and drafted: plain's output."""
    expected = plain(target, features, **call)
    holder = watched(target)
    hf_specdec.enable(target)
    out = target.generate(features, assistant_model=truncated(target), spec_config=FIXED, **call)
    assert_same(out, expected)
    assert_drafted(holder)
    return expected


def test_token_timestamps_are_plain():
    """``return_token_timestamps`` reads each window's cross-attentions (eager attention, ``alignment_heads``):
    the per-step cross-attentions hf_specdec returns give plain's token times."""
    target = long_whisper(alignment_heads=[[1, 0], [1, 2]])
    features, mask = audio()
    call = dict(attention_mask=mask, return_timestamps=True, condition_on_prev_tokens=True,
                return_token_timestamps=True, do_sample=False)
    expected = plain(target, features, **call)
    assert "token_timestamps" in expected
    holder = watched(target)
    hf_specdec.enable(target)
    out = target.generate(features, assistant_model=truncated(target), spec_config=FIXED, **call)
    assert_same(out, expected)
    assert_drafted(holder)
