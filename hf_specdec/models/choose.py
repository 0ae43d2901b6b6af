"""Choosing from a hardware profile: the target dtype and the draft format that ``dtype="auto"`` and
``quantize="auto"`` load, each with a human-readable why.

No rule about CPU flags says what is fast. On an AMD EPYC with AVX2 only, bf16 took the faster plain step
(memory-bound) while its multi-token forwards grew linearly (no bf16 FMA) and fp32 verified 8 tokens for ~3
steps; the 4-bit draft was the slowest draft format there; with a few-hundred-token prompt bf16's compute-bound
prefill outweighed its faster steps. So the choices are made on measured costs (``profile``):

- ``choose_dtype(profile, workload)``: the target dtype with the lowest expected end-to-end time of the call
  (``Workload``: prompt and new tokens, draft acceptance 0.7 per token), prefill included, speculating when that
  pays at the measured costs (``estimate_call``, ``speculation_verdict``); it reports when prefilling in one
  dtype and decoding in another would win. Without a workload (``load_pair``'s, before any prompt is seen) the
  calls are unknown, and one dtype can be the faster for some and much the slower for others (no bf16 units:
  bf16 steps fast and prefills slowly): the choice is the dtype whose worst call of ``TYPICAL_CALLS`` is the
  least slower than that call's fastest dtype, the promise (never slower than the fastest plain decoding)
  kept as nearly as one dtype can;
- ``choose_draft_format(profile, memory_bytes=...)``: the fastest draft format that fits.

Both return a ``Choice``. Profiles can be built from given numbers (``HardwareProfile.from_numbers``), so the
choosers are tested without measuring:

    choice = choose_dtype(HardwareProfile.from_numbers({"bf16": {1: 0.2, 8: 0.21}, "fp32": {1: 0.26, 8: 0.8}}))
    choice.value, choice.why   # "bf16", "bf16: expected ... for a 256-token prompt and 128 new tokens ..."
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..costmodel import Bound, RoundCost, best_round, prefix_gains
from .formats import FORMATS, as_format
from .profile import FormatCost, HardwareProfile

VERIFY_PROBE = 8  # the "verifying 8 tokens costs x steps" figure of a dtype's why
DRAFT_TIE = 0.05  # a draft format within 5% of the fastest counts as as fast: the earlier one in FORMATS wins
SPLIT_MIN_GAIN = 0.05  # a prefill/decode dtype split is reported when it would save at least 5%
MEMORY_MARGIN = 1.2  # a format fits when 1.2 x its weights (activations, KV cache) fit in the free memory


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


# The calls a dtype is chosen for when the caller names none: prompts of 32 to 512 tokens, 32 to 128 new tokens,
# the range first calls are measured on (docs/benchmarks.md), at its ends and middle.
TYPICAL_CALLS = tuple(Workload(prompt_tokens=prompt, new_tokens=new) for prompt in (32, 128, 512) for new in (32, 128))


class ChoiceKind(enum.StrEnum):
    """What a ``Choice`` chose (its ``kind``; ``Choice.to_dict()`` writes the value)."""

    DTYPE = "dtype"  # the target's dtype (``choose_dtype``)
    DRAFT_FORMAT = "draft_format"  # the draft's format (``choose_draft_format``)


@dataclass(frozen=True)
class Choice:
    """A choice and why: ``kind`` a ``ChoiceKind`` (its value accepted too): the target's ``DTYPE`` or the
    ``DRAFT_FORMAT``; ``value`` the format chosen;
    ``seconds``: ((candidate, seconds), ...), the expected end-to-end seconds per target dtype, or the draft
    step per draft format; ``draft_tokens``: the draft length per round the estimate speculates with (0: plain
    decoding expected; dtype only); ``split``: a prefill/decode dtype split that would win, with its figure."""

    kind: ChoiceKind
    value: str
    why: str
    seconds: tuple[tuple[str, float], ...] = ()
    draft_tokens: int = 0
    split: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in tuple(ChoiceKind):
            raise ValueError(f"Choice.kind={self.kind!r}: use one of {[kind.value for kind in ChoiceKind]}")
        object.__setattr__(self, "kind", ChoiceKind(self.kind))
        object.__setattr__(self, "value", as_format(self.value))
        object.__setattr__(self, "seconds", tuple((as_format(f), float(s)) for f, s in self.seconds))

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "value": self.value, "why": self.why, "seconds": dict(self.seconds),
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
    each draft token accepted with ``workload.acceptance`` (``costmodel.best_round``: the policy's own answer).
    ``draft_step``: seconds of one draft step; None: no draft, plain steps."""
    price = RoundCost(profile.target_cost(dtype), t_draft=draft_step)
    limit = workload.max_draft_tokens if draft_step is not None else 0
    best = best_round(price, prefix_gains([workload.acceptance] * workload.max_draft_tokens), limit, Bound.WORST)
    k, rate = best.k, best.rate
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


def worst_calls(profile: HardwareProfile, formats: Sequence[str], calls: Sequence[Workload],
                draft_step: float | None) -> dict[str, tuple[float, Workload]]:
    """Per format: its largest ratio, over ``calls``, of its expected seconds to the fastest format's for that
    call, and the call it is reached on.

    >>> from hf_specdec.models.profile import HardwareProfile
    >>> avx2 = HardwareProfile.from_numbers({"bf16": {1: 0.2, 8: 1.6}, "fp32": {1: 0.4, 8: 1.2}},
    ...                                     prefill_per_token={"bf16": 0.12, "fp32": 0.024})  # no bf16 units
    >>> worst = worst_calls(avx2, ["bf16", "fp32"], TYPICAL_CALLS, None)
    >>> {f: (round(ratio, 2), call.prompt_tokens, call.new_tokens) for f, (ratio, call) in worst.items()}
    {'bf16': (2.74, 512, 32), 'fp32': (1.78, 32, 128)}
    """
    seconds = {call: {f: estimate_call(profile, f, call, draft_step).total_s for f in formats} for call in calls}
    ratios = {f: [(seconds[call][f] / min(seconds[call].values()), call) for call in calls] for f in formats}
    return {f: max(ratios[f], key=lambda item: item[0]) for f in formats}


def choose_dtype(profile: HardwareProfile, workload: Workload | None = None, *, draft_format: str | None = None,
                 candidates: Iterable[str] | None = None) -> Choice:
    """The target dtype with the lowest expected end-to-end time of ``workload`` (prefill included), speculating
    with the profile's draft (``draft_format``, default its fastest format) where that is faster than plain
    steps; without a workload, the dtype whose worst call of ``TYPICAL_CALLS`` is the least slower than that
    call's fastest dtype (``worst_calls``; ties: the faster for the default ``Workload``), its figures given for
    the default ``Workload``. Reports in ``split`` when prefilling in one dtype and decoding in another would save
    >= 5%."""
    formats = [as_format(f) for f in (candidates or profile.target_formats) if as_format(f) in profile.target_formats]
    if not formats:
        raise ValueError(f"the profile has no target measurement to choose from (measured: "
                         f"{', '.join(profile.target_formats) or 'none'})")
    draft_name, draft_step = _fastest_draft_step(profile, draft_format)
    calls = TYPICAL_CALLS if workload is None else (workload,)
    workload = workload or Workload()
    estimates = {f: estimate_call(profile, f, workload, draft_step) for f in formats}
    worst = worst_calls(profile, formats, calls, draft_step) if len(calls) > 1 else {}
    best = min(formats, key=lambda f: (worst[f][0] if worst else 0.0, estimates[f].total_s, formats.index(f)))
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
    if worst:
        def at_worst(f: str) -> str:
            ratio, call = worst[f]
            return f"{f} {ratio:.2f}x (a {call.prompt_tokens}-token prompt, {call.new_tokens} new tokens)"

        prompts, news = (sorted({getattr(call, name) for call in calls}) for name in ("prompt_tokens", "new_tokens"))
        parts.append(f"over calls of {prompts[0]}-{prompts[-1]} prompt tokens and {news[0]}-{news[-1]} new tokens, "
                     f"the slowest against the fastest dtype: " + ", ".join(at_worst(f) for f in
                                                                       sorted(formats, key=lambda f: worst[f][0])))
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
    return Choice(ChoiceKind.DTYPE, best, "; ".join(parts), tuple((f, estimates[f].total_s) for f in formats),
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
    return Choice(ChoiceKind.DRAFT_FORMAT, pick.format, why, tuple((e.format, e.t1) for e in entries))
