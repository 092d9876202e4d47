"""A server assembled from its options (``build_server``): the engine, its scheduler with the
policy that picks K, and the app; the one assembly ``cactus-spec serve``, the tests and the
benchmarks share.

The app and the scheduler read the engine through ``runtime.rows.ServingEngine`` only; this
module makes the engine and hands it over (mypy checks that it implements them here).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.rows import ServingEngine
from cactus_spec.runtime.scheduler import Scheduler
from cactus_spec.server.app import create_app
from cactus_spec.server.options import ServeOptions
from cactus_spec.server.run import BackgroundServer, serve


@dataclass(frozen=True)
class Server:
    """A built server, not yet running."""

    options: ServeOptions
    engine: SpeculativeDecoder
    scheduler: Scheduler[ServingEngine]
    app: FastAPI

    def serve(self, started: float | None = None) -> None:
        """Serve in the foreground until a signal (``run.serve``; ``started``: when start-up
        began, a ``time.monotonic()``)."""
        o, app = self.options, self.app
        grace, head = o.shutdown_grace, o.header_timeout
        serve(app, self.scheduler, o.host, o.port, app.state.drain, grace, head, started)

    @contextmanager
    def running(self) -> Iterator[str]:
        """The scheduler and uvicorn on threads of their own (``run.BackgroundServer``), for
        tests and benchmarks: yields the base URL (http://HOST:PORT); both stop on exit."""
        o = self.options
        self.scheduler.start()
        try:
            with BackgroundServer(self.app, o.host, o.port, o.header_timeout) as url:
                yield url
        finally:
            self.scheduler.stop()


def build_server(options: ServeOptions) -> Server:
    """Load the models, make the engine (with policy auto, requests that give no K leave it
    to the policy, up to the spec's K), its scheduler (policy auto: the models are timed
    first, on this thread) and the app; nothing runs yet."""
    spec = options.spec
    cap = spec.num_draft_tokens if spec.drafts else None
    if options.policy == "auto":
        spec = spec.with_num_draft_tokens(None)
    engine = SpeculativeDecoder(
        **options.models.as_kwargs(),
        spec=spec,
        max_draft_tokens=cap,
        max_batch=options.max_batch,
        prefix_cache=options.prefix_cache,
        grammar_limits=options.grammar_limits(),
    )
    scheduler = _scheduler(engine, options)
    app = create_app(scheduler, options.app_config(engine.backend))
    return Server(options, engine, scheduler, app)


def _scheduler(engine: ServingEngine, options: ServeOptions) -> Scheduler[ServingEngine]:
    """A scheduler over ``engine``, not yet running; policy auto times the models first (on
    this thread)."""
    chosen = None
    if options.policy == "auto" and engine.spec.drafts:
        print("timing the models for the speculation policy …", file=sys.stderr)
        start = time.monotonic()
        chosen = engine.calibrated_policy()
        print(f"timed in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return Scheduler(engine, options.max_queue, chosen, options.prefill_chunk)
