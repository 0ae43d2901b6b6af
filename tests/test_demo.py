"""The Gradio demo's handlers (hf_specdec.demo.app), called as plain Python with the offline tiny pair.

No browser here (see test_browser_demo.py): these call ``run_comparison`` -- the generator behind the Run
button -- and check what it yields: panes filled and streamed, metrics present, accepted-draft highlights,
the plot, the summary line, and clear errors instead of crashes.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

gr = pytest.importorskip("gradio", reason="the demo needs gradio: pip install 'hf_specdec[demo]'")
pytest.importorskip("matplotlib", reason="the demo's plot needs matplotlib: pip install 'hf_specdec[demo]'")

from hf_specdec.demo import app, loading, panes  # noqa: E402
from hf_specdec.harness import RoundStreamer  # noqa: E402
from tests.test_models import smollm2_bundle  # noqa: E402,F401 (the session fixture that fetches the bundle once)


@pytest.fixture(scope="module")
def tiny_cache():
    return app.ModelCache(app.ModelChoice(tiny=True), warm_modes=["plain", "hf_assisted"], warm_prompt="def f():")


def run_all(cache, modes, max_new_tokens=24, temperature=0.0, prompt="def fibonacci(n):", session=None,
            policy="adaptive"):
    return list(app.run_comparison(cache, prompt, modes, max_new_tokens, temperature, policy, "4bit", session or {}))


def unpack(frame):
    """(status, {pane: html}, {pane: visible}, plot, summary, session) from one yielded tuple."""
    status, *rest = frame
    pane_updates, (plot, summary, session) = rest[: len(app.PANES)], rest[len(app.PANES):]
    html = {k: p.get("value") for k, p in zip(app.PANES, pane_updates)}
    visible = {k: p.get("visible") for k, p in zip(app.PANES, pane_updates)}
    return status, html, visible, plot, summary, session


def metric(pane_html: str, key: str) -> str:
    match = re.search(rf'data-metric="{key}".*?<div style="font-weight:600">([^<]*)</div>', pane_html)
    assert match, f"metric {key} missing"
    return match.group(1)


def pane_text(pane_html: str) -> str:
    body = re.search(r'<pre class="hfsd-text"[^>]*>(.*)</pre>', pane_html, re.S).group(1)
    return re.sub(r"<[^>]+>", "", body)


def test_module_imports_without_loading_models():
    assert isinstance(app.demo, gr.Blocks)
    assert app.demo.model_cache._target is None  # lazy: nothing loaded at import
    assert app.demo.model_cache.choice == app.ModelChoice()  # the bundled default pair
    assert app.main(["--tiny", "--no-launch"]) == 0


def test_space_entry_point_serves_the_package_app():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "demo" / "app.py"
    spec = importlib.util.spec_from_file_location("space_app_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.demo is app.demo and module.main is app.main
    assert len(path.read_text().splitlines()) <= 5


def test_models_are_warmed_up_once_before_the_first_run():
    from transformers import PreTrainedModel

    called: dict[int, int] = {}

    def count(module, args):
        if isinstance(module, PreTrainedModel):
            called[id(module)] = called.get(id(module), 0) + 1

    cache = app.ModelCache(app.ModelChoice(tiny=True), warm_modes=["plain", "hf_assisted", "lookahead"])
    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        loaded = cache.get("none")
        after_load = dict(called)
        assert cache.get("none") is loaded and cache.get("4bit").harness is loaded.harness
    finally:
        handle.remove()
    harness = loaded.harness
    assert after_load[id(harness.target)] > 0 and after_load[id(harness.draft)] > 0  # every mode ran once
    assert harness.target.last_spec_stats.mode == "lookahead"  # the hf_specdec mode ran too, last
    assert called == after_load  # a second get() warms nothing up again
    assert not [n for n in loaded.notes if "warm-up" in n]


def test_warm_up_failures_are_shown(monkeypatch):
    from hf_specdec.models.tiny import tiny_pair

    def broken_pair():
        target, draft, tokenizer = tiny_pair()

        def fail(module, args):
            raise RuntimeError("the draft is broken")

        draft.register_forward_pre_hook(fail)
        return target, draft, tokenizer

    monkeypatch.setattr(loading, "tiny_pair", broken_pair)
    cache = app.ModelCache(app.ModelChoice(tiny=True), warm_modes=["plain", "hf_assisted"])
    notes = cache.get("none").notes
    assert notes == ("warm-up of hf_assisted failed: RuntimeError: the draft is broken",)
    frames = run_all(cache, ["plain", "assisted"], max_new_tokens=4)
    status, html, *_ = unpack(frames[-1])
    assert "warm-up of hf_assisted failed" in status and "the draft is broken" in html["assisted"]


def test_plain_vs_assisted_streams_fills_panes_and_highlights(tiny_cache):
    frames = run_all(tiny_cache, ["plain", "assisted"])
    assert len(frames) >= 4  # loading, start, streamed updates, final
    status, html, visible, plot, summary, session = unpack(frames[-1])
    assert visible == {"plain": True, "assisted": True, "hf_specdec": False, "lookahead": False}
    assert "Done" in status and "one after another for honest timings" in status
    for mode in ("plain", "assisted"):
        pane = html[mode]
        assert 'data-status="done"' in pane
        assert pane_text(pane).strip()
        assert float(metric(pane, "tok_s")) > 0
        assert metric(pane, "ttft").endswith(" s") and metric(pane, "elapsed").endswith(" s")
        assert metric(pane, "tokens").startswith("24 / ")
    assert metric(html["plain"], "mal") == "1.00" and metric(html["plain"], "tokens") == "24 / 24"
    assert metric(html["plain"], "acceptance").startswith("—")
    assert float(metric(html["assisted"], "mal")) > 1.0  # the noisy-copy draft is right some of the time
    assert re.fullmatch(r"\d+%", metric(html["assisted"], "acceptance"))  # exact once done: no "≈"
    assert 'class="hfsd-draft"' in html["assisted"] and 'class="hfsd-draft"' not in html["plain"]
    assert "Speedup over plain on this prompt" in summary and "Transformers assisted" in summary
    assert "Transformers assisted ✓ identical" in summary  # greedy: assisted decoding must reproduce plain
    assert session["runs"] == 1 and "Transformers assisted" in session["speedups"]
    from matplotlib.figure import Figure

    assert isinstance(plot, Figure)
    # streaming: some intermediate frame showed the plain pane running while assisted was still waiting
    running = [unpack(f)[1] for f in frames[1:-1]]
    assert any('data-status="running"' in h["plain"] and 'data-status="waiting"' in h["assisted"] for h in running)


def test_highlight_spans_follow_on_round(tiny_cache):
    tokenizer = tiny_cache.get("none").harness.tokenizer
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    run = panes.PaneRun("hf_specdec", "x", drafts=True)
    run.start(0.0, decode)
    chunks = []
    streamer = RoundStreamer(on_chunk=lambda ids, accepted, t, paths: chunks.append((ids, accepted)))
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt: ignored
    streamer.on_round_paths(5, 2)
    streamer.on_round(2, 3)
    streamer.put(torch.tensor([[10, 11, 12]]))
    streamer.put(torch.tensor([[13, 14]]))  # no on_round: inferred as len - 1 (transformers' assisted loop)
    streamer.put(torch.tensor([[15]]))
    assert chunks == [([10, 11, 12], 2), ([13, 14], 1), ([15], 0)]
    assert streamer.rounds == [(2, 3), (1, 2), (0, 1)] and streamer.round_log == [(2, 3)]
    assert streamer.paths == [2, None, None]  # only what on_round_paths reported
    assert streamer.streamed_tokens == 6 and streamer.t_first is not None
    for i, (ids, accepted) in enumerate(chunks):
        run.add_round(ids, accepted, float(i), streamer.paths[i])
    kinds = [(kind, index) for _, kind, index in run.segments]
    assert kinds == [("draft", 0), ("target", 0), ("draft", 1), ("target", 1), ("target", 2)]
    assert "".join(text for text, _, _ in run.segments) == decode(list(range(10, 16)))
    assert run.rounds == [(2, 3), (1, 2), (0, 1)]
    html = panes.render_pane(run)
    assert html.count('class="hfsd-draft"') == 2 and 'data-round="1"' in html
    assert f'background:{panes.DRAFT_COLORS[0]}' in html and f'background:{panes.DRAFT_COLORS[1]}' in html
    assert 'title="round 0: accepted draft tokens (a tree of 2 paths)"' in html and panes.tree_rounds(run) == [0]


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_hf_specdec_and_lookahead_panes_finish_and_match_plain(tiny_cache, policy):
    frames = run_all(tiny_cache, ["plain", "hf_specdec", "lookahead"], max_new_tokens=16, policy=policy)
    status, html, visible, plot, summary, session = unpack(frames[-1])
    assert visible["hf_specdec"] and visible["lookahead"] and not visible["assisted"]
    for key, title in (("hf_specdec", f"hf_specdec ({policy})"), ("lookahead", "Lookahead (hf_specdec)")):
        pane = html[key]
        assert 'data-status="done"' in pane, pane  # an error in either pane fails the test
        assert pane_text(pane).strip() and float(metric(pane, "tok_s")) > 0
        assert re.fullmatch(r"\d+%", metric(pane, "acceptance"))
        assert f"{title} ✓ identical" in summary
    assert "failed" not in summary


def test_sampling_run_says_outputs_may_differ(tiny_cache):
    frames = run_all(tiny_cache, ["plain", "assisted"], max_new_tokens=8, temperature=0.8)
    status, html, visible, plot, summary, session = unpack(frames[-1])
    assert 'data-status="done"' in html["plain"] and 'data-status="done"' in html["assisted"]
    assert "sampling" in summary


def test_bad_inputs_and_caps(tiny_cache):
    status = run_all(tiny_cache, ["plain"], prompt="   ")[-1][0]
    assert "enter a prompt" in status
    status = run_all(tiny_cache, [])[-1][0]
    assert "at least one mode" in status
    s = app.DemoSettings.from_ui(10_000, -3, "nonsense", "8bit")
    assert (s.max_new_tokens, s.temperature, s.policy, s.draft_quant) == (app.MAX_NEW_TOKENS, 0.0, "adaptive", "auto")
    defaults = app.DemoSettings(app.DEFAULT_NEW_TOKENS, 0.0, "fixed", "none")
    assert app.DemoSettings.from_ui(None, "x", "fixed", "none") == defaults
    frames = run_all(tiny_cache, ["plain"], max_new_tokens=8, prompt="def f(x): return x\n" * 2000)
    status, html, *_ = unpack(frames[-1])
    assert "prompt cut to 8000 characters" in status and "prompt cut to its last 1024 tokens" in status
    assert 'data-status="done"' in html["plain"]


def test_model_load_failure_is_shown_not_raised(monkeypatch):
    cache = app.ModelCache(app.ModelChoice(target="no-such-model", draft="no-such-draft"))

    def fail(*args, **kwargs):
        raise OSError("no-such-model: not a bundle, not a local directory, and the hub is unreachable")

    monkeypatch.setattr(loading, "get_profile", lambda target, draft: None)
    monkeypatch.setattr(loading, "load_model", fail)
    frames = run_all(cache, ["plain", "hf_specdec"])
    status, html, *_ = unpack(frames[-1])
    assert "Error" in status and "no-such-model" in status and "hub is unreachable" in status
    # a second click does not retry forever or crash either
    assert "Error" in run_all(cache, ["plain"])[-1][0]


def test_draft_load_failure_is_shown_in_the_panes_that_need_it(monkeypatch):
    from hf_specdec.models import LoadedModel
    from hf_specdec.models.loading import LoadInfo
    from hf_specdec.models.tiny import tiny_pair

    target, _, tokenizer = tiny_pair()

    def load(ref, **kwargs):
        if ref == "broken-draft":
            raise OSError("broken-draft: no such model")
        return LoadedModel(target, tokenizer, LoadInfo(ref, "pretrained", ref, "float32", None, "cpu", 0.0))

    monkeypatch.setattr(loading, "get_profile", lambda target, draft: None)
    monkeypatch.setattr(loading, "load_model", load)
    cache = app.ModelCache(app.ModelChoice(target="t", draft="broken-draft"), warm_modes=["plain"])
    frames = run_all(cache, ["plain", "assisted"], max_new_tokens=4)
    status, html, *_ = unpack(frames[-1])
    assert 'data-status="done"' in html["plain"] and 'data-status="error"' in html["assisted"]
    assert "broken-draft: no such model" in html["assisted"]


def test_the_target_dtype_is_chosen_with_the_draft_profiled(monkeypatch):
    """dtype "auto": the demo loads the target and the "auto" draft with one profile of the pair, as load_pair
    does, so the target's dtype is priced with the draft's step (not as if there were no draft); an explicit
    draft format loads without it."""
    from hf_specdec.models import LoadedModel
    from hf_specdec.models.loading import LoadInfo
    from hf_specdec.models.tiny import tiny_pair

    target, _, tokenizer = tiny_pair()
    pair_profile, profiled, loads = object(), [], []
    monkeypatch.setattr(loading, "get_profile", lambda t, d: profiled.append((t, d)) or pair_profile)

    def load(ref, **kwargs):
        loads.append((ref, kwargs.get("quantize"), kwargs.get("profile")))
        return LoadedModel(target, tokenizer, LoadInfo(ref, "pretrained", ref, "float32", None, "cpu", 0.0))

    monkeypatch.setattr(loading, "load_model", load)
    cache = app.ModelCache(app.ModelChoice(target="t", draft="d"), warm_modes=[])
    cache.get("auto")
    cache.get("none")
    assert profiled == [("t", "d")]
    assert loads == [("t", None, pair_profile), ("d", "auto", pair_profile), ("d", None, None)]


def test_leaving_mid_run_stops_generate(tiny_cache):
    loaded = tiny_cache.get("none")
    ids = loaded.harness.encode("def f(x):", chat=True).input_ids
    stream = app.run_mode("plain", loaded, ids, app.DemoSettings(max_new_tokens=200))
    run = next(stream)
    stream.close()  # what Gradio does when the page goes away
    assert run.row is None and len(run.ids) < 200
    assert not any(t.name == "demo-plain" and t.is_alive() for t in threading.enumerate())


@pytest.mark.slow
@pytest.mark.network
def test_real_bundle_pair_plain_vs_hf_specdec(smollm2_bundle, user_cache_dir, monkeypatch):
    """SmolLM2-135M as target and draft through load_model, in fp32 (bf16 near-ties may legitimately flip where
    dtype="auto" picks bf16): real text, identical outputs. The demo loads from the default cache: here, the
    user's, where the bundle is."""
    from hf_specdec.models import TINY_TARGET
    from hf_specdec.models.bundles import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(user_cache_dir))

    cache = app.ModelCache(app.ModelChoice(target=TINY_TARGET, draft=TINY_TARGET, dtype="fp32"),
                           warm_modes=["plain", "specdec_adaptive"])
    frames = list(app.run_comparison(cache, app.EXAMPLES[0], ["plain", "hf_specdec"], 16, 0.0, "adaptive", "none",
                                     {}))
    status, html, visible, plot, summary, session = unpack(frames[-1])
    assert "Done" in status and "dtype fp32" in status, status
    assert 'data-status="done"' in html["plain"] and 'data-status="done"' in html["hf_specdec"], html["hf_specdec"]
    assert "def" in pane_text(html["plain"]) or "fib" in pane_text(html["plain"]).lower()
    assert "hf_specdec (adaptive) ✓ identical" in summary


# -- why a greedy pane left plain's output ----------------------------------------------------------------------
def _tied_at(dtype):
    """A tiny model in ``dtype`` and its greedy output, with row 90 of its head made equal to the row of the token
    it emits at position 3: an exact tie there."""
    from hf_specdec.models.tiny import tiny_model

    model = tiny_model("llama", seed=0, tie_word_embeddings=False)
    prompt = [5, 17, 42, 8, 23, 61, 2, 9]
    out = type(model).generate(model, torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    with torch.no_grad():
        model.lm_head.weight[90] = model.lm_head.weight[out[3]]
    return model.to(dtype), prompt, out


def test_a_bf16_divergence_at_a_tie_says_so():
    from hf_specdec.harness.margins import divergence_note

    model, prompt, out = _tied_at(torch.bfloat16)
    note = divergence_note(model, prompt, out, 3)
    assert note == ("target's top-two logit margin there 0 in bfloat16: a tie in bf16 (margin ≤ one bf16 rounding "
                    "step), not an error; fp32 is token-identical")


def test_a_divergence_away_from_a_tie_gives_the_margin_only():
    from hf_specdec.harness.margins import divergence_note, teacher_forced

    from hf_specdec.models.tiny import tiny_model

    model, prompt = tiny_model("llama", seed=0), [5, 17, 42, 8, 23, 61, 2, 9]
    out = type(model).generate(model, torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    margin = teacher_forced(model, prompt, out[:2])["margin"][-1]
    assert margin > 1e-3
    assert divergence_note(model, prompt, out, 1) == f"target's top-two logit margin there {margin:.4g} in float32"


def test_the_summary_shows_the_margin_at_the_first_differing_token():
    model, prompt, out = _tied_at(torch.bfloat16)
    row = {"output_ids": out, "new_tokens": len(out), "e2e_s": 1.0, "tokens_per_s": 6.0, "ttft_s": 0.1,
           "spec": None, "target_forwards": len(out), "mean_accepted_length": 1.0}
    plain = panes.PaneRun("plain", "Plain", drafts=False, status="done", row=row)
    other = panes.PaneRun("hf_specdec", "hf_specdec", drafts=True, status="done",
                          row=dict(row, output_ids=out[:3] + [90] + out[4:]))
    settings = app.DemoSettings.from_ui(6, 0.0, "adaptive", "auto")
    assert app.explain_divergences(model, prompt, [plain, other], settings)
    assert ("hf_specdec ✗ differs from token 3 (target's top-two logit margin there 0 in bfloat16: a tie in bf16 "
            "(margin ≤ one bf16 rounding step), not an error; fp32 is token-identical)") in panes.summary_line(
        [plain, other], sampling=False)


def test_the_hf_specdec_pane_says_why_rounds_were_plain():
    """The planner's reasons reach the page in its own words, most frequent first (issue 27)."""
    from hf_specdec.demo.app import _notes

    spec = {"rounds_spec_off": 14, "rounds": 40, "fell_back": None,
            "plain_reasons": {"drafting does not pay": 2, "draft prompt read not repaid": 12},
            "plain_wording": {"drafting does not pay": "drafting does not pay: 3.1 tok/s expected, 4.0 plain",
                              "draft prompt read not repaid": "draft prompt read not repaid: 0.90 s to read, "
                                                              "~0.70 s saved over the 12 tokens left"}}
    (note,) = _notes("hf_specdec", {"spec": spec}, "adaptive")
    assert note == ("no draft in 14 of 40 rounds (12: draft prompt read not repaid: 0.90 s to read, ~0.70 s saved "
                    "over the 12 tokens left; 2: drafting does not pay: 3.1 tok/s expected, 4.0 plain)")


@pytest.fixture
def transformers_warnings():
    """What transformers logs at WARNING from here on (its library logger does not propagate to pytest's caplog).
    ``warning_once`` forgets what it already said, so that a warning an earlier test caused shows again."""
    import io
    import logging

    logging.Logger.warning_once.cache_clear()
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setLevel(logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)
    try:
        yield text
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        logging.Logger.warning_once.cache_clear()


DEPRECATION = "Passing `generation_config` together with generation-related arguments"


def test_the_assisted_pane_logs_no_generation_config_deprecation(transformers_warnings):
    """transformers' assisted generation drafts with ``generate(generation_config=..., max_new_tokens=...)`` and
    warns about that call of its own; the demo's start-up (warming the assisted pane up) and its runs must not show
    it. The same call outside the harness does warn, so the capture could fail."""
    import logging

    loaded = app.ModelCache(app.ModelChoice(tiny=True), warm_modes=["hf_assisted"], warm_prompt="def f():").get("none")
    assert not [n for n in loaded.notes if "warm-up" in n]
    logging.Logger.warning_once.cache_clear()
    run_all(app.ModelCache(app.ModelChoice(tiny=True)), ["assisted"], max_new_tokens=8)
    assert DEPRECATION not in transformers_warnings.getvalue()

    logging.Logger.warning_once.cache_clear()
    harness = loaded.harness
    ids = harness.encode("def f():").input_ids
    type(harness.target).generate(harness.target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                  do_sample=False, assistant_model=harness.draft)
    assert DEPRECATION in transformers_warnings.getvalue()


def test_only_the_draft_calls_deprecation_is_dropped():
    """The filter drops the warning naming transformers' draft-call arguments only; a caller's own stays."""
    import logging

    from hf_specdec.harness.modes import _DEPRECATION_PREFIX, _DraftCallDeprecation

    def passes(message):
        return _DraftCallDeprecation().filter(logging.LogRecord("t", logging.WARNING, __file__, 0, message, None, None))

    assert not passes(_DEPRECATION_PREFIX + "({'use_cache', 'max_new_tokens', 'min_new_tokens'}) is deprecated")
    assert not passes(_DEPRECATION_PREFIX + "({'max_new_tokens', 'min_new_tokens'}) is deprecated")
    assert passes(_DEPRECATION_PREFIX + "({'temperature', 'max_new_tokens'}) is deprecated")
    assert passes("Setting `pad_token_id` to `eos_token_id`:2 for open-end generation.")
