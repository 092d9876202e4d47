"""A server in its own process, until it answers ``/health``: the one launcher of
``serve_bench.py``, ``server_duel.py`` and ``soak.py`` (``cactus-spec serve`` or llama.cpp's
``llama-server``).

    with launched(command, port, log) as server:
        ...  # server.url, e.g. http://127.0.0.1:PORT
    server.exit  # how it stopped: seconds after SIGTERM, exit code, killed

The server's output goes to ``log``. A server that exits before it answers ends the run
(``SystemExit`` naming its log and quoting its end). On leaving, the server gets SIGTERM,
then SIGKILL after ``exit_wait_s``.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cactus_spec.server.run import free_port

__all__ = ["Server", "free_port", "launched"]


@dataclass
class Server:
    """The server's process; ``exit`` is filled in once it has been stopped."""

    url: str
    process: subprocess.Popen
    log: Path
    exit: dict = field(default_factory=dict)


@contextlib.contextmanager
def launched(
    command: list[str],
    port: int,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    new_session: bool = False,
    start_timeout_s: float | None = None,
    exit_wait_s: float = 60.0,
) -> Iterator[Server]:
    """``command`` (which listens on ``port`` of loopback) started, yielded once it answers
    ``/health``. ``new_session``: its own process session, so Ctrl-C reaches only this
    script; ``start_timeout_s``: how long it may take to answer (None: as long as it runs)."""
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=new_session
        )
        server = Server(f"http://127.0.0.1:{port}", process, log)
        try:
            wait_healthy(server, start_timeout_s)
            yield server
        finally:
            server.exit = stop(process, exit_wait_s)


def wait_healthy(server: Server, timeout_s: float | None = None) -> None:
    """Until ``GET /health`` answers 200; ``SystemExit`` when the process ends first or
    ``timeout_s`` passes."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise SystemExit(
                f"the server exited ({server.process.returncode}); see {server.log}:\n{tail}"
            )
        try:
            urllib.request.urlopen(f"{server.url}/health", timeout=5).close()
            return
        except OSError:  # not listening yet, or not healthy yet (HTTPError is an OSError)
            time.sleep(1)
    raise SystemExit(f"the server did not answer /health in {timeout_s:.0f} s; see {server.log}")


def stop(process: subprocess.Popen, wait_s: float) -> dict:
    """SIGTERM, then SIGKILL after ``wait_s``: how long it took and the exit code."""
    died_before = process.poll()
    start = time.perf_counter()
    process.terminate()
    try:
        code = process.wait(timeout=wait_s)
        killed = False
    except subprocess.TimeoutExpired:
        process.kill()
        code, killed = process.wait(), True
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "code": code, "killed": killed, "died_before": died_before}
