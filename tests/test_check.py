"""`hf-specdec check`: tokenizer compatibility (equal, padded, different vocabularies), the hardware profile and
its choices (fed in with --profile: nothing here depends on this CPU), the cost model, teacher-forced acceptance,
the vLLM command and the versions it holds for, exit codes and the --json schema, on tiny random models."""

import json
import shlex

import pytest
import torch
from transformers import AutoTokenizer

from hf_specdec.costmodel import expected_tokens, prefix_gains
from hf_specdec.models import compat
from hf_specdec.models import HardwareProfile
from hf_specdec.models.tiny import tiny_model_dir, word_tokenizer
from hf_specdec.models.cli import main as cli_main

TOP_KEYS = {"schema", "compatible", "reason", "hardware", "target", "draft", "tokenizer", "parameter_ratio",
            "parameter_ratio_guidance", "profile", "choices", "cost", "profile_error", "acceptance", "prediction",
            "recommendation", "vllm"}
# given numbers (seconds): bf16 verifies flat, fp32 steeply; the fp32 draft is the fastest format
PROFILE = HardwareProfile.from_numbers(
    {"bf16": {1: 0.20, 2: 0.20, 4: 0.21, 8: 0.22}, "fp32": {1: 0.25, 2: 0.40, 4: 0.70, 8: 1.3}},
    prefill_per_token={"bf16": 0.002, "fp32": 0.004}, draft={"fp32": 0.03, "bf16": 0.05})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    size = len(word_tokenizer().get_vocab())
    profile = root / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    return {
        "target": tiny_model_dir(root / "target", seed=0, layers=2),
        "draft": tiny_model_dir(root / "draft", seed=1, layers=1),
        "padded": tiny_model_dir(root / "padded", seed=2, layers=1, vocab_size=size + 12),
        "other": tiny_model_dir(root / "other", tokenizer=word_tokenizer(permute=True), seed=3, layers=1),
        "profile": profile,
    }


@pytest.fixture(scope="module")
def FAST(dirs):
    return ["--repeats", "1", "--max-k", "3", "--max-new-tokens", "6", "--dtype", "fp32", "--profile",
            str(dirs["profile"])]


def _check(capsys, *argv):
    code = cli_main(["check", *argv])
    return code, capsys.readouterr()


# ---------------------------------------------------------------------------------------------------------
# tokenizer compatibility


def test_compat_identical_padded_different():
    a, b = word_tokenizer(), word_tokenizer()
    n = len(a.get_vocab())
    same = compat.tokenizer_compatibility(a, b, n, n)
    assert same["compatible"] and same["kind"] == "identical" and same["shared_vocab_size"] == n
    padded = compat.tokenizer_compatibility(a, b, n + 128, n)  # e.g. Qwen2.5 7B 152,064 vs 0.5B 151,936
    assert padded["compatible"] and padded["kind"] == "padded" and padded["shared_vocab_size"] == n
    assert "padding" in padded["notes"][0]
    diff = compat.tokenizer_compatibility(a, word_tokenizer(permute=True), n, n)
    assert not diff["compatible"] and diff["kind"] == "different" and "different ids" in diff["reason"]
    short = compat.tokenizer_compatibility(a, b, n, n - 1)
    assert not short["compatible"] and "embedding rows" in short["reason"]


def test_qwen_like_padding_sizes():
    a = word_tokenizer()
    r = compat.tokenizer_compatibility(a, word_tokenizer(), 152_064, 151_936)
    assert r["compatible"] and r["shared_vocab_size"] == 151_936


# ---------------------------------------------------------------------------------------------------------
# cost model and acceptance


def test_expected_tokens_and_prediction():
    assert expected_tokens(prefix_gains([0.0] * 4)) == 1.0
    assert expected_tokens(prefix_gains([1.0] * 4)) == 5.0
    assert expected_tokens(prefix_gains([0.5] * 2)) == pytest.approx(1.75)
    cost = {"c": 0.05, "verify_cost": {"0": 1.0, "1": 1.1, "2": 1.2}}
    acc = {"alpha": 0.5, "expected_tokens_measured": {"0": 1.0, "1": 1.5, "2": 1.75}}
    rows = compat.predict(cost, acc, 2)
    assert [r["k"] for r in rows] == [0, 1, 2] and rows[0]["speedup"] == pytest.approx(1.0)
    assert rows[2]["speedup"] == pytest.approx(1.75 / (2 * 0.05 + 1.2))
    rec = compat.recommend(cost, rows)
    assert rec["mode"] == "speculative" and rec["policy"] == "adaptive" and rec["k"] == 2
    slow = {"c": 2.0, "verify_cost": {str(k): 1.0 + k for k in range(5)}}
    assert compat.recommend(slow, compat.predict(slow, acc | {"alpha": 0.1}, 2))["mode"] == "plain"
    cheap = {"c": 2.0, "verify_cost": {str(k): 1.0 + 0.01 * k for k in range(5)}}
    assert compat.recommend(cheap, compat.predict(cheap, acc, 4))["mode"] == "lookahead"


def test_acceptance_of_a_model_with_itself_is_one(dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()
    tok = AutoTokenizer.from_pretrained(dirs["target"])
    acc = compat.measure_acceptance(model, model, tok, ["def sort the list", "import json"], shared_vocab=
                                    model.config.vocab_size, max_new_tokens=5, max_k=3)
    assert acc["tokens"] > 0 and acc["alpha"] == 1.0
    assert acc["per_position"] == [1.0, 1.0, 1.0] and acc["expected_tokens_measured"]["3"] == 4.0


def test_measured_costs_come_from_the_one_probe(dirs, monkeypatch):
    """check's c and v(k) are hf_specdec.costmodel.forward_times medians, re-keyed: v(k) is the time over k + 1
    new tokens over the time over 1."""
    from transformers import AutoModelForCausalLM

    from hf_specdec.models import measure

    model = AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()
    tok = AutoTokenizer.from_pretrained(dirs["target"])
    fake = {1: 0.010, 2: 0.011, 3: 0.013, 4: 0.020}
    calls = []

    def forward_times(m, prefix_ids, sizes, repeats=5):
        calls.append((m, tuple(prefix_ids.shape), list(sizes), repeats))
        return {n: fake[n] if m is model else 0.002 for n in sizes}

    monkeypatch.setattr(measure, "forward_times", forward_times)
    draft = AutoModelForCausalLM.from_pretrained(dirs["draft"]).eval()
    cost = compat.measure_costs(model, draft, tok, shared_vocab=model.config.vocab_size, max_k=3, repeats=2,
                                prefix_tokens=16)
    assert calls == [(model, (1, 16), [1, 2, 3, 4], 2), (draft, (1, 16), [1], 2)]
    assert cost["verify_cost"] == pytest.approx({"0": 1.0, "1": 1.1, "2": 1.3, "3": 2.0})
    assert cost["c"] == pytest.approx(0.2) and cost["t_step_ms"] == pytest.approx(10.0)
    assert cost["t_verify_ms"]["3"] == pytest.approx(20.0)


def test_forward_times_leave_the_prefix_cached(dirs):
    from transformers import AutoModelForCausalLM

    from hf_specdec.harness import measure_costs

    model = AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()
    costs = measure_costs(model, None, torch.arange(4, 20)[None], [2, 3], repeats=2)
    assert set(costs["v"]) == {"1", "2", "3"} and costs["v"]["1"] == 1.0 and costs["t_step_s"] > 0
    assert costs["context_tokens"] == 16 and "c" not in costs


# ---------------------------------------------------------------------------------------------------------
# vLLM


def test_vllm_config():
    v = compat.vllm_config("qwen2.5-coder-1.5b-instruct", "bundle:qwen2.5-coder-0.5b-instruct", 4, "4bit")
    argv = shlex.split(v["command"])
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Coder-1.5B-Instruct"] and argv[3] == "--speculative-config"
    spec = json.loads(argv[4])
    assert spec == {"method": "draft_model", "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                    "num_speculative_tokens": 4, "quantization": "bitsandbytes"} == v["speculative_config"]
    assert v["valid_for"] == ">=0.14" and "vLLM >= 0.14" in v["note"] and "PR #24322" in v["note"]
    assert "0.10-0.13 reject it" in v["note"]
    plain = compat.vllm_config("/models/t", "/models/d", 3)
    assert "quantization" not in json.loads(shlex.split(plain["command"])[4])


# ---------------------------------------------------------------------------------------------------------
# CLI: exit codes and the JSON schema


def test_check_compatible_json(dirs, FAST, capsys):
    code, out = _check(capsys, "--target", str(dirs["target"]), "--draft", str(dirs["draft"]), "--json", *FAST)
    assert code == 0, out.err
    report = json.loads(out.out)
    assert set(report) == TOP_KEYS and report["schema"] == compat.SCHEMA
    assert report["compatible"] and report["reason"] is None and report["tokenizer"]["kind"] == "identical"
    assert 0 < report["parameter_ratio"] < 1 and report["parameter_ratio_guidance"] == pytest.approx(0.02)
    for who in ("target", "draft"):
        assert {"ref", "kind", "path", "vocab_size", "parameters", "footprint_bytes", "dtype", "quantize",
                "load_time_s"} <= set(report[who]) and report[who]["footprint_bytes"] > 0
    cost = report["cost"]
    assert cost["c"] > 0 and list(cost["verify_cost"]) == ["0", "1", "2", "3"] and cost["verify_cost"]["0"] == 1.0
    acc = report["acceptance"]
    assert 0 <= acc["alpha"] <= 1 and len(acc["per_position"]) == 3 and acc["tokens"] > 0
    assert [r["k"] for r in report["prediction"]] == [0, 1, 2, 3]
    assert {"k", "expected_tokens", "expected_tokens_measured", "round_cost", "speedup", "speedup_measured"} \
        <= set(report["prediction"][1])
    rec = report["recommendation"]
    assert rec == compat.recommend(cost, report["prediction"]) and {"mode", "policy", "k", "why"} <= set(rec)
    spec = json.loads(shlex.split(report["vllm"]["command"])[4])
    assert spec["method"] == "draft_model" and spec["model"] == str(dirs["draft"])
    assert "vLLM >= 0.14" in report["vllm"]["note"] and report["vllm"]["valid_for"] == ">=0.14"
    assert report["hardware"]["dtype"] == "float32" and {"cpu_model", "cpu_flags", "torch_threads"} <= set(
        report["hardware"])
    assert HardwareProfile.from_dict(report["profile"]) == PROFILE
    assert report["target"]["choice"] is None and report["target"]["format"] == "fp32"  # --dtype fp32 was asked
    assert report["draft"]["choice"]["value"] == "fp32" and report["draft"]["format"] == "fp32"
    assert set(report["profile_error"]) == {"target_step", "draft_step"}


def test_check_reports_the_profile_and_loads_what_it_chooses(dirs, capsys):
    """--dtype auto / --draft-quantize auto load what the (given) profile chooses; --json and the text say why."""
    argv = ["--target", str(dirs["target"]), "--draft", str(dirs["draft"]), "--repeats", "1", "--max-k", "2",
            "--max-new-tokens", "4", "--profile", str(dirs["profile"])]
    code, out = _check(capsys, *argv, "--json", "--prompt-tokens", "64")
    assert code == 0, out.err
    report = json.loads(out.out)
    choices = report["choices"]
    assert choices["workload"]["prompt_tokens"] == 64 and choices["target_dtype"]["value"] == "bf16"
    assert "verifying 8 tokens costs 1.10 steps in bf16" in choices["target_dtype"]["why"]
    assert report["target"]["dtype"] == "bfloat16" and report["target"]["choice"] == choices["target_dtype"]
    assert report["draft"]["format"] == "fp32" and report["draft"]["choice"]["value"] == "fp32"
    assert report["hardware"]["dtype"] == "bfloat16"
    code, out = _check(capsys, *argv)
    assert code == 0, out.err
    assert "hardware profile" in out.out and "target dtype: bf16" in out.out and "draft format: fp32" in out.out
    assert "valid for vLLM >= 0.14 (draft_model method re-added by PR #24322); 0.10-0.13 reject it" in out.out


@pytest.mark.parametrize("draft,c,v_step,mode", [
    ("target", 0.05, 0.02, "speculative"),  # the draft is the target (alpha = 1) and cheap: speculate
    ("draft", 2.0, 0.01, "lookahead"),      # a draft dearer than the target, verifying nearly free: lookahead
    ("draft", 2.0, 0.5, "plain"),           # a dear draft and dear verification: plain decoding
])
def test_check_recommends_what_the_costs_imply(dirs, FAST, capsys, monkeypatch, draft, c, v_step, mode):
    """Costs fed in (not this CPU's): the recommendation follows them."""
    def measure_costs(target, draft_model, tokenizer, *, shared_vocab, max_k, repeats, prefix_tokens=100):
        v = {str(k): 1.0 + v_step * k for k in range(max_k + 1)}
        return {"t_step_ms": 10.0, "t_draft_ms": 10.0 * c, "c": c, "verify_cost": v,
                "t_verify_ms": {k: 10.0 * x for k, x in v.items()}, "prefix_tokens": prefix_tokens, "repeats": repeats}

    monkeypatch.setattr(compat, "measure_costs", measure_costs)
    code, out = _check(capsys, "--target", str(dirs["target"]), "--draft", str(dirs[draft]), "--json", *FAST)
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["cost"]["c"] == c and report["recommendation"]["mode"] == mode, report["recommendation"]


def test_check_padded_vocab_is_compatible(dirs, FAST, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def merge the list"}\n\n{"prompt": "class stack"}\n')
    code, out = _check(capsys, "--target", str(dirs["padded"]), "--draft", str(dirs["draft"]), "--json",
                       "--prompts", str(prompts), *FAST)
    assert code == 0, out.err
    report = json.loads(out.out)
    tok = report["tokenizer"]
    assert tok["kind"] == "padded" and tok["shared_vocab_size"] == tok["draft_vocab_size"] < tok["target_vocab_size"]
    assert report["acceptance"]["prompts"] == 2


def test_check_human_output(dirs, FAST, capsys):
    code, out = _check(capsys, "--target", str(dirs["target"]), "--draft", str(dirs["draft"]), *FAST)
    assert code == 0 and "recommended: mode=" in out.out and "vllm serve" in out.out and "c = " in out.out


def test_check_different_tokenizers_refused(dirs, FAST, capsys):
    code, out = _check(capsys, "--target", str(dirs["target"]), "--draft", str(dirs["other"]), "--json", *FAST)
    assert code == 1
    report = json.loads(out.out)
    assert set(report) == TOP_KEYS and not report["compatible"] and "different tokenizers" in report["reason"]
    assert report["cost"] is None and report["vllm"] is None and report["profile"] is None
    code, out = _check(capsys, "--target", str(dirs["target"]), "--draft", str(dirs["other"]), *FAST)
    assert code == 1 and "INCOMPATIBLE" in out.out


def test_check_usage_errors(dirs, FAST, capsys, tmp_path):
    t, d = str(dirs["target"]), str(dirs["draft"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    assert _check(capsys, "--target", t, "--draft", d, "--prompts", str(bad))[0] == 2
    assert _check(capsys, "--target", t, "--draft", d, "--prompts", str(tmp_path / "missing.jsonl"))[0] == 2
    assert _check(capsys, "--target", t, "--draft", d, "--max-new-tokens", "0")[0] == 2
    assert _check(capsys, "--target", t, "--draft", d, "--threads", "0")[0] == 2
    assert _check(capsys, "--target", str(tmp_path / "no-model-here"), "--draft", d)[0] == 2
    assert _check(capsys, "--target", "bundle:no-such-bundle", "--draft", d)[0] == 2
    assert _check(capsys, "--target", t, "--draft", d, "--profile", str(tmp_path / "missing.json"))[0] == 2
    assert _check(capsys, "--target", t, "--draft", d, "--profile", str(bad))[0] == 2
    assert _check(capsys, "--target", t, "--draft", d, "--new-tokens", "0", "--profile", str(dirs["profile"]))[0] == 2
    with pytest.raises(SystemExit) as e:
        cli_main(["check", "--draft-quantize", "3bit"])
    assert e.value.code == 2
