"""Tensor parallelism 2 on vLLM's CPU build: two worker processes, one core each, serving the
default pair's 0.5B (14 attention and 2 KV heads divide by 2; SmolLM2's 9 do not). Every
worker samples every request, so every worker must apply its rule, and one of them meters it:
the meter's lines and vLLM's /metrics counters equal the number of requests (a meter on each
worker counted every request twice)."""

from __future__ import annotations

import os

import pytest
from serving import (
    assert_counters_match,
    cactus,
    complete,
    meter_lines,
    prometheus,
    vllm_server,
)

TP_MODEL_ENV = "CACTUS_SPEC_VLLM_TP_MODEL"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +"
ASKS = [
    cactus(1.0),
    {"cactus_method": "sps"},
    cactus(0.5),
    {"cactus_method": "topk", "cactus_k": 2},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = os.environ.get(TP_MODEL_ENV)
    if not model:
        pytest.fail(f"{TP_MODEL_ENV} must name the 0.5B's dense folder (make test-vllm sets it)")
    options = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with vllm_server(model, tmp_path_factory, *options, env=env) as running:
        yield running


def test_each_request_is_metered_once(server) -> None:
    client, meter = server
    for seed, xargs in enumerate(ASKS):
        assert complete(client, PROMPT, seed, xargs, max_tokens=24)
    lines = meter_lines(client, meter)
    ids = [x["request_id"] for x in lines]
    assert len(ids) == len(set(ids)) == len(ASKS)
    assert all(x["drafted"] > 0 for x in lines)
    assert_counters_match(prometheus(client), lines, ("cactus", "sps", "topk"))


def test_every_worker_applies_the_rule(server) -> None:
    """SpS through the plugin is vLLM's own token for token; a seeded Cactus request draws the
    same text again (workers that disagreed would feed each other different tokens)."""
    client, _ = server
    plain = complete(client, PROMPT, 11, max_tokens=32)
    assert complete(client, PROMPT, 11, {"cactus_method": "sps"}, max_tokens=32) == plain
    lossy = complete(client, PROMPT, 11, cactus(4.0), max_tokens=32)
    assert lossy == complete(client, PROMPT, 11, cactus(4.0), max_tokens=32)
