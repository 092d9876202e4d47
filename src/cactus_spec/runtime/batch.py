"""Decode a list of prompts to the end, many rows at a time: the scheduler, driven to empty.

``decode_all`` submits every prompt to a ``Scheduler`` over the engine's rows
(``max_batch`` of them) and waits: rows that finish are refilled with the next prompt
between iterations (continuous batching), and each result is handed to ``on_result`` as
soon as it exists, so a caller can record it before the rest are done (resumable runs).
A row's law is its own (its spec, sampling and seed), whatever its neighbours are. Every
prompt is queued before the scheduler starts, so the first iteration holds the first
``max_batch`` of them. The loop runs on the calling thread, the one that loaded the models
(``scheduler``: torch's OpenMP workers spin for it alone). The engine's ``decode_many`` checks the
prompts and calls this.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime.generation import GenerationResult
from cactus_spec.runtime.policy import SpeculationPolicy
from cactus_spec.runtime.scheduler import Request, Rows, Scheduler


@dataclass(frozen=True)
class Prompt:
    """One generation to run: ids (already encoded), its budget, its seed, its stops, and
    its own spec (None: the run's)."""

    ids: Sequence[int]
    max_new_tokens: int
    seed: int = 0
    stop: tuple[str, ...] = ()
    spec: DecodeSpec | None = None


def decode_all(
    engine: Rows,
    prompts: Sequence[Prompt],
    sampling: SamplingConfig,
    spec: DecodeSpec,
    *,
    policy: SpeculationPolicy | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
) -> list[GenerationResult]:
    """Decode every prompt by its own spec, else ``spec``; the results in the prompts' order.

    ``on_result(index, result)`` runs on the decoding thread as each prompt finishes; an
    exception it raises stops the run and is raised here. A prompt whose decoding fails (its
    own error: ``scheduler``) ends alone; the others run to their end, and then the first
    such error is raised as ``RowError`` naming its prompt. Ctrl-C stops after the current
    iteration (what finished has been handed to ``on_result``) and raises KeyboardInterrupt.
    """
    results: list[GenerationResult | None] = [None] * len(prompts)
    failures: list[BaseException] = []
    row_errors: list[RowError] = []
    remaining = [len(prompts)]

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

    scheduler = Scheduler(engine, max_queue=max(1, len(prompts)), policy=policy)
    for index, prompt in enumerate(prompts):
        scheduler.submit(_request(prompt, sampling, spec, index, done, failed))
    if prompts and _run_here(scheduler):
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
    """Prompt ``index`` failed on its own (``cause``); the others were decoded."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(f"prompts[{index}]: {cause}")
        self.index = index
        self.cause = cause


def _request(prompt: Prompt, sampling, spec, index: int, done, failed) -> Request:
    return Request(
        list(prompt.ids),
        prompt.max_new_tokens,
        sampling,
        prompt.seed,
        prompt.spec or spec,
        stop=list(prompt.stop),
        on_done=lambda result: done(index, result),
        on_error=lambda err: failed(index, err),
    )
