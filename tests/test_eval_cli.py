"""End to end on tiny random models saved to a temp dir: the harness's measurements and CLI smoke runs."""

import json

import pytest
import torch

from eval.__main__ import main
from hf_specdec import LookaheadConfig
from hf_specdec.harness import MODES, Harness, Settings
from hf_specdec.models.tiny import save_tiny_pair
from hf_specdec.round import SourceKind
from hf_specdec.stats import last_spec_stats
from tests.clock import VirtualClock


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def models(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny[1], dtype=torch.float32).eval()
    return target, draft, AutoTokenizer.from_pretrained(tiny[0])


def test_harness_measurements(models):
    target, draft, tok = models
    with Harness(target, tok, draft, Settings(max_new_tokens=8)) as harness:
        ids = harness.encode("def add(a, b):\n").input_ids
        row = harness.generate_row("plain", ids, seed=0)
        assert row["new_tokens"] == len(row["output_ids"]) == row["streamed_tokens"] > 0
        assert 0 < row["ttft_s"] < row["e2e_s"]
        assert row["target_forwards"] == row["new_tokens"] and row["mean_accepted_length"] == 1.0
        assert row["spec"] is None and row["peak_mem_bytes"] and "draft_forwards" not in row
        before = draft.generation_config.to_dict()
        k3 = harness.generate_row("hf_assisted_k3", ids, seed=0)
        assert draft.generation_config.to_dict() == before  # fixed-k settings restored
        assert k3["output_ids"] == row["output_ids"]  # greedy parity in fp32
        assert k3["draft_forwards"] > 0 and k3["target_forwards"] < k3["new_tokens"] + 1
        lookup = harness.generate_row("hf_prompt_lookup", ids, seed=0)
        assert lookup["output_ids"] == row["output_ids"]
        for mode in ("specdec_adaptive", "lookahead", "lookahead_warm"):
            spec = harness.generate_row(mode, ids, seed=0)
            assert spec["output_ids"] == row["output_ids"], mode
            assert spec["spec"]["new_tokens"] == spec["new_tokens"] and spec["round_log"], mode


def test_chain_and_tree_modes(models, monkeypatch, tmp_path):
    """specdec_chain never verifies a tree, specdec_tree does; both exact. The clock charges flat target forwards
    and a cheap draft (tests/clock.py), where drafting pays; an empty profile cache, so that no profile an earlier
    test measured seeds the memories with the tiny models' real costs."""
    target, draft, tok = models
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, target, lambda n: 1.0, name="target")
    clock.charge(monkeypatch, draft, lambda n: 0.01, name="draft")
    with Harness(target, tok, draft, Settings(max_new_tokens=16), profile_cache_dir=tmp_path) as harness:
        ids = harness.encode("def add(a, b):\n").input_ids
        plain = harness.generate_row("plain", ids, seed=0)["output_ids"]
        chain = harness.generate_row("specdec_chain", ids, seed=0)
        tree = harness.generate_row("specdec_tree", ids, seed=0)
    assert chain["output_ids"] == tree["output_ids"] == plain
    assert chain["spec"]["drafted"] > 0 and chain["spec"]["tree_rounds"] == 0
    assert tree["spec"]["tree_rounds"] > 0 and tree["spec"]["tree_nodes"] > tree["spec"]["tree_rounds"]
    # each mode learns on its own memory: the tree's second choices were judged in the tree mode's alone
    second_choice = (SourceKind.DRAFT, 1)
    assert second_choice in harness.spec_memory("specdec_tree").estimates(draft).acceptance
    assert second_choice not in harness.spec_memory("specdec_chain").estimates(draft).acceptance


def test_fixed_k_modes_fix_k_on_the_draft(models):
    """transformers reads the fixed k (and the confidence stop that would make k variable) from the draft's
    generation_config during the call; the harness sets all three and restores them afterwards."""
    target, draft, tok = models
    seen = []
    handle = draft.register_forward_pre_hook(lambda module, args: seen.append(
        (module.generation_config.num_assistant_tokens, module.generation_config.num_assistant_tokens_schedule,
         module.generation_config.assistant_confidence_threshold)))
    try:
        with Harness(target, tok, draft, Settings(max_new_tokens=6)) as harness:
            harness.generate_row("hf_assisted_k5", harness.encode("x = 1\n").input_ids)
    finally:
        handle.remove()
    assert seen and set(seen) == {(5, "constant", 0.0)}
    assert draft.generation_config.assistant_confidence_threshold != 0.0


def test_transformers_modes_bypass_hf_specdec(models):
    target, draft, tok = models
    with Harness(target, tok, draft, Settings(max_new_tokens=4)) as harness:
        ids = harness.encode("x = 1\n").input_ids
        try:
            harness.generate_row("specdec_fixed", ids)  # enables hf_specdec on this instance
            assert "generate" in vars(target)
            target.last_spec_stats.set(None)  # the plain mode (type(model).generate) must not set them again
            row = harness.generate_row("plain", ids, seed=0)
            assert row["spec"] is None and last_spec_stats(target) is None
        finally:
            import hf_specdec

            hf_specdec.disable(target)


def test_lookahead_warm_shares_one_memory_per_harness(models):
    target, draft, tok = models
    # W, N and G given: no size depends on measured time, so the rounds counted are the same on any machine
    fixed = LookaheadConfig(window=4, ngram=3, max_candidates=4)
    with Harness(target, tok, draft, Settings(max_new_tokens=48, lookahead=fixed)) as harness:
        ids = harness.encode("def add(a, b):\n").input_ids
        cold = [harness.generate_row("lookahead", ids)["spec"]["rounds"] for _ in range(2)]
        warm = [harness.generate_row("lookahead_warm", ids)["spec"]["rounds"] for _ in range(2)]
        # the second warm call copies the first one's output from the shared memory; a cold call has no such
        # source (here: cold 22 and 22 rounds, warm 22 then 8)
        assert warm[1] < warm[0] and 3 * warm[1] < 2 * min(cold), (cold, warm)
        memory = harness.memory
        harness.new_memory()
        assert harness.memory is not memory


def test_cli_smoke(tiny, tmp_path):
    out = tmp_path / "run"
    args = ["run", "--target", tiny[0], "--draft", tiny[1], "--dtype", "fp32", "--draft-quant", "none",
            "--modes", ",".join(MODES), "--task", "humaneval", "--limit", "2",
            "--max-new-tokens", "6", "--warmup", "1", "--out", str(out), "--no-progress", "--exec-timeout", "5"]
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["prompt_id"]) for r in rows][:len(MODES)] == [(m, "HumanEval/0") for m in MODES]
    assert [(r["mode"], r["error"]) for r in rows if r.get("error")] == []  # every mode, hf_specdec's included
    assert len(rows) == 2 * len(MODES)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["errors"] == []
    assert summary["config"]["dtype_resolved"] == "float32"
    assert summary["config"]["load_info"]["draft"]["kind"] == "pretrained"
    assert {"cpu_model", "cpu_flags", "torch", "transformers", "hf_specdec"} <= set(summary["machine"])
    for mode in MODES:  # greedy fp32: every mode reproduces plain
        if mode != "plain":
            assert summary["quality"]["modes"][mode]["exact_rate"] == 1.0, mode
    assert summary["speed"]["lookahead"]["speedup_vs_prompt_lookup"] > 0
    plain = [r for r in rows if r["mode"] == "plain"]
    assert summary["oracle"]["harness_costs"]["tokens"] == sum(r["new_tokens"] - 1 for r in plain)
    md = (out / "report.md").read_text()
    assert "hf_prompt_lookup" in md and (out / "tokens_per_s.png").exists()
    # resume: nothing is decoded again
    assert main(args) == 0
    assert len((out / "rows.jsonl").read_text().splitlines()) == len(rows)
    # a different setting into the same --out is refused
    assert main([a if a != "6" else "7" for a in args]) == 2


def test_cli_plain_dtypes_and_the_fastest_plain(tiny, tmp_path):
    """--plain-dtypes times plain decoding of the target in each other dtype (the one it was loaded in is the
    "plain" mode), and every mode is compared with the fastest plain decoding of each prompt."""
    out = tmp_path / "run"
    assert main(["run", "--target", tiny[0], "--draft", tiny[1], "--dtype", "fp32", "--draft-quant", "none",
                 "--modes", "plain,specdec_adaptive", "--plain-dtypes", "bf16,fp32", "--task", "humaneval",
                 "--limit", "2", "--max-new-tokens", "6", "--warmup", "0", "--no-analysis", "--out", str(out),
                 "--no-progress", "--exec-timeout", "5"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["errors"] == []
    assert summary["config"]["modes"] == ["plain", "specdec_adaptive", "plain_bf16"]
    assert summary["config"]["plain_is"] == "fp32"
    speed = summary["speed"]
    assert summary["quality"]["modes"]["specdec_adaptive"]["exact_rate"] == 1.0
    for mode in ("plain", "specdec_adaptive", "plain_bf16"):
        assert speed[mode]["n_prompts"] == 2 and speed[mode]["per_prompt_vs_fastest_plain"]["n"] == 2, mode
    for mode in ("plain", "plain_bf16"):  # no plain mode beats the fastest plain of a prompt
        assert speed[mode]["per_prompt_vs_fastest_plain"]["max"] <= 1.0 + 1e-9, mode
    assert max(speed[m]["per_prompt_vs_fastest_plain"]["max"] for m in ("plain", "plain_bf16")) == 1.0
    assert summary["config"]["choices"]["target"]["line"] == "target fp32 (as asked)"
    assert "Against the fastest plain decoding" in (out / "report.md").read_text()
    assert main(["run", "--target", tiny[0], "--modes", "plain", "--plain-dtypes", "int3", "--task", "humaneval",
                 "--out", str(tmp_path / "bad")]) == 2


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
