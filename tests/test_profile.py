"""hf_specdec.models' hardware profile (formats, profile, measure, store, choose): its key, cache and round trip, the proxies, and the choices
(target dtype, draft format) on profiles built from given numbers: an AVX2-like CPU (bf16 multi-token forwards
steep, 4-bit the slowest draft) and an AMX-like one (bf16 flat). Nothing here depends on this CPU's speed: every
choice is made on numbers fed in, and real measurements are only checked for their shape."""

import dataclasses
import json

import pytest
import torch

from hf_specdec.costmodel import ForwardCost
from hf_specdec.models import choose as C
from hf_specdec.models import formats as F
from hf_specdec.models import hardware, loading, refs
from hf_specdec.models import measure as M
from hf_specdec.models import profile as P
from hf_specdec.models import store as S
from hf_specdec.models.cli import main as cli_main
from hf_specdec.models.packed import packed_available
from hf_specdec.models.tiny import tiny_model, tiny_model_dir


def ms(table):
    return {n: v / 1e3 for n, v in table.items()}


# an AMD EPYC with AVX2 only, as issue 14 measured it: bf16 steps faster but its forwards grow linearly in the
# tokens read (no bf16 FMA) and its prefill is compute-bound; fp32 verifies 8 tokens for ~3 steps; the 4-bit
# draft is the slowest draft format (c ~ 1.5)
AVX2 = P.HardwareProfile.from_numbers(
    {"bf16": {1: 0.20, 2: 0.38, 4: 0.75, 8: 1.5, 16: 3.0, 32: 6.0},
     "fp32": {1: 0.26, 2: 0.30, 4: 0.45, 8: 0.78, 16: 1.4, 32: 2.7}},
    prefill_per_token={"bf16": 0.19, "fp32": 0.084}, draft={"bf16": 0.07, "fp32": 0.08, "4bit": 0.35})
# a Sapphire Rapids with AMX: bf16 t(n) flat up to 32 tokens (the figures), fp32 steep; 4-bit the fastest draft
AMX = P.HardwareProfile.from_numbers(
    {"bf16": ms({1: 195, 2: 194, 4: 194, 8: 201, 16: 208, 32: 231}),
     "fp32": ms({1: 238, 2: 258, 4: 477, 8: 661, 16: 647, 32: 807})},
    prefill_per_token={"bf16": 0.002, "fp32": 0.006}, draft={"bf16": 0.088, "fp32": 0.087, "4bit": 0.0465},
    footprints={"bf16": 990_000_000, "fp32": 1_980_000_000, "4bit": 460_000_000})


# ---------------------------------------------------------------------------------------------------------
# keys, values, round trips


def test_fingerprint_follows_the_architecture_not_the_bookkeeping():
    base = tiny_model("qwen2").config
    renamed = type(base).from_dict({**base.to_dict(), "_name_or_path": "elsewhere", "eos_token_id": 7,
                                    "rms_norm_eps": 1e-5, "dtype": "bfloat16"})
    assert P.model_fingerprint(renamed) == P.model_fingerprint(base)
    for change in ({"hidden_size": 128}, {"num_hidden_layers": 3, "layer_types": None}, {"vocab_size": 97}, {"num_key_value_heads": 4}):
        other = type(base).from_dict({**base.to_dict(), **change})
        assert P.model_fingerprint(other) != P.model_fingerprint(base), change


def test_key_changes_with_format_model_device_and_torch(tmp_path):
    device = P.DeviceIdentity("cpu", "Some CPU", ("avx2", "amx_bf16"), 2)
    key = P.ProfileKey("target", "bfloat16", "abc", device, "2.13.0")
    assert key.format == "bf16" and key.path(tmp_path).parent == tmp_path / "profiles"
    variants = [dataclasses.replace(key, format="fp32"), dataclasses.replace(key, model="abd"),
                dataclasses.replace(key, torch_version="2.14.0"), dataclasses.replace(key, role="draft"),
                dataclasses.replace(key, device=dataclasses.replace(device, flags=("avx2",))),
                dataclasses.replace(key, device=dataclasses.replace(device, threads=1)),
                dataclasses.replace(key, device=P.DeviceIdentity("cuda", "NVIDIA H200", ("sm_90",), 2))]
    assert len({key.digest, *(v.digest for v in variants)}) == len(variants) + 1
    with pytest.raises(ValueError, match="role"):
        P.ProfileKey("verifier", "bf16", "abc", device, "2.13.0")
    with pytest.raises(ValueError, match="unknown format"):
        P.ProfileKey("target", "int3", "abc", device, "2.13.0")


def test_values_are_frozen_and_validated():
    cost = P.FormatCost("bf16", {2: 0.3, 1: 0.2}, 256, 1.0, 10, "proxy")
    assert cost.step == ((1, 0.2), (2, 0.3)) and cost.t1 == 0.2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.format = "fp32"
    for bad in (dict(step={2: 0.3}), dict(step={1: -0.1}), dict(step={1: float("nan")}),
                dict(step={1: 0.1}, prefill_tokens=256), dict(step={1: 0.1}, method="guessed")):
        with pytest.raises(ValueError):
            P.FormatCost("bf16", **bad)
    with pytest.raises(ValueError, match="twice"):
        P.HardwareProfile(P.DeviceIdentity("given", "given"), "x", (cost, cost))
    with pytest.raises(ValueError, match="target formats only"):
        P.HardwareProfile(P.DeviceIdentity("given", "given"), "x", (P.FormatCost("4bit", {1: 0.1}),))
    for bad in (dict(prompt_tokens=-1), dict(new_tokens=0), dict(acceptance=1.5), dict(max_draft_tokens=-1)):
        with pytest.raises(ValueError):
            C.Workload(**bad)


def test_profile_round_trips_and_feeds_the_cost_model():
    data = json.loads(json.dumps(AMX.to_dict()))
    assert P.HardwareProfile.from_dict(data) == AMX
    cost = AMX.target_cost("bfloat16")
    assert isinstance(cost, ForwardCost) and cost.table() == AMX.target_entry("bf16").table
    assert cost.estimate(1) == pytest.approx(0.195) and cost.estimate(3) == pytest.approx(0.194)
    assert AMX.draft_step("4bit") == 0.0465 and AMX.draft_step(torch.float32) == 0.087
    assert AMX.verify_cost("bf16", 8) == pytest.approx(201 / 195)
    assert AMX.prefill_seconds("bf16", 256) == pytest.approx(0.512)
    assert AMX.prefill_seconds("bf16", 4) == pytest.approx(0.194)  # a short prompt still reads every weight once
    with pytest.raises(KeyError, match="no target measurement in fp16"):
        AMX.target_cost("fp16")
    with pytest.raises(ValueError, match="schema"):
        P.HardwareProfile.from_dict({**data, "schema": "something/0"})
    assert "bf16" in AMX.describe() and "draft t(1)" in AMX.describe()


# ---------------------------------------------------------------------------------------------------------
# the cache


def _fake_measurer(calls, slow=()):
    """Formats cost bf16 0.2 s, fp32-packed 0.25 s, fp32 0.3 s, others 0.1 s a step (``slow`` ones 1.0 s); 8-bit
    is unavailable. Like ``measure_format`` it stops at a probe of t(1) when that is over ``slower_than``."""
    def measure(config, role, fmt, device, weights=None, slower_than=None):
        calls.append((role, fmt))
        if slower_than is not None and fmt in slow and 1.0 > slower_than:
            return P.FormatCost(fmt, {1: 1.0}, footprint_bytes=1000, method="probe")
        if fmt == "8bit":
            raise F.FormatUnavailable("bitsandbytes 8-bit kernels need wider layers")
        base = 1.0 if fmt in slow else {"bf16": 0.2, "fp32-packed": 0.25, "fp32": 0.3}.get(fmt, 0.1)
        sizes = F.role_sizes(role)
        return P.FormatCost(fmt, {n: base * (1 + 0.01 * n) for n in sizes},
                            P.PREFILL_TOKENS if role == "target" else 0,
                            base * 20 if role == "target" else None, 1000, "proxy")
    return measure


def test_get_profile_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    config = tiny_model("qwen2").config
    calls = []
    measure = _fake_measurer(calls)
    first = S.get_profile(config, config, cache_dir=tmp_path, measurer=measure)
    assert calls == [("target", f) for f in F.candidate_formats("target")] + \
        [("draft", f) for f in F.candidate_formats("draft")]
    assert first.target_formats == F.candidate_formats("target") and "8bit" not in first.draft_formats
    assert any("8bit" in note and "wider layers" in note for note in first.notes)  # left out, with the reason
    assert first.target_model == first.draft_model == P.model_fingerprint(config)
    calls.clear()
    again = S.get_profile(config, config, cache_dir=tmp_path, measurer=measure)
    assert calls == [("draft", "8bit")]  # only what could not be measured is tried again
    assert again.target == first.target and again.draft == first.draft
    calls.clear()
    S.get_profile(config, cache_dir=tmp_path, measurer=measure, refresh=True)
    assert calls == [("target", f) for f in F.candidate_formats("target")]
    calls.clear()
    monkeypatch.setattr(torch, "__version__", "99.0.0")  # another torch: another key, measured again
    S.get_profile(config, cache_dir=tmp_path, measurer=measure)
    assert calls == [("target", f) for f in F.candidate_formats("target")]
    calls.clear()
    other = type(config).from_dict({**config.to_dict(), "hidden_size": 128})
    assert S.get_profile(other, cache_dir=tmp_path, measurer=measure, cached_only=True).target == ()
    assert calls == []


def test_a_draft_format_slower_than_a_measured_one_stops_at_its_probe(tmp_path):
    """Once a draft format is measured, the next ones are measured under a bound of SLOWER_MARGIN times its t(1):
    one over it keeps its probe (t(1) alone), is cached as such, and is never chosen."""
    config = tiny_model("qwen2").config
    calls, bounds = [], []
    fake = _fake_measurer(calls, slow=("int4",))

    def measure(config, role, fmt, device, weights=None, **bound):
        bounds.append((fmt, bound.get("slower_than")))
        return fake(config, role, fmt, device, weights, **bound)

    profile = S.get_profile(None, config, cache_dir=tmp_path, measurer=measure, draft_formats=["bf16", "int4"])
    assert bounds == [("bf16", None), ("int4", pytest.approx(S.SLOWER_MARGIN * 0.2 * 1.01))]  # nothing to beat first
    assert profile.draft_entry("int4").method == "probe" and profile.draft_entry("int4").table == {1: 1.0}
    assert "int4 1000.0 ms" in profile.describe() and "a probe" in profile.describe()
    assert C.choose_draft_format(profile).value == "bf16"
    calls.clear()
    again = S.get_profile(None, config, cache_dir=tmp_path, measurer=measure, draft_formats=["bf16", "int4"])
    assert calls == [] and again.draft == profile.draft  # the probe is cached: not tried again


def test_measure_format_stops_at_the_probe_over_its_bound():
    """The real measurer on a tiny config: under an impossible bound it times one step of each proxy and returns
    t(1) alone; without one it measures every size."""
    config = tiny_model("llama").config
    probe = M.measure_format(config, "draft", "fp32", slower_than=1e-9)
    assert probe.method == "probe" and list(probe.table) == [1] and probe.t1 > 0 and not probe.read_table
    full = M.measure_format(config, "draft", "fp32", slower_than=1e3, read_tokens=(16,))
    assert full.method == "proxy" and list(full.table) == list(F.role_sizes("draft")) and full.read_table


def test_cached_costs_for_loaded_models_never_measure(tmp_path):
    target, draft = tiny_model("qwen2"), tiny_model("llama").to(torch.bfloat16)
    calls = []
    assert S.cached_costs(target, draft, cache_dir=tmp_path) == (None, None)  # nothing cached, nothing measured
    S.get_profile(target, draft, cache_dir=tmp_path, measurer=_fake_measurer(calls))
    forward, steps = S.cached_costs(target, draft, cache_dir=tmp_path)
    assert forward == pytest.approx({n: 0.3 * (1 + 0.01 * n) for n in F.TARGET_SIZES})  # the fp32 target's curve
    assert steps == pytest.approx({rows: 0.2 * (1 + 0.01 * rows) for rows in (1, 2, 4, 8)})  # the bf16 draft's step


def test_cache_entries_survive_only_their_own_key(tmp_path):
    key = P.ProfileKey("draft", "4bit", "abc", P.DeviceIdentity("cpu", "A CPU", ("avx2",), 2), "2.13.0")
    cost = P.FormatCost("4bit", {1: 0.05}, footprint_bytes=123, method="proxy")
    path = S.write_entry(key, cost, tmp_path, seconds=1.5)
    assert S.read_entry(key, tmp_path) == cost and json.loads(path.read_text())["measure_seconds"] == 1.5
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "key": {**data["key"], "torch": "2.12.0"}}))  # a stale file in place
    assert S.read_entry(key, tmp_path) is None
    path.write_text("{not json")
    assert S.read_entry(key, tmp_path) is None
    assert S.read_entry(dataclasses.replace(key, format="8bit"), tmp_path) is None


# ---------------------------------------------------------------------------------------------------------
# choices


def test_avx2_like_profile_chooses_by_prompt_length():
    """Plain decoding (no useful draft): bf16 steps faster, fp32 prefills faster; which wins is the prompt's."""
    plain = dataclasses.replace(AVX2, draft=())
    short = C.choose_dtype(plain, C.Workload(prompt_tokens=8, new_tokens=128))
    long = C.choose_dtype(plain, C.Workload(prompt_tokens=512, new_tokens=128))
    assert short.value == "bf16" and long.value == "fp32"
    for choice in (short, long):
        seconds = dict(choice.seconds)
        assert choice.value == min(seconds, key=seconds.get)  # the lowest expected end-to-end time
        assert choice.draft_tokens == 0
    assert "verifying 8 tokens costs 7.50 steps in bf16" in short.why and "speculation off" in short.why
    # prefill in fp32, decode in bf16 would beat either alone on a 256-token prompt: reported with its figure
    split = C.choose_dtype(plain, C.Workload(prompt_tokens=256, new_tokens=128)).split
    assert split.startswith("prefill in fp32") and "decode in bf16" in split and "% less than" in split
    assert C.choose_dtype(plain, C.Workload(prompt_tokens=8, new_tokens=128)).split is None


def test_without_a_workload_the_dtype_whose_worst_typical_call_loses_least_is_chosen():
    """No bf16 units: bf16 is the faster dtype for a short prompt and the slower for a long one, so one dtype
    loses on some call. Without a workload (``load_pair`` before any prompt) the choice is the dtype whose worst
    typical call is the least slower than that call's fastest dtype, and the why says both worst cases. (The
    AVX2 EPYC of stop 37, plain steps: bf16 steps 2.1x faster and prefills 5x slower; for a 256-token prompt and
    128 new tokens bf16 is expected 1% faster, so a choice for that call alone takes it.)"""
    plain = P.HardwareProfile.from_numbers({"bf16": {1: 0.183, 8: 1.16}, "fp32": {1: 0.39, 8: 1.2}},
                                           prefill_per_token={"bf16": 0.124, "fp32": 0.024})
    assert C.choose_dtype(plain, C.Workload()).value == "bf16"
    worst = C.worst_calls(plain, ["bf16", "fp32"], C.TYPICAL_CALLS, None)
    per_call = {call: C.choose_dtype(plain, call).value for call in C.TYPICAL_CALLS}
    assert set(per_call.values()) == {"bf16", "fp32"}  # neither is the fastest on every call
    choice = C.choose_dtype(plain)
    assert choice.value == min(worst, key=lambda f: worst[f][0])
    other = ({"bf16", "fp32"} - {choice.value}).pop()
    assert 1.0 < worst[choice.value][0] < worst[other][0]
    assert all(ratio >= 1.0 for ratio, _ in worst.values())
    ratio, call = worst[choice.value]
    assert (f"over calls of 32-512 prompt tokens and 32-128 new tokens, the slowest against the fastest dtype: "
            f"{choice.value} {ratio:.2f}x (a {call.prompt_tokens}-token prompt, {call.new_tokens} new tokens)"
            in choice.why)
    assert "over calls" not in C.choose_dtype(plain, C.Workload()).why  # a given workload: that call alone


def test_avx2_like_profile_speculates_in_fp32_with_a_full_precision_draft():
    draft = C.choose_draft_format(AVX2, target_dtype="fp32")
    assert draft.value == "bf16"  # 4-bit is the slowest here; bf16 and fp32 tie within 5%: bf16, half the memory
    assert "c = 0.27" in draft.why
    choice = C.choose_dtype(AVX2, C.Workload(prompt_tokens=64, new_tokens=128, acceptance=0.7))
    assert choice.value == "fp32" and choice.draft_tokens >= 1  # fp32 verifies cheaply enough to speculate
    assert "speculation can pay" in choice.why
    assert C.choose_dtype(AVX2, C.Workload(prompt_tokens=4, new_tokens=128, acceptance=0.7)).value == "bf16"


def test_amx_like_profile_chooses_bf16_and_the_fastest_draft():
    choice = C.choose_dtype(AMX)
    assert choice.value == "bf16" and choice.draft_tokens >= 1 and choice.split is None
    assert "verifying 8 tokens costs 1.03 steps in bf16" in choice.why and "speculation can pay" in choice.why
    draft = C.choose_draft_format(AMX, target_dtype="bf16", memory_bytes=64 * 10**9)
    assert draft.value == "4bit" and "the fastest here" in draft.why and "c = 0.24" in draft.why


def test_draft_format_follows_the_memory_left():
    slow_4bit = dataclasses.replace(AMX, draft=(P.FormatCost("bf16", {1: 0.05}, footprint_bytes=990_000_000),
                                                P.FormatCost("4bit", {1: 0.06}, footprint_bytes=460_000_000)))
    assert C.choose_draft_format(slow_4bit, memory_bytes=8 * 10**9).value == "bf16"  # 4-bit only if it must
    tight = C.choose_draft_format(slow_4bit, memory_bytes=700_000_000)
    assert tight.value == "4bit" and "bf16 would not fit" in tight.why
    nothing = C.choose_draft_format(slow_4bit, memory_bytes=100_000_000)
    assert nothing.value == "4bit" and "no measured format fits" in nothing.why
    assert C.choose_draft_format(slow_4bit, candidates=["bf16"]).value == "bf16"


# ---------------------------------------------------------------------------------------------------------
# load_model on an injected profile (no measurement)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), hidden=64)  # bitsandbytes' CPU kernels need >= 64


@pytest.fixture
def no_measuring(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measured although a profile was given")

    monkeypatch.setattr(M, "measure_format", refuse)


@pytest.mark.parametrize("profile,expected", [(AMX, torch.bfloat16), (dataclasses.replace(AVX2, draft=()),
                                                                     torch.float32)])
def test_load_model_auto_dtype_uses_the_given_profile(tiny_dir, no_measuring, profile, expected):
    workload = C.Workload(prompt_tokens=512)
    model, _, info = loading.load_model(str(tiny_dir), dtype="auto", profile=profile, workload=workload)
    assert model.dtype == expected and info.dtype == str(expected).removeprefix("torch.")
    assert info.choice == C.choose_dtype(profile, workload) and info.why == info.choice.why
    assert info.quantize is None


def test_load_model_auto_quantize_loads_the_chosen_draft_format(tiny_dir, no_measuring):
    fast_int8 = P.HardwareProfile.from_numbers(draft={"fp32": 0.2, "bf16": 0.2, "dynamic-int8": 0.05, "4bit": 0.3})
    model, _, info = loading.load_model(str(tiny_dir), quantize="auto", profile=fast_int8)
    assert info.quantize == "dynamic-int8" and info.dtype == "float32" and F.model_format(model) == "dynamic-int8"
    assert info.choice.kind == "draft_format" and info.choice.value == "dynamic-int8"
    with torch.no_grad():
        assert model(torch.tensor([[1, 5, 6]])).logits.shape[-1] == model.config.vocab_size
    json.dumps(dataclasses.asdict(info))  # the eval harness stores it as JSON
    fp32 = P.HardwareProfile.from_numbers(draft={"fp32": 0.05, "4bit": 0.3})
    model, _, info = loading.load_model(str(tiny_dir), quantize="auto", profile=fp32)
    assert F.model_format(model) == "fp32" and info.quantize is None


def test_a_draft_that_runs_out_of_memory_is_loaded_in_4bit(tiny_dir, no_measuring, monkeypatch, caplog):
    pytest.importorskip("bitsandbytes")
    real = refs.from_pretrained

    def only_quantized_fits(path, **kwargs):
        if "quantization_config" not in kwargs:
            raise MemoryError()
        return real(path, **kwargs)

    monkeypatch.setattr(refs, "from_pretrained", only_quantized_fits)
    profile = P.HardwareProfile.from_numbers(draft={"bf16": 0.05, "4bit": 0.3})
    model, _, info = loading.load_model(str(tiny_dir), quantize="auto", profile=profile)
    assert info.quantize == "4bit" and F.model_format(model) == "4bit"
    assert "ran out of memory at load in bf16" in info.why and "loading it in 4-bit" in caplog.text
    with pytest.raises(hardware.ModelLoadOOMError):  # a target (no auto draft) still fails with the remedy
        loading.load_model(str(tiny_dir), dtype="bf16")


def test_a_profile_of_another_model_is_refused(tiny_dir, no_measuring):
    other = tiny_model("qwen2").config
    profile = dataclasses.replace(AMX, target_model=P.model_fingerprint(other))
    with pytest.raises(ValueError, match="another model"):
        loading.load_model(str(tiny_dir), dtype="auto", profile=profile)


def test_load_pair_prices_the_draft_into_the_target_choice(tiny_dir, no_measuring):
    (target, _, t_info), (draft, _, d_info) = loading.load_pair(str(tiny_dir), str(tiny_dir), profile=AVX2,
                                                                  workload=C.Workload(prompt_tokens=64))
    assert t_info.choice.value == "fp32" and t_info.choice.draft_tokens >= 1 and target.dtype == torch.float32
    assert d_info.choice.value == "bf16" and draft.dtype == torch.bfloat16
    (_, _, t_info), (draft, _, d_info) = loading.load_pair(str(tiny_dir), str(tiny_dir), dtype="bf16",
                                                           draft_quantize=None)
    assert t_info.choice is None and d_info.choice is None and draft.dtype == torch.bfloat16


def test_explicit_dtypes_need_no_profile(tiny_dir, no_measuring):
    assert loading.load_model(str(tiny_dir), dtype="fp32").info.choice is None
    with pytest.raises(ValueError, match="measured hardware profile"):
        hardware.resolve_dtype("auto")


# ---------------------------------------------------------------------------------------------------------
# proxies (shape and scaling, not speed)


def test_proxies_scale_to_the_real_layer_count():
    model = tiny_model("qwen2", num_hidden_layers=5, tie_word_embeddings=True)
    view = M.one_layer_view(model)
    assert len(view.model.layers) == 1 and view.config.num_hidden_layers == 1 and model.config.num_hidden_layers == 5
    assert view.model.layers[0].mlp.up_proj.weight is model.model.layers[0].mlp.up_proj.weight  # shared, no copy
    cost = M.measure_format(model.config, "target", "fp32", sizes=(1, 2, 4), repeats=1, prefill_tokens=16)
    assert [n for n, _ in cost.step] == [1, 2, 4] and cost.method == "proxy" and cost.prefill_tokens == 16
    assert all(s > 0 for _, s in cost.step) and cost.prefill_s > 0
    # footprints scale exactly: embeddings + 5 layers, as the real model holds them
    assert cost.footprint_bytes == hardware.footprint_bytes(model)
    draft = M.measure_format(model.config, "draft", "dynamic-int8", repeats=1)
    assert [n for n, _ in draft.step] == list(F.DRAFT_SIZES) == [1, 2, 4, 8] and draft.prefill_s is None  # by rows
    quantized = hardware.quantize_dynamic_int8(tiny_model("qwen2", num_hidden_layers=5, tie_word_embeddings=True))
    assert draft.footprint_bytes == hardware.footprint_bytes(quantized)
    real = M.measure_model(model, sizes=(1, 2), repeats=1, prefill_tokens=8)
    assert real.method == "real" and real.format == "fp32"


def test_8bit_is_measured_on_the_real_weights(tiny_dir):
    """LLM.int8's cost depends on the activations' outliers, which random proxies lack: real weights or nothing."""
    pytest.importorskip("bitsandbytes")
    config, weights = refs.config_of(str(tiny_dir))
    assert weights == str(tiny_dir)
    with pytest.raises(F.FormatUnavailable, match="real activations"):
        M.measure_format(config, "draft", "8bit")
    cost = M.measure_format(config, "draft", "8bit", weights=weights, repeats=1)
    assert cost.method == "real" and cost.format == "8bit" and [n for n, _ in cost.step] == list(F.DRAFT_SIZES)


def test_model_format_names_what_was_loaded():
    model = tiny_model("llama")
    assert F.model_format(model) == "fp32" and F.model_format(model.to(torch.bfloat16)) == "bf16"
    assert F.model_format(hardware.quantize_dynamic_int8(tiny_model("llama"))) == "dynamic-int8"
    assert F.format_load_args("4bit") == (torch.bfloat16, "4bit")
    assert F.format_load_args("dynamic-int8") == (torch.float32, "dynamic-int8")
    assert F.format_load_args("bfloat16") == (torch.bfloat16, None)
    assert F.format_load_args("fp32-packed") == (torch.float32, "fp32-packed")
    if packed_available():
        assert F.model_format(F.quantize_loaded(tiny_model("llama"), "fp32-packed")) == "fp32-packed"


# ---------------------------------------------------------------------------------------------------------
# hf-specdec tune


def test_tune_measures_caches_and_prints(tiny_dir, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(M, "measure_format", _fake_measurer(calls))
    argv = ["tune", "--target", str(tiny_dir), "--draft", str(tiny_dir), "--cache-dir", str(tmp_path)]
    assert cli_main([*argv, "--json", "--prompt-tokens", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "hf_specdec.tune/1" and out["choices"]["workload"]["prompt_tokens"] == 32
    profile = P.HardwareProfile.from_dict(out["profile"])
    assert profile.target_formats == F.candidate_formats("target")
    assert out["choices"]["target_dtype"]["value"] == "bf16"
    assert out["choices"]["draft_format"]["value"] in profile.draft_formats
    assert len(list((tmp_path / "profiles").glob("*.json"))) == len(calls) - 1  # all but the unavailable 8bit
    measured = len(calls)
    assert cli_main([*argv, "--cached"]) == 0  # the cache answers; text output
    text = capsys.readouterr().out
    assert len(calls) == measured + 1 and "hardware profile" in text and "target dtype: bf16" in text
    assert cli_main([*argv, "--draft", "none"]) == 0  # tune re-measures the target alone
    assert calls[measured + 1:] == [("target", f) for f in F.candidate_formats("target")]
    capsys.readouterr()
    assert cli_main(["tune", "--target", str(tmp_path / "nothing"), "--cache-dir", str(tmp_path)]) == 2


# ---------------------------------------------------------------------------------------------------------
# the harness: what loading chose, shown the same everywhere, and the speculative memory seeded from a profile


def test_harness_seeds_the_speculative_memory_from_a_given_profile(tmp_path):
    from hf_specdec.harness import Harness, choice_line, seed_memory
    from hf_specdec.models.tiny import tiny_model

    target, draft = tiny_model("qwen2", seed=0).eval(), tiny_model("qwen2", seed=1).eval()
    given = P.HardwareProfile.from_numbers({"fp32": {1: 0.2, 2: 0.21, 4: 0.22, 8: 0.25}}, draft={"fp32": 0.05})
    with Harness(target, None, draft, profile=given) as harness:
        record = harness.memory_seed
    assert record["seeded"] and record["source"] == "the given hardware profile"
    assert record["forward_sizes"] == [1, 2, 4, 8] and record["c"] == pytest.approx(0.25)
    assert record["why"] == ("seeded from the given hardware profile: target t(n) in fp32 at 4 sizes "
                             "(t(1) 200.0 ms), draft step in fp32 50.0 ms, c = 0.25")
    estimates = target.speculative_memory.estimates(draft)
    assert estimates.forward.estimate(8) == pytest.approx(0.25) and estimates.draft_step.estimate(1) == pytest.approx(0.05)
    # lookahead's memories start from the same t(n): the model's own, the harness's warm one and every cold one
    assert record["forward_seconds"] == {1: 0.2, 2: 0.21, 4: 0.22, 8: 0.25}
    assert target.lookahead_memory.estimates.forward.estimate(4) == pytest.approx(0.22)
    cold, other_cold = harness.cold_memory(), harness.cold_memory()
    assert cold is not other_cold and cold is not harness.memory and not cold.corpus.tokens
    assert cold.estimates.forward.estimate(8) == harness.memory.estimates.forward.estimate(8) == pytest.approx(0.25)
    again = seed_memory(target, draft, profile=given)  # what the memory learned is never overwritten
    assert not again["seeded"] and "already holds estimates" in again["why"]
    other = tiny_model("qwen2", seed=2).eval()
    missing = seed_memory(target, other, cache_dir=tmp_path)  # an empty profile cache: nothing measured here
    assert not missing["seeded"] and missing["why"].startswith("not seeded: no cached hardware profile")
    bf16_only = P.HardwareProfile.from_numbers({"bf16": {1: 0.1}}, draft={"4bit": 0.05})
    assert "neither the target in fp32 nor the draft in fp32" in seed_memory(target, other, profile=bf16_only)["why"]
    asked = loading.LoadInfo(ref="x", kind="pretrained", path="x", dtype="float32", quantize=None, device="cpu",
                             load_time_s=0.0, choice=None)
    assert choice_line("target", asked) == "target fp32 (as asked)"
    assert choice_line("draft", dataclasses.replace(asked, quantize="4bit")) == "draft 4bit (as asked)"


# ---------------------------------------------------------------------------------------------------------
# damaged caches never raise (issue 30): measured again, or kept in memory, with a warning


def _entry(config, role="target", fmt="bf16") -> P.ProfileKey:
    return P.ProfileKey(role, fmt, P.model_fingerprint(config), P.DeviceIdentity.here("cpu"), torch.__version__)


def test_a_damaged_cache_entry_is_measured_again(tmp_path, caplog):
    config = tiny_model("qwen2").config
    calls = []
    measure = _fake_measurer(calls)
    S.get_profile(config, cache_dir=tmp_path, measurer=measure, target_formats=["bf16"])
    path = _entry(config).path(tmp_path)
    good = json.loads(path.read_text())
    damaged = {
        "not UTF-8": b"\xff\xfe{\x00",
        "a step of the wrong type": json.dumps({**good, "cost": {**good["cost"], "step": [[1, 0.2]]}}).encode(),
        "a cost of the wrong type": json.dumps({**good, "cost": ["bf16"]}).encode(),
        "a time that is no number": json.dumps({**good, "cost": {**good["cost"], "step": {"1": None}}}).encode(),
    }
    for what, data in damaged.items():
        path.write_bytes(data)
        calls.clear()
        caplog.clear()
        profile = S.get_profile(config, cache_dir=tmp_path, measurer=measure, target_formats=["bf16"])
        assert calls == [("target", "bf16")], what  # measured again
        assert profile.target_formats == ("bf16",) and str(path) in caplog.text, what  # with a warning
        assert S.read_entry(_entry(config), tmp_path) == profile.target[0], what  # and rewritten


def test_seed_memory_runs_unseeded_parts_past_a_damaged_entry(tmp_path):
    from hf_specdec import enable
    from hf_specdec.harness import seed_memory

    target, draft = tiny_model("qwen2"), tiny_model("llama").to(torch.bfloat16)
    S.get_profile(target, draft, cache_dir=tmp_path, measurer=_fake_measurer([]))
    path = _entry(draft.config, "draft", "bf16").path(tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "cost": {**data["cost"], "step": [[1, 0.2]]}}))
    enable(target)
    record = seed_memory(target, draft, cache_dir=tmp_path)  # never raises: the target's t(n) is still seeded
    assert record["seeded"] and record["forward_sizes"] == list(F.TARGET_SIZES) and record["draft_step_s"] is None


def test_an_unwritable_cache_keeps_the_measured_profile(tmp_path, caplog):
    config = tiny_model("qwen2").config
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")  # <cache>/profiles cannot be made
    profile = S.get_profile(config, cache_dir=blocked, measurer=_fake_measurer([]), target_formats=["bf16"])
    assert profile.target_formats == ("bf16",) and "cannot be written" in caplog.text
    path = _entry(config).path(tmp_path)
    path.mkdir(parents=True)  # the entry's name taken: the rename fails after the temporary file is written
    profile = S.get_profile(config, cache_dir=tmp_path, measurer=_fake_measurer([]), target_formats=["bf16"])
    assert profile.target_formats == ("bf16",)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


# ---------------------------------------------------------------------------------------------------------
# the draft's prompt read: measured warm at a few prompt lengths, kept in the profile, old files still read


def test_the_draft_prompt_read_is_measured_and_kept(tmp_path):
    model = tiny_model("qwen2", num_hidden_layers=3)
    draft = M.measure_format(model.config, "draft", "fp32", repeats=1, read_tokens=(8, 32))
    assert [n for n, _ in draft.prompt_read] == [8, 32] and all(s > 0 for _, s in draft.prompt_read)
    target = M.measure_format(model.config, "target", "fp32", sizes=(1, 2), repeats=1, prefill_tokens=8)
    assert target.prompt_read == ()  # a target's prompt is its prefill
    assert P.FormatCost.from_dict(json.loads(json.dumps(draft.to_dict()))) == draft
    old = {k: v for k, v in draft.to_dict().items() if k != "prompt_read"}  # a file written before it was measured
    assert P.FormatCost.from_dict(old).prompt_read == ()
    profile = P.HardwareProfile.from_numbers(draft={"4bit": 0.05}, draft_read={"4bit": {16: 0.012, 64: 0.018,
                                                                                        256: 0.042}})
    assert profile.draft_read("4bit") == {16: 0.012, 64: 0.018, 256: 0.042}
    assert P.linear_parts(profile.draft_read("4bit")) == pytest.approx((0.01, 0.000125))
    assert "draft prompt read" in profile.describe() and "10.0 ms + 0.125 ms/token" in profile.describe()
    with pytest.raises(ValueError):
        P.FormatCost("4bit", {1: 0.05}, prompt_read={16: -1.0})


def test_seed_memory_passes_the_draft_prompt_read():
    from hf_specdec import enable
    from hf_specdec.harness import seed_memory

    target, draft = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    given = P.HardwareProfile.from_numbers({"fp32": {1: 0.2, 2: 0.21}}, draft={"fp32": 0.05},
                                           draft_read={"fp32": {16: 0.02, 64: 0.05}})
    enable(target)
    record = seed_memory(target, draft, profile=given)
    assert record["draft_read_seconds"] == {16: 0.02, 64: 0.05} and "prompt read at 16/64 tokens" in record["why"]
    share = (0.02 / given.prefill_seconds("fp32", 16) + 0.05 / given.prefill_seconds("fp32", 64)) / 2  # the median
    assert target.speculative_memory.estimates(draft).draft_read.prior == pytest.approx(share)
    plain = tiny_model("qwen2", seed=2)
    assert "not enabled" in seed_memory(plain, draft, profile=given)["why"]  # seeding enables nothing itself


def test_a_draft_step_is_timed_through_the_head_it_drafts_with(monkeypatch):
    """A draft over a vocabulary the drafter narrows (over 65536 ids) is timed through the narrowed head it
    drafts with (SubVocabHead over the first 32768 ids), whose weights count in its footprint; a target, and a
    draft whose vocabulary is not narrowed, through their own output layer."""
    from hf_specdec.drafters.draft_model import SubVocabHead

    wide = tiny_model("qwen2", vocab=70000, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      tie_word_embeddings=False).eval()
    heads = []
    real = M.forward_times
    monkeypatch.setattr(M, "forward_times", lambda *a, head=None, **k: heads.append(head) or real(*a, head=head, **k))
    head = M.drafting_head(wide)
    assert isinstance(head, SubVocabHead) and head.token_ids.tolist() == list(range(32768))
    draft = M.measure_model(wide, "draft", sizes=(1,), repeats=1, rounds=1, read_tokens=(8,))
    assert [h.token_ids.numel() for h in heads] == [32768, 32768]  # its rounds, and t(1) again at the end (drift)
    assert draft.footprint_bytes == hardware.footprint_bytes(wide) + 32768 * 16 * 4  # the narrowed fp32 copy
    heads.clear()
    M.measure_model(wide, "target", sizes=(1,), repeats=1, rounds=1)
    assert heads == [None, None]
    assert M.drafting_head(tiny_model()) is None  # 384 ids: scored in full


def test_draft_keys_name_how_a_step_is_timed():
    """Draft entries timed through the whole output layer (cached before draft steps were timed as they draft)
    are measured again: the draft key carries the step's method, the target key is unchanged."""
    device = P.DeviceIdentity("cpu", "x")
    target, draft = (P.ProfileKey(role, "fp32", "m", device, "2.13.0") for role in ("target", "draft"))
    assert "step" not in target.to_dict() and draft.to_dict()["step"] == P.DRAFT_STEP == "drafting-head"
