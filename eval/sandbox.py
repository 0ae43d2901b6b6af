"""Run untrusted generated code: one subprocess per sample, with limits, no network, killed as a group.

Generated code is untrusted. Every program runs in a fresh subprocess with

* its own temporary directory as cwd (deleted afterwards);
* ``resource.setrlimit`` limits set before exec: RLIMIT_AS (memory), RLIMIT_CPU (CPU seconds), RLIMIT_NPROC
  (stops fork bombs), RLIMIT_FSIZE (largest file it may write), RLIMIT_NOFILE and RLIMIT_CORE = 0;
* ``start_new_session=True``, and on timeout the whole process group is SIGKILLed (repeatedly, until empty);
* no network, by the strongest means the machine offers (see :func:`isolation`):

  - ``"netns+nobody"`` (running as root with ``unshare`` and ``setpriv``): a fresh network namespace with no
    interfaces, and the program runs as user ``nobody`` keeping only CAP_DAC_READ_SEARCH (so it can read the
    Python installation but write nowhere except its own directory). Root ignores RLIMIT_NPROC, so dropping to
    ``nobody`` is what makes the fork-bomb limit real.
  - ``"userns"`` (not root, ``unshare -rn`` works): a user + network namespace; RLIMIT_NPROC applies to the user.
  - ``"preamble"`` (neither): the socket module is disabled in a preamble and proxy variables are removed.
    Weaker: code that imports ``_socket`` directly can still reach the network.

  In every mode the preamble also disables ``socket`` and the usual process/file-system escape hatches
  (``os.fork``, ``os.system``, ``subprocess.Popen``, ``shutil.rmtree``, ...) as defense in depth, and the
  environment is reduced to a few variables with ``no_proxy=*``.

A sample passes only when the process exits with status 0 *and* prints a per-run random token written after
the tests, so ``sys.exit(0)`` / ``os._exit(0)`` inside generated code cannot fake a pass. The program text is
sent on stdin, never written to disk. This sandbox guards against accidents and runaway code from a model,
not against a determined attacker (it is not a container or a VM).
"""

from __future__ import annotations

import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

NOBODY_UID = 65534

# Runs before the generated code (inside the sandboxed interpreter).
_PREAMBLE = r'''
import builtins as _b, os as _os, sys as _sys
def _blocked(*a, **k):
    raise PermissionError("blocked by the eval sandbox")
import socket as _socket
class _BlockedSocket(_socket.socket):  # still a class: modules that subclass socket.socket (ssl) import fine
    def __init__(self, *a, **k):
        _blocked()
_socket.socket = _BlockedSocket
for _name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(_socket, _name, _blocked)
for _name in ("fork", "forkpty", "system", "popen", "kill", "killpg", "putenv", "setsid",
              "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe",
              "spawnl", "spawnle", "spawnlp", "spawnv", "spawnve", "spawnvp", "posix_spawn", "posix_spawnp",
              "removedirs", "rmdir", "chmod", "chown", "chroot", "fchdir", "truncate"):
    if hasattr(_os, _name):
        setattr(_os, _name, _blocked)
import subprocess as _sp, shutil as _sh
_sp.Popen = _blocked; _sp.run = _blocked; _sp.call = _blocked; _sp.check_output = _blocked
_sh.rmtree = _blocked; _sh.move = _blocked
del _name
'''


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10  # RLIMIT_CPU
    memory_mb: int = 1024  # RLIMIT_AS
    max_procs: int = 32  # RLIMIT_NPROC on top of the user's current processes ("netns+nobody", "userns")
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE


@dataclass
class SandboxResult:
    passed: bool
    status: str  # "passed" | "failed" | "timeout" | "error"
    returncode: int | None
    duration_s: float
    stderr_tail: str

    def to_dict(self) -> dict:
        return asdict(self)


def _probe(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[str, tuple[str, ...]]:
    """Detect the network/user isolation available here: (name, command prefix)."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if os.name != "posix":
        return "preamble", ()
    if os.geteuid() == 0 and unshare and setpriv:
        prefix = (
            unshare, "-n", setpriv, f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups",
            "--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search", "--no-new-privs",
        )
        if _probe([*prefix, sys.executable, "-I", "-c", "import os; assert os.getuid() != 0"]):
            return "netns+nobody", prefix
    if unshare and _probe([unshare, "-rn", sys.executable, "-I", "-c", "pass"]):
        return "userns", (unshare, "-rn")
    return "preamble", ()


def _count_processes(matches) -> int:
    """How many processes in /proc satisfy ``matches(pid)`` (Linux; 0 where /proc is missing).

    ``matches`` reads what it needs of ``/proc/<pid>``; a process that vanished meanwhile (OSError) is skipped.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    count = 0
    for entry in entries:
        if entry.isdigit():
            try:
                count += bool(matches(entry))
            except OSError:
                continue
    return count


def _owned_by(uid: int):
    def matches(pid: str) -> bool:
        with open(f"/proc/{pid}/status") as fh:
            return any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in fh)
    return matches


def _live_in_group(pgid: int):
    def matches(pid: str) -> bool:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return int(fields[2]) == pgid and fields[0] != b"Z"
    return matches


def _processes_of(uid: int) -> int:
    """How many processes user ``uid`` runs now (RLIMIT_NPROC counts all of them, not only the sandbox's)."""
    return _count_processes(_owned_by(uid))


def _preexec(limits: Limits, nproc: int):
    def apply() -> None:
        mb = 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mb * mb, limits.max_file_mb * mb))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _live_members(pgid: int) -> int:
    """Processes of group ``pgid`` that are not zombies (Linux /proc; 0 elsewhere)."""
    return _count_processes(_live_in_group(pgid))


def _kill_group(pgid: int) -> None:
    """SIGKILL the whole process group until no live member is left (a fork bomb keeps refilling it)."""
    for _ in range(100):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not _live_members(pgid):
            return
        time.sleep(0.01)


def run_program(program: str, limits: Limits | None = None) -> SandboxResult:
    """Execute ``program`` (Python source) in the sandbox; passed = exit 0 and reached the end."""
    limits = limits or Limits()
    name, prefix = isolation()
    token = secrets.token_hex(16)
    source = _PREAMBLE + "\n" + program + f"\n\nprint({token!r}, flush=True)\n"
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "no_proxy": "*",
        "NO_PROXY": "*",
        "HOME": "/nonexistent",
    }
    workdir = tempfile.mkdtemp(prefix="eval_sandbox_")
    if name == "netns+nobody":
        os.chown(workdir, NOBODY_UID, NOBODY_UID)
    env["TMPDIR"] = workdir
    cmd = [*prefix, sys.executable, "-I", "-"]
    # RLIMIT_NPROC counts every process of the user the program runs as: allow max_procs on top of those
    run_uid = NOBODY_UID if name == "netns+nobody" else os.getuid()
    nproc = limits.max_procs + _processes_of(run_uid)
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=_preexec(limits, nproc),
        )
    except OSError as err:
        shutil.rmtree(workdir, ignore_errors=True)
        return SandboxResult(False, "error", None, 0.0, f"could not start sandbox: {err}")
    try:
        stdout, stderr = proc.communicate(source.encode(), timeout=limits.timeout_s)
        status = None
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        status = "timeout"
    finally:
        _kill_group(proc.pid)  # stray children of a finished program
        shutil.rmtree(workdir, ignore_errors=True)
    duration = time.perf_counter() - start
    passed = status is None and proc.returncode == 0 and token.encode() in stdout
    if status is None:
        status = "passed" if passed else "failed"
    if proc.returncode is not None and proc.returncode < 0 and status == "failed":
        status = f"killed:{signal.Signals(-proc.returncode).name}"
    tail = stderr.decode("utf-8", "replace")[-600:]
    return SandboxResult(passed, status, proc.returncode, duration, tail)
