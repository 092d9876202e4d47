"""The scheduler's queue: bounded, and a cancelled request that still waits leaves it at
once (it does not hold its slot until a row frees)."""

from __future__ import annotations

import pytest
from conftest import AR, make_tiny_lm

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request
from cactus_spec.runtime.scheduler import QueueFullError, Scheduler


def request() -> Request:
    return Request(prompt_ids=[1, 2, 3], max_new_tokens=4, sampling=SamplingConfig(), spec=AR)


@pytest.fixture(scope="module")
def engine() -> SpeculativeDecoder:
    return SpeculativeDecoder(make_tiny_lm(), spec=AR)


def test_a_full_queue_refuses_and_counts_it(engine) -> None:
    scheduler = Scheduler(engine, max_queue=2)  # not started: nothing leaves the queue
    scheduler.submit(request())
    scheduler.submit(request())
    with pytest.raises(QueueFullError, match="2 requests waiting"):
        scheduler.submit(request())
    assert scheduler.counters.requests_rejected == 1


def test_a_cancelled_waiting_request_frees_its_slot_at_once(engine) -> None:
    scheduler = Scheduler(engine, max_queue=2)
    first, second = request(), request()
    scheduler.submit(first)
    scheduler.submit(second)
    scheduler.cancel(first)
    assert scheduler.queue_length == 1
    assert scheduler.counters.requests_cancelled == 1
    scheduler.submit(request())  # the slot is free again
    assert scheduler.queue_length == 2
