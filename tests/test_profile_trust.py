"""A hardware profile that cannot lie for long: a measurement is cached only when it agrees with itself
(``profile.check_cost``), a cached entry that does not is measured again, and an entry that a call's own timed
forwards disagree with is scaled to what the call timed (``seeding.call_end``, ``store.calibrate``).

The bad tables are the numbers of the profile cache found on the AVX2-only EPYC in session 37 (measured while
the machine was under load; copies in /work/notes/s37/bad_profiles/): they made ``dtype="auto"`` choose bf16
where fp32 decodes 1.22x faster. Nothing here reads ~/.cache or depends on this CPU's speed: measurements are
fake measurers, and calls run on a virtual clock (tests/clock.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import hf_specdec
from hf_specdec.memory import EstimatesFrom
from hf_specdec.models import formats as F
from hf_specdec.models import measure as M
from hf_specdec.models import profile as P
from hf_specdec.models import seeding
from hf_specdec.models import store as S
from hf_specdec.models.bundles import CACHE_ENV
from tests.clock import VirtualClock
from tests.conftest import perturbed_copy, tiny_model

# the 1.5B target in fp32 and bf16 as the loaded EPYC measured them (seconds, rounded to 4 digits)
LOADED_FP32 = {1: 2.493, 2: 11.00, 3: 11.97, 4: 13.57, 6: 13.91, 8: 14.65, 12: 9.630, 16: 16.37, 24: 12.92,
               32: 25.24}
LOADED_FP32_PREFILL = 18.95
LOADED_BF16 = {1: 0.1190, 2: 0.1956, 3: 0.3194, 4: 0.3844, 6: 0.5785, 8: 0.7107, 12: 1.078, 16: 1.386, 24: 2.247,
               32: 2.853}
LOADED_BF16_PREFILL = 124.5  # 256 tokens: over 4 times 256 single steps
# a good measurement: the Sapphire Rapids profile of docs/models.md (ms), proxy noise included (fp32 t(12) is 25%
# over t(24))
GOOD_BF16 = {1: 205.6, 2: 215.7, 3: 228.3, 4: 234.2, 6: 220.0, 8: 239.4, 12: 267.9, 16: 258.4, 24: 269.2, 32: 283.1}
GOOD_FP32 = {1: 261.3, 2: 285.8, 3: 286.1, 4: 526.4, 6: 543.1, 8: 650.1, 12: 899.5, 16: 794.2, 24: 717.5, 32: 743.1}


def seconds(table_ms):
    return {n: v / 1e3 for n, v in table_ms.items()}


def target_cost(table, prefill=None, fmt="fp32", samples=None):
    return P.FormatCost(fmt, table, 256 if prefill is not None else 0, prefill, 1000, "proxy", samples=samples)


# ---------------------------------------------------------------------------------------------------------
# the check


def test_the_loaded_tables_contradict_themselves():
    fp32 = P.check_cost(target_cost(LOADED_FP32, LOADED_FP32_PREFILL))
    assert fp32.kinds == (P.FlawKind.NOT_MONOTONE, P.FlawKind.OVER_STEPS)
    assert fp32.why == "t(12) = 9.63 s is below t(8) = 14.7 s; t(2) = 11 s is over 2 single steps (4.99 s)"
    bf16 = P.check_cost(target_cost(LOADED_BF16, LOADED_BF16_PREFILL, "bf16"))
    assert bf16.kinds == (P.FlawKind.OVER_STEPS,)
    assert bf16.why == "the prefill over 256 tokens (124 s) is over 256 single steps (30.5 s)"


def test_good_tables_pass_noise_included():
    for table, prefill in ((GOOD_BF16, 2.51 * 256), (GOOD_FP32, 11.06 * 256)):
        verdict = P.check_cost(target_cost(seconds(table), prefill / 1e3))
        assert verdict.ok and verdict.why == "" and verdict.flaws == ()
    # t(1) above t(2): a one-token forward runs matrix-vector products (ForwardCost's docstring): not a flaw
    assert P.check_cost(target_cost({1: 0.22, 2: 0.19, 4: 0.21})).ok
    draft = P.FormatCost("int4", {1: 0.046, 2: 0.055, 4: 0.082, 8: 0.162},
                         prompt_read={16: 0.297, 64: 0.679, 256: 3.02})
    assert P.check_cost(draft).ok


def test_prompt_reads_are_checked_like_forwards():
    draft = P.FormatCost("bf16", {1: 0.09}, prompt_read={16: 0.6, 64: 0.3, 256: 40.0})
    assert P.check_cost(draft).why == ("read(64) = 0.3 s is below read(16) = 0.6 s; the prompt read over 256 tokens "
                                       "(40 s) is over 256 single steps (23 s)")


def test_rounds_that_disagree_and_a_drifting_load_are_flaws():
    table = {1: 0.10, 2: 0.11, 4: 0.12}
    agreeing = P.Samples({1: (0.10, 0.12, 0.9), 2: (0.11, 0.13), 4: (0.12, 0.14)}, (0.020, 0.022))
    assert P.check_cost(target_cost(table, samples=agreeing)).ok  # a slow third round: interference, set aside
    apart = P.Samples({1: (0.10, 0.12), 2: (0.11, 0.30), 4: (0.12, 0.25)}, (0.020, 0.031))
    verdict = P.check_cost(target_cost(table, samples=apart))
    assert verdict.kinds == (P.FlawKind.ROUNDS_DISAGREE, P.FlawKind.LOAD_DRIFT)
    assert verdict.why == ("the two fastest rounds of t(2) disagree (0.11 s and 0.3 s); t(1) was 0.02 s at the start "
                           "and 0.031 s at the end")
    quieter = P.Samples({1: (0.10,)}, (0.020, 0.012))  # the load that stopped while measuring: drift too
    assert P.check_cost(target_cost(table, samples=quieter)).kinds == (P.FlawKind.LOAD_DRIFT,)
    lenient = P.Tolerance(shape=0.35, rounds=2.0, drift=1.0)
    assert P.check_cost(target_cost(table, samples=apart), lenient).ok


def test_measurements_keep_their_samples_outside_their_value():
    config = tiny_model("llama").config
    cost = M.measure_format(config, "draft", "fp32", repeats=1, read_tokens=(8,))
    samples = cost.samples
    assert [n for n, _ in samples.rounds] == list(F.DRAFT_SIZES)
    assert all(len(times) >= M.ROUNDS for _, times in samples.rounds)
    assert len(samples.drift) == 2 and all(s > 0 for s in samples.drift)
    stored = P.FormatCost.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert stored == cost and stored.samples is None and "samples" not in cost.to_dict()
    real = M.measure_model(tiny_model("llama"), sizes=(1, 2), repeats=1, prefill_tokens=8)
    assert [n for n, _ in real.samples.rounds] == [1, 2] and len(real.samples.drift) == 2


# ---------------------------------------------------------------------------------------------------------
# the store: kept only when self-consistent


def _key(config, role="target", fmt="fp32") -> P.ProfileKey:
    return P.ProfileKey(role, fmt, P.model_fingerprint(config), P.DeviceIdentity.here("cpu"), torch.__version__)


def scripted(calls, *tables):
    """A measurer that returns ``tables`` in turn (the last one again when they run out), as fp32 target costs."""
    def measure(config, role, fmt, device, weights=None, **bound):
        calls.append((role, fmt))
        table = tables[min(len(calls), len(tables)) - 1]
        return target_cost(table, fmt=fmt)
    return measure


GOOD = seconds(GOOD_FP32)


def test_a_measurement_that_contradicts_itself_is_measured_again_and_kept_when_it_agrees(tmp_path):
    config = tiny_model("qwen2").config
    calls = []
    profile = S.get_profile(config, cache_dir=tmp_path, measurer=scripted(calls, LOADED_FP32, GOOD),
                            target_formats=["fp32"])
    assert calls == [("target", "fp32")] * 2 and profile.target[0].table == GOOD and profile.notes == ()
    assert S.read_entry(_key(config), tmp_path).table == GOOD


def test_a_measurement_that_never_agrees_is_cached_unverified_for_calls_to_calibrate(tmp_path, caplog):
    config = tiny_model("qwen2").config
    calls, lines = [], []
    with caplog.at_level(logging.WARNING, logger="hf_specdec.models.store"):
        profile = S.get_profile(config, cache_dir=tmp_path, measurer=scripted(calls, LOADED_FP32),
                                target_formats=["fp32"], log=lines.append)
    assert calls == [("target", "fp32")] * (1 + S.REMEASURE)
    assert profile.target[0].table == LOADED_FP32  # this process decides with it: nothing better was measured
    why = "t(12) = 9.63 s is below t(8) = 14.7 s; t(2) = 11 s is over 2 single steps (4.99 s)"
    assert profile.notes == (f"target fp32 cached unverified (timed 2 times, never self-consistent: {why}); "
                             "calibrated by the first call that disagrees",)
    assert f"  {profile.notes[0]}" in profile.describe().splitlines()
    assert lines[1] == f"the target in fp32 measured inconsistently ({why}); measuring it again"
    assert (f"hardware profile: the target in fp32 did not measure self-consistently ({why}); cached unverified, "
            "calibrated by the first call that disagrees") in caplog.messages
    path = _key(config).path(tmp_path)
    assert json.loads(path.read_text())[S.UNVERIFIED] == why
    calls.clear()  # the next process reads it as it is: no minutes of measuring in every process
    assert S.get_profile(config, cache_dir=tmp_path, measurer=scripted(calls, GOOD),
                         target_formats=["fp32"]).target[0].table == LOADED_FP32 and calls == []
    assert S.calibrate(_key(config), LOADED_FP32, 0.5, "a call disagreed", tmp_path)  # (seeding.call_end)
    S.get_profile(config, cache_dir=tmp_path, measurer=scripted(calls, GOOD), target_formats=["fp32"])
    assert calls == [] and S.read_entry(_key(config), tmp_path).table == {n: 0.5 * t for n, t in LOADED_FP32.items()}


def test_a_cached_entry_that_contradicts_itself_is_measured_again(tmp_path, caplog):
    config = tiny_model("qwen2").config
    for table, prefill, fmt in ((LOADED_FP32, LOADED_FP32_PREFILL, "fp32"), (LOADED_BF16, LOADED_BF16_PREFILL, "bf16")):
        path = S.write_entry(_key(config, fmt=fmt), target_cost(table, prefill, fmt), tmp_path)  # as written before
        calls = []
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_specdec.models.store"):
            assert S.read_entry(_key(config, fmt=fmt), tmp_path) is None
            profile = S.get_profile(config, cache_dir=tmp_path, measurer=scripted(calls, GOOD), target_formats=[fmt])
        assert calls == [("target", fmt)] and profile.target[0].table == GOOD
        assert f"hardware profile cache entry {path} contradicts itself (" in caplog.text
        assert S.read_entry(_key(config, fmt=fmt), tmp_path).table == GOOD  # rewritten


def test_calibrate_scales_only_the_entry_it_judged(tmp_path, caplog):
    config = tiny_model("qwen2").config
    key = _key(config)
    path = S.write_entry(key, target_cost(GOOD), tmp_path)
    assert not S.calibrate(key, {1: 0.5}, 3.0, "another table", tmp_path)  # measured again since: left alone
    assert S.read_entry(key, tmp_path).table == GOOD
    with caplog.at_level(logging.WARNING, logger="hf_specdec.models.store"):
        assert S.calibrate(key, GOOD, 3.0, "t(1): off", tmp_path)
    tripled = {n: 3.0 * t for n, t in GOOD.items()}
    assert json.loads(path.read_text())[S.CALIBRATED] == "t(1): off" and S.read_entry(key, tmp_path).table == tripled
    assert (f"hardware profile cache entry {path} disagrees with what a call timed (t(1): off); its t(n) is scaled "
            "by 3") in caplog.messages
    assert not S.calibrate(key, GOOD, 3.0, "again", tmp_path)  # calibrated since: the table it judged is gone
    assert not S.calibrate(_key(config, fmt="bf16"), GOOD, 3.0, "absent", tmp_path)
    calls = []
    S.get_profile(config, cache_dir=tmp_path, measurer=scripted(calls, GOOD), target_formats=["fp32"])
    assert calls == []  # a calibrated entry is read as it is: nothing measured again


def test_disagreement_is_judged_over_enough_forwards_both_ways():
    profile = {1: 0.1, 4: 0.12, 8: 0.2}
    assert seeding.disagreement(profile, {1: [0.3] * 4}) is None  # too few forwards to judge
    assert seeding.disagreement(profile, {16: [0.9] * 9}) is None  # beyond what the profile measured
    assert seeding.disagreement(profile, {1: [0.12] * 5, 6: [0.17, 0.15, 0.16, 0.2, 0.5]}) is None
    slow = seeding.disagreement(profile, {1: [0.12] * 5, 4: [0.13, 0.3, 0.31, 0.32, 0.4]})
    assert (slow.n, slow.samples) == (4, 5) and slow.ratio == pytest.approx(0.31 / 0.12)
    assert slow.why == "t(4): the profile predicts 0.12 s, 5 forwards of a call took 0.31 s (median), 2.6x"
    fast = seeding.disagreement({1: 2.493, 2: 11.0}, {1: [0.3] * 6, 2: [0.32] * 6})  # the worst size
    assert fast.why == "t(2): the profile predicts 11 s, 6 forwards of a call took 0.32 s (median), 0.029x"


NEW = 40
T_TARGET, T_DRAFT = 0.1, 0.005


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def flat(config, role, fmt, device, weights=None, **bound) -> P.FormatCost:
    """A flat profile: t(n) = 0.1 s, a draft step of 5 ms."""
    if role == "target":
        return P.FormatCost(fmt, {n: T_TARGET for n in F.TARGET_SIZES}, 100, 100 * T_TARGET, method="given")
    return P.FormatCost(fmt, {rows: T_DRAFT for rows in F.DRAFT_SIZES}, method="given")


def run_call(monkeypatch, cache, target_seconds):
    """A profile cached for a tiny pair, then one greedy call whose target forwards cost ``target_seconds``: the
    call's output (against plain generate), its stats and the two cache files."""
    model = tiny_model("llama", seed=0)
    draft = perturbed_copy(model, 0.02)
    prompt = torch.tensor([[1, 5, 9, 2, 7, 3, 8, 4]])
    expected = type(model).generate(model, prompt, max_new_tokens=NEW, do_sample=False)
    S.get_profile(model, draft, cache_dir=cache, target_formats=["fp32"], draft_formats=["fp32"], measurer=flat)
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, target_seconds, name="target")
    clock.charge(monkeypatch, draft, lambda n: T_DRAFT, name="draft")
    hf_specdec.enable(model)
    out = model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False)
    stats = model.last_spec_stats.get()
    assert torch.equal(out, expected) and stats.accepted > 0
    assert stats.estimates_from is EstimatesFrom.HARDWARE_PROFILE
    paths = {p.name.split("-")[0]: p for p in (cache / "profiles").glob("*.json")}
    return model, draft, stats, paths


def test_a_call_that_disagrees_with_the_cached_profile_calibrates_it(cache, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_specdec.models.store"):
        model, draft, stats, paths = run_call(monkeypatch, cache, lambda n: 5 * T_TARGET)  # 5x the profile
    found = seeding.disagreement({n: T_TARGET for n in F.TARGET_SIZES}, stats.verify_time_by_tokens)
    assert found.ratio == pytest.approx(5) and found.samples >= seeding.STALE_SAMPLES
    entry = json.loads(paths["target"].read_text())
    assert entry[S.CALIBRATED] == (
        f"t({found.n}): the profile predicts 0.1 s, {found.samples} forwards of a call took 0.5 s (median), 5x")
    assert S.CALIBRATED not in json.loads(paths["draft"].read_text())  # the draft's entry is not judged by t(n)
    assert "disagrees with what a call timed" in caplog.text
    # the next get_profile reads the target's entry as the call timed it: nothing is measured again
    calls = []
    profile = S.get_profile(model, draft, target_formats=["fp32"], draft_formats=["fp32"],
                            measurer=lambda *a, **k: calls.append(a[1:3]) or flat(*a, **k))
    assert calls == [] and profile.target[0].t1 == pytest.approx(5 * T_TARGET)


def test_a_call_that_agrees_leaves_the_cached_profile(cache, monkeypatch):
    model, draft, stats, paths = run_call(monkeypatch, cache, lambda n: 1.3 * T_TARGET)  # within the factor
    assert max(len(v) for v in stats.verify_time_by_tokens.values()) >= seeding.STALE_SAMPLES  # judged
    assert S.CALIBRATED not in json.loads(paths["target"].read_text())
    calls = []
    S.get_profile(model, draft, target_formats=["fp32"], draft_formats=["fp32"],
                  measurer=lambda *a, **k: calls.append(a[1:3]) or flat(*a, **k))
    assert calls == []
