"""The sandbox stops runaway or hostile generated code and scores it as a failure; correct code passes."""

import os

import pytest

from eval.sandbox import Limits, isolation, run_program

LIMITS = Limits(timeout_s=2.0, cpu_s=2, memory_mb=512)

GOOD = "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n"


def test_correct_solution_passes():
    result = run_program(GOOD, LIMITS)
    assert result.passed and result.status == "passed"


def test_failing_assertion_fails():
    result = run_program("assert 1 == 2\n", LIMITS)
    assert not result.passed and "AssertionError" in result.stderr_tail


@pytest.mark.parametrize(
    "program",
    [
        pytest.param("while True:\n    pass\n", id="infinite-loop"),
        pytest.param("import time\ntime.sleep(60)\n", id="sleep"),
    ],
)
def test_runaway_is_killed(program):
    result = run_program(program, LIMITS)
    assert not result.passed
    assert result.status == "timeout" or result.status.startswith("killed")


def test_fork_is_blocked():
    result = run_program("import os\nwhile True:\n    os.fork()\n", LIMITS)
    assert result.status == "failed" and "PermissionError: blocked by the eval sandbox" in result.stderr_tail


def test_fork_bomb_is_stopped():
    # bypasses the preamble's os.fork guard: only RLIMIT_NPROC and the group kill stop it
    program = "import posix\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n        pass\n"
    result = run_program(program, LIMITS)
    assert not result.passed
    assert result.status == "timeout" or result.status.startswith("killed")
    # nothing of the group survives: a later program still runs normally
    assert run_program(GOOD, LIMITS).passed


def test_large_allocation_fails():
    result = run_program("x = bytearray(8 * 1024 ** 3)\nprint(len(x))\n", LIMITS)
    assert not result.passed and "MemoryError" in result.stderr_tail


BLOCKED = "blocked by the eval sandbox"


@pytest.mark.parametrize(
    "program,reason",
    [
        pytest.param("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n",
                     f"PermissionError: {BLOCKED}", id="socket"),
        pytest.param("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n",
                     f"PermissionError: {BLOCKED}", id="socket.socket"),
        pytest.param("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)\n",
                     f"URLError: <urlopen error {BLOCKED}>", id="urllib"),
        # raw _socket skips the preamble: only the network namespace stops it (no interface, no route)
        pytest.param("import _socket\ns = _socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))\n",
                     "OSError: [Errno 101] Network is unreachable", id="_socket"),
    ],
)
def test_network_is_blocked(program, reason, request):
    if request.node.callspec.id == "_socket" and isolation()[0] == "preamble":
        pytest.skip("no network namespace here: raw _socket is only blocked by unshare")
    result = run_program(program, LIMITS)
    assert result.status == "failed" and reason in result.stderr_tail, result.stderr_tail


def test_modules_that_subclass_socket_still_import():
    assert run_program("import ssl, urllib.request, http.client\n", LIMITS).passed


@pytest.mark.parametrize("program", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"])
def test_early_exit_cannot_fake_a_pass(program):
    assert not run_program(program + "assert False\n", LIMITS).passed


def test_runs_in_own_temp_dir_and_cleans_up():
    program = ("import os, sys\nopen('f.txt', 'w').write('x')\nassert os.path.exists('f.txt')\n"
               "print('CWD=' + os.getcwd(), file=sys.stderr)\n")
    result = run_program(program, LIMITS)
    assert result.passed
    (cwd,) = [line[4:] for line in result.stderr_tail.splitlines() if line.startswith("CWD=")]
    assert os.path.basename(cwd).startswith("eval_sandbox_")
    assert not os.path.exists(cwd)  # the directory and the file written in it are gone


def test_hostile_completions_are_scored_as_failures(tmp_path):
    """Through the report's scoring path: HumanEval/2 (truncate_number) completions."""
    from eval.report import output_hash, score_rows

    completions = {
        "correct": "    return number % 1.0\n",
        "loop": "    while True:\n        pass\n",
        "fork": "    import os\n    while True:\n        os.fork()\n",
        "alloc": "    x = bytearray(8 * 1024 ** 3)\n    return number % 1.0\n",
        "network": "    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    return number % 1.0\n",
    }
    rows = [{"task": "humaneval", "prompt_id": "HumanEval/2", "mode": name, "repeat": 0, "seed": 0,
             "style": "completion", "text": text} for name, text in completions.items()]
    results = score_rows(tmp_path, rows, LIMITS)
    passed = {r["mode"]: results[output_hash(r)]["passed"] for r in rows}
    assert passed == {"correct": True, "loop": False, "fork": False, "alloc": False, "network": False}
