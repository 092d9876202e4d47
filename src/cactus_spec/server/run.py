"""Starting the server: the engine's scheduler and policy, and uvicorn on a thread."""

from __future__ import annotations

import socket
import sys
import threading
import time

from cactus_spec.core.checks import check_int
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.policy import POLICIES
from cactus_spec.runtime.scheduler import Scheduler


def start_scheduler(
    engine: SpeculativeDecoder, policy: str = "auto", max_queue: int = 64
) -> Scheduler:
    """A started scheduler over ``engine``; ``policy`` auto times the models first."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    check_int("max_queue", max_queue)
    chosen = None
    if policy == "auto" and engine.spec.drafts:
        print("timing the models for the speculation policy …", file=sys.stderr)
        chosen = engine.calibrated_policy()
    scheduler = Scheduler(engine, max_queue, chosen)
    scheduler.start()
    return scheduler


class BackgroundServer:
    """The app served by uvicorn on a thread of this process (for benchmarks and tests):
    ``with BackgroundServer(app) as url: ...`` gives the base URL, e.g. http://127.0.0.1:PORT."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.host = host
        self.port = port or _free_port(host)
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()


_START_TIMEOUT_S = 30.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
