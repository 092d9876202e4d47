"""Decode a list of prompts to the end, many rows at a time: the scheduler, driven to empty.

``decode_all`` submits every prompt to a ``Scheduler`` over the decoder's rows
(``max_batch`` of them) and waits: rows that finish are refilled with the next prompt
between iterations (continuous batching), and each result is handed to ``on_result`` as
soon as it exists, so a caller can record it before the rest are done (resumable runs).
A row's law is its own (its rule, sampling and seed), whatever its neighbours are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cactus_spec.core.rules import Rule
from cactus_spec.core.sampling import SamplingConfig, check_seed
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import GenerationResult
from cactus_spec.runtime.policy import SpeculationPolicy
from cactus_spec.runtime.scheduler import Request, Scheduler


@dataclass(frozen=True)
class Prompt:
    """One generation to run: ids (already encoded), its budget, its seed, its stops."""

    ids: Sequence[int]
    max_new_tokens: int
    seed: int = 0
    stop: tuple[str, ...] = ()


def decode_all(
    decoder: SpeculativeDecoder,
    prompts: Sequence[Prompt],
    sampling: SamplingConfig,
    *,
    rule: Rule | None | str = "default",
    num_draft_tokens: int | None = None,
    policy: SpeculationPolicy | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
) -> list[GenerationResult]:
    """Decode every prompt; the results in the prompts' order.

    ``rule``: the decoder's own (``"default"``), another Rule, or None (autoregressive).
    ``num_draft_tokens``: a fixed K (None: the policy's choice, else the decoder's K).
    ``on_result(index, result)`` runs on the decoding thread as each prompt finishes; an
    exception it raises stops the run and is raised here. Ctrl-C stops after the current
    iteration (what finished has been handed to ``on_result``) and raises KeyboardInterrupt.
    """
    for prompt in prompts:
        check_seed(prompt.seed)
        decoder.check_context(len(prompt.ids), prompt.max_new_tokens)
    rule = decoder.rule if rule == "default" else rule
    results: list[GenerationResult | None] = [None] * len(prompts)
    failures: list[BaseException] = []
    all_done = threading.Event()
    remaining = [len(prompts)]

    def done(index: int, result: GenerationResult) -> None:
        results[index] = result
        try:
            if on_result is not None:
                on_result(index, result)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            fail(err)
        remaining[0] -= 1
        if remaining[0] == 0:
            all_done.set()

    def fail(err: BaseException) -> None:
        failures.append(err)
        all_done.set()

    scheduler = Scheduler(decoder, max_queue=max(1, len(prompts)), policy=policy)
    scheduler.start()
    try:
        for index, prompt in enumerate(prompts):
            scheduler.submit(_request(prompt, sampling, rule, num_draft_tokens, index, done, fail))
        if prompts:
            while not all_done.wait(0.2):  # a timed wait, so Ctrl-C reaches this thread
                pass
    finally:
        scheduler.stop()
    if failures:
        raise failures[0]
    return results  # type: ignore[return-value]  # every slot is filled once all_done


def _request(prompt, sampling, rule, num_draft_tokens, index, done, fail) -> Request:
    return Request(
        list(prompt.ids),
        prompt.max_new_tokens,
        sampling,
        prompt.seed,
        rule,
        num_draft_tokens,
        stop=list(prompt.stop),
        on_done=lambda result: done(index, result),
        on_error=fail,
    )
