"""hf_specdec demo: plain, transformers-assisted, hf_specdec and lookahead decoding side by side.

One prompt, up to four modes run one after another (honest timings) and streamed round by round into panes
(``panes.py``), every mode through ``hf_specdec.harness`` (the eval harness's modes, streamer, encoding and
measurements); models load once per app and every mode is warmed up, untimed (``loading.py``).

    hf-specdec demo [--tiny] [--target REF --draft REF] [--dtype fp32] [--port 7860]

The module-level ``demo`` loads nothing at import: models load on the first Run, or at start through ``main``.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import MappingProxyType

import gradio as gr
import torch

from ..config import PolicyKind
from ..harness import MODES, RoundStreamer, Settings
from ..models import DEFAULT_DRAFT, DEFAULT_TARGET
from .loading import Loaded, ModelCache, ModelChoice, ModelLoadError
from ..harness.margins import divergence_note
from .panes import PaneRun, first_difference, render_pane, rounds_figure, session_line, speedup, summary_line

PANES = MappingProxyType({"plain": "Plain (transformers)", "assisted": "Transformers assisted",
                          "hf_specdec": "hf_specdec", "lookahead": "Lookahead (hf_specdec)"})  # key -> label, run order
DEFAULT_PANES = ("plain", "hf_specdec")
POLICIES = tuple(kind.value for kind in PolicyKind)  # the draft policies a visitor picks from (SpecConfig.policy)
QUANTIZATIONS = ("auto", "4bit", "none")  # auto: the hardware profile's fastest draft format that fits
MAX_PROMPT_CHARS = 8000  # cut before tokenizing
MAX_PROMPT_TOKENS = 1024  # the last 1024 prompt tokens are kept
MAX_NEW_TOKENS = 256  # CPU demo: keep a run of all four modes under a few minutes
DEFAULT_NEW_TOKENS = 64
MAX_TEMPERATURE = 1.5
SEED = 0  # every mode is seeded the same when sampling
REFRESH_S = 0.15  # at most ~7 UI updates per second while streaming
HONEST_TIMING_NOTE = "Modes run one after another for honest timings (no two ever share the CPU)."
EXAMPLES = (
    "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation. "
    "Add three doctests.",
    "Implement binary search over a sorted list in Python and explain its time complexity in one sentence.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods, and raise IndexError on empty pop.",
    "Convert this loop to a list comprehension:\n\nresult = []\nfor x in range(20):\n    if x % 3 == 0:\n"
    "        result.append(x * x)",
)
INTRO = """# hf_specdec: speculative and lookahead decoding, live
The same prompt decoded by each selected mode. **Highlighted text came from accepted draft tokens** (two shades
alternate by round): everywhere it is highlighted, the target model checked several tokens in one forward instead
of producing them one by one. *Mean accepted length* = tokens per target forward (plain = 1.00).
"""


def harness_mode(key: str, policy: PolicyKind) -> str:
    """The harness mode behind a pane (lookahead cold: a visitor's run never copies another visitor's)."""
    return {"plain": "plain", "assisted": "hf_assisted", "hf_specdec": f"specdec_{policy}",
            "lookahead": "lookahead"}[key]


@dataclass(frozen=True)
class DemoSettings:
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    temperature: float = 0.0
    policy: PolicyKind = PolicyKind.ADAPTIVE
    draft_quant: str = "auto"

    @classmethod
    def from_ui(cls, max_new_tokens, temperature, policy, draft_quant) -> "DemoSettings":
        """Clamp whatever the browser (or an API caller) sent into the allowed ranges."""
        try:
            n = int(max_new_tokens)
        except (TypeError, ValueError):
            n = DEFAULT_NEW_TOKENS
        try:
            t = float(temperature)
        except (TypeError, ValueError):
            t = 0.0
        return cls(min(max(n, 1), MAX_NEW_TOKENS), min(max(t, 0.0), MAX_TEMPERATURE),
                   PolicyKind(policy) if policy in POLICIES else PolicyKind.ADAPTIVE,
                   draft_quant if draft_quant in QUANTIZATIONS else "auto")

    def generation(self) -> Settings:
        return Settings(max_new_tokens=self.max_new_tokens, temperature=self.temperature)


def run_mode(key: str, loaded: Loaded, input_ids: torch.LongTensor,  # [1, L] the encoded prompt
             settings: DemoSettings, run: PaneRun | None = None) -> Iterator[PaneRun]:
    """Run one pane's mode on ``input_ids``, streaming: yields the same ``PaneRun`` as it fills
    (throttled), then once done. ``generate_row`` runs in a worker thread that this generator reads through a
    queue; closing the generator (the visitor left) cancels the call. Errors end in the pane, never raise."""
    harness = loaded.harness
    mode = MODES[harness_mode(key, settings.policy)]
    run = run or PaneRun(key, mode.title, drafts=key != "plain")
    if mode.needs_draft and harness.draft is None:
        run.fail(loaded.draft_error or "no draft model")
        yield run
        return
    events: queue.Queue = queue.Queue()
    streamer = RoundStreamer(on_chunk=lambda *chunk: events.put(chunk), sync=harness.sync)
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["row"] = harness.generate_row(mode.name, input_ids, SEED, settings=settings.generation(),
                                                  streamer=streamer)
        except Exception as exc:  # noqa: BLE001 - shown in the pane
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            events.put(None)

    run.start(time.perf_counter(), lambda ids: harness.tokenizer.decode(ids, skip_special_tokens=True))
    worker = threading.Thread(target=work, name=f"demo-{key}", daemon=True)
    worker.start()
    last_yield = 0.0
    try:
        while (event := _next_event(events)) is not None:
            if event != "tick":
                run.add_round(*event)
                run.drafted_live = harness.draft_forwards if mode.needs_draft else None
            if event == "tick" or time.perf_counter() - last_yield >= REFRESH_S:
                last_yield = time.perf_counter()
                yield run
        worker.join()
    finally:  # also reached when Gradio closes this generator: stop generate, then wait for the thread
        if worker.is_alive():
            streamer.cancel()
            worker.join(timeout=60)
    if "error" in outcome:
        run.fail(outcome["error"])
    else:
        run.finish(outcome["row"], _notes(key, outcome["row"], settings.policy))
    yield run


def _next_event(events: queue.Queue):
    try:
        return events.get(timeout=REFRESH_S)
    except queue.Empty:  # nothing new (a long prefill): still tick the clock
        return "tick"


def _notes(key: str, row: dict, policy: PolicyKind) -> list[str]:
    spec, notes = row.get("spec") or {}, []
    if key == "hf_specdec" and spec.get("rounds_spec_off"):
        reasons, wording = spec.get("plain_reasons") or {}, spec.get("plain_wording") or {}
        why = "; ".join(f"{count}: {wording.get(kind, kind)}" for kind, count in
                        sorted(reasons.items(), key=lambda item: -item[1]))  # the planner's own words, most first
        if not why and policy == PolicyKind.ADAPTIVE:
            why = "the adaptive policy judged a draft not worth its cost there"
        rounds = f"no draft in {spec['rounds_spec_off']} of {spec.get('rounds')} rounds"
        notes.append(f"{rounds} ({why})" if why else rounds)
    if spec.get("fell_back"):
        notes.append(f"fell back to plain decoding: {spec['fell_back']}")
    return notes


def compare_modes(loaded: Loaded, prompt: str, keys: list[str], settings: DemoSettings
                  ) -> Iterator[tuple[list[PaneRun], tuple[str, ...]]]:
    """Run the chosen panes one after another on the same prompt; yields (all pane runs, prompt notes)."""
    encoded = loaded.harness.encode(prompt.strip(), chat=True, max_chars=MAX_PROMPT_CHARS,
                                    max_tokens=MAX_PROMPT_TOKENS)
    runs = [PaneRun(k, MODES[harness_mode(k, settings.policy)].title, drafts=k != "plain") for k in PANES if k in keys]
    yield runs, encoded.notes
    for run in runs:
        for _ in run_mode(run.key, loaded, encoded.input_ids, settings, run=run):
            yield runs, encoded.notes
    if explain_divergences(loaded.harness.target, encoded.input_ids[0].tolist(), runs, settings):
        yield runs, encoded.notes


def explain_divergences(target, prompt_ids: list[int], runs: list[PaneRun], settings: DemoSettings) -> bool:
    """Greedy panes that left plain's output get the target's margin at the first differing token (one
    teacher-forced target forward each); returns whether any did."""
    plain = next((r for r in runs if r.key == "plain" and r.status == "done"), None)
    if plain is None or settings.temperature > 0:
        return False
    explained = False
    for run in runs:
        first = first_difference(run.output_ids, plain.output_ids) if run is not plain and run.status == "done" \
            else None
        if first is not None:
            run.divergence = divergence_note(target, prompt_ids, plain.output_ids, first)
            explained = True
    return explained


def run_comparison(cache: ModelCache, prompt: str, modes: list[str], max_new_tokens, temperature, policy,
                   draft_quant, session: dict | None):
    """The Run button: yields (status, one pane per key of PANES, plot, summary, session) as the modes stream."""
    session = dict(session or {})
    settings = DemoSettings.from_ui(max_new_tokens, temperature, policy, draft_quant)
    keys = [k for k in PANES if k in (modes or [])]
    plotted: list[tuple[str, str]] = []  # (pane, status) drawn last time: redraw only when a mode finishes

    def frame(status, runs, summary="", final=False):
        by_key = {r.key: r for r in runs}
        panes = [gr.update(value=render_pane(by_key.get(k), k), visible=k in by_key or not runs) for k in PANES]
        finished = [(r.key, r.status) for r in runs if r.status in ("done", "error")]
        plot = gr.update()
        if finished != plotted or final:
            plotted[:] = finished
            plot = rounds_figure(runs)
        return (status, *panes, plot, summary, session)

    def message(status):
        return (status, *[gr.update() for _ in PANES], gr.update(), "", session)

    if not prompt or not prompt.strip():
        yield message("**Error:** enter a prompt (or pick an example) first.")
        return
    if not keys:
        yield message("**Error:** choose at least one mode.")
        return
    if not cache.is_loaded(settings.draft_quant):
        yield message("Loading models and warming every mode up (the first start downloads the bundles) …")
    try:
        loaded = cache.get(settings.draft_quant)
    except ModelLoadError as exc:
        yield message(f"**Error:** {exc}")
        return
    header = cache.choice.describe(settings.draft_quant)
    runs, notes = [], ()
    for runs, notes in compare_modes(loaded, prompt, keys, settings):
        active = next((i for i, r in enumerate(runs) if r.status == "running"), None)
        where = f"{active + 1}/{len(runs)}: **{runs[active].title}**" if active is not None else "starting"
        status = f"Running: {where} — {HONEST_TIMING_NOTE}  \n{header}"
        yield frame(status, runs, summary_line(runs, settings.temperature > 0))
    plain = next((r for r in runs if r.key == "plain" and r.status == "done"), None)
    if plain is not None:
        speedups = {k: list(v) for k, v in session.get("speedups", {}).items()}
        for r in runs:
            if r.key != "plain" and r.status == "done":
                speedups.setdefault(r.title, []).append(speedup(r, plain))
        session["speedups"] = speedups
    session["runs"] = session.get("runs", 0) + 1
    tail = "; ".join(notes + loaded.notes)
    status = f"**Done.** {HONEST_TIMING_NOTE}  \n{header}" + (f"  \nNote: {tail}" if tail else "")
    summary = summary_line(runs, settings.temperature > 0) + session_line(session.get("speedups", {}))
    yield frame(status, runs, summary, final=True)


def build_demo(choice: ModelChoice | None = None) -> gr.Blocks:
    """Build the Blocks app. Loads nothing: models load on the first Run (or via ``warm_cache``)."""
    choice = choice or ModelChoice()
    cache = ModelCache(choice, warm_modes=[harness_mode(k, PolicyKind.ADAPTIVE) for k in PANES],
                       warm_prompt=EXAMPLES[0])
    with gr.Blocks(title="hf_specdec demo") as app:
        app.model_cache = cache  # for main() (preload) and tests; not a global
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=5, max_length=MAX_PROMPT_CHARS, elem_id="prompt",
                                    placeholder="Ask for some code…", value=EXAMPLES[0])
                gr.Examples(examples=[[e] for e in EXAMPLES], inputs=[prompt], label="Coding examples")
            with gr.Column(scale=2):
                modes = gr.CheckboxGroup(choices=[(label, key) for key, label in PANES.items()],
                                         value=list(DEFAULT_PANES), label="Modes (2 to 4)", elem_id="modes")
                max_new = gr.Slider(8, MAX_NEW_TOKENS, value=DEFAULT_NEW_TOKENS, step=8, label="Max new tokens",
                                    elem_id="max-new-tokens")
                temperature = gr.Slider(0.0, MAX_TEMPERATURE, value=0.0, step=0.1,
                                        label="Temperature (0 = greedy: outputs must be identical)")
                with gr.Row():
                    policy = gr.Radio(list(POLICIES), value=PolicyKind.ADAPTIVE.value,
                                      label="Draft policy (hf_specdec)")
                    quant = gr.Radio(list(QUANTIZATIONS), value="auto", label="Draft format (auto: measured here)")
                run_btn = gr.Button("Run", variant="primary", elem_id="run")
                gr.Markdown(f"*{HONEST_TIMING_NOTE}* Models: {choice.describe()}.")
        status = gr.Markdown(elem_id="status")
        summary = gr.Markdown(elem_id="summary")
        with gr.Row(equal_height=False):
            panes = [gr.HTML(render_pane(None, k), elem_id=f"pane-{k}", visible=k in DEFAULT_PANES, min_height=140)
                     for k in PANES]
        plot = gr.Plot(label="Accepted draft tokens per round (drawn as each mode finishes)", show_label=False,
                       elem_id="rounds-plot", format="png")
        session = gr.State({})

        def on_run(prompt_text, mode_keys, n, temp, pol, q, state, progress=gr.Progress(track_tqdm=True)):
            # track_tqdm: a first Run that has to fetch/load models shows load_model's progress bars here
            yield from run_comparison(cache, prompt_text, mode_keys, n, temp, pol, q, state)

        run_btn.click(on_run, inputs=[prompt, modes, max_new, temperature, policy, quant, session],
                      outputs=[status, *panes, plot, summary, session], concurrency_limit=1, api_name="compare")
    app.queue(default_concurrency_limit=1, max_size=16)
    return app


def warm_cache(app: gr.Blocks, draft_quant: str = "auto") -> str | None:
    """Load the models and warm every mode up now. Returns an error message instead of raising."""
    try:
        app.model_cache.get(draft_quant)
    except ModelLoadError as exc:
        return str(exc)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-specdec demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model: bundle name, hub id, dir or .gguf")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (same tokenizer as the target)")
    parser.add_argument("--dtype", default="auto", help="auto | bf16 | fp16 | fp32 (both models)")
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
    app = build_demo(ModelChoice(target=args.target, draft=args.draft, tiny=args.tiny, dtype=args.dtype))
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
