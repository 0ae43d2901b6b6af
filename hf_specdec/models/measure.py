"""Timing: what a forward costs here, measured on proxies of a model's shape or on a loaded model.

- per target dtype: t(n), seconds of one forward over n new tokens on top of a cached ``CONTEXT_TOKENS``
  prefix, n in ``TARGET_SIZES``, and the prefill: one forward over a ``PREFILL_TOKENS`` prompt;
- per draft format: one draft step over n rows, n in ``DRAFT_SIZES``, timed as one row of n new tokens (the same
  matrix products) through the output layer it drafts with (``drafting_head``: narrowed where the drafter
  narrows it), and the draft's prompt read: its prefill over prompts of ``DRAFT_READ_TOKENS`` tokens (shown by
  ``hf-specdec tune`` as a fixed part plus a part per prompt token, ``profile.linear_parts``; the core's prior
  is its share of the target's prefill over as many tokens, ``seeding.read_share``, since a call prices the
  draft's read as that share of the target's prefill it has just timed, ``costmodel.ReadCost``). Every prefill
  time is warm: the first forward at each length is a warm-up and is not counted (one-time kernel and allocator
  costs would otherwise land in the fixed part). A draft step does not grow with the batch as the target's
  forward does: on an Intel Xeon with AMX the dynamic-int8 0.5B draft took 48 / 52 / 95 / 106 ms over
  1 / 2 / 4 / 8 rows while the bf16 target's t(n) was flat, so scaling one from the other priced a batch-of-8
  draft step at half its cost.

**How: proxies.** A proxy is the model's own architecture built from its config with 2 decoder layers and
random weights, real embedding and ``lm_head`` sizes, then the same model with 1 layer (the same weights). With
t1 and t2 their times, ``t = t1 + (L - 1) * (t2 - t1)`` for the real layer count L (head + L layers), per n;
footprints scale the same way. Every dtype and format is measured without loading the real weights once.
Quantized proxies go through the same ``from_pretrained`` path as ``load_model`` (saved to a temporary dir).
bitsandbytes 8-bit is measured on the real weights instead: its cost depends on the activations' outliers,
which random weights lack. Proxies against the real Qwen2.5-Coder pair on the development CPU: docs/models.md.
t(n) comes from ``hf_specdec.costmodel.forward_times``, the one offline probe; ``measure_costs`` is the same
probe on a loaded target and draft (``hf-specdec check``'s c and v(k), the eval harness's costs).

    cost = measure_format(config, "draft", "4bit")   # a FormatCost, method "proxy"
    cost.table, cost.read_table                       # {rows: s}, {prompt tokens: s}

Nothing here reads or writes the cache (``store`` does).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..costmodel import forward_times
from . import refs
from .formats import FormatUnavailable, as_format, format_load_args, model_format, quantize_loaded, role_sizes
from .hardware import (POST_LOAD_QUANTIZE, decoder_layers, dynamic_int8_available, footprint_bytes,
                       quantization_config, quantized_compute_dtype, resolve_device)
from .int4 import int4_available
from .packed import packed_available
from .profile import CONTEXT_TOKENS, PREFILL_TOKENS, FormatCost, Samples, text_config

REPEATS = 3
ROUNDS, MAX_ROUNDS, ROUNDS_AGREE = 2, 4, 0.15  # proxy rounds: 2, up to 4 until two agree within 15%
DRAFT_READ_TOKENS = (16, 64, 256)  # prompt lengths the draft's prompt read is measured at
PROBE_REPEATS = 2  # steps a proxy is timed for before the format is measured in full (``slower_than``)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill_seconds(model, prompt_ids: torch.LongTensor, repeats: int = 2, head=None) -> float:
    """Median seconds of one forward over ``prompt_ids`` ([1, P]) into an empty cache, logits of the last
    position only (what generation's prefill computes), after a warm-up; CUDA synchronised. ``head``: the
    output layer used instead of the model's (a draft's narrowed head, ``drafting_head``).

    ``costmodel.forward_times`` prices new tokens on top of a cache with logits for each of them, which is a
    verify forward; a prefill keeps one row of logits, so it has its own probe here.
    """
    from .. import cache as kv  # the one place that touches caches

    device = next(model.parameters()).device
    prompt_ids = prompt_ids.to(device)
    samples = []
    for repeat in range(repeats + 1):
        cache = kv.new_cache(model)
        _sync(device)
        start = time.perf_counter()
        kv.call_model(model, prompt_ids, cache, logits_at=1, head=head)
        _sync(device)
        if repeat:
            samples.append(time.perf_counter() - start)
        del cache
    return statistics.median(samples)


def drafting_head(model):
    """The output layer a draft model drafts with: ``drafters.draft_model.SubVocabHead`` over the first
    ``config.auto_draft_vocab_size`` ids where its output layer is a float one that can be narrowed (what
    ``SpecConfig(draft_vocab_size="auto")`` does), else None (its own). A draft step's cost depends on it: the
    0.5B Qwen2.5 draft's fp32 output layer reads 545 MB over 151,936 ids and 117 MB over 32,768, and in dynamic
    int8 its body reads 358 MB; a profile that timed the whole output layer priced a step the draft never takes.
    The prompt's own ids beyond the first ones, which the drafter also scores, are left out (a few rows)."""
    from ..config import auto_draft_vocab_size
    from ..drafters.draft_model import SubVocabHead  # the drafter's own head, not a copy of its arithmetic

    if not SubVocabHead.usable(model):
        return None
    rows = int(model.get_output_embeddings().weight.shape[0])
    width = auto_draft_vocab_size(rows)  # below rows whenever it is not None
    if width is None:
        return None
    return SubVocabHead(model, torch.arange(width, device=model.get_output_embeddings().weight.device), rows)


def _token_ids(length: int, vocab: int, seed: int = 0) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=generator)


def _proxy_config(config, layers: int):
    proxy = copy.deepcopy(config)
    text = text_config(proxy)
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), (list, tuple)):
        text.layer_types = list(text.layer_types[:layers])
    return proxy


_FILL = 1 << 20


def _fill_random(model: torch.nn.Module) -> None:
    """Random values in every parameter, from one small pool (initialising 200M+ values one by one costs seconds;
    what a matmul costs does not depend on the values, as long as there are no denormals)."""
    pool = torch.empty(_FILL, dtype=torch.float32).uniform_(-0.02, 0.02)
    with torch.no_grad():
        for p in model.parameters():
            flat, chunk = p.data.view(-1), pool.to(device=p.device, dtype=p.dtype)
            for start in range(0, flat.numel(), _FILL):
                end = min(flat.numel(), start + _FILL)
                flat[start:end].copy_(chunk[: end - start])


def build_proxy(config, fmt: str, device: str = "cpu", layers: int = 2, workdir: str | os.PathLike | None = None):
    """The model of ``config`` with ``layers`` decoder layers and random weights, in format ``fmt`` on ``device``.

    bitsandbytes formats are saved to ``workdir`` in bf16 and loaded back through ``load_model``'s
    ``from_pretrained`` call with the same quantization config; dynamic int8 and int4 are applied as
    ``load_model`` does (what their kernels cost does not depend on the weights' values).
    Raises ``FormatUnavailable`` when the format cannot be built here.
    """
    from transformers import AutoModelForCausalLM

    fmt = as_format(fmt)
    dense = format_load_args(fmt, device)[0]  # the dtype it is built in (a post-load kind's input)
    if fmt == "dynamic-int8" and (str(device) != "cpu" or not dynamic_int8_available()):
        raise FormatUnavailable("torch dynamic int8 runs on CPU with a quantized engine only")
    if fmt == "int4" and (str(device) != "cpu" or not int4_available()):
        raise FormatUnavailable(f"int4 runs on CPU with torch's int4 CPU kernel only (torch {torch.__version__})")
    if fmt == "fp32-packed" and (str(device) != "cpu" or not packed_available()):
        raise FormatUnavailable(f"fp32-packed runs on CPU with torch's oneDNN only (torch {torch.__version__})")
    proxy_config = _proxy_config(config, layers)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: initialise normally (slower, same result)
        no_init_weights = None
    with torch.device(device):
        if no_init_weights is None:
            model = AutoModelForCausalLM.from_config(proxy_config, dtype=dense)
        else:
            with no_init_weights():
                model = AutoModelForCausalLM.from_config(proxy_config, dtype=dense)
    model.tie_weights()
    _fill_random(model)
    model.eval()
    if fmt in ("4bit", "8bit"):
        if workdir is None:
            raise ValueError("build_proxy: a bitsandbytes format needs a workdir")
        try:
            qconfig = quantization_config(fmt, dense)
        except ImportError as err:
            raise FormatUnavailable(str(err)) from None
        model.save_pretrained(workdir)
        del model
        try:
            with _quiet_bitsandbytes():
                model = refs.from_pretrained(str(workdir), dtype=dense, quantization_config=qconfig,
                                             device_map={"": device})
        except (RuntimeError, ValueError, NotImplementedError, AssertionError) as err:
            raise FormatUnavailable(f"{type(err).__name__}: {str(err)[:160]}") from None
        model.eval()
    elif fmt in POST_LOAD_QUANTIZE:
        quantize_loaded(model, fmt)
    return model


def one_layer_view(model):
    """The same model with its first decoder layer only, sharing every weight (no copy): the 1-layer proxy."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    view = copy.deepcopy(model, memo=shared)  # modules and config copied, tensors shared
    parent, name = decoder_layers(view)
    setattr(parent, name, torch.nn.ModuleList(list(getattr(parent, name))[:1]))
    text = text_config(view.config)
    text.num_hidden_layers = 1
    if isinstance(getattr(text, "layer_types", None), (list, tuple)):
        text.layer_types = list(text.layer_types[:1])
    return view


@contextlib.contextmanager
def _quiet_bitsandbytes():
    """bitsandbytes' 8-bit matmul logs a warning per layer and call on CPU (bf16 inputs cast to fp16); silence it
    while timing, then restore the logger's level."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class Timing:
    """One round of timings of one model: ``steps`` {n: s} (t(n), or a draft step by rows), ``prefill`` (a
    target's forward over ``prefill_tokens``; None for a draft), ``reads`` {prompt tokens: s} (a draft's prompt
    read; {} for a target) and the model's ``footprint`` in bytes."""

    steps: Mapping[int, float]
    prefill: float | None
    reads: Mapping[int, float]
    footprint: int


def _timings(model, role: str, sizes: Sequence[int], repeats: int, context_tokens: int, prefill_tokens: int,
             read_tokens: Sequence[int] = DRAFT_READ_TOKENS) -> Timing:
    """A target as it verifies; a draft as it drafts, through its narrowed head (``drafting_head``), whose
    weights it holds beside its own while it drafts (counted in the footprint)."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    prefill_repeats = max(1, repeats - 1)
    head = drafting_head(model) if role == "draft" else None
    with _quiet_bitsandbytes():
        steps = forward_times(model, _token_ids(context_tokens, vocab), sizes, repeats, head=head)
        prefill = (prefill_seconds(model, _token_ids(prefill_tokens, vocab, seed=1), prefill_repeats)
                   if role == "target" and prefill_tokens else None)
        reads = ({n: prefill_seconds(model, _token_ids(n, vocab, seed=2), prefill_repeats, head=head)
                  for n in read_tokens} if role == "draft" else {})
    extra = 0 if head is None else head.weight.numel() * head.weight.element_size()
    return Timing(steps, prefill, reads, footprint_bytes(model) + extra)


def _scaled(one: float, two: float, layers: int) -> float:
    """head + L x layer from t(1 layer) = head + layer and t(2 layers) = head + 2 layer; a layer never costs less
    than nothing (noise can make the difference negative)."""
    return one + (layers - 1) * max(two - one, 0.0)


def _agreeing(scaled: list[float]) -> bool:
    """Two of the rounds' t(1) estimates within ``ROUNDS_AGREE`` of each other (another process stealing the CPU
    for a while only makes a round slower: the fastest two agreeing means that it did not hit both)."""
    best = sorted(scaled)[:2]
    return len(best) == 2 and best[1] <= best[0] * (1 + ROUNDS_AGREE)


def measure_format(config, role: str, fmt: str, device: str = "cpu", weights: str | None = None, *,
                   sizes: Sequence[int] | None = None, repeats: int = REPEATS, context_tokens: int = CONTEXT_TOKENS,
                   prefill_tokens: int = PREFILL_TOKENS, read_tokens: Sequence[int] = DRAFT_READ_TOKENS,
                   slower_than: float | None = None) -> FormatCost:
    """Measure one format by proxies (see the module docstring): t(n) (a target: ``sizes``, default
    ``TARGET_SIZES``; a draft: a step over ``DRAFT_SIZES`` rows), for a target the prefill, for a draft its
    prompt read at ``read_tokens`` prompt tokens; scaled to the real layer count.

    The 2-layer and 1-layer proxies are timed in alternating rounds (``forward_times`` medians), at least
    ``ROUNDS`` and up to ``MAX_ROUNDS`` until two rounds agree; each time is the fastest round's (interference
    from other processes only ever adds time). The result keeps its ``Samples`` for ``profile.check_cost``
    (``store`` caches only what passes): each round's scaled t(n), and the 2-layer proxy's first size timed once
    more at the end against its first round (a load that came or went while measuring).

    ``slower_than`` (seconds): a bound the format is worth measuring under. One step of each proxy is timed
    first (``PROBE_REPEATS``); when the scaled t(1) is above the bound the format is not measured further and the
    result holds that t(1) alone (``method="probe"``). A draft format slower than one already measured can never
    be chosen (``choose.choose_draft_format`` takes the fastest), and measuring a slow format in full is where
    a first load's time went: on the AVX2-only EPYC the int4 0.5B draft proxy stepped in seconds and its full
    measurement took 343 s (docs/benchmarks.md).

    bitsandbytes 8-bit (LLM.int8) is the exception: its matmul splits off the activation columns above its
    outlier threshold, which real models have and random proxies do not (a 0.5B proxy measured 28 ms, the real
    model 118 ms), so it is measured on the real weights (``weights``: the directory ``from_pretrained`` reads)
    and is unavailable from a config alone.
    """
    device = resolve_device(device)
    sizes = tuple(sizes or role_sizes(role))
    if as_format(fmt) == "8bit":
        return _measure_real_8bit(weights, role, device, sizes, repeats, context_tokens, prefill_tokens, read_tokens)
    layers = int(text_config(config).num_hidden_layers)
    rounds: dict[int, list[Timing]] = {2: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="hf_specdec_proxy_") as workdir:
        try:
            proxies = {2: build_proxy(config, fmt, device, 2, workdir)}
            proxies[1] = one_layer_view(proxies[2])
            if slower_than is not None:
                probe = _probe_t1(proxies, layers, context_tokens, role)
                if probe > slower_than:
                    footprint = int(_scaled(footprint_bytes(proxies[1]), footprint_bytes(proxies[2]), layers))
                    return FormatCost(fmt, {1: probe}, footprint_bytes=footprint, method="probe",
                                      context_tokens=context_tokens)
            for done in range(1, MAX_ROUNDS + 1):
                for count in (2, 1):
                    rounds[count].append(_timings(proxies[count], role, sizes, repeats, context_tokens,
                                                  prefill_tokens, read_tokens))
                scaled = [_scaled(one.steps[1], two.steps[1], layers) for one, two in zip(rounds[1], rounds[2])]
                if done >= ROUNDS and _agreeing(scaled):
                    break
            drift = (rounds[2][0].steps[min(sizes)], _retimed(proxies[2], role, min(sizes), repeats, context_tokens))
        except (RuntimeError, ValueError, NotImplementedError, AssertionError) as err:
            if isinstance(err, FormatUnavailable):
                raise
            raise FormatUnavailable(f"{type(err).__name__}: {str(err)[:160]}") from None
        finally:
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    fastest = {count: _fastest(rounds[count]) for count in (1, 2)}
    step = {n: _scaled(fastest[1].steps[n], fastest[2].steps[n], layers) for n in sizes}
    reads = {n: _scaled(fastest[1].reads[n], fastest[2].reads[n], layers) for n in fastest[1].reads}
    prefill = None
    if fastest[1].prefill is not None:
        prefill = _scaled(fastest[1].prefill, fastest[2].prefill, layers)
    footprint = int(_scaled(rounds[1][0].footprint, rounds[2][0].footprint, layers))
    samples = Samples({n: tuple(_scaled(one.steps[n], two.steps[n], layers) for one, two in zip(rounds[1], rounds[2]))
                       for n in sizes}, drift)
    return FormatCost(fmt, step, prefill_tokens if prefill is not None else 0, prefill, footprint, "proxy",
                      context_tokens, reads, samples)


def _retimed(model, role: str, size: int, repeats: int, context_tokens: int) -> float:
    """The first size timed once more, as ``_timings`` timed it: the end of a measurement's ``Samples.drift``
    (another process that started or stopped while it ran shows as a change against the start)."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    head = drafting_head(model) if role == "draft" else None
    with _quiet_bitsandbytes():
        return forward_times(model, _token_ids(context_tokens, vocab), (size,), repeats, head=head)[size]


def _probe_t1(proxies: Mapping[int, Any], layers: int, context_tokens: int, role: str) -> float:
    """t(1) of the real layer count from one short timing of each proxy (``PROBE_REPEATS`` steps after a
    warm-up): enough to tell a format several times slower than another, never to price it."""
    vocab = int(proxies[2].get_input_embeddings().weight.shape[0])
    ids = _token_ids(context_tokens, vocab)
    head = drafting_head(proxies[2]) if role == "draft" else None  # one head: the proxies share their weights
    with _quiet_bitsandbytes():
        one, two = (forward_times(proxies[count], ids, (1,), PROBE_REPEATS, head=head)[1] for count in (1, 2))
    return _scaled(one, two, layers)


def _fastest(samples: Sequence[Timing]) -> Timing:
    """Each time the fastest of its rounds (interference only ever adds time)."""
    first = samples[0]
    return Timing({n: min(s.steps[n] for s in samples) for n in first.steps},
                  None if first.prefill is None else min(s.prefill for s in samples),
                  {n: min(s.reads[n] for s in samples) for n in first.reads}, first.footprint)


def measure_model(model, role: str = "target", *, sizes: Sequence[int] | None = None, repeats: int = REPEATS,
                  context_tokens: int = CONTEXT_TOKENS, prefill_tokens: int = PREFILL_TOKENS,
                  rounds: int = ROUNDS, read_tokens: Sequence[int] = DRAFT_READ_TOKENS) -> FormatCost:
    """The same measurement on a loaded model itself (``method="real"``; the fastest of ``rounds`` rounds): to
    validate the proxies, for formats whose cost depends on the weights (8-bit), or for any loaded model."""
    sizes = tuple(sizes or role_sizes(role))
    timed = [_timings(model, role, sizes, repeats, context_tokens, prefill_tokens, read_tokens)
             for _ in range(max(1, rounds))]
    drift = (timed[0].steps[min(sizes)], _retimed(model, role, min(sizes), repeats, context_tokens))
    best = _fastest(timed)
    return FormatCost(model_format(model), best.steps, prefill_tokens if best.prefill is not None else 0,
                      best.prefill, best.footprint, "real", context_tokens, best.reads,
                      Samples({n: tuple(t.steps[n] for t in timed) for n in sizes}, drift))


def _measure_real_8bit(weights: str | None, role: str, device: str, sizes, repeats: int, context_tokens: int,
                       prefill_tokens: int, read_tokens: Sequence[int]) -> FormatCost:
    if weights is None:
        raise FormatUnavailable("bitsandbytes 8-bit costs depend on the real activations' outliers: measured on the "
                                "model's weights only (give a reference, not a config)")
    try:
        qconfig = quantization_config("8bit")
    except ImportError as err:
        raise FormatUnavailable(str(err)) from None
    try:
        with _quiet_bitsandbytes():
            model = refs.from_pretrained(str(weights), dtype=quantized_compute_dtype(device),
                                         quantization_config=qconfig, device_map={"": device}).eval()
            return measure_model(model, role, sizes=sizes, repeats=repeats, context_tokens=context_tokens,
                                 prefill_tokens=prefill_tokens, read_tokens=read_tokens)
    except (RuntimeError, ValueError, NotImplementedError, AssertionError, OSError) as err:
        raise FormatUnavailable(f"{type(err).__name__}: {str(err)[:160]}") from None


def measure_costs(target, draft,
                  prefix_ids: torch.LongTensor,  # [1, L] the cached context
                  sizes: Sequence[int], repeats: int = 5) -> dict:
    """Forward costs of loaded models measured offline by :func:`hf_specdec.costmodel.forward_times` (median of
    ``repeats``).

    ``t_s[n]``: seconds of one target forward over n new tokens;
    ``t_step_s`` = t(1); ``v[n]`` = t(n) / t(1); with a draft, ``t_draft_s`` (one draft forward over 1 new
    token) and ``c`` = t_draft / t_step. Keys of ``t_s`` and ``v`` are strings (JSON).
    """
    sizes = sorted({1, *(int(n) for n in sizes)})
    times = forward_times(target, prefix_ids, sizes, repeats)
    t_step = times[1]
    result: dict[str, Any] = {"repeats": repeats, "context_tokens": int(prefix_ids.shape[1]), "t_step_s": t_step,
                              "t_s": {str(n): times[n] for n in sizes}, "v": {str(n): times[n] / t_step for n in sizes}}
    if draft is not None:
        t_draft = forward_times(draft, prefix_ids, [1], repeats)[1]
        result.update(t_draft_s=t_draft, c=t_draft / t_step)
    return result
