"""tests/clock.py's ``VirtualClock`` replaces the clock of every module that times a round: a module that reads
``time.perf_counter`` and is missing from ``TIMED_MODULES`` would feed this machine's timings into the policy's
choices (and so into the random draws of a sampled run) in tests that claim to be the same on every machine."""

import ast
import pkgutil
from pathlib import Path

import hf_specdec
from tests.clock import TIMED_MODULES

# modules that read the real clock for something no round's decision depends on, with what they time
REAL_CLOCK = {
    "hf_specdec.costmodel": "forward_times: the offline measurement of a hardware profile, never called in a round",
    "hf_specdec.models.measure": "the hardware profile's measurement (hf-specdec tune), cached on disk",
    "hf_specdec.models.store": "how long measuring a profile took, for its log line",
    "hf_specdec.models.bundles": "how long loading or converting a bundle took, for its log line",
    "hf_specdec.models.loading": "how long loading a model took, reported to the caller",
    "hf_specdec.harness.run": "a benchmark run's wall time, the figure it reports",
    "hf_specdec.harness.streaming": "the time of each streamed chunk, for the harness's time to first token",
    "hf_specdec.demo.app": "the demo's refresh interval",
    "hf_specdec.demo.panes": "the demo's tokens per second on screen",
    "hf_specdec.distill": "training's wall time, for its progress log and resumable budget",
}


def perf_counter_callers(package) -> set[str]:
    """Modules under ``package`` whose source calls ``perf_counter`` (``time.perf_counter()`` or an imported name),
    found by parsing each module, not by importing it."""
    found = set()
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        tree = ast.parse(Path(info.module_finder.find_spec(info.name).origin).read_text())
        for node in ast.walk(tree):
            called = node.func if isinstance(node, ast.Call) else None
            name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", None)
            if name == "perf_counter":
                found.add(info.name)
                break
    return found


def test_every_module_that_reads_the_clock_is_virtual_or_explained():
    callers = perf_counter_callers(hf_specdec)
    assert not set(TIMED_MODULES) & set(REAL_CLOCK)
    missing = callers - set(TIMED_MODULES) - set(REAL_CLOCK)
    assert not missing, f"{sorted(missing)} read perf_counter: add them to tests/clock.py's TIMED_MODULES (their " \
                        f"times feed a round's decision) or to REAL_CLOCK here, with what they time"
    stale = (set(TIMED_MODULES) | set(REAL_CLOCK)) - callers
    assert not stale, f"{sorted(stale)} no longer read perf_counter: take them off the lists"


def test_the_scan_finds_a_call_in_either_spelling(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "dotted.py").write_text("import time\nstart = time.perf_counter()\n")
    (package / "imported.py").write_text("from time import perf_counter\nstart = perf_counter()\n")
    (package / "mentioned.py").write_text('"""says perf_counter in words only"""\n')
    assert perf_counter_callers(type("pkg", (), {"__path__": [str(package)], "__name__": "pkg"})) == {
        "pkg.dotted", "pkg.imported"}
