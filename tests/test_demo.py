"""The Gradio demo's handlers, called as plain Python with the offline tiny model pair (demo/tiny.py).

No browser here (see test_browser_demo.py): these call ``run_comparison`` -- the generator behind the Run
button -- and check what it yields: panes filled and streamed, metrics present, accepted-draft highlights,
the plot, the summary line, and clear errors instead of crashes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

gr = pytest.importorskip("gradio", reason="the demo needs gradio: pip install 'hf_specdec[demo]'")
pytest.importorskip("matplotlib", reason="the demo's plot needs matplotlib: pip install 'hf_specdec[demo]'")

APP_PATH = Path(__file__).resolve().parents[1] / "demo" / "app.py"


@pytest.fixture(scope="module")
def app():
    spec = importlib.util.spec_from_file_location("hf_specdec_demo_app_under_test", APP_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_cache(app):
    return app.ModelCache(app.ModelChoice(tiny=True))


def run_all(app, cache, modes, max_new_tokens=24, temperature=0.0, prompt="def fibonacci(n):", session=None):
    frames = list(app.run_comparison(cache, prompt, modes, max_new_tokens, temperature, "adaptive", "4bit",
                                     session or {}))
    return frames


def unpack(app, frame):
    """(status, {mode: pane html}, {mode: visible}, plot, summary, session) from one yielded tuple."""
    status, *rest = frame
    panes, (plot, summary, session) = rest[: len(app.PANE_MODES)], rest[len(app.PANE_MODES):]
    html = {m: p.get("value") for m, p in zip(app.PANE_MODES, panes)}
    visible = {m: p.get("visible") for m, p in zip(app.PANE_MODES, panes)}
    return status, html, visible, plot, summary, session


def metric(pane_html: str, key: str) -> str:
    match = re.search(rf'data-metric="{key}".*?<div style="font-weight:600">([^<]*)</div>', pane_html)
    assert match, f"metric {key} missing"
    return match.group(1)


def pane_text(pane_html: str) -> str:
    body = re.search(r'<pre class="hfsd-text"[^>]*>(.*)</pre>', pane_html, re.S).group(1)
    return re.sub(r"<[^>]+>", "", body)


def test_module_imports_without_loading_models(app):
    assert isinstance(app.demo, gr.Blocks)
    assert app.demo.model_cache._target is None  # lazy: nothing loaded at import
    assert app.demo.model_cache.choice == app.ModelChoice()  # the bundled default pair
    assert app.main(["--tiny", "--no-launch"]) == 0


def test_plain_vs_assisted_streams_fills_panes_and_highlights(app, tiny_cache):
    frames = run_all(app, tiny_cache, ["plain", "assisted"])
    assert len(frames) >= 4  # loading, start, streamed updates, final
    status, html, visible, plot, summary, session = unpack(app, frames[-1])
    assert visible == {"plain": True, "assisted": True, "hf_specdec": False, "lookahead": False}
    assert "Done" in status and "one after another for honest timings" in status
    for mode in ("plain", "assisted"):
        pane = html[mode]
        assert 'data-status="done"' in pane
        assert pane_text(pane).strip()
        assert float(metric(pane, "tok_s")) > 0
        assert metric(pane, "ttft").endswith(" s") and metric(pane, "elapsed").endswith(" s")
        assert metric(pane, "tokens").startswith("24 / ")
    assert metric(html["plain"], "mal") == "1.00"
    assert metric(html["plain"], "acceptance").startswith("—")
    assert float(metric(html["assisted"], "mal")) > 1.0  # the noisy-copy draft is right some of the time
    assert metric(html["assisted"], "acceptance").endswith("%")
    assert 'class="hfsd-draft"' in html["assisted"] and 'class="hfsd-draft"' not in html["plain"]
    assert "Speedup over plain on this prompt" in summary and "Transformers assisted" in summary
    assert "✓ identical" in summary  # greedy: assisted decoding must reproduce plain exactly
    assert session["runs"] == 1 and "Transformers assisted" in session["speedups"]
    from matplotlib.figure import Figure
    assert isinstance(plot, Figure)
    # streaming: some intermediate frame showed the plain pane running while assisted was still waiting
    running = [unpack(app, f)[1] for f in frames[1:-1]]
    assert any('data-status="running"' in h["plain"] and 'data-status="waiting"' in h["assisted"] for h in running)


def test_highlight_spans_follow_on_round(app, tiny_cache):
    models = tiny_cache.get("none")
    run = app.PaneRun(mode="hf_specdec", title="x")
    run._decode = lambda ids: models.tokenizer.decode(ids, skip_special_tokens=True)
    events = __import__("queue").Queue()
    streamer = app.RoundStreamer(events)
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt: ignored
    streamer.on_round(2, 3)
    streamer.put(torch.tensor([[10, 11, 12]]))
    streamer.put(torch.tensor([[13, 14]]))  # no on_round: inferred as len - 1 (transformers' assisted loop)
    streamer.put(torch.tensor([[15]]))
    rounds = [events.get_nowait()[2] for _ in range(3)]
    assert rounds == [([10, 11, 12], 2), ([13, 14], 1), ([15], 0)]
    for i, (ids, accepted) in enumerate(rounds):
        run.add_round(float(i), ids, accepted)
    kinds = [(kind, index) for _, kind, index in run.segments]
    assert kinds == [("draft", 0), ("target", 0), ("draft", 1), ("target", 1), ("target", 2)]
    assert "".join(text for text, _, _ in run.segments) == run._decode(list(range(10, 16)))
    assert run.rounds == [(2, 3), (1, 2), (0, 1)]
    html = app.render_pane(run)
    assert html.count('class="hfsd-draft"') == 2 and 'data-round="1"' in html


def test_hf_specdec_and_lookahead_panes(app, tiny_cache):
    core, why = app._import_core()
    frames = run_all(app, tiny_cache, ["plain", "hf_specdec", "lookahead"], max_new_tokens=16)
    status, html, visible, plot, summary, session = unpack(app, frames[-1])
    assert visible["hf_specdec"] and visible["lookahead"] and not visible["assisted"]
    for mode in ("hf_specdec", "lookahead"):
        pane = html[mode]
        if 'data-status="error"' in pane:  # the core missing or failing is shown, never raised
            assert re.search(r'class="hfsd-message"[^>]*>[^<]+<', pane)
            assert f"{app._mode_title(mode, app.Settings())} failed" in summary
        else:
            assert 'data-status="done"' in pane and pane_text(pane).strip()
            assert f"{app._mode_title(mode, app.Settings())} ✓ identical" in summary
    if core is not None:  # with the core installed, hf_specdec itself must work and match plain
        assert 'data-status="done"' in html["hf_specdec"], html["hf_specdec"]
    else:
        assert why and 'data-status="error"' in html["hf_specdec"]


def test_sampling_run_says_outputs_may_differ(app, tiny_cache):
    frames = run_all(app, tiny_cache, ["plain", "assisted"], max_new_tokens=8, temperature=0.8)
    status, html, visible, plot, summary, session = unpack(app, frames[-1])
    assert 'data-status="done"' in html["plain"] and 'data-status="done"' in html["assisted"]
    assert "sampling" in summary


def test_bad_inputs_and_caps(app, tiny_cache):
    status = run_all(app, tiny_cache, ["plain"], prompt="   ")[-1][0]
    assert "enter a prompt" in status
    status = run_all(app, tiny_cache, [])[-1][0]
    assert "at least one mode" in status
    s = app.Settings.from_ui(10_000, -3, "nonsense", "8bit")
    assert (s.max_new_tokens, s.temperature, s.policy, s.draft_quant) == (app.MAX_NEW_TOKENS, 0.0, "adaptive", "4bit")
    defaults = app.Settings(app.DEFAULT_NEW_TOKENS, 0.0, "fixed", "none")
    assert app.Settings.from_ui(None, "x", "fixed", "none") == defaults
    tokenizer = tiny_cache.get("none").tokenizer
    inputs, notes = app.encode_prompt(tokenizer, "def f(x): return x\n" * 2000)
    assert inputs["input_ids"].shape[1] <= app.MAX_PROMPT_TOKENS and notes


def test_model_load_failure_is_shown_not_raised(app, monkeypatch):
    cache = app.ModelCache(app.ModelChoice(target="no-such-model", draft="no-such-draft"))

    def fail(*args, **kwargs):
        raise OSError("no-such-model: not a bundle, not a local directory, and the hub is unreachable")

    try:
        import hf_specdec.models as models_pkg
    except Exception:  # no loader at all: the demo reports that instead, which is also what this test wants
        models_pkg = None
    if models_pkg is not None:
        monkeypatch.setattr(models_pkg, "load_model", fail, raising=False)
    frames = run_all(app, cache, ["plain", "hf_specdec"])
    status, html, *_ = unpack(app, frames[-1])
    assert "Error" in status and "no-such-model" in status
    assert models_pkg is None or "hub is unreachable" in status
    # a second click does not retry forever or crash either
    assert "Error" in run_all(app, cache, ["plain"])[-1][0]


def test_leaving_mid_run_stops_generate(app, tiny_cache):
    models = tiny_cache.get("none")
    inputs, _ = app.encode_prompt(models.tokenizer, "def f(x):")
    stream = app.run_mode("plain", models, inputs, app.Settings(max_new_tokens=200))
    run = next(stream)
    stream.close()  # what Gradio does when the page goes away
    assert run.t_end is None and len(run.ids) < 200
    import threading
    assert not any(t.name == "demo-plain" and t.is_alive() for t in threading.enumerate())


@pytest.mark.slow
def test_real_bundle_pair_plain_vs_hf_specdec(app):
    """SmolLM2-135M as target and draft through hf_specdec.models.load_model: real text, identical outputs."""
    models_pkg = pytest.importorskip("hf_specdec.models")
    bundle = models_pkg.BUNDLES[models_pkg.TINY_TARGET]
    if models_pkg.bundle_status(bundle)["status"] == "missing":
        pytest.skip(f"bundle {models_pkg.TINY_TARGET} not fetched (hf-specdec models fetch)")
    cache = app.ModelCache(app.ModelChoice(target=models_pkg.TINY_TARGET, draft=models_pkg.TINY_TARGET))
    frames = list(app.run_comparison(cache, app.EXAMPLES[0], ["plain", "hf_specdec"], 16, 0.0, "adaptive", "none",
                                     {}))
    status, html, visible, plot, summary, session = unpack(app, frames[-1])
    assert "Done" in status, status
    assert 'data-status="done"' in html["plain"] and 'data-status="done"' in html["hf_specdec"], html["hf_specdec"]
    assert "def" in pane_text(html["plain"]) or "fib" in pane_text(html["plain"]).lower()
    assert "hf_specdec (adaptive) ✓ identical" in summary
