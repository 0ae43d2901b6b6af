"""A hardware profile: what each format of a target and a draft costs on this device, and what it is valid for.

The data (measured by ``measure``, kept by ``store``, read by ``choose``):

- ``FormatCost``: one format's t(n) (a target: n new tokens on top of a cached ``CONTEXT_TOKENS`` prefix; a
  draft: one step over n rows), its prefill (a target: one forward over a ``PREFILL_TOKENS`` prompt), its prompt
  read (a draft: ``{tokens: seconds}`` of its prefill at a few prompt lengths, a fixed part plus a per-token
  part), and the real model's weight bytes;
- ``HardwareProfile``: the ``FormatCost`` of every measured format, per role, with lookups for the decoding core
  (``target_cost(dtype) -> ForwardCost``, ``draft_steps(format) -> {rows: seconds}``, ``draft_read(format) ->
  {tokens: seconds}``) and its text (``describe``);
- the keys: ``model_fingerprint`` (the config fields that change what a forward costs), ``DeviceIdentity``
  (CPU model, relevant flags and torch threads, or GPU name and compute capability) and ``ProfileKey`` (role,
  format, fingerprint, device, torch version): a changed key is a new measurement.

    profile = HardwareProfile.from_numbers({"bf16": {1: 0.195, 8: 0.201}}, prefill_per_token={"bf16": 0.002},
                                           draft={"4bit": 0.046})
    profile.verify_cost("bf16", 8)        # 1.03: verifying 8 tokens costs 1.03 plain steps
    profile.prefill_seconds("bf16", 256)  # 0.512

Nothing here measures or touches the disk (``ProfileKey.path`` only names the cache file).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ..costmodel import Bound, ForwardCost, RoundCost
from .bundles import resolve_cache_dir
from .formats import ROLES, TARGET_FORMATS, as_format, role_sizes
from .hardware import cpu_flags, cpu_model, resolve_device

SCHEMA = "hf_specdec.profile/1"
CONTEXT_TOKENS = 100
PREFILL_TOKENS = 256
METHODS = ("proxy", "real", "given", "probe")  # how a FormatCost was measured (FormatCost.method)
# how a draft step is timed, part of every draft key: through the output layer it drafts with (a narrowed one,
# measure.drafting_head); entries timed through the whole output layer (no tag) are measured again
DRAFT_STEP = "drafting-head"
# flags that decide what runs fast on a CPU: native bf16 / fp16 / int8 dot products and tiles
PROFILE_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16",
                     "amx_int8", "amx_fp16")
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


# -- keys -----------------------------------------------------------------------------------------------------------
def text_config(config):
    """The text part of a config (a multimodal config holds it inside), or the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_fingerprint(config) -> str:
    """A hash of the config fields that change what a forward costs (sizes, layer count and kinds, attention
    and MLP shapes, vocabulary, activation), not ids, numerics or bookkeeping."""
    fields = {k: v for k, v in sorted(text_config(config).to_dict().items())
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
        found = {"schema": self.schema, "role": self.role, "format": self.format, "model": self.model,
                 "device": self.device.to_dict(), "torch": self.torch_version, "sizes": list(self.sizes)}
        return found if self.role == "target" else {**found, "step": DRAFT_STEP}

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


def _seconds_table(name: str, items) -> tuple[tuple[int, float], ...]:
    """((size, seconds), ...) ascending from a mapping or pairs, every size distinct and >= 1, every time
    positive."""
    pairs = items.items() if isinstance(items, Mapping) else items
    table = tuple(sorted((int(n), _finite_positive(f"{name}({n})", s)) for n, s in pairs))
    if any(n < 1 for n, _ in table) or len({n for n, _ in table}) != len(table):
        raise ValueError(f"FormatCost.{name} must hold distinct sizes >= 1, got {table!r}")
    return table


def _json_table(name: str, value) -> dict[int, float]:
    """A ``{size: seconds}`` table as JSON holds it (string keys); ValueError for anything else (a damaged file)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object of seconds by size, got {type(value).__name__}")
    return {int(n): float(s) for n, s in value.items()}


def linear_parts(table: Mapping[int, float]) -> tuple[float, float]:
    """``(fixed_s, per_token_s)``: the least-squares line through ``{tokens: seconds}`` (per token never below 0,
    fixed never below 0). A prompt read is priced this way: a fixed part (launching every layer once, reading the
    weights) plus a part per prompt token.

        linear_parts({16: 0.012, 64: 0.018, 256: 0.042})   # (0.01, 0.000125)
    """
    if not table:
        raise ValueError("linear_parts: an empty table")
    n = len(table)
    mean_x, mean_y = sum(table) / n, sum(table.values()) / n
    spread = sum((x - mean_x) ** 2 for x in table)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in table.items()) / spread) if spread else 0.0
    return max(0.0, mean_y - slope * mean_x), slope


@dataclass(frozen=True)
class Samples:
    """What one measurement saw besides its table: ``rounds``, each size's t(n) in every round it was timed
    (((n, (seconds, ...)), ...); the table keeps the fastest), and ``drift``, the first size timed at the start of
    the measurement and once more at its end ((start, end) seconds of the same forward; None: not timed again)."""

    rounds: tuple[tuple[int, tuple[float, ...]], ...] = ()
    drift: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounds", tuple((int(n), tuple(float(s) for s in seconds))
                                                 for n, seconds in sorted(dict(self.rounds).items())))
        if self.drift is not None:
            object.__setattr__(self, "drift", (float(self.drift[0]), float(self.drift[1])))


@dataclass(frozen=True)
class FormatCost:
    """What one format costs here.

    ``step``: ((n, seconds), ...) ascending, t(n) over a cached prefix of ``context_tokens`` (a draft format: a
    step over n rows); ``prefill_tokens`` / ``prefill_s``: one forward over a prompt of that length into an
    empty cache (0 / None: not measured); ``footprint_bytes``: the real model's weights in this format;
    ``method``: "proxy" (scaled from 1- and 2-layer proxies), "real" (the model itself), "given", or "probe"
    (t(1) alone, from a short timing of the proxies: the format was slower than one measured before it and was not
    measured further, ``measure.measure_format(slower_than=)``);
    ``prompt_read`` (a draft format): ((tokens, seconds), ...), its prefill over prompts of those lengths, warm
    (() : not measured, as in cache files written before it was measured);
    ``samples``: what the measurement saw besides its table (``Samples``: each round's t(n), the first size timed
    again at the end), for ``check_cost``; None for numbers given or read from the cache. Not part of the value
    (equality, ``to_dict``): it judges a measurement once, before it is cached.
    """

    format: str
    step: tuple[tuple[int, float], ...]
    prefill_tokens: int = 0
    prefill_s: float | None = None
    footprint_bytes: int | None = None
    method: str = "given"
    context_tokens: int = CONTEXT_TOKENS
    prompt_read: tuple[tuple[int, float], ...] = ()
    samples: "Samples | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", as_format(self.format))
        step = _seconds_table("t", self.step)
        if not step or step[0][0] != 1:
            raise ValueError(f"FormatCost.step must hold t(1) and distinct sizes >= 1, got {step!r}")
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "prompt_read", _seconds_table("prompt_read", self.prompt_read))
        if self.method not in METHODS:
            raise ValueError(f"FormatCost.method={self.method!r}: use one of {', '.join(METHODS)}")
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

    @property
    def read_table(self) -> dict[int, float]:
        """The prompt read, ``{tokens: seconds}`` (empty: not measured)."""
        return dict(self.prompt_read)

    def cost(self) -> ForwardCost:
        return ForwardCost.from_table(self.table)

    def to_dict(self) -> dict:
        return {"format": self.format, "step": {str(n): s for n, s in self.step}, "prefill_tokens": self.prefill_tokens,
                "prefill_s": self.prefill_s, "footprint_bytes": self.footprint_bytes, "method": self.method,
                "context_tokens": self.context_tokens, "prompt_read": {str(n): s for n, s in self.prompt_read}}

    @classmethod
    def from_dict(cls, data: Mapping) -> "FormatCost":
        """The inverse of ``to_dict``; a missing ``prompt_read`` is "not measured". Raises ValueError for anything
        that is not such a dict (a damaged or hand-edited cache file), never another error."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a format cost must be an object, got {type(data).__name__}")
        try:
            return cls(format=data["format"], step=_json_table("step", data["step"]),
                       prefill_tokens=int(data.get("prefill_tokens") or 0), prefill_s=data.get("prefill_s"),
                       footprint_bytes=data.get("footprint_bytes"), method=data.get("method", "given"),
                       context_tokens=int(data.get("context_tokens", CONTEXT_TOKENS)),
                       prompt_read=_json_table("prompt_read", data.get("prompt_read") or {}))
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a format cost: {type(err).__name__}: {err}") from None


# -- is a measurement self-consistent? ------------------------------------------------------------------------------
class FlawKind(enum.StrEnum):
    """What makes a measurement contradict itself (``Flaw.kind``)."""

    NOT_MONOTONE = "not monotone"  # a forward over more tokens (n >= 2) measured cheaper than one over fewer
    OVER_STEPS = "over n steps"  # a forward over n tokens measured dearer than n single steps
    ROUNDS_DISAGREE = "rounds disagree"  # the two fastest rounds of one size far apart
    LOAD_DRIFT = "load drift"  # the first size timed again at the end far from its start


@dataclass(frozen=True)
class Flaw:
    """One way a measurement contradicts itself: its ``kind`` and the sentence that says where (``text``)."""

    kind: FlawKind
    text: str


@dataclass(frozen=True)
class Tolerance:
    """How far a measurement may stray from what forwards cost before it is judged wrong, as fractions.

    ``shape``: t(m) may fall below t(n), 2 <= n < m, and t(n) may exceed n t(1), by this much (proxy tables
    scale a layer's time by the layer count, so a few percent of noise in the two proxies' difference comes out
    tens of percent in t(n)); ``rounds``: the two fastest rounds of one size may differ by this much; ``drift``:
    the first size timed again at the end may differ from its start by this much, either way.

    Set from what noise looks like: the Sapphire Rapids profile of docs/models.md, sound in use, has fp32 t(12) 25%
    over t(24); on the 2-core AVX2 EPYC, the 0.5B draft's proxy rounds of t(1) came 13-38% apart and the 2-layer
    proxy's t(1) re-timed within 15% while the machine was quiet, and 2-10x apart, drifting 40% to 3x, while
    other jobs ran."""

    shape: float = 0.35
    rounds: float = 0.5
    drift: float = 0.3


@dataclass(frozen=True)
class Consistency:
    """The verdict of ``check_cost``: the ``flaws`` found (none: the measurement may be kept)."""

    flaws: tuple[Flaw, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.flaws

    @property
    def kinds(self) -> tuple[FlawKind, ...]:
        return tuple(flaw.kind for flaw in self.flaws)

    @property
    def why(self) -> str:
        """The flaws as one line ("" when there are none)."""
        return "; ".join(flaw.text for flaw in self.flaws)


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s"


def _worst_drop(table: Mapping[int, float], name: str, smallest: int, tol: float) -> Flaw | None:
    """The size whose time falls furthest below a smaller size's (from ``smallest`` up), beyond ``tol``."""
    worst, highest = None, None
    for n, seconds in sorted(table.items()):
        if n < smallest:
            continue
        if highest is not None and seconds * (1 + tol) < highest[1]:
            ratio = highest[1] / seconds
            if worst is None or ratio > worst[0]:
                worst = (ratio, n, seconds, *highest)
        if highest is None or seconds > highest[1]:
            highest = (n, seconds)
    if worst is None:
        return None
    _, n, seconds, m, above = worst
    return Flaw(FlawKind.NOT_MONOTONE, f"{name}({n}) = {_s(seconds)} is below {name}({m}) = {_s(above)}")


def check_cost(cost: FormatCost, tolerance: Tolerance = Tolerance()) -> Consistency:
    """Does a measurement agree with itself? A forward over more tokens never costs less (sizes n >= 2: a
    one-token forward runs matrix-vector products, which may cost more than a product over two rows), a forward
    over n tokens never costs more than n single steps (t(n), the prefill over its prompt, a draft's prompt
    read), and, where the measurement kept its ``Samples``, its rounds agree and the machine's load did not
    change while it ran; each within ``tolerance``. A table that breaks them was timed while other work took the
    CPU: it would price forwards the model never takes, and choose formats by the load of the moment.

    >>> check_cost(FormatCost("fp32", {1: 2.49, 2: 11.0, 8: 14.6, 12: 9.63})).why  # timed under load
    't(12) = 9.63 s is below t(8) = 14.6 s; t(2) = 11 s is over 2 single steps (4.98 s)'
    >>> check_cost(FormatCost("bf16", {1: 0.119, 32: 2.85}, 256, 124.5)).kinds
    (<FlawKind.OVER_STEPS: 'over n steps'>,)
    >>> check_cost(FormatCost("fp32", {1: 0.26, 2: 0.25, 8: 0.78, 16: 0.74}, 256, 21.5)).ok  # within noise
    True
    >>> timed = Samples(rounds={1: (0.26, 0.27), 8: (0.78, 1.9)}, drift=(0.26, 0.52))
    >>> print(check_cost(FormatCost("fp32", {1: 0.26, 8: 0.78}, samples=timed)).why)
    the two fastest rounds of t(8) disagree (0.78 s and 1.9 s); t(1) was 0.26 s at the start and 0.52 s at the end
    """
    t1, tol, flaws = cost.t1, tolerance.shape, []
    drop = _worst_drop(cost.table, "t", 2, tol)
    if drop is not None:
        flaws.append(drop)
    over = [(seconds / (n * t1), n, seconds) for n, seconds in cost.step if seconds > n * t1 * (1 + tol)]
    if over:
        _, n, seconds = max(over)
        flaws.append(Flaw(FlawKind.OVER_STEPS, f"t({n}) = {_s(seconds)} is over {n} single steps ({_s(n * t1)})"))
    tokens = cost.prefill_tokens
    if cost.prefill_s is not None and cost.prefill_s > tokens * t1 * (1 + tol):
        flaws.append(Flaw(FlawKind.OVER_STEPS, f"the prefill over {tokens} tokens ({_s(cost.prefill_s)}) is over "
                                               f"{tokens} single steps ({_s(tokens * t1)})"))
    reads = cost.read_table
    drop = _worst_drop(reads, "read", 1, tol)
    if drop is not None:
        flaws.append(drop)
    over = [(seconds / (n * t1), n, seconds) for n, seconds in reads.items() if seconds > n * t1 * (1 + tol)]
    if over:
        _, n, seconds = max(over)
        flaws.append(Flaw(FlawKind.OVER_STEPS, f"the prompt read over {n} tokens ({_s(seconds)}) is over {n} "
                                               f"single steps ({_s(n * t1)})"))
    if cost.samples is not None:
        flaws += _sample_flaws(cost.samples, tolerance)
    return Consistency(tuple(flaws))


def _sample_flaws(samples: Samples, tolerance: Tolerance) -> list[Flaw]:
    """The rounds that disagree (the worst size) and a load that drifted, as flaws."""
    flaws, spread = [], []
    for n, seconds in samples.rounds:
        if len(seconds) >= 2:
            low, high = sorted(seconds)[:2]
            if high > low * (1 + tolerance.rounds):
                spread.append((high / low, n, low, high))
    if spread:
        _, n, low, high = max(spread)
        flaws.append(Flaw(FlawKind.ROUNDS_DISAGREE, f"the two fastest rounds of t({n}) disagree ({_s(low)} and "
                                                    f"{_s(high)})"))
    if samples.drift is not None:
        start, end = samples.drift
        if not start / (1 + tolerance.drift) <= end <= start * (1 + tolerance.drift):
            first = samples.rounds[0][0] if samples.rounds else 1
            flaws.append(Flaw(FlawKind.LOAD_DRIFT, f"t({first}) was {_s(start)} at the start and {_s(end)} at the "
                                                   "end"))
    return flaws


@dataclass(frozen=True)
class HardwareProfile:
    """Measured costs of a target (per dtype) and a draft (per format) on one device.

    ``target`` / ``draft``: one ``FormatCost`` per measured format; ``target_model`` / ``draft_model``: the
    fingerprints they were measured for (None: given numbers, any model); ``notes``: formats that could not be
    measured, or were cached unverified (``store``: not self-consistent), and why.
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
            if role == "target" and any(f not in TARGET_FORMATS for f in formats):
                raise ValueError(f"HardwareProfile.target holds target formats only ({', '.join(TARGET_FORMATS)}): "
                                 f"{formats}")
            object.__setattr__(self, role, entries)
        object.__setattr__(self, "notes", tuple(self.notes))

    @classmethod
    def from_numbers(cls, target: Mapping[str, Mapping[int, float]] | None = None, *,
                     prefill_per_token: Mapping[str, float] | None = None,
                     draft: Mapping[str, float | Mapping[int, float]] | None = None,
                     footprints: Mapping[str, int] | None = None,
                     draft_read: Mapping[str, Mapping[int, float]] | None = None,
                     device: DeviceIdentity | None = None) -> "HardwareProfile":
        """A profile from given numbers (seconds): ``target={"bf16": {1: 0.195, 8: 0.201, ...}}``,
        ``prefill_per_token={"bf16": 0.004}``, ``draft={"4bit": 0.046}`` (one row) or ``{"4bit": {1: 0.046, 8:
        0.09}}`` (by rows), ``footprints={"bf16": 988_000_000}`` (draft formats' weight bytes, for the memory
        check), ``draft_read={"4bit": {16: 0.05, 256: 0.4}}`` (the draft's prompt read by prompt tokens)."""
        prefill_per_token, footprints = dict(prefill_per_token or {}), dict(footprints or {})
        draft_read = dict(draft_read or {})
        targets = tuple(
            FormatCost(fmt, table, PREFILL_TOKENS if fmt in prefill_per_token else 0,
                       prefill_per_token[fmt] * PREFILL_TOKENS if fmt in prefill_per_token else None)
            for fmt, table in (target or {}).items())
        drafts = tuple(FormatCost(fmt, seconds if isinstance(seconds, Mapping) else {1: seconds},
                                  footprint_bytes=footprints.get(fmt), prompt_read=draft_read.get(fmt, ()))
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

    def draft_read(self, fmt: str | torch.dtype) -> dict[int, float]:
        """Seconds of the draft's prompt read (its prefill) in format ``fmt`` by prompt tokens; {}: not measured."""
        return self.draft_entry(fmt).read_table

    def verify_cost(self, dtype: str | torch.dtype, n: int) -> float:
        """v(n) = t(n) / t(1) in ``dtype``: the price of a forward over n inputs (``costmodel.RoundCost``, at
        ``Bound.WORST``: extrapolated past the largest measured n) in plain steps."""
        price = RoundCost(self.target_cost(dtype))
        return price(n, Bound.WORST) / price.step()

    def prefill_seconds(self, dtype: str | torch.dtype, prompt_tokens: int) -> float:
        """Expected seconds of the prefill of a ``prompt_tokens`` prompt: the measured seconds per prompt token
        times the length, but never below the forward over as many new tokens in the t(n) table (a short prompt
        still reads every weight once); without a prefill measurement, that forward's price at ``Bound.WORST``
        (``costmodel.RoundCost``: t(n) extrapolated)."""
        entry, price = self.target_entry(dtype), RoundCost(self.target_cost(dtype))
        if prompt_tokens <= 0:
            return 0.0
        if entry.prefill_s is None:
            return price(prompt_tokens, Bound.WORST)
        per_token = entry.prefill_s / entry.prefill_tokens
        return max(price(min(prompt_tokens, price.cost.largest)), per_token * prompt_tokens)

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
                + (" (a probe: slower than another format, not measured further)" if e.method == "probe" else "")
                for e in self.draft))
            if any(len(e.step) > 1 for e in self.draft):  # what a batched draft step costs
                lines.append("  draft step ms by rows")
                lines += _ms_table("rows", self.draft)
            reads = [e for e in self.draft if e.prompt_read]
            if reads:
                lines.append("  draft prompt read ms by prompt tokens (fixed + per token)")
                lines += _ms_table("tokens", reads, "prompt_read")
                lines += [f"    {e.format}: {fixed * 1e3:.1f} ms + {per * 1e3:.3f} ms/token"
                          for e in reads for fixed, per in [linear_parts(e.read_table)]]
        for note in self.notes:
            lines.append(f"  {note}")
        return "\n".join(lines)


def _ms_table(label: str, entries: Sequence[FormatCost], field: str = "step") -> list[str]:
    """Lines of a table of milliseconds: one column per size any entry measured (in ``field``: "step" or
    "prompt_read"), one row per format."""
    sizes = sorted({n for e in entries for n, _ in getattr(e, field)})
    width = max(7, *(len(e.format) + 1 for e in entries))
    lines = [f"    {label:<{width}}" + "".join(f"{n:>8d}" for n in sizes)]
    for e in entries:
        table = dict(getattr(e, field))
        lines.append(f"    {e.format:<{width}}" + "".join(f"{table[n] * 1e3:8.1f}" if n in table else f"{'-':>8}"
                                                   for n in sizes))
    return lines

