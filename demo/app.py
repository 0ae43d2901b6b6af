"""hf_specdec demo: plain, transformers-assisted, hf_specdec and lookahead decoding side by side.

One prompt, up to four decoding modes, run one after another (for honest timings) and streamed round by round
into side-by-side panes. Every pane shows tokens/s, time to first token, elapsed time, mean accepted length
(tokens per target forward) and the draft acceptance rate, live. Text that came from accepted draft tokens is
highlighted, two shades alternating by round, so one sees where the draft was right. A plot shows accepted
tokens per round; a summary line gives each mode's speedup over plain and whether its output is identical.

Run it:
    python demo/app.py                       # default pair: qwen2.5-coder-1.5b-instruct + 0.5b draft (4-bit), CPU
    python demo/app.py --tiny                # offline random tiny pair, seconds to start (gibberish text)
    hf-specdec demo --target smollm2-135m-instruct --draft smollm2-135m-instruct

Layout of this file: constants, model loading (a cache object created per app, never a module global that
holds models), the streamer, one ``run_mode`` shared by every pane, rendering, the Gradio UI, ``main``.
The module-level ``demo`` is importable without loading any model: models load on the first Run (or at start
when launched through ``main``).
"""

import argparse
import html
import importlib.util
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import gradio as gr
import pandas as pd
import torch

# Run from a source checkout without installing: make the repository root importable (no import happens here).
_REPO_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("hf_specdec") is None and (_REPO_ROOT / "hf_specdec").is_dir():
    sys.path.insert(0, str(_REPO_ROOT))

# ----------------------------------------------------------------------------------------------------------------
# Constants

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"  # = hf_specdec.models.DEFAULT_TARGET
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"  # = hf_specdec.models.DEFAULT_DRAFT
TINY_LABEL = "tiny random Llama pair (offline, random weights: the text is gibberish)"

MODES = {  # key -> pane title, in the order the modes run
    "plain": "Plain (transformers)",
    "assisted": "Transformers assisted",
    "hf_specdec": "hf_specdec",
    "lookahead": "Lookahead (hf_specdec)",
}
DEFAULT_MODES = ["plain", "hf_specdec"]
POLICIES = ["adaptive", "fixed", "heuristic"]
QUANTIZATIONS = ["4bit", "none"]

MAX_PROMPT_CHARS = 8000  # cut before tokenizing
MAX_PROMPT_TOKENS = 1024  # the last 1024 prompt tokens are kept
MAX_NEW_TOKENS = 256  # CPU demo: keep a run of all four modes under a few minutes
DEFAULT_NEW_TOKENS = 64
MAX_TEMPERATURE = 1.5
SEED = 0  # every mode is seeded the same when sampling
RETRY_LOAD_S = 60  # a model that failed to load is tried again on a Run after this long
REFRESH_S = 0.15  # at most ~7 UI updates per second while streaming
HONEST_TIMING_NOTE = "Modes run one after another for honest timings (no two ever share the CPU)."

DRAFT_COLORS = ("#fcd34d", "#fde68a")  # accepted draft tokens, alternating by round

EXAMPLES = [
    "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation. "
    "Add three doctests.",
    "Implement binary search over a sorted list in Python and explain its time complexity in one sentence.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods, and raise IndexError on empty pop.",
    "Convert this loop to a list comprehension:\n\nresult = []\nfor x in range(20):\n    if x % 3 == 0:\n"
    "        result.append(x * x)",
]


# ----------------------------------------------------------------------------------------------------------------
# Models: chosen once per app, loaded lazily, cached in an object (not a module global)


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message is shown in the UI as is."""


@dataclass(frozen=True)
class ModelChoice:
    """Which models an app serves. ``tiny`` ignores target/draft and builds the offline random pair."""

    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    tiny: bool = False

    def describe(self, draft_quant: str = "4bit") -> str:
        if self.tiny:
            return TINY_LABEL
        quant = "4-bit" if draft_quant == "4bit" else "unquantized"
        return f"target `{self.target}` · draft `{self.draft}` ({quant}) · CPU"


@dataclass
class LoadedModels:
    target: Any
    tokenizer: Any
    draft: Any | None  # None when the draft failed to load (the panes that need it say why)
    draft_error: str | None
    core: Any | None  # the hf_specdec module when importable, with hf_specdec.enable(target) applied
    core_error: str | None
    notes: list[str]


def _import_core():
    """Return (hf_specdec, None) or (None, why not). The core is optional: plain and assisted still run."""
    try:
        import hf_specdec

        for name in ("enable", "SpecConfig", "LookaheadConfig"):
            if not hasattr(hf_specdec, name):
                return None, f"hf_specdec has no `{name}` yet (core not installed or incomplete)"
        return hf_specdec, None
    except Exception as exc:  # an ImportError, or a broken core: either way the demo keeps running
        return None, f"hf_specdec could not be imported ({type(exc).__name__}: {exc})"


def _load_tiny_module():
    spec = importlib.util.spec_from_file_location("hf_specdec_demo_tiny", Path(__file__).with_name("tiny.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ModelCache:
    """Loads the target once and each draft quantization once, on first use; thread-safe.

    One instance per app, created by ``build_demo`` and captured by its handlers. Loading failures raise
    ``ModelLoadError`` with a readable message; the handler turns that into an error in the UI.
    """

    def __init__(self, choice: ModelChoice):
        self.choice = choice
        self._lock = threading.Lock()
        self._target = self._tokenizer = None
        self._target_error: str | None = None
        self._failed_at = float("-inf")  # a failed load is retried on a Run at least RETRY_LOAD_S later
        self._drafts: dict[str, tuple[Any | None, str | None, list[str]]] = {}
        self._core = None
        self._core_error: str | None = None

    def is_loaded(self, draft_quant: str = "4bit") -> bool:
        return self._target is not None and draft_quant in self._drafts

    def get(self, draft_quant: str = "4bit") -> LoadedModels:
        with self._lock:
            retry = time.monotonic() - self._failed_at > RETRY_LOAD_S
            if self._target is None and (self._target_error is None or retry):
                self._target_error = None
                self._load_target()
            if self._target_error is not None:
                self._failed_at = self._failed_at if not retry else time.monotonic()
                raise ModelLoadError(self._target_error)
            if draft_quant not in self._drafts or (self._drafts[draft_quant][0] is None and retry):
                self._drafts[draft_quant] = self._load_draft(draft_quant)
                if self._drafts[draft_quant][0] is None:
                    self._failed_at = time.monotonic()
            draft, draft_error, notes = self._drafts[draft_quant]
            return LoadedModels(self._target, self._tokenizer, draft, draft_error, self._core, self._core_error,
                                list(notes))

    def _load_target(self) -> None:
        try:
            if self.choice.tiny:
                target, draft, tokenizer = _load_tiny_module().build_tiny_pair()
                self._drafts["4bit"] = (draft, None, ["4-bit quantization is not applied to the tiny random draft"])
                self._drafts["none"] = (draft, None, [])
            else:
                try:
                    from hf_specdec.models import load_model
                except Exception as exc:
                    raise ModelLoadError(
                        f"the models loader (hf_specdec.models.load_model) is not available: "
                        f"{type(exc).__name__}: {exc}. Install hf_specdec, or start the demo with --tiny."
                    ) from exc
                print(f"[demo] loading target {self.choice.target} (the first start downloads the bundle) ...",
                      flush=True)
                target, tokenizer = load_model(self.choice.target, dtype="auto", quantize=None)
            target.eval()
        except Exception as exc:
            reason = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            self._target_error = f"Could not load the target model `{self.choice.target}`: {reason}"
            if self.choice.tiny:
                self._target_error = f"Could not build the tiny models: {reason}"
            return
        self._core, self._core_error = _import_core()
        if self._core is not None:
            try:
                self._core.enable(target)
            except Exception as exc:
                self._core, self._core_error = None, f"hf_specdec.enable failed ({type(exc).__name__}: {exc})"
        _warm_up(target, tokenizer)
        self._target, self._tokenizer = target, tokenizer

    def _load_draft(self, draft_quant: str) -> tuple[Any | None, str | None, list[str]]:
        from hf_specdec.models import load_model  # tiny drafts were filled in by _load_target

        notes: list[str] = []
        quantize = "4bit" if draft_quant == "4bit" else None
        print(f"[demo] loading draft {self.choice.draft} (quantize={quantize}) ...", flush=True)
        try:
            draft, _ = load_model(self.choice.draft, dtype="auto", quantize=quantize)
        except Exception as exc:
            if quantize is None:
                return None, f"Could not load the draft `{self.choice.draft}`: {type(exc).__name__}: {exc}", notes
            notes.append(f"the 4-bit draft failed to load ({type(exc).__name__}: {exc}); using it unquantized")
            try:
                draft, _ = load_model(self.choice.draft, dtype="auto", quantize=None)
            except Exception as exc2:
                return None, f"Could not load the draft `{self.choice.draft}`: {type(exc2).__name__}: {exc2}", notes
            self._drafts.setdefault("none", (draft, None, []))  # the same model: never load it twice
        draft.eval()
        _warm_up(draft, self._tokenizer)
        return draft, None, notes


def _warm_up(model, tokenizer) -> None:
    """One tiny generate, so the first timed mode does not pay one-off start-up costs the others skip."""
    try:
        ids = tokenizer("def f(x):", return_tensors="pt")
        with torch.inference_mode():
            type(model).generate(model, **ids, max_new_tokens=2, do_sample=False)
    except Exception:
        pass  # warm-up is best effort; a real failure shows up, with its message, in the run itself


# ----------------------------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    temperature: float = 0.0
    policy: str = "adaptive"
    draft_quant: str = "4bit"

    @classmethod
    def from_ui(cls, max_new_tokens, temperature, policy, draft_quant) -> "Settings":
        """Clamp whatever the browser (or an API caller) sent into the allowed ranges."""
        try:
            n = int(max_new_tokens)
        except (TypeError, ValueError):
            n = DEFAULT_NEW_TOKENS
        try:
            t = float(temperature)
        except (TypeError, ValueError):
            t = 0.0
        return cls(
            max_new_tokens=min(max(n, 1), MAX_NEW_TOKENS),
            temperature=min(max(t, 0.0), MAX_TEMPERATURE),
            policy=policy if policy in POLICIES else "adaptive",
            draft_quant=draft_quant if draft_quant in QUANTIZATIONS else "4bit",
        )

    @property
    def sampling(self) -> bool:
        return self.temperature > 0


def encode_prompt(tokenizer, prompt: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Chat-template the prompt when the tokenizer has a template, then cap its length. Returns inputs and notes."""
    notes = []
    prompt = prompt.strip()
    if len(prompt) > MAX_PROMPT_CHARS:
        prompt = prompt[:MAX_PROMPT_CHARS]
        notes.append(f"prompt cut to {MAX_PROMPT_CHARS} characters")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    input_ids = enc["input_ids"]
    if input_ids.shape[1] > MAX_PROMPT_TOKENS:
        input_ids = input_ids[:, -MAX_PROMPT_TOKENS:]
        notes.append(f"prompt cut to its last {MAX_PROMPT_TOKENS} tokens")
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}, notes


# ----------------------------------------------------------------------------------------------------------------
# Streaming: what each round emitted, and how much of it came from accepted draft tokens


class GenerationCancelled(RuntimeError):
    """Raised from the streamer to stop a generate call nobody is watching any more."""


class RoundStreamer:
    """A transformers streamer that forwards each round's tokens to a queue, with its accepted-draft count.

    hf_specdec calls ``on_round(num_accepted_draft_tokens, num_emitted)`` just before each round's ``put``.
    Transformers' own loops do not: plain decoding puts one token per step (0 accepted), and assisted
    decoding puts ``n_matches + 1`` tokens per round (its accepted candidates, then the target's token), so
    without ``on_round`` the count is inferred as ``len(chunk) - 1``, which is exact for both.
    """

    def __init__(self, events: queue.Queue):
        self._events = events
        self._prompt_seen = False
        self._pending_accepted: int | None = None
        self.cancelled = threading.Event()  # set when the visitor leaves: the next put aborts generate

    def cancel(self) -> None:
        self.cancelled.set()

    def on_round(self, num_accepted_draft_tokens: int, num_emitted: int) -> None:
        self._pending_accepted = int(num_accepted_draft_tokens)

    def put(self, value: torch.Tensor) -> None:
        if self.cancelled.is_set():
            raise GenerationCancelled("the page stopped listening")
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        ids = [int(t) for t in value.reshape(-1).tolist()]
        accepted = self._pending_accepted if self._pending_accepted is not None else len(ids) - 1
        self._pending_accepted = None
        self._events.put(("round", time.perf_counter(), (ids, max(0, min(accepted, len(ids))))))

    def end(self) -> None:
        pass


class _DraftForwardCounter:
    """Counts draft-model forwards while a mode runs: the live estimate of drafted tokens (one per forward)."""

    def __init__(self, draft):
        self.count = 0
        self._handle = None
        if draft is not None and hasattr(draft, "register_forward_hook"):
            self._handle = draft.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.count += 1

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


# ----------------------------------------------------------------------------------------------------------------
# One mode's run: state, metrics


@dataclass
class PaneRun:
    """Everything one pane shows. Updated in place while its mode streams."""

    mode: str
    title: str
    status: str = "waiting"  # waiting | running | done | error
    message: str = ""
    ids: list[int] = field(default_factory=list)
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (accepted draft tokens, emitted) per round
    segments: list[list[Any]] = field(default_factory=list)  # [text, kind ("draft"|"target"), round index]
    output_ids: list[int] | None = None  # what generate returned (the truth for "identical" checks)
    t_start: float | None = None
    t_first: float | None = None
    t_end: float | None = None
    drafted: int | None = None  # None: this mode has no draft tokens to count
    drafted_exact: bool = False  # True once taken from SpecStats / the final count
    stats: dict[str, Any] | None = None
    _text: str = ""
    _decode: Any = None

    # -- recording ------------------------------------------------------------------------------------------
    def add_round(self, t: float, ids: list[int], accepted: int) -> None:
        if self.t_first is None:
            self.t_first = t
        cut = len(self.ids) + accepted
        self.ids.extend(ids)
        index = len(self.rounds)
        self.rounds.append((accepted, len(ids)))
        if accepted:
            self._add_segment(cut, "draft", index)
        if cut < len(self.ids):
            self._add_segment(len(self.ids), "target", index)

    def _add_segment(self, end: int, kind: str, index: int) -> None:
        text = self._decode(self.ids[:end])
        if not text.startswith(self._text):  # a multi-byte character completed: re-cut the earlier segments
            keep = len(_common_prefix(text, self._text))
            total = 0
            for i, seg in enumerate(self.segments):
                if total + len(seg[0]) > keep:
                    seg[0] = seg[0][: keep - total]
                    del self.segments[i + 1:]
                    break
                total += len(seg[0])
            self._text = text[:keep]
        piece = text[len(self._text):]
        self._text = text
        if piece:
            self.segments.append([piece, kind, index])

    # -- metrics ----------------------------------------------------------------------------------------------
    @property
    def new_tokens(self) -> int:
        return len(self.output_ids) if self.output_ids is not None else len(self.ids)

    @property
    def accepted(self) -> int:
        return sum(a for a, _ in self.rounds)

    def metrics(self, now: float | None = None) -> dict[str, Any]:
        """tokens/s, TTFT, elapsed, mean accepted length, acceptance rate; None where not measured (yet)."""
        if self.t_start is None:
            return {"tok_s": None, "ttft_s": None, "elapsed_s": None, "mean_accepted_length": None,
                    "acceptance_rate": None, "tokens": 0, "rounds": 0}
        end = self.t_end if self.t_end is not None else (now or time.perf_counter())
        elapsed = max(end - self.t_start, 1e-9)
        rounds = len(self.rounds)
        accepted = self.accepted
        if self.stats is not None and self.stats.get("drafted"):
            rate = self.stats["accepted"] / self.stats["drafted"]
        elif self.drafted:
            rate = min(accepted / self.drafted, 1.0)
        else:
            rate = None if self.drafted is None or not rounds else 0.0
        return {
            "tok_s": self.new_tokens / elapsed if self.new_tokens else 0.0,
            "ttft_s": (self.t_first - self.t_start) if self.t_first is not None else None,
            "elapsed_s": elapsed,
            "mean_accepted_length": (len(self.ids) / rounds) if rounds else None,
            "acceptance_rate": rate,
            "tokens": self.new_tokens,
            "rounds": rounds,
        }


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def _mode_title(mode: str, settings: Settings) -> str:
    return f"hf_specdec ({settings.policy})" if mode == "hf_specdec" else MODES[mode]


def _mode_call(mode: str, models: LoadedModels, settings: Settings):
    """The generate call behind each mode, or a string saying why the mode cannot run."""
    target, draft, core = models.target, models.draft, models.core
    if mode in ("assisted", "hf_specdec") and draft is None:
        return models.draft_error or "no draft model"
    if mode in ("hf_specdec", "lookahead") and core is None:
        return models.core_error or "hf_specdec is not available"
    if mode == "plain":  # the unpatched transformers generate
        return lambda **kw: type(target).generate(target, **kw)
    if mode == "assisted":  # transformers' own assisted decoding, unpatched
        return lambda **kw: type(target).generate(target, **kw, assistant_model=draft)
    if mode == "hf_specdec":
        spec_config = core.SpecConfig(policy=settings.policy)
        return lambda **kw: target.generate(**kw, assistant_model=draft, spec_config=spec_config)
    if mode == "lookahead":
        lookahead_config = core.LookaheadConfig()
        return lambda **kw: target.generate(**kw, decoding="lookahead", lookahead_config=lookahead_config)
    raise ValueError(f"unknown mode {mode!r}; choose from {list(MODES)}")


def _stats_dict(stats) -> dict[str, Any] | None:
    if stats is None:
        return None
    try:
        return stats.to_dict()
    except Exception:
        return {k: getattr(stats, k, None) for k in ("rounds", "new_tokens", "drafted", "accepted")}


def run_mode(mode: str, models: LoadedModels, inputs: dict[str, torch.Tensor], settings: Settings,
             run: PaneRun | None = None) -> Iterator[PaneRun]:
    """Run one mode on the prompt, streaming: yields the same ``PaneRun`` as it fills (throttled), then once done.

    generate runs in a worker thread; this generator reads its rounds from a queue, so the UI never blocks it.
    Errors end up in ``run.status == "error"`` with the message, never as an exception.
    """
    run = run or PaneRun(mode=mode, title=_mode_title(mode, settings))
    tokenizer = models.tokenizer
    run._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    call = _mode_call(mode, models, settings)
    if isinstance(call, str):
        run.status, run.message = "error", call
        yield run
        return

    events: queue.Queue = queue.Queue()
    streamer = RoundStreamer(events)
    kwargs: dict[str, Any] = dict(inputs, max_new_tokens=settings.max_new_tokens, streamer=streamer)
    if settings.sampling:
        kwargs.update(do_sample=True, temperature=settings.temperature)
    else:
        kwargs.update(do_sample=False)
    counter = _DraftForwardCounter(models.draft) if mode in ("assisted", "hf_specdec") else None
    if mode in ("assisted", "hf_specdec", "lookahead"):
        run.drafted = 0
    if mode in ("hf_specdec", "lookahead"):
        models.target.last_spec_stats = None  # so a failed call never shows the previous call's stats
    outcome: dict[str, Any] = {}

    def work():
        try:
            if settings.sampling:
                torch.manual_seed(SEED)
            with torch.inference_mode():
                outcome["output"] = call(**kwargs)
        except BaseException as exc:  # reported in the pane
            outcome["error"] = exc
        finally:
            outcome["t_end"] = time.perf_counter()
            events.put(("done", outcome["t_end"], None))

    run.status = "running"
    run.t_start = time.perf_counter()
    worker = threading.Thread(target=work, name=f"demo-{mode}", daemon=True)
    worker.start()
    last_yield = 0.0
    try:
        while True:
            try:
                kind, t, payload = events.get(timeout=REFRESH_S)
            except queue.Empty:  # nothing new (a long prefill): still tick the clock
                last_yield = time.perf_counter()
                yield run
                continue
            if kind == "done":
                break
            run.add_round(t, *payload)
            if counter is not None:
                run.drafted = counter.count
            if time.perf_counter() - last_yield >= REFRESH_S:
                last_yield = time.perf_counter()
                yield run
        worker.join()
    finally:  # also reached when Gradio closes this generator (the visitor left): stop generate, then clean up
        if worker.is_alive():
            streamer.cancel()
            worker.join(timeout=60)
        if counter is not None:
            counter.close()

    run.t_end = outcome["t_end"]
    if "error" in outcome:
        exc = outcome["error"]
        run.status, run.message = "error", f"{type(exc).__name__}: {exc}"
        yield run
        return
    output = outcome["output"]
    sequences = getattr(output, "sequences", output)
    run.output_ids = [int(t) for t in sequences[0, inputs["input_ids"].shape[1]:].tolist()]
    if mode in ("hf_specdec", "lookahead"):
        run.stats = _stats_dict(getattr(output, "spec_stats", None) or getattr(models.target, "last_spec_stats", None))
        if run.stats and run.stats.get("drafted") is not None:
            run.drafted, run.drafted_exact = int(run.stats["drafted"]), True
    elif counter is not None:
        run.drafted, run.drafted_exact = counter.count, True
    notes = []
    if run.stats and mode == "hf_specdec" and run.stats.get("rounds_spec_off"):
        why = " (the adaptive policy judged a draft not worth its cost there)" if settings.policy == "adaptive" else ""
        notes.append(f"no draft in {run.stats['rounds_spec_off']} of {run.stats.get('rounds')} rounds{why}")
    if run.stats and run.stats.get("fell_back"):
        notes.append(f"fell back to plain decoding: {run.stats['fell_back']}")
    run.message = "; ".join(notes)
    if run.output_ids != run.ids:
        notes.append("the streamed tokens differ from the returned ones; tokens/s uses the returned ones")
        run.message = "; ".join(notes)
    run.status = "done"
    yield run


def compare_modes(models: LoadedModels, prompt: str, modes: list[str], settings: Settings
                  ) -> Iterator[tuple[list[PaneRun], list[str]]]:
    """Run the chosen modes one after another on the same prompt; yields (all pane runs, prompt notes)."""
    inputs, notes = encode_prompt(models.tokenizer, prompt)
    runs = [PaneRun(mode=m, title=_mode_title(m, settings)) for m in MODES if m in modes]
    yield runs, notes
    for run in runs:
        for _ in run_mode(run.mode, models, inputs, settings, run=run):
            yield runs, notes


# ----------------------------------------------------------------------------------------------------------------
# Rendering (inline styles only, so the panes look the same in any Gradio theme and without custom CSS)


def _fmt(value, pattern: str, dash: str = "—") -> str:
    return dash if value is None else pattern.format(value)


def render_pane(run: PaneRun | None, mode: str = "") -> str:
    if run is None:
        return f'<div class="hfsd-pane" data-mode="{mode}" data-status="idle"></div>'
    m = run.metrics()
    approx = "" if run.drafted_exact or run.status != "running" else "≈"
    rate = m["acceptance_rate"]
    if rate is None and run.mode == "plain":
        rate_text = "— (no draft)"
    else:
        rate_text = approx + _fmt(None if rate is None else 100 * rate, "{:.0f}%")
    metrics = [
        ("tok_s", "tokens/s", _fmt(m["tok_s"], "{:.1f}")),
        ("ttft", "TTFT", _fmt(m["ttft_s"], "{:.2f} s")),
        ("elapsed", "elapsed", _fmt(m["elapsed_s"], "{:.2f} s")),
        ("mal", "mean accepted length", _fmt(m["mean_accepted_length"], "{:.2f}")),
        ("acceptance", "acceptance rate", rate_text),
        ("tokens", "tokens / rounds", f"{m['tokens']} / {m['rounds']}"),
    ]
    cells = "".join(
        f'<div class="hfsd-metric" data-metric="{key}" style="padding:2px 8px 2px 0">'
        f'<div style="font-size:11px;opacity:.7">{label}</div>'
        f'<div style="font-weight:600">{html.escape(value)}</div></div>'
        for key, label, value in metrics
    )
    status_color = {"running": "#2563eb", "done": "#16a34a", "error": "#dc2626"}.get(run.status, "#6b7280")
    spans = []
    for text, kind, index in run.segments:
        if kind == "draft":
            color = DRAFT_COLORS[index % 2]
            spans.append(f'<span class="hfsd-draft" data-round="{index}" title="round {index}: accepted draft tokens" '
                         f'style="background:{color};color:#111;border-radius:2px">{html.escape(text)}</span>')
        else:
            spans.append(f'<span class="hfsd-target" data-round="{index}">{html.escape(text)}</span>')
    waiting = '<span style="opacity:.5">waiting for its turn…</span>' if run.status == "waiting" else ""
    body = "".join(spans) or waiting
    message_color = status_color if run.status == "error" else "#6b7280"
    message = (f'<div class="hfsd-message" style="color:{message_color};font-size:13px;margin:4px 0">'
               f'{html.escape(run.message)}</div>') if run.message else ""
    return (
        f'<div class="hfsd-pane" data-mode="{run.mode}" data-status="{run.status}" '
        f'style="border:1px solid #d1d5db;border-radius:8px;padding:10px;min-height:120px">'
        f'<div style="display:flex;justify-content:space-between;align-items:baseline">'
        f'<b style="font-size:15px">{html.escape(run.title)}</b>'
        f'<span class="hfsd-status" style="color:{status_color};font-size:12px">{run.status}</span></div>'
        f'<div class="hfsd-metrics" style="display:flex;flex-wrap:wrap;margin:6px 0">{cells}</div>{message}'
        f'<pre class="hfsd-text" style="white-space:pre-wrap;word-break:break-word;font-size:13px;'
        f'line-height:1.45;margin:0;max-height:420px;overflow:auto">{body}</pre></div>'
    )


def rounds_frame(runs: list[PaneRun]) -> pd.DataFrame:
    """Accepted draft tokens per round, one series per mode that drafts (plain would be a flat zero)."""
    rows = [{"round": i, "accepted": accepted, "mode": run.title}
            for run in runs if run.mode != "plain" for i, (accepted, _) in enumerate(run.rounds)]
    frame = pd.DataFrame(rows, columns=["round", "accepted", "mode"])
    return frame.astype({"round": "int64", "accepted": "int64", "mode": "object"})


PLOT_COLORS = {"assisted": "#6b7280", "hf_specdec": "#d97706", "lookahead": "#2563eb"}


def rounds_figure(runs: list[PaneRun]):
    """A small matplotlib figure of ``rounds_frame`` (object API, no pyplot: safe in Gradio's worker threads)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 2.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for run in runs:
        if run.mode == "plain" or not run.rounds:
            continue
        accepted = [a for a, _ in run.rounds]
        ax.plot(range(len(accepted)), accepted, marker="o", markersize=3, linewidth=1.2,
                color=PLOT_COLORS.get(run.mode), label=f"{run.title} (mean {sum(accepted) / len(accepted):.2f})")
    ax.set_xlabel("round (one target forward)")
    ax.set_ylabel("accepted")
    ax.set_title("Accepted draft tokens per round", fontsize=10)
    ax.margins(y=0.15)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no drafting mode has run yet", ha="center", va="center", transform=ax.transAxes,
                color="#6b7280")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.yaxis.get_major_locator().set_params(integer=True)
    return fig


def summary_line(runs: list[PaneRun], settings: Settings) -> str:
    """Speedup of each mode over plain (tokens/s ratio) and whether its tokens equal plain's."""
    done = {r.mode: r for r in runs if r.status == "done"}
    plain = done.get("plain")
    others = [r for r in runs if r.mode != "plain"]
    if not others:
        return "Pick a second mode to compare against plain."
    if plain is None:
        return "Speedup and identity are measured against **plain**: select it (and let it finish) to see them."
    plain_rate = plain.metrics()["tok_s"] or 1e-9
    speed, same = [], []
    for r in others:
        if r.status == "error":
            speed.append(f"{r.title} failed")
            continue
        if r.status != "done":
            continue
        speed.append(f"{r.title} **{r.metrics()['tok_s'] / plain_rate:.2f}×**")
        if r.output_ids == plain.output_ids:
            same.append(f"{r.title} ✓ identical")
        else:
            first = next((i for i, (a, b) in enumerate(zip(r.output_ids, plain.output_ids)) if a != b),
                         min(len(r.output_ids), len(plain.output_ids)))
            same.append(f"{r.title} ✗ differs from token {first}")
    if not speed:
        return ""
    line = f"**Speedup over plain on this prompt:** {' · '.join(speed)}"
    if same:
        line += f"  \n**Output vs plain:** {' · '.join(same)}"
        if settings.sampling:
            line += " (sampling at temperature > 0: each mode draws its own sample, so outputs may differ)"
    return line


def session_line(session: dict) -> str:
    history = session.get("speedups", {})
    if not history:
        return ""
    parts = [f"{title} median {statistics.median(values):.2f}× over {len(values)} run(s)"
             for title, values in history.items()]
    return f"  \nThis session: {' · '.join(parts)}"


# ----------------------------------------------------------------------------------------------------------------
# The Gradio handler (plain generator; tests call it directly)

PANE_MODES = list(MODES)


def run_comparison(cache: ModelCache, prompt: str, modes: list[str], max_new_tokens, temperature, policy,
                   draft_quant, session: dict | None):
    """Yields (status, pane per mode in MODES order, plot frame, summary, session) as the modes stream."""
    session = dict(session or {})
    settings = Settings.from_ui(max_new_tokens, temperature, policy, draft_quant)
    modes = [m for m in PANE_MODES if m in (modes or [])]
    plotted: list[tuple[str, str]] = []  # (mode, status) drawn last time: redraw only when a mode finishes

    def frame(status, runs, summary="", final=False):
        by_mode = {r.mode: r for r in runs}
        panes = [gr.update(value=render_pane(by_mode.get(m), m), visible=m in by_mode or not runs)
                 for m in PANE_MODES]
        finished = [(r.mode, r.status) for r in runs if r.status in ("done", "error")]
        plot = gr.update()
        if finished != plotted or final:
            plotted[:] = finished
            plot = rounds_figure(runs)
        return (status, *panes, plot, summary, session)

    def message(status):  # only the status line changes
        return (status, *[gr.update() for _ in PANE_MODES], gr.update(), "", session)

    if not prompt or not prompt.strip():
        yield message("**Error:** enter a prompt (or pick an example) first.")
        return
    if not modes:
        yield message("**Error:** choose at least one mode.")
        return
    if not cache.is_loaded(settings.draft_quant):
        yield message("Loading models (the first start downloads and converts the bundles) …")
    try:
        models = cache.get(settings.draft_quant)
    except ModelLoadError as exc:
        yield message(f"**Error:** {exc}")
        return
    except Exception as exc:  # never crash the app on a load problem
        yield message(f"**Error:** model loading failed: {type(exc).__name__}: {exc}")
        return

    header = cache.choice.describe(settings.draft_quant)
    extra = "; ".join(models.notes)
    runs: list[PaneRun] = []
    notes: list[str] = []
    for runs, notes in compare_modes(models, prompt, modes, settings):
        active = next((i for i, r in enumerate(runs) if r.status == "running"), None)
        where = f"{active + 1}/{len(runs)}: **{runs[active].title}**" if active is not None else "starting"
        status = f"Running: {where} — {HONEST_TIMING_NOTE}  \n{header}"
        yield frame(status, runs, summary_line(runs, settings))

    summary = summary_line(runs, settings)
    plain = next((r for r in runs if r.mode == "plain" and r.status == "done"), None)
    if plain is not None:
        speedups = {k: list(v) for k, v in session.get("speedups", {}).items()}
        for r in runs:
            if r.mode != "plain" and r.status == "done":
                speedups.setdefault(r.title, []).append(r.metrics()["tok_s"] / (plain.metrics()["tok_s"] or 1e-9))
        session["speedups"] = speedups
    session["runs"] = session.get("runs", 0) + 1
    tail = "; ".join(notes + ([extra] if extra else []))
    status = f"**Done.** {HONEST_TIMING_NOTE}  \n{header}" + (f"  \nNote: {tail}" if tail else "")
    yield frame(status, runs, summary + session_line(session), final=True)


# ----------------------------------------------------------------------------------------------------------------
# UI

INTRO = """# hf_specdec: speculative and lookahead decoding, live
The same prompt decoded by each selected mode. **Highlighted text came from accepted draft tokens** (two shades
alternate by round): everywhere it is highlighted, the target model checked several tokens in one forward instead
of producing them one by one. *Mean accepted length* = tokens per target forward (plain = 1.00).
"""


def build_demo(choice: ModelChoice | None = None) -> gr.Blocks:
    """Build the Blocks app. Loads nothing: models load on the first Run (or via ``warm_cache``)."""
    choice = choice or ModelChoice()
    cache = ModelCache(choice)

    with gr.Blocks(title="hf_specdec demo") as app:
        app.model_cache = cache  # for main() (preload) and tests; not a global
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=5, max_length=MAX_PROMPT_CHARS, elem_id="prompt",
                                    placeholder="Ask for some code…", value=EXAMPLES[0])
                gr.Examples(examples=[[e] for e in EXAMPLES], inputs=[prompt], label="Coding examples")
            with gr.Column(scale=2):
                modes = gr.CheckboxGroup(choices=[(title, key) for key, title in MODES.items()],
                                         value=DEFAULT_MODES, label="Modes (2 to 4)", elem_id="modes")
                max_new = gr.Slider(8, MAX_NEW_TOKENS, value=DEFAULT_NEW_TOKENS, step=8, label="Max new tokens",
                                    elem_id="max-new-tokens")
                temperature = gr.Slider(0.0, MAX_TEMPERATURE, value=0.0, step=0.1,
                                        label="Temperature (0 = greedy: outputs must be identical)")
                with gr.Row():
                    policy = gr.Radio(POLICIES, value="adaptive", label="Draft policy (hf_specdec)")
                    quant = gr.Radio(QUANTIZATIONS, value="4bit", label="Draft quantization")
                run_btn = gr.Button("Run", variant="primary", elem_id="run")
                gr.Markdown(f"*{HONEST_TIMING_NOTE}* Models: {choice.describe()}.")
        status = gr.Markdown(elem_id="status")
        summary = gr.Markdown(elem_id="summary")
        with gr.Row(equal_height=False):
            panes = [gr.HTML(render_pane(None, m), elem_id=f"pane-{m}", visible=m in DEFAULT_MODES,
                             min_height=140)
                     for m in PANE_MODES]
        plot = gr.Plot(label="Accepted draft tokens per round (drawn as each mode finishes)", show_label=False,
                       elem_id="rounds-plot", format="png")
        session = gr.State({})

        def on_run(prompt_text, mode_keys, n, temp, pol, q, state, progress=gr.Progress(track_tqdm=True)):
            # track_tqdm: a first Run that has to fetch/load models shows load_model's progress bars here
            yield from run_comparison(cache, prompt_text, mode_keys, n, temp, pol, q, state)

        run_btn.click(on_run, inputs=[prompt, modes, max_new, temperature, policy, quant, session],
                      outputs=[status, *panes, plot, summary, session], concurrency_limit=1,
                      api_name="compare")
    app.queue(default_concurrency_limit=1, max_size=16)
    return app


def warm_cache(app: gr.Blocks, draft_quant: str = "4bit") -> str | None:
    """Load the models now (prints load_model's progress). Returns an error message instead of raising."""
    try:
        app.model_cache.get(draft_quant)
        return None
    except Exception as exc:
        return str(exc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-specdec demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model: bundle name, hub id, dir or .gguf")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (same tokenizer as the target)")
    parser.add_argument("--tiny", action="store_true",
                        help="offline random tiny Llama pair (no download, gibberish text): for quick checks")
    parser.add_argument("--host", default=None, help="server address (default: Gradio's, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="server port (default: Gradio's, 7860)")
    parser.add_argument("--share", action="store_true", help="create a public gradio.live link (off by default)")
    parser.add_argument("--no-preload", action="store_true", help="load the models on the first Run, not at start")
    parser.add_argument("--no-launch", action="store_true", help="build the app and exit (for tests)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    app = build_demo(ModelChoice(target=args.target, draft=args.draft, tiny=args.tiny))
    if args.no_launch:
        print(f"[demo] built the app for {app.model_cache.choice.describe()} (not launched)")
        return 0
    if not args.no_preload:
        error = warm_cache(app)
        if error:
            print(f"[demo] {error}\n[demo] starting anyway: the UI will show this error on Run", file=sys.stderr)
    app.launch(server_name=args.host, server_port=args.port, share=args.share)
    return 0


demo = build_demo()

if __name__ == "__main__":
    sys.exit(main())
