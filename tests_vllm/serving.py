"""`vllm serve` (vLLM's CPU build, n-gram drafting, K = 4) started for a test module, with the
plugin's meter file and Prometheus's multiprocess directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(model: str, tmp_path_factory, *options: str, env: dict | None = None):
    """(openai client, meter file) of a server of ``model`` (served as "served") started with
    ``options`` beside the defaults; stopped on exit."""
    meter = tmp_path_factory.mktemp("vllm") / "meter.jsonl"
    port = free_port()
    environment = {
        **os.environ,
        "CACTUS_SPEC_VLLM_METER": str(meter),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path_factory.mktemp("prometheus")),
        **(env or {}),
    }
    environment.pop("TRITON_INTERPRET", None)  # conftest's, for the kernels in this process
    command = [
        # vllm-cpu's `vllm` command looks up the metadata of a package called vllm and fails
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--seed",
        "0",
        "--served-model-name",
        "served",
        "--speculative-config",
        json.dumps(NGRAM),
        *options,
    ]
    log_path = meter.with_suffix(".log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            _wait(client, process, log_path)
            yield client, meter
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait(client, process, log_path, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"vllm serve did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)


def complete(client, prompt: str, seed: int, xargs: dict | None = None, **options) -> str:
    extra = {"vllm_xargs": xargs} if xargs else None
    response = client.completions.create(
        model="served",
        prompt=prompt,
        max_tokens=options.pop("max_tokens", 48),
        seed=seed,
        temperature=options.pop("temperature", 0.8),
        extra_body=extra,
        **options,
    )
    return response.choices[0].text


def meter_lines(client, meter: Path) -> list[dict]:
    """The meter's lines so far; a one-token request first makes the worker take a step, in
    which it learns of (and closes) the requests that finished before."""
    complete(client, "flush", seed=0, max_tokens=1)
    if not meter.exists():
        return []
    return [json.loads(line) for line in meter.read_text().splitlines()]


def cactus(delta: float, exact: bool = False) -> dict:
    return {"cactus_method": "cactus", "cactus_delta": delta, "cactus_exact": str(exact).lower()}


def prometheus(client) -> dict[str, float]:
    """The cactus_spec counters on the API server's /metrics."""
    url = str(client.base_url).replace("/v1/", "/metrics")
    values = {}
    for row in httpx.get(url).text.splitlines():
        if row.startswith("cactus_spec:"):
            name, value = row.rsplit(" ", 1)
            values[name] = float(value)
    return values


def assert_counters_match(values: dict[str, float], lines: list[dict], methods) -> None:
    """The /metrics counters of each method equal the meter's lines: requests, drafted and
    accepted tokens."""
    for method in methods:
        mine = [x for x in lines if x["method"] == method]
        label = f'{{method="{method}"}}'
        assert values[f"cactus_spec:requests_total{label}"] == len(mine)
        for field in ("drafted", "accepted"):
            total = sum(x[field] for x in mine)
            assert values[f"cactus_spec:{field}_tokens_total{label}"] == total, (method, field)
