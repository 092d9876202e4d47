"""Running a built server (``build.build_server``): in the foreground (``serve``: decoding on
the calling thread, uvicorn on another, draining on SIGTERM), or uvicorn on a thread
(``BackgroundServer``).

Both run uvicorn's h11 protocol with a deadline on each request's head (``_HeadTimeout``):
uvicorn itself waits forever for headers, so a client that sends half a head holds a socket.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cactus_spec.runtime.scheduler import Scheduler
from cactus_spec.server.protocol import APIError

#: Seconds a connection may take to send a request's head (from opening, or from its last
#: response); then it gets 408 and is closed.
HEADER_TIMEOUT_S = 10.0


class _HeadTimeout(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head."""

    def __init__(self, *args, header_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a whole head arrived
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.head_timer = self.loop.call_later(self.header_timeout_s, self._late)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _late(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        message = f"the request head did not arrive within {self.header_timeout_s:g} s"
        body = json.dumps(APIError(408, message).body()).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def _config(app, host: str, port: int, header_timeout_s: float) -> uvicorn.Config:
    protocol = functools.partial(_HeadTimeout, header_timeout_s=header_timeout_s)
    # uvicorn calls ``http`` to make each connection's protocol: a factory serves as a class
    return uvicorn.Config(app, host=host, port=port, http=protocol, log_level="warning")  # type: ignore[arg-type]


def serve(
    app,
    scheduler: Scheduler,
    host: str,
    port: int,
    drain: Callable[[float], Awaitable[None]],
    shutdown_grace_s: float,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    started: float | None = None,
) -> None:
    """Serve ``app`` until a signal, running ``scheduler``'s loop on this thread (the one
    that loaded the models: ``runtime.scheduler`` says why) and uvicorn on another. Once it
    listens it prints ``listening on http://HOST:PORT``, and the seconds since ``started``
    (a ``time.monotonic()``: when start-up began) to stderr. The first
    SIGTERM or SIGINT calls ``drain(grace)`` (the app stops admitting, lets in-flight
    requests run up to the grace, ends the rest with a final event), then uvicorn shuts down
    and the loop stops; a second signal exits at once. uvicorn's own exit status (1 when it
    cannot bind) is raised as SystemExit."""
    config = _config(app, host, port, header_timeout_s)
    server = _DrainingServer(config, drain, shutdown_grace_s, started)
    status: list[int] = []

    def run_uvicorn() -> None:
        try:
            server.run()
        except SystemExit as err:
            status.append(err.code if isinstance(err.code, int) else 1)
        finally:
            scheduler.stop()

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in signals}
    thread = threading.Thread(target=run_uvicorn, name="uvicorn")
    try:
        thread.start()
        scheduler.run()
    finally:
        if thread.is_alive():  # the loop failed: no one would answer uvicorn's requests
            server.should_exit = server.force_exit = True
        thread.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if status and status[0]:
        raise SystemExit(status[0])


class _DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the app before uvicorn shuts down."""

    def __init__(
        self,
        config,
        drain: Callable[[float], Awaitable[None]],
        grace: float,
        started: float | None = None,
    ) -> None:
        super().__init__(config)
        self.drain, self.grace = drain, grace
        self.began = time.monotonic() if started is None else started
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        """uvicorn's start-up, then the ready line (none when it could not bind)."""
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        took = time.monotonic() - self.began
        ready = f"listening on http://{host}:{port} (ready {took:.1f} s after start)"
        print(ready, file=sys.stderr)

    def handle_exit(self, sig, frame) -> None:
        if self.loop is None:
            super().handle_exit(sig, frame)
            return
        if self.draining:  # a second signal: no more waiting for anyone
            self.should_exit = self.force_exit = True
            return
        self.draining = True  # then a clean exit (status 0), the signal handled
        asyncio.run_coroutine_threadsafe(self._drain(), self.loop)

    async def _drain(self) -> None:
        await self.drain(self.grace)
        self.should_exit = True


class BackgroundServer:
    """The app served by uvicorn on a thread of this process (for benchmarks and tests):
    ``with BackgroundServer(app) as url: ...`` gives the base URL, e.g. http://127.0.0.1:PORT."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(_config(app, host, self.port, header_timeout_s))
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
