"""Every benchmark script runs, and what it reports holds: each one's tiny smoke run (documented in its docstring)
finishes, writes its report, and the report says that every mode produced tokens and that they are plain
greedy's. Benchmarks are scripts, not timed tests, so nothing here asserts a speed; but a script that no longer
runs against the library (a protocol it implements grew a method, a default that does not fit the tiny model), or
whose modes no longer return plain's tokens, is found here, not on the day a GPU is lent for it. The scripts
record their verdicts and exit 0 either way: the verdicts are read here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SMOKE_RUNS = {  # script: its smoke runs' arguments, one list per run, in order (OUT is replaced by the output path)
    "first_call.py": [["--tiny", "--limit", "2", "--out", "OUT"]],
    "compiled_verify.py": [["--tiny", "--out", "OUT"]],
    "trees.py": [["--tiny", "--limit", "2", "--out", "OUT"]],
    "drafters.py": [["--tiny", "--limit", "2", "--out", "OUT"]],
    "before_after.py": [["--tiny", "--limit", "2", "--old", "HEAD", "--out", "OUT"]],
    "early_exit.py": [["--tiny", "--out", "OUT"]],
    "distill_real.py": [["--tiny", "--start", "draft_spread:1", "--steps", "4", "--out", "OUT"],  # teacher .. costs
                        ["--tiny", "--stage", "spec", "--spec-prompts", "1", "--spec-tokens", "8", "--out", "OUT"],
                        ["--tiny", "--stage", "speed", "--spec-prompts", "1", "--speed-tokens", "8", "--out", "OUT"]],
    "gpu_check.py": [["--device", "cpu", "--tiny", "--out", "OUT"]],
    "batch.py": [["--tiny", "--json", "OUT"]],
    "packed.py": [["--tiny", "--json", "OUT"]],
    "tiny_regime.py": [["--tiny", "--out", "OUT"]],
    "grad_modes.py": [["--tiny", "--out", "OUT"]],
    "static_cache.py": [["--tiny", "--out", "OUT"]],
}

NO_SMOKE_RUN = {  # bench/*.py without one, and why
    "old_commit.py": "not a script: the helper that imports an older commit for before_after.py and first_call.py "
                     "(--old); before_after.py's smoke run (--old HEAD) runs it",
    "int4_draft.py": "decodes nothing: it times the bundled 0.5B draft's real formats (int4, nf4 from bitsandbytes, "
                     "dynamic-int8) and measures teacher-forced agreement of their argmax, a figure of the real "
                     "weights; there are no modes to compare with plain, and random tiny weights say nothing of it",
    "verify_paths.py": "decodes nothing: it times t(n) of the bundled target per kernel path (MKL, oneDNN, "
                       "torch.compile); there are no modes to compare with plain",
}


def _records_modes(report: dict, skip: tuple[str, ...] = ()) -> list[tuple[str, int, bool]]:
    """first_call, trees and drafters: ``records[i]["modes"][mode]`` with ``tokens`` and ``identical_to_plain``."""
    return [(f"{record['id']} {mode}", entry["tokens"], entry["identical_to_plain"])
            for record in report["records"] for mode, entry in record["modes"].items() if mode not in skip]


def _fraction_all(text: str) -> bool:
    """'n/n' (every prompt or row), and not '0/0'."""
    done, total = (int(x) for x in text.split("/"))
    return done == total > 0


def verdicts(script: str, out: Path) -> list[tuple[str, int, bool]]:
    """(what, tokens it produced, identical to plain greedy) for every mode of the smoke run's report."""
    if script in ("first_call.py", "trees.py", "drafters.py"):
        report = json.loads((out / script.replace(".py", ".json")).read_text())
        # first_call's plain_other is plain in the other dtype (bf16), its own baseline, not the reference
        return _records_modes(report, skip=("plain_other",))
    if script == "before_after.py":
        report = json.loads(out.read_text())
        return [(mode, round(rate * 1000), _fraction_all(report["per_mode"][mode]["equal_to_plain"]))
                for mode, rate in report["tokens_per_s"].items()]  # tokens per 1000 s: > 0 iff it produced any
    if script == "grad_modes.py":  # decodes nothing: each model's forwards in both modes, the same logits in each
        report = json.loads((out / "grad_modes.json").read_text())
        return [(f"{name} forward", row["inputs"], row["same_logits"]) for name, row in report["models"].items()]
    if script == "early_exit.py":
        report = json.loads((out / "early_exit.json").read_text())
        return [(f"{run['prompt']} {run['mode']}", run["new"], run.get("identical", True)) for run in report["runs"]]
    if script == "distill_real.py":
        report = json.loads((out / "summary.json").read_text())
        # spec records the tokens asked for; a mean accepted length above 0 says the calls emitted them
        spec = [(f"spec {name}", entry["tokens"] * (entry["mean_accepted_length"] > 0),
                 entry["identical_to_plain"] == entry["prompts"])
                for name, entry in report["spec"].items() if isinstance(entry, dict)]
        speed = [(f"speed {name}", round(entry["tokens_per_s"] * 1000), entry["identical_to_plain"] ==
                  report["speed"]["prompts"]) for name, entry in report["speed"].items() if isinstance(entry, dict)]
        return spec + speed
    if script == "gpu_check.py":
        report = json.loads(out.read_text())
        return [(f"scripted {row['mode']} right={row.get('right')}", round(row["tokens_per_s"] * 1000),
                 row.get("identical_to_plain", True)) for row in report["scripted"]]  # plain's row is the reference
    if script == "batch.py":
        report = json.loads(out.read_text())
        return [(f"B={batch} {mode}", entry["tokens"], _fraction_all(entry["rows_equal_to_plain"]))
                for batch, modes in report["results"].items() for mode, entry in modes.items()]
    if script == "packed.py":
        model = json.loads(out.read_text())["model"]
        return [("dense", len(model["dense"]), True), ("packed", len(model["packed"]), model["identical_to_dense"])]
    if script == "tiny_regime.py":
        report = json.loads((out / "tiny_regime.json").read_text())
        return [(mode, entry["tokens"], entry["identical"] == report["args"]["prompts"])
                for mode, entry in report["modes"].items()]
    if script == "static_cache.py":
        report = json.loads((out / "static_cache.json").read_text())
        return [(f"B={batch} {mode}", entry["tokens"], _fraction_all(entry["rows_equal_to_plain"]))
                for batch, modes in report["results"].items() for mode, entry in modes.items()]
    if script == "compiled_verify.py":  # forwards, not decoding: compiled picks eager's token at every input
        report = json.loads((out / "compiled_verify.json").read_text())
        return [(f"{row['model']} n={row['inputs']}", row["inputs"], row["same_tokens"])
                for model in report["models"] for row in model["rows"]]
    raise AssertionError(f"no reader for bench/{script}'s report: add one to verdicts()")


@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_the_benchmark_script_runs_and_its_modes_are_plain(script, tmp_path):
    out = tmp_path / "report"
    for run in SMOKE_RUNS[script]:
        args = [str(out) if arg == "OUT" else arg for arg in run]
        done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, f"bench/{script} {' '.join(args)} failed:\n{done.stderr[-3000:]}"
        assert out.exists(), f"bench/{script} wrote no report at {out}"
    found = verdicts(script, out)
    assert len(found) >= 2, found  # at least plain and one mode against it
    assert all(tokens > 0 for _, tokens, _ in found), [what for what, tokens, _ in found if tokens <= 0]
    assert all(identical for _, _, identical in found), [what for what, _, identical in found if not identical]


def test_every_script_has_a_smoke_run_or_a_reason():
    scripts = {path.name for path in (ROOT / "bench").glob("*.py")}
    assert not set(SMOKE_RUNS) & set(NO_SMOKE_RUN)
    assert scripts == set(SMOKE_RUNS) | set(NO_SMOKE_RUN), scripts ^ (set(SMOKE_RUNS) | set(NO_SMOKE_RUN))
    tiny = {path.name for path in (ROOT / "bench").glob("*.py") if "--tiny" in path.read_text()}
    assert tiny == set(SMOKE_RUNS)


def test_the_readers_catch_a_mode_that_differs(tmp_path):
    """A report whose mode differs from plain, or produced nothing, is caught by the reader, not passed."""
    report = {"records": [{"id": "p", "modes": {"plain": {"tokens": 4, "identical_to_plain": True},
                                                "fresh": {"tokens": 4, "identical_to_plain": False},
                                                "plain_other": {"tokens": 4, "identical_to_plain": False}}}]}
    (tmp_path / "first_call.json").write_text(json.dumps(report))
    assert verdicts("first_call.py", tmp_path) == [("p plain", 4, True), ("p fresh", 4, False)]
    modes = {"plain": {"tokens": 8, "rows_equal_to_plain": "1/1"},
             "lookahead": {"tokens": 0, "rows_equal_to_plain": "0/1"}}
    (tmp_path / "batch.json").write_text(json.dumps({"results": {"1": modes}}))
    assert verdicts("batch.py", tmp_path / "batch.json") == [("B=1 plain", 8, True), ("B=1 lookahead", 0, False)]
