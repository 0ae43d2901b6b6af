"""Every benchmark script runs: each one's tiny smoke run (documented in its docstring) finishes and writes its
report. Benchmarks are scripts, not timed tests, so nothing here asserts a speed; but a script that no longer
runs against the library (a protocol it implements grew a method, a default that does not fit the tiny model)
is found here, not on the day a GPU is lent for it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SMOKE_RUNS = {  # script: its smoke run's arguments (OUT is replaced by the output path)
    "first_call.py": ["--tiny", "--limit", "2", "--out", "OUT"],
    "trees.py": ["--tiny", "--limit", "2", "--out", "OUT"],
    "drafters.py": ["--tiny", "--limit", "2", "--out", "OUT"],
    "before_after.py": ["--tiny", "--limit", "2", "--old", "HEAD", "--out", "OUT"],
    "early_exit.py": ["--tiny", "--out", "OUT"],
    "distill_real.py": ["--tiny", "--start", "draft_spread:1", "--steps", "4", "--out", "OUT"],
    "gpu_check.py": ["--device", "cpu", "--tiny", "--out", "OUT"],
}


@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_the_benchmark_script_runs(script, tmp_path):
    out = tmp_path / "report"
    args = [str(out) if arg == "OUT" else arg for arg in SMOKE_RUNS[script]]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, f"bench/{script} {' '.join(args)} failed:\n{done.stderr[-3000:]}"
    assert out.exists(), f"bench/{script} wrote no report at {out}"


def test_every_script_with_a_smoke_run_is_here():
    tiny = {path.name for path in (ROOT / "bench").glob("*.py") if "--tiny" in path.read_text()}
    assert tiny == set(SMOKE_RUNS)
