"""End to end on tiny random models saved to a temp dir: the generator's measurements and a CLI smoke run."""

import json

import pytest
import torch

from eval.__main__ import main
from eval.modes import Generator, Settings
from eval.tiny import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def models(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny[1], dtype=torch.float32).eval()
    return target, draft, AutoTokenizer.from_pretrained(tiny[0])


def test_generator_measurements(models):
    target, draft, tok = models
    gen = Generator(target, tok, draft, Settings(max_new_tokens=8))
    row = gen.generate("plain", "def add(a, b):\n", seed=0)
    assert row["new_tokens"] == len(row["output_ids"]) == row["streamed_tokens"] > 0
    assert 0 < row["ttft_s"] < row["e2e_s"]
    assert row["target_forwards"] == row["new_tokens"] and row["mean_accepted_length"] == 1.0
    assert row["spec"] is None and row["peak_mem_bytes"]
    before = draft.generation_config.to_dict()
    k3 = gen.generate("hf_assisted_k3", "def add(a, b):\n", seed=0)
    assert draft.generation_config.to_dict() == before  # fixed-k settings restored
    assert k3["output_ids"] == row["output_ids"]  # greedy parity in fp32
    lookup = gen.generate("hf_prompt_lookup", "def add(a, b):\n", seed=0)
    assert lookup["output_ids"] == row["output_ids"]
    gen.close()


def test_transformers_modes_bypass_hf_specdec(models):
    pytest.importorskip("hf_specdec")
    target, draft, tok = models
    gen = Generator(target, tok, draft, Settings(max_new_tokens=4))
    try:
        gen.specdec  # enables hf_specdec on this instance
        assert "generate" in vars(target)
        target.last_spec_stats = None
        row = gen.generate("plain", "x = 1\n", seed=0)
        assert row["spec"] is None and getattr(target, "last_spec_stats", None) is None
    finally:
        gen.close()
        import hf_specdec

        hf_specdec.disable(target)


def test_cli_smoke(tiny, tmp_path):
    out = tmp_path / "run"
    args = ["run", "--target", tiny[0], "--draft", tiny[1], "--dtype", "fp32",
            "--modes", "plain,hf_assisted_k3,hf_prompt_lookup,specdec_fixed", "--task", "humaneval", "--limit", "2",
            "--max-new-tokens", "6", "--warmup", "1", "--out", str(out), "--no-progress", "--exec-timeout", "5"]
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["prompt_id"]) for r in rows][:4] == [
        ("plain", "HumanEval/0"), ("hf_assisted_k3", "HumanEval/0"), ("hf_prompt_lookup", "HumanEval/0"),
        ("specdec_fixed", "HumanEval/0")]
    assert all(not r.get("error") for r in rows if not r["mode"].startswith("specdec"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["dtype_resolved"] == "float32"
    assert summary["quality"]["modes"]["hf_assisted_k3"]["exact_rate"] == 1.0
    plain = [r for r in rows if r["mode"] == "plain"]
    assert summary["oracle"]["harness_costs"]["tokens"] == sum(r["new_tokens"] - 1 for r in plain)
    md = (out / "report.md").read_text()
    assert "hf_prompt_lookup" in md and (out / "tokens_per_s.png").exists()
    # resume: nothing is decoded again
    assert main(args) == 0
    assert len((out / "rows.jsonl").read_text().splitlines()) == len(rows)
    # a different setting into the same --out is refused
    assert main([a if a != "6" else "7" for a in args]) == 2


def test_cli_jsonl_sampling_repeats(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n", "id": "a"}\n{"prompt": "Write hello world.", "chat": true}\n')
    out = tmp_path / "run"
    assert main(["run", "--target", tiny[0], "--dtype", "fp32", "--modes", "plain,hf_prompt_lookup",
                 "--task", f"jsonl:{prompts}", "--max-new-tokens", "4", "--repeats", "2", "--temperature", "0.7",
                 "--seeds", "0,1", "--warmup", "0", "--no-analysis", "--out", str(out), "--no-progress"]) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 * 2  # repeats x seeds x prompts x modes
    assert [r["error"] for r in rows if r.get("error")] == []
    assert {r["prompt_id"] for r in rows} == {"a", "prompts/2"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quality"]["greedy"] is False
    assert summary["quality"]["modes"]["hf_prompt_lookup"]["ks_length"]["n"] == [4, 4]
    # same seed, same mode -> same sample across repeats
    assert summary["quality"]["modes"]["plain"]["nondeterministic_prompts"] == 0
