"""A cost profile of this hardware, measured once and cached, and the choices it makes: target dtype, draft format.

No rule about CPU flags says what is fast. On an AMD EPYC with AVX2 only, bf16 took the faster plain step
(memory-bound) while its multi-token forwards grew linearly (no bf16 FMA) and fp32 verified 8 tokens for ~3
steps; the 4-bit draft was the slowest draft format there; with a few-hundred-token prompt bf16's compute-bound
prefill outweighed its faster steps. So everything is measured, here, at first use:

- per target dtype (CPU: bf16, fp32; CUDA: bf16, fp16): t(n), seconds of one forward over n new tokens on top
  of a cached 100-token prefix, n in ``TARGET_SIZES``, and the prefill: one forward over a 256-token prompt;
- per draft format (bf16 / fp16 / fp32, bitsandbytes 8-bit and 4-bit, torch dynamic int8 on CPU): one draft
  step over n rows, n in ``DRAFT_SIZES``, timed as one row of n new tokens (the same matrix products). A draft
  step does not grow with the batch as the target's forward does: on an Intel Xeon with AMX the dynamic-int8
  0.5B draft took 48 / 52 / 95 / 106 ms over 1 / 2 / 4 / 8 rows while the bf16 target's t(n) was flat, so
  scaling one from the other priced a batch-of-8 draft step at half its cost.

**How: proxies.** A proxy is the model's own architecture built from its config with 2 decoder layers and
random weights, real embedding and ``lm_head`` sizes, then the same model with 1 layer (the same weights). With
t1 and t2 their times, ``t = t1 + (L - 1) * (t2 - t1)`` for the real layer count L (head + L layers), per n;
footprints scale the same way. Every dtype and format is measured without loading the real weights once.
Quantized proxies go through the same ``from_pretrained`` path as ``load_model`` (saved to a temporary dir).
bitsandbytes 8-bit is measured on the real weights instead: its cost depends on the activations' outliers,
which random weights lack. Proxies against the real Qwen2.5-Coder pair on the development CPU: docs/models.md.
t(n) comes from ``hf_specdec.costmodel.forward_times``, the one offline probe.

**Cache.** One JSON file per measurement under ``<cache>/profiles/``, keyed by ``ProfileKey``: the role
(target curve or draft step), the format, a fingerprint of the config's architecture fields, the device (CPU
model, relevant flags and torch threads, or GPU name and compute capability) and the torch version; a changed key
is a new measurement.

**Choices.** ``choose_dtype(profile, workload)``: the target dtype with the lowest expected end-to-end time of a
typical call (``Workload``: a 256-token prompt, 128 new tokens, draft acceptance 0.7 per token), prefill
included, speculating when that pays at the measured costs; it reports when prefilling in one dtype and decoding
in another would win. ``choose_draft_format(profile, memory_bytes=...)``: the fastest draft format that fits.
Both return a ``Choice`` with a human-readable ``why``. Profiles can be built from given numbers
(``HardwareProfile.from_numbers``), so the choosers are tested without measuring.

For the decoding core: ``profile.target_cost(dtype) -> ForwardCost`` and ``profile.draft_steps(format) ->
{rows: seconds}`` seed its estimates (``profile.draft_step(format)``: one row); ``cached_costs(target, draft)``
gives both for loaded models from the cache without measuring; ``model_format(model)`` names the format of a
loaded model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..costmodel import ForwardCost, best_count, expected_tokens, forward_times, prefix_gains
from .bundles import resolve_cache_dir
from .hardware import (available_memory_bytes, cpu_flags, decoder_layers, dynamic_int8_available, footprint_bytes,
                       quantization_config, quantize_dynamic_int8, quantized_compute_dtype, resolve_device)

SCHEMA = "hf_specdec.profile/1"
TARGET_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DRAFT_SIZES = (1, 2, 4, 8)  # rows of a batched draft step
CONTEXT_TOKENS = 100
PREFILL_TOKENS = 256
REPEATS = 3
ROUNDS, MAX_ROUNDS, ROUNDS_AGREE = 2, 4, 0.15  # proxy rounds: 2, up to 4 until two agree within 15%
VERIFY_PROBE = 8  # the "verifying 8 tokens costs x steps" figure of a dtype's why

# every format a profile can hold; for drafts, also the tie-break order (full precision first, then less memory)
FORMATS = ("bf16", "fp16", "fp32", "8bit", "dynamic-int8", "4bit")
FORMAT_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32})
DTYPE_FORMATS = MappingProxyType({torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"})
ROLES = ("target", "draft")
# flags that decide what runs fast on a CPU: native bf16 / fp16 / int8 dot products and tiles
PROFILE_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16",
                     "amx_int8", "amx_fp16")
DRAFT_TIE = 0.05  # a draft format within 5% of the fastest counts as as fast: the earlier one in FORMATS wins
SPLIT_MIN_GAIN = 0.05  # a prefill/decode dtype split is reported when it would save at least 5%
MEMORY_MARGIN = 1.2  # a format fits when 1.2 x its weights (activations, KV cache) fit in the free memory
# config keys that do not change what a forward costs (ids, numerics, rope scaling, limits, bookkeeping)
_IGNORED_CONFIG_KEYS = frozenset({
    "architectures", "dtype", "torch_dtype", "transformers_version", "name_or_path", "id2label", "label2id",
    "initializer_range", "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop",
    "summary_first_dropout", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "use_cache",
    "max_position_embeddings", "n_positions", "n_ctx", "rope_parameters", "rope_scaling", "rope_theta",
    "output_attentions", "output_hidden_states", "return_dict", "task_specific_params", "problem_type",
    "tokenizer_class", "prefix", "chunk_size_feed_forward", "tie_encoder_decoder", "is_decoder",
    "is_encoder_decoder", "quantization_config", "generation_config", "pruned_heads", "torchscript",
    "use_return_dict", "finetuning_task", "max_window_layers",
})


def role_sizes(role: str) -> tuple[int, ...]:
    """The sizes a role is measured at: t(n) of a target, a draft step over n rows."""
    return TARGET_SIZES if role == "target" else DRAFT_SIZES


class FormatUnavailable(RuntimeError):
    """A format cannot be measured (or loaded) here: bitsandbytes missing, layers too narrow for its kernels, no
    int8 engine, out of memory. The profile notes it and goes on without that format."""


def as_format(dtype_or_format: str | torch.dtype) -> str:
    """A format name from a format ("bf16", "4bit", ...), a dtype name ("bfloat16", "float32") or a torch.dtype."""
    if isinstance(dtype_or_format, torch.dtype):
        try:
            return DTYPE_FORMATS[dtype_or_format]
        except KeyError:
            raise ValueError(f"no profile format for {dtype_or_format}") from None
    name = str(dtype_or_format).lower().removeprefix("torch.")
    name = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
            "int8": "dynamic-int8"}.get(name, name)
    if name not in FORMATS:
        raise ValueError(f"unknown format {dtype_or_format!r}: use one of {', '.join(FORMATS)}")
    return name


def format_load_args(fmt: str, device: str = "cpu") -> tuple[torch.dtype, str | None]:
    """``(dtype, quantize)`` that ``load_model`` takes to load a model in format ``fmt`` on ``device``."""
    fmt = as_format(fmt)
    if fmt in FORMAT_DTYPES:
        return FORMAT_DTYPES[fmt], None
    if fmt == "dynamic-int8":
        return torch.float32, "dynamic-int8"
    return quantized_compute_dtype(device), fmt


def model_format(model: torch.nn.Module) -> str:
    """The format of a loaded model: "4bit" / "8bit" (bitsandbytes layers), "dynamic-int8" (torch dynamic
    quantized Linear layers), else its parameters' dtype ("bf16", "fp16", "fp32")."""
    kinds = {type(m).__name__ for m in model.modules()}
    if "Linear4bit" in kinds:
        return "4bit"
    if "Linear8bitLt" in kinds:
        return "8bit"
    if any(isinstance(getattr(m, "_packed_params", None), torch.nn.Module) for m in model.modules()):
        return "dynamic-int8"
    return as_format(next(p.dtype for p in model.parameters() if p.is_floating_point()))


def candidate_formats(role: str, device: str = "cpu") -> tuple[str, ...]:
    """The formats a profile measures for ``role`` on ``device``: target dtypes CPU bf16 and fp32, CUDA bf16
    (where supported) and fp16; draft formats add bitsandbytes 8-bit / 4-bit and, on CPU, dynamic int8."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: use 'target' or 'draft'")
    cuda = str(device).startswith("cuda")
    if cuda:
        dense = ("bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp16",)
    else:
        dense = ("bf16", "fp32")
    if role == "target":
        return dense
    return dense + ("8bit", "4bit") + (() if cuda else ("dynamic-int8",))


# -- keys -----------------------------------------------------------------------------------------------------------
def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_fingerprint(config) -> str:
    """A hash of the config fields that change what a forward costs (sizes, layer count and kinds, attention
    and MLP shapes, vocabulary, activation), not ids, numerics or bookkeeping."""
    fields = {k: v for k, v in sorted(_text_config(config).to_dict().items())
              if not k.startswith("_") and k not in _IGNORED_CONFIG_KEYS and not k.endswith(("token_id", "token_ids"))}
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DeviceIdentity:
    """Where a measurement holds: ``kind`` "cpu" / "cuda" (or "given" for numbers fed in), ``name`` (CPU model or
    GPU name), ``flags`` (the CPU's ``PROFILE_CPU_FLAGS`` present, or the GPU's compute capability) and the
    torch CPU ``threads``."""

    kind: str
    name: str
    flags: tuple[str, ...] = ()
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda", "given"):
            raise ValueError(f"DeviceIdentity.kind={self.kind!r}: use 'cpu', 'cuda' or 'given'")
        object.__setattr__(self, "flags", tuple(self.flags))

    @classmethod
    def here(cls, device: str = "cpu") -> "DeviceIdentity":
        device = resolve_device(device)
        if device.startswith("cuda"):
            index = torch.device(device).index or 0
            major, minor = torch.cuda.get_device_capability(index)
            return cls("cuda", torch.cuda.get_device_name(index), (f"sm_{major}{minor}",), torch.get_num_threads())
        from ..harness.machine import cpu_model  # the machine record's own CPU name (harness imports models)

        flags = cpu_flags()
        return cls("cpu", cpu_model(), tuple(f for f in PROFILE_CPU_FLAGS if f in flags), torch.get_num_threads())

    @property
    def label(self) -> str:
        """Short: "this CPU (amx_bf16)", "this CPU (avx2)", "this GPU (NVIDIA H200)", "the given device"."""
        if self.kind == "cuda":
            return f"this GPU ({self.name})"
        if self.kind == "given":
            return "the given device"
        best = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in self.flags), None)
        return f"this CPU ({best})" if best else "this CPU"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "flags": list(self.flags), "threads": self.threads}

    @classmethod
    def from_dict(cls, data: Mapping) -> "DeviceIdentity":
        return cls(str(data["kind"]), str(data["name"]), tuple(data.get("flags", ())), data.get("threads"))


@dataclass(frozen=True)
class ProfileKey:
    """What one cached measurement is valid for; any change is a new measurement."""

    role: str
    format: str
    model: str
    device: DeviceIdentity
    torch_version: str
    schema: str = SCHEMA
    sizes: tuple[int, ...] = ()  # the sizes measured; () = the role's (``role_sizes``)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"ProfileKey.role={self.role!r}: use 'target' or 'draft'")
        object.__setattr__(self, "format", as_format(self.format))
        object.__setattr__(self, "sizes", tuple(self.sizes) or role_sizes(self.role))

    def to_dict(self) -> dict:
        return {"schema": self.schema, "role": self.role, "format": self.format, "model": self.model,
                "device": self.device.to_dict(), "torch": self.torch_version, "sizes": list(self.sizes)}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:20]

    def path(self, cache_dir=None) -> Path:
        return resolve_cache_dir(cache_dir) / "profiles" / f"{self.role}-{self.format}-{self.digest}.json"


# -- measured costs -------------------------------------------------------------------------------------------------
def _finite_positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return value


@dataclass(frozen=True)
class FormatCost:
    """What one format costs here.

    ``step``: ((n, seconds), ...) ascending, t(n) over a cached prefix of ``context_tokens`` (a draft format: a
    step over n rows); ``prefill_tokens`` / ``prefill_s``: one forward over a prompt of that length into an
    empty cache (0 / None: not measured); ``footprint_bytes``: the real model's weights in this format;
    ``method``: "proxy" (scaled from 1- and 2-layer proxies), "real" (the model itself) or "given".
    """

    format: str
    step: tuple[tuple[int, float], ...]
    prefill_tokens: int = 0
    prefill_s: float | None = None
    footprint_bytes: int | None = None
    method: str = "given"
    context_tokens: int = CONTEXT_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", as_format(self.format))
        items = self.step.items() if isinstance(self.step, Mapping) else self.step
        step = tuple(sorted((int(n), _finite_positive(f"t({n})", s)) for n, s in items))
        if not step or step[0][0] != 1 or len({n for n, _ in step}) != len(step):
            raise ValueError(f"FormatCost.step must hold t(1) and distinct sizes >= 1, got {step!r}")
        object.__setattr__(self, "step", step)
        if self.method not in ("proxy", "real", "given"):
            raise ValueError(f"FormatCost.method={self.method!r}: use 'proxy', 'real' or 'given'")
        if (self.prefill_s is None) != (self.prefill_tokens == 0):
            raise ValueError("FormatCost: prefill_tokens and prefill_s go together (0 and None: not measured)")
        if self.prefill_s is not None:
            object.__setattr__(self, "prefill_s", _finite_positive("prefill_s", self.prefill_s))
            if self.prefill_tokens < 1:
                raise ValueError(f"FormatCost.prefill_tokens must be >= 1, got {self.prefill_tokens}")
        if self.footprint_bytes is not None and self.footprint_bytes < 0:
            raise ValueError(f"FormatCost.footprint_bytes must be >= 0, got {self.footprint_bytes}")

    @property
    def table(self) -> dict[int, float]:
        return dict(self.step)

    @property
    def t1(self) -> float:
        return self.step[0][1]

    def cost(self) -> ForwardCost:
        return ForwardCost.from_table(self.table)

    def to_dict(self) -> dict:
        return {"format": self.format, "step": {str(n): s for n, s in self.step}, "prefill_tokens": self.prefill_tokens,
                "prefill_s": self.prefill_s, "footprint_bytes": self.footprint_bytes, "method": self.method,
                "context_tokens": self.context_tokens}

    @classmethod
    def from_dict(cls, data: Mapping) -> "FormatCost":
        return cls(format=data["format"], step={int(n): float(s) for n, s in data["step"].items()},
                   prefill_tokens=int(data.get("prefill_tokens") or 0), prefill_s=data.get("prefill_s"),
                   footprint_bytes=data.get("footprint_bytes"), method=data.get("method", "given"),
                   context_tokens=int(data.get("context_tokens", CONTEXT_TOKENS)))


@dataclass(frozen=True)
class HardwareProfile:
    """Measured costs of a target (per dtype) and a draft (per format) on one device.

    ``target`` / ``draft``: one ``FormatCost`` per measured format; ``target_model`` / ``draft_model``: the
    fingerprints they were measured for (None: given numbers, any model); ``notes``: formats that could not be
    measured and why.
    """

    device: DeviceIdentity
    torch_version: str
    target: tuple[FormatCost, ...] = ()
    draft: tuple[FormatCost, ...] = ()
    target_model: str | None = None
    draft_model: str | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for role in ROLES:
            entries = tuple(getattr(self, role))
            formats = [e.format for e in entries]
            if len(set(formats)) != len(formats):
                raise ValueError(f"HardwareProfile.{role} holds a format twice: {formats}")
            if role == "target" and any(f not in FORMAT_DTYPES for f in formats):
                raise ValueError(f"HardwareProfile.target holds dtypes only ({', '.join(FORMAT_DTYPES)}): {formats}")
            object.__setattr__(self, role, entries)
        object.__setattr__(self, "notes", tuple(self.notes))

    @classmethod
    def from_numbers(cls, target: Mapping[str, Mapping[int, float]] | None = None, *,
                     prefill_per_token: Mapping[str, float] | None = None,
                     draft: Mapping[str, float | Mapping[int, float]] | None = None,
                     footprints: Mapping[str, int] | None = None,
                     device: DeviceIdentity | None = None) -> "HardwareProfile":
        """A profile from given numbers (seconds): ``target={"bf16": {1: 0.195, 8: 0.201, ...}}``,
        ``prefill_per_token={"bf16": 0.004}``, ``draft={"4bit": 0.046}`` (one row) or ``{"4bit": {1: 0.046, 8:
        0.09}}`` (by rows), ``footprints={"bf16": 988_000_000}`` (draft formats' weight bytes, for the memory
        check)."""
        prefill_per_token, footprints = dict(prefill_per_token or {}), dict(footprints or {})
        targets = tuple(
            FormatCost(fmt, table, PREFILL_TOKENS if fmt in prefill_per_token else 0,
                       prefill_per_token[fmt] * PREFILL_TOKENS if fmt in prefill_per_token else None)
            for fmt, table in (target or {}).items())
        drafts = tuple(FormatCost(fmt, seconds if isinstance(seconds, Mapping) else {1: seconds},
                                  footprint_bytes=footprints.get(fmt))
                       for fmt, seconds in (draft or {}).items())
        return cls(device or DeviceIdentity("given", "given"), torch.__version__, targets, drafts)

    # -- lookups --------------------------------------------------------------------------------------------------
    def _entry(self, role: str, fmt: str | torch.dtype) -> FormatCost:
        fmt = as_format(fmt)
        for entry in getattr(self, role):
            if entry.format == fmt:
                return entry
        have = ", ".join(e.format for e in getattr(self, role)) or "none"
        raise KeyError(f"this profile has no {role} measurement in {fmt} (measured: {have})")

    def target_entry(self, dtype: str | torch.dtype) -> FormatCost:
        return self._entry("target", dtype)

    def draft_entry(self, fmt: str | torch.dtype) -> FormatCost:
        return self._entry("draft", fmt)

    @property
    def target_formats(self) -> tuple[str, ...]:
        return tuple(e.format for e in self.target)

    @property
    def draft_formats(self) -> tuple[str, ...]:
        return tuple(e.format for e in self.draft)

    def target_cost(self, dtype: str | torch.dtype) -> ForwardCost:
        """The target's t(n) in ``dtype`` as a ``costmodel.ForwardCost``, to seed the core's estimates."""
        return self.target_entry(dtype).cost()

    def draft_step(self, fmt: str | torch.dtype) -> float:
        """Seconds of one draft forward (one new token, one row) in format ``fmt``."""
        return self.draft_entry(fmt).t1

    def draft_steps(self, fmt: str | torch.dtype) -> dict[int, float]:
        """Seconds of one draft step over n rows in format ``fmt``, by n (what was measured)."""
        return self.draft_entry(fmt).table

    def verify_cost(self, dtype: str | torch.dtype, n: int) -> float:
        """v(n) = t(n) / t(1) in ``dtype`` (extrapolated past the largest measured n)."""
        cost = self.target_cost(dtype)
        return cost.estimate(n, extrapolate=True) / cost.estimate(1)

    def prefill_seconds(self, dtype: str | torch.dtype, prompt_tokens: int) -> float:
        """Expected seconds of the prefill of a ``prompt_tokens`` prompt: the measured seconds per prompt token
        times the length, but never below the forward over as many new tokens in the t(n) table (a short prompt
        still reads every weight once); without a prefill measurement, t(n) extrapolated."""
        entry, cost = self.target_entry(dtype), self.target_cost(dtype)
        floor = cost.estimate(min(prompt_tokens, cost.largest)) if prompt_tokens > 0 else 0.0
        if entry.prefill_s is None:
            return cost.estimate(prompt_tokens, extrapolate=True) if prompt_tokens > 0 else 0.0
        return max(floor, entry.prefill_s / entry.prefill_tokens * prompt_tokens)

    # -- JSON -----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "device": self.device.to_dict(), "torch": self.torch_version,
                "target_model": self.target_model, "draft_model": self.draft_model,
                "target": [e.to_dict() for e in self.target], "draft": [e.to_dict() for e in self.draft],
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: Mapping) -> "HardwareProfile":
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a hardware profile ({SCHEMA}): schema {data.get('schema')!r}")
        return cls(DeviceIdentity.from_dict(data["device"]), str(data["torch"]),
                   tuple(FormatCost.from_dict(e) for e in data.get("target", ())),
                   tuple(FormatCost.from_dict(e) for e in data.get("draft", ())),
                   data.get("target_model"), data.get("draft_model"), tuple(data.get("notes", ())))

    def check_model(self, role: str, config) -> None:
        """Refuse a profile measured for another model (given numbers fit any)."""
        expected = self.target_model if role == "target" else self.draft_model
        if expected is not None and expected != model_fingerprint(config):
            raise ValueError(f"this hardware profile's {role} was measured for another model (fingerprint "
                             f"{expected}, this one {model_fingerprint(config)}); measure one with get_profile()")

    # -- text -----------------------------------------------------------------------------------------------------
    def describe(self) -> str:
        """The profile as a few lines of text (``hf-specdec check`` / ``tune``)."""
        d = self.device
        threads = f", {d.threads} threads" if d.threads else ""
        lines = [f"hardware profile  {d.kind}: {d.name} ({' '.join(d.flags) or 'no relevant flags'}{threads}), "
                 f"torch {self.torch_version}"]
        if self.target:
            context = self.target[0].context_tokens
            lines.append(f"  target t(n) ms over a {context}-token cache ({self.target[0].method})")
            lines += _ms_table("n", self.target)
            prefill = [f"{e.format} {e.prefill_s / e.prefill_tokens * 1e3:.2f} ms" for e in self.target
                       if e.prefill_s is not None]
            if prefill:
                lines.append(f"  prefill per prompt token ({self.target[0].prefill_tokens}-token forward): "
                             + ", ".join(prefill))
        if self.draft:
            lines.append("  draft t(1): " + ", ".join(
                f"{e.format} {e.t1 * 1e3:.1f} ms" + (f" ({e.footprint_bytes / 1e9:.2f} GB)" if e.footprint_bytes else "")
                for e in self.draft))
            if any(len(e.step) > 1 for e in self.draft):  # what a batched draft step costs
                lines.append("  draft step ms by rows")
                lines += _ms_table("rows", self.draft)
        for note in self.notes:
            lines.append(f"  not measured: {note}")
        return "\n".join(lines)


def _ms_table(label: str, entries: Sequence[FormatCost]) -> list[str]:
    """Lines of a table of milliseconds: one column per size any entry measured, one row per format."""
    sizes = sorted({n for e in entries for n, _ in e.step})
    width = max(7, *(len(e.format) + 1 for e in entries))
    lines = [f"    {label:<{width}}" + "".join(f"{n:>8d}" for n in sizes)]
    for e in entries:
        table = e.table
        lines.append(f"    {e.format:<{width}}" + "".join(f"{table[n] * 1e3:8.1f}" if n in table else f"{'-':>8}"
                                                   for n in sizes))
    return lines


# -- measuring ------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill_seconds(model, prompt_ids: torch.LongTensor, repeats: int = 2) -> float:
    """Median seconds of one forward over ``prompt_ids`` ([1, P]) into an empty cache, logits of the last
    position only (what generation's prefill computes), after a warm-up; CUDA synchronised.

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
        kv.call_model(model, prompt_ids, cache, logits_at=1)
        _sync(device)
        if repeat:
            samples.append(time.perf_counter() - start)
        del cache
    return statistics.median(samples)


def _token_ids(length: int, vocab: int, seed: int = 0) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=generator)


def _proxy_config(config, layers: int):
    proxy = copy.deepcopy(config)
    text = _text_config(proxy)
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
    ``from_pretrained`` call with the same quantization config; dynamic int8 is applied as ``load_model`` does.
    Raises ``FormatUnavailable`` when the format cannot be built here.
    """
    from transformers import AutoModelForCausalLM

    from . import loading

    fmt = as_format(fmt)
    dense = FORMAT_DTYPES.get(fmt, torch.float32 if fmt == "dynamic-int8" else quantized_compute_dtype(device))
    if fmt == "dynamic-int8" and (str(device) != "cpu" or not dynamic_int8_available()):
        raise FormatUnavailable("torch dynamic int8 runs on CPU with a quantized engine only")
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
                model = loading._from_pretrained(str(workdir), dtype=dense, quantization_config=qconfig,
                                                 device_map={"": device})
        except (RuntimeError, ValueError, NotImplementedError, AssertionError) as err:
            raise FormatUnavailable(f"{type(err).__name__}: {str(err)[:160]}") from None
        model.eval()
    elif fmt == "dynamic-int8":
        quantize_dynamic_int8(model)
    return model


def one_layer_view(model):
    """The same model with its first decoder layer only, sharing every weight (no copy): the 1-layer proxy."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    view = copy.deepcopy(model, memo=shared)  # modules and config copied, tensors shared
    parent, name = decoder_layers(view)
    setattr(parent, name, torch.nn.ModuleList(list(getattr(parent, name))[:1]))
    text = _text_config(view.config)
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


def _timings(model, role: str, sizes: Sequence[int], repeats: int, context_tokens: int, prefill_tokens: int):
    vocab = int(model.get_input_embeddings().weight.shape[0])
    with _quiet_bitsandbytes():
        steps = forward_times(model, _token_ids(context_tokens, vocab), sizes, repeats)
        prefill = (prefill_seconds(model, _token_ids(prefill_tokens, vocab, seed=1), max(1, repeats - 1))
                   if role == "target" and prefill_tokens else None)
    return steps, prefill, footprint_bytes(model)


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
                   prefill_tokens: int = PREFILL_TOKENS) -> FormatCost:
    """Measure one format by proxies (see the module docstring): t(n) (a target: ``sizes``, default
    ``TARGET_SIZES``; a draft: n = 1) and, for a target, the prefill; scaled to the real layer count.

    The 2-layer and 1-layer proxies are timed in alternating rounds (``forward_times`` medians), at least
    ``ROUNDS`` and up to ``MAX_ROUNDS`` until two rounds agree; each time is the fastest round's (interference
    from other processes only ever adds time).

    bitsandbytes 8-bit (LLM.int8) is the exception: its matmul splits off the activation columns above its
    outlier threshold, which real models have and random proxies do not (a 0.5B proxy measured 28 ms, the real
    model 118 ms), so it is measured on the real weights (``weights``: the directory ``from_pretrained`` reads)
    and is unavailable from a config alone.
    """
    device = resolve_device(device)
    sizes = tuple(sizes or role_sizes(role))
    if as_format(fmt) == "8bit":
        return _measure_real_8bit(weights, role, device, sizes, repeats, context_tokens, prefill_tokens)
    layers = int(_text_config(config).num_hidden_layers)
    rounds: dict[int, list] = {2: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="hf_specdec_proxy_") as workdir:
        try:
            proxies = {2: build_proxy(config, fmt, device, 2, workdir)}
            proxies[1] = one_layer_view(proxies[2])
            for done in range(1, MAX_ROUNDS + 1):
                for count in (2, 1):
                    rounds[count].append(_timings(proxies[count], role, sizes, repeats, context_tokens,
                                                  prefill_tokens))
                scaled = [_scaled(one[0][1], two[0][1], layers) for one, two in zip(rounds[1], rounds[2])]
                if done >= ROUNDS and _agreeing(scaled):
                    break
        except (RuntimeError, ValueError, NotImplementedError, AssertionError) as err:
            if isinstance(err, FormatUnavailable):
                raise
            raise FormatUnavailable(f"{type(err).__name__}: {str(err)[:160]}") from None
        finally:
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    fastest = {count: {n: min(r[0][n] for r in rounds[count]) for n in sizes} for count in (1, 2)}
    step = {n: _scaled(fastest[1][n], fastest[2][n], layers) for n in sizes}
    prefill = None
    if rounds[1][0][1] is not None:
        prefill = _scaled(min(r[1] for r in rounds[1]), min(r[1] for r in rounds[2]), layers)
    footprint = int(_scaled(rounds[1][0][2], rounds[2][0][2], layers))
    return FormatCost(fmt, step, prefill_tokens if prefill is not None else 0, prefill, footprint, "proxy",
                      context_tokens)


def measure_model(model, role: str = "target", *, sizes: Sequence[int] | None = None, repeats: int = REPEATS,
                  context_tokens: int = CONTEXT_TOKENS, prefill_tokens: int = PREFILL_TOKENS,
                  rounds: int = ROUNDS) -> FormatCost:
    """The same measurement on a loaded model itself (``method="real"``; the fastest of ``rounds`` rounds): to
    validate the proxies, for formats whose cost depends on the weights (8-bit), or for any loaded model."""
    sizes = tuple(sizes or role_sizes(role))
    samples = [_timings(model, role, sizes, repeats, context_tokens, prefill_tokens) for _ in range(max(1, rounds))]
    steps = {n: min(s[0][n] for s in samples) for n in sizes}
    prefill = None if samples[0][1] is None else min(s[1] for s in samples)
    return FormatCost(model_format(model), steps, prefill_tokens if prefill is not None else 0, prefill,
                      samples[0][2], "real", context_tokens)


def _measure_real_8bit(weights: str | None, role: str, device: str, sizes, repeats: int, context_tokens: int,
                       prefill_tokens: int) -> FormatCost:
    from . import loading

    if weights is None:
        raise FormatUnavailable("bitsandbytes 8-bit costs depend on the real activations' outliers: measured on the "
                                "model's weights only (give a reference, not a config)")
    try:
        qconfig = quantization_config("8bit")
    except ImportError as err:
        raise FormatUnavailable(str(err)) from None
    try:
        with _quiet_bitsandbytes():
            model = loading._from_pretrained(str(weights), dtype=quantized_compute_dtype(device),
                                             quantization_config=qconfig, device_map={"": device}).eval()
            return measure_model(model, role, sizes=sizes, repeats=repeats, context_tokens=context_tokens,
                                 prefill_tokens=prefill_tokens)
    except (RuntimeError, ValueError, NotImplementedError, AssertionError, OSError) as err:
        raise FormatUnavailable(f"{type(err).__name__}: {str(err)[:160]}") from None


# -- the cache ------------------------------------------------------------------------------------------------------
Measurer = Callable[..., FormatCost]  # (config, role, format, device, weights) -> FormatCost


def read_entry(key: ProfileKey, cache_dir=None) -> FormatCost | None:
    """The cached measurement for ``key``, or None (absent, unreadable, or written for another key)."""
    path = key.path(cache_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return None  # unreadable: measured again and rewritten
    if not isinstance(data, dict) or data.get("key") != key.to_dict():
        return None
    try:
        return FormatCost.from_dict(data["cost"])
    except (KeyError, TypeError, ValueError):
        return None


def write_entry(key: ProfileKey, cost: FormatCost, cache_dir=None, seconds: float | None = None) -> Path:
    """Store one measurement (written to a temporary name, then renamed: never half a file)."""
    path = key.path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"key": key.to_dict(), "cost": cost.to_dict(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "measure_seconds": seconds}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def config_of(model_or_ref, *, cache_dir=None, progress: bool = True):
    """``(config, weights)`` of a config, a model (its ``.config``) or a reference (``load_model``'s kinds, or a
    ``ResolvedRef``); ``weights``: the directory ``from_pretrained`` loads the weights from (None without one, and
    for a GGUF file, which bitsandbytes cannot quantize)."""
    from transformers import PretrainedConfig

    from .loading import ResolvedRef, load_config, resolve_reference

    if isinstance(model_or_ref, PretrainedConfig):
        return model_or_ref, None
    if isinstance(model_or_ref, torch.nn.Module):
        return model_or_ref.config, None
    resolved = model_or_ref if isinstance(model_or_ref, ResolvedRef) else \
        resolve_reference(str(model_or_ref), cache_dir=cache_dir, progress=progress)
    return load_config(resolved), (None if resolved.gguf_file else resolved.path)


def get_profile(target=None, draft=None, *, device: str = "cpu", cache_dir=None, refresh: bool = False,
                cached_only: bool = False, target_formats: Iterable[str] | None = None,
                draft_formats: Iterable[str] | None = None, measurer: Measurer | None = None,
                log: Callable[[str], None] | None = None) -> HardwareProfile:
    """The hardware profile of a target and/or a draft (configs, models, references or resolved references) on
    ``device``.

    Each (role, format) comes from the cache when its key matches, else it is measured (``measurer``, default
    :func:`measure_format`) and cached. ``refresh``: measure everything again; ``cached_only``: never measure
    (what is not cached is left out). Formats that cannot be measured here are left out with a note.
    """
    device = resolve_device(device)
    measurer = measurer or measure_format
    log = log or (lambda msg: None)
    identity = DeviceIdentity.here(device)
    entries: dict[str, list[FormatCost]] = {"target": [], "draft": []}
    fingerprints: dict[str, str | None] = {"target": None, "draft": None}
    notes: list[str] = []
    for role, ref, formats in (("target", target, target_formats), ("draft", draft, draft_formats)):
        if ref is None:
            continue
        config, weights = config_of(ref, cache_dir=cache_dir)
        fingerprints[role] = fingerprint = model_fingerprint(config)
        for fmt in (as_format(f) for f in (formats or candidate_formats(role, device))):
            key = ProfileKey(role, fmt, fingerprint, identity, torch.__version__)
            cost = None if refresh else read_entry(key, cache_dir)
            if cost is None and not cached_only:
                log(f"measuring the {role} in {fmt} on {identity.label} (once; cached in {key.path(cache_dir)})")
                start = time.perf_counter()
                try:
                    cost = measurer(config, role, fmt, device, weights)
                except FormatUnavailable as err:
                    notes.append(f"{role} {fmt}: {err}")
                    continue
                write_entry(key, cost, cache_dir, time.perf_counter() - start)
            if cost is not None:
                entries[role].append(cost)
    return HardwareProfile(identity, torch.__version__, tuple(entries["target"]), tuple(entries["draft"]),
                           fingerprints["target"], fingerprints["draft"], tuple(notes))


def cached_costs(target, draft=None, *, cache_dir=None) -> tuple[dict[int, float] | None, dict[int, float] | None]:
    """For the decoding core: the cached t(n) table of a loaded ``target`` in its format and the cached draft step
    by rows of a loaded ``draft`` in its format, on the target's device, or None for what is not cached. Never
    measures, so it costs a few file reads at the start of a call:

        forward_seconds, draft_step_seconds = cached_costs(model, draft)  # {n: s}, {rows: s}
        model.speculative_memory.seed(draft, forward_seconds, draft_step_seconds)
    """
    device = str(next(target.parameters()).device)
    target_format = model_format(target)
    draft_formats = [model_format(draft)] if draft is not None else None
    profile = get_profile(target, draft, device=device, cache_dir=cache_dir, cached_only=True,
                          target_formats=[target_format] if target_format in FORMAT_DTYPES else [],
                          draft_formats=draft_formats)
    forward = profile.target[0].table if profile.target else None
    steps = profile.draft[0].table if profile.draft else None
    return forward, steps


def read_profile_file(path: str | os.PathLike) -> HardwareProfile:
    """A profile from a JSON file written by ``hf-specdec tune --json`` (or ``HardwareProfile.to_dict``)."""
    data = json.loads(Path(path).read_text())
    return HardwareProfile.from_dict(data.get("profile", data) if isinstance(data, dict) else data)


# -- choosing -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The call a choice is made for: ``prompt_tokens`` (256) and ``new_tokens`` (128), and for speculative
    estimates the per-token chance a draft token is accepted (``acceptance``, 0.7: what the Qwen2.5-Coder
    0.5B/1.5B pair measures on code, ``hf-specdec check``) up to ``max_draft_tokens`` per round (8)."""

    prompt_tokens: int = 256
    new_tokens: int = 128
    acceptance: float = 0.7
    max_draft_tokens: int = 8

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.new_tokens < 1:
            raise ValueError(f"Workload: prompt_tokens must be >= 0 and new_tokens >= 1, got {self.prompt_tokens}, "
                             f"{self.new_tokens}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"Workload.acceptance must be in [0, 1], got {self.acceptance}")
        if not 0 <= self.max_draft_tokens <= 64:
            raise ValueError(f"Workload.max_draft_tokens must be in [0, 64], got {self.max_draft_tokens}")


@dataclass(frozen=True)
class Choice:
    """A choice and why: ``kind`` "dtype" (the target's) or "draft_format"; ``value`` the format chosen;
    ``seconds``: ((candidate, seconds), ...), the expected end-to-end seconds per target dtype, or the draft
    step per draft format; ``draft_tokens``: the draft length per round the estimate speculates with (0: plain
    decoding expected; dtype only); ``split``: a prefill/decode dtype split that would win, with its figure."""

    kind: str
    value: str
    why: str
    seconds: tuple[tuple[str, float], ...] = ()
    draft_tokens: int = 0
    split: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("dtype", "draft_format"):
            raise ValueError(f"Choice.kind={self.kind!r}: use 'dtype' or 'draft_format'")
        object.__setattr__(self, "value", as_format(self.value))
        object.__setattr__(self, "seconds", tuple((as_format(f), float(s)) for f, s in self.seconds))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "why": self.why, "seconds": dict(self.seconds),
                "draft_tokens": self.draft_tokens, "split": self.split}


@dataclass(frozen=True)
class DecodeEstimate:
    """Expected seconds of one call in one target dtype: prefill, then decoding at the best draft length
    (``draft_tokens``, 0 = plain steps)."""

    prefill_s: float
    decode_s: float
    draft_tokens: int

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def estimate_call(profile: HardwareProfile, dtype: str, workload: Workload = Workload(),
                  draft_step: float | None = None) -> DecodeEstimate:
    """Prefill plus decoding ``new_tokens - 1`` tokens (the prefill emits the first) at the best expected rate:
    plain steps, or rounds of k draft steps and one verify forward over k + 1 tokens, k <= max_draft_tokens,
    each draft token accepted with ``workload.acceptance`` (``costmodel.best_count``, the policies' arithmetic).
    ``draft_step``: seconds of one draft step; None: no draft, plain steps."""
    cost = profile.target_cost(dtype)
    step = cost.estimate(1)

    def round_seconds(k: int) -> float:
        return step if k == 0 else k * draft_step + cost.estimate(k + 1, extrapolate=True)

    k = 0
    gains = prefix_gains([workload.acceptance] * workload.max_draft_tokens)
    if draft_step is not None and workload.max_draft_tokens:
        k = best_count(gains, round_seconds)
    rate = expected_tokens(gains[:k]) / round_seconds(k)
    return DecodeEstimate(profile.prefill_seconds(dtype, workload.prompt_tokens), (workload.new_tokens - 1) / rate, k)


def _secs(seconds: float) -> str:
    """Seconds for a why: "12.3 s", "0.51 s", "8.2 ms"."""
    return f"{seconds:.1f} s" if seconds >= 10 else f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _fastest_draft_step(profile: HardwareProfile, draft_format: str | None) -> tuple[str | None, float | None]:
    if draft_format is not None:
        return as_format(draft_format), profile.draft_step(draft_format)
    if not profile.draft:
        return None, None
    best = min(profile.draft, key=lambda e: e.t1)
    return best.format, best.t1


def speculation_verdict(profile: HardwareProfile, dtype: str, workload: Workload = Workload(),
                        draft_step: float | None = None) -> tuple[float, bool]:
    """v(8) in ``dtype`` and whether guesses can pay there at the workload's acceptance (with this draft step;
    without a draft, draft-free guesses such as lookahead's and prompt lookup's, which cost no draft step)."""
    v = profile.verify_cost(dtype, VERIFY_PROBE)
    probe = workload if workload.max_draft_tokens else dataclasses.replace(workload, max_draft_tokens=VERIFY_PROBE)
    estimate = estimate_call(profile, dtype, probe, 0.0 if draft_step is None else draft_step)
    return v, estimate.draft_tokens > 0


def choose_dtype(profile: HardwareProfile, workload: Workload = Workload(), *, draft_format: str | None = None,
                 candidates: Iterable[str] | None = None) -> Choice:
    """The target dtype with the lowest expected end-to-end time of ``workload`` (prefill included), speculating
    with the profile's draft (``draft_format``, default its fastest format) where that is faster than plain
    steps. Reports in ``split`` when prefilling in one dtype and decoding in another would save >= 5%."""
    formats = [as_format(f) for f in (candidates or profile.target_formats) if as_format(f) in profile.target_formats]
    if not formats:
        raise ValueError(f"the profile has no target measurement to choose from (measured: "
                         f"{', '.join(profile.target_formats) or 'none'})")
    draft_name, draft_step = _fastest_draft_step(profile, draft_format)
    estimates = {f: estimate_call(profile, f, workload, draft_step) for f in formats}
    best = min(formats, key=lambda f: (estimates[f].total_s, formats.index(f)))
    chosen = estimates[best]
    label = profile.device.label
    v, can_pay = speculation_verdict(profile, best, workload, draft_step)
    guesses = "speculation can pay" if can_pay else "speculation off"
    if draft_step is None:
        guesses += " (draft-free guesses; no draft profiled)" if can_pay else ""
    per_round = (f", {chosen.draft_tokens} {draft_name} draft token{'s' if chosen.draft_tokens > 1 else ''} per round "
                 f"at acceptance {workload.acceptance:g}" if chosen.draft_tokens else ", plain steps")
    parts = [f"{best}: expected {_secs(chosen.total_s)} for a {workload.prompt_tokens}-token prompt and "
             f"{workload.new_tokens} new tokens (prefill {_secs(chosen.prefill_s)} + decode {_secs(chosen.decode_s)}"
             f"{per_round})"]
    others = [f"{f} {_secs(estimates[f].total_s)} (prefill {_secs(estimates[f].prefill_s)} + decode "
              f"{_secs(estimates[f].decode_s)})" for f in formats if f != best]
    if others:
        parts.append("vs " + ", ".join(others))
    parts.append(f"verifying {VERIFY_PROBE} tokens costs {v:.2f} steps in {best} on {label}: {guesses}")
    split = None
    if len(formats) > 1:
        pairs = [(a, b) for a in formats for b in formats if a != b]
        a, b = min(pairs, key=lambda p: estimates[p[0]].prefill_s + estimates[p[1]].decode_s)
        seconds = estimates[a].prefill_s + estimates[b].decode_s
        if seconds <= chosen.total_s * (1 - SPLIT_MIN_GAIN):
            split = (f"prefill in {a} ({_secs(estimates[a].prefill_s)}) and decode in {b} "
                     f"({_secs(estimates[b].decode_s)}) would take {_secs(seconds)}, {1 - seconds / chosen.total_s:.0%}"
                     f" less than {best} alone ({_secs(chosen.total_s)}); not done: it needs the weights in both dtypes "
                     f"and the KV cache converted")
    return Choice("dtype", best, "; ".join(parts), tuple((f, estimates[f].total_s) for f in formats),
                  chosen.draft_tokens, split)


def choose_draft_format(profile: HardwareProfile, *, memory_bytes: int | None = None,
                        target_dtype: str | None = None, candidates: Iterable[str] | None = None) -> Choice:
    """The fastest measured draft format (``draft_step``) among those whose weights fit in ``memory_bytes``
    (times ``MEMORY_MARGIN``; None: no check). Formats within ``DRAFT_TIE`` of the fastest count as as fast and
    the earlier in ``FORMATS`` wins (full precision first, then less memory), so 4-bit is chosen only when it
    measures fastest or when nothing else fits. With ``target_dtype``, the why gives c = t_draft / t_target(1)."""
    names = [as_format(f) for f in (candidates or profile.draft_formats)]
    entries = [e for e in profile.draft if e.format in names]
    if not entries:
        raise ValueError(f"the profile has no draft measurement to choose from (measured: "
                         f"{', '.join(profile.draft_formats) or 'none'})")

    def fits(e: FormatCost) -> bool:
        return memory_bytes is None or e.footprint_bytes is None or e.footprint_bytes * MEMORY_MARGIN <= memory_bytes

    fitting = [e for e in entries if fits(e)]
    steps = ", ".join(f"{e.format} {e.t1 * 1e3:.1f} ms" for e in sorted(entries, key=lambda e: e.t1))
    free = f"{memory_bytes / 1e9:.2f} GB free" if memory_bytes is not None else ""
    if not fitting:
        pick = next((e for e in entries if e.format == "4bit"), min(entries, key=lambda e: e.footprint_bytes or 0))
        why = (f"{pick.format}: no measured format fits in {free} with a {MEMORY_MARGIN:g}x margin; the smallest "
               f"is tried (draft steps: {steps})")
    else:
        fastest = min(e.t1 for e in fitting)
        tied = [e for e in fitting if e.t1 <= fastest * (1 + DRAFT_TIE)]
        pick = min(tied, key=lambda e: FORMATS.index(e.format))
        left_out = [e.format for e in entries if not fits(e)]
        why = (f"{pick.format}: one draft step {pick.t1 * 1e3:.1f} ms, "
               + ("the fastest here" if pick.t1 == fastest else f"within {DRAFT_TIE:.0%} of the fastest and the "
                  "more precise") + f" (draft steps: {steps})")
        if left_out:
            why += f"; {', '.join(left_out)} would not fit in {free}"
    if target_dtype is not None and as_format(target_dtype) in profile.target_formats:
        t1 = profile.target_entry(target_dtype).t1
        why += f"; c = {pick.t1 / t1:.2f} against the {as_format(target_dtype)} target step ({t1 * 1e3:.1f} ms)"
    return Choice("draft_format", pick.format, why, tuple((e.format, e.t1) for e in entries))


def log_to_stderr(msg: str) -> None:
    print(f"[hf_specdec] {msg}", file=sys.stderr, flush=True)
