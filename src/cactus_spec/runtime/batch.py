"""Decode a list of requests to the end, many rows at a time: the scheduler, driven to empty.

``decode_all`` submits every request to a ``Scheduler`` over the engine's rows
(``max_batch`` of them) and waits: rows that finish are refilled with the next request
between iterations (continuous batching), and each result is handed to ``on_result`` as
soon as it exists, so a caller can record it before the rest are done (resumable runs).
A row's law is its own (its spec, sampling and seed), whatever its neighbours are. Every
request is queued before the scheduler starts, so the first iteration holds the first
``max_batch`` of them. The loop runs on the calling thread, the one that loaded the models
(``scheduler``: torch's OpenMP workers spin for it alone). The engine's ``decode_many`` checks the
requests and calls this.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime.generation import GenerationResult, Request
from cactus_spec.runtime.policy import SpeculationPolicy
from cactus_spec.runtime.rows import Rows
from cactus_spec.runtime.scheduler import Scheduler


def decode_all(
    engine: Rows,
    requests: Sequence[Request],
    sampling: SamplingConfig,
    spec: DecodeSpec,
    *,
    policy: SpeculationPolicy | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
) -> list[GenerationResult]:
    """Decode every request by its own spec and sampling, else ``spec`` and ``sampling``; the
    results in the requests' order.

    ``on_result(index, result)`` runs on the decoding thread as each request finishes; an
    exception it raises stops the run and is raised here. A request whose decoding fails
    (its own error: ``scheduler``) ends alone; the others run to their end, and then the
    first such error is raised as ``RowError`` naming its index. Ctrl-C stops after the current
    iteration (what finished has been handed to ``on_result``) and raises KeyboardInterrupt.
    """
    results: list[GenerationResult | None] = [None] * len(requests)
    failures: list[BaseException] = []
    row_errors: list[RowError] = []
    remaining = [len(requests)]

    def finished() -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            scheduler.stop()

    def done(index: int, result: GenerationResult) -> None:
        results[index] = result
        try:
            if on_result is not None:
                on_result(index, result)
        except BaseException as err:  # noqa: BLE001 - raised once the loop has stopped
            failures.append(err)
            scheduler.stop()
        finished()

    def failed(index: int, err: BaseException) -> None:
        row_errors.append(RowError(index, err))
        finished()

    scheduler = Scheduler(engine, max_queue=max(1, len(requests)), policy=policy)
    for index, request in enumerate(requests):
        scheduler.submit(
            replace(
                request,
                spec=request.spec or spec,
                sampling=request.sampling or sampling,
                on_done=functools.partial(done, index),
                on_error=functools.partial(failed, index),
            )
        )
    if requests and _run_here(scheduler):
        raise KeyboardInterrupt
    if failures:
        raise failures[0]
    if row_errors:
        raise min(row_errors, key=lambda e: e.index)
    return results  # type: ignore[return-value]  # every slot is filled: all finished


def _run_here(scheduler: Scheduler) -> bool:
    """Run ``scheduler``'s loop on this thread until it stops; on the main thread Ctrl-C stops
    it after the current iteration. Whether Ctrl-C did."""
    if threading.current_thread() is not threading.main_thread():
        scheduler.run()
        return False
    interrupted: list[int] = []

    def interrupt(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        scheduler.stop()

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        scheduler.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    return bool(interrupted)


class RowError(ValueError):
    """Request ``index`` failed on its own (``cause``); the others were decoded."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(f"requests[{index}]: {cause}")
        self.index = index
        self.cause = cause
