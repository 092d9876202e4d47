"""`cactus-spec serve` as a process under SIGTERM: it stops admitting (503), lets in-flight
requests run up to --shutdown-grace, ends the rest with a final event, and exits 0."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cactus_spec.loading.models import resolve_draft_quant
from cactus_spec.server.run import free_port

pytestmark = pytest.mark.slow

# The short stream (8 tokens, ~0.5 s on a 2-core machine) ends well inside the grace; the
# long one (4000 tokens) cannot end inside it on any CPU.
GRACE_S = 8.0
SHORT, LONG = 8, 4000


def call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(method, path, body=None if body is None else json.dumps(body))
    response = connection.getresponse()
    return response.status, json.loads(response.read() or b"{}")


@pytest.fixture
def server(tmp_path):
    yield from serving(tmp_path, ["--drafter", "ngram"])


def serving(tmp_path, models: list[str]):
    """A ``cactus-spec serve`` process on SmolLM2 with ``models`` flags, once it answers
    /health: (process, port); its output goes to ``serve.log``."""
    port = free_port()
    cli = Path(sys.executable).with_name("cactus-spec")
    command = [str(cli), "serve", "--verifier", "smollm2-135m", *models,
               "--policy", "fixed", "--port", str(port), "--max-batch", "4",
               "--shutdown-grace", str(GRACE_S), "--dtype", "float32"]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    deadline = time.monotonic() + 120
    while True:
        try:
            if call(port, "GET", "/health")[0] == 200:
                break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail("serve did not start:\n" + (tmp_path / "serve.log").read_text()[-2000:])
        time.sleep(0.2)
    yield process, port
    if process.poll() is None:
        process.kill()
    log.close()


def stream(port: int, max_tokens: int, events: list, first: threading.Event) -> None:
    body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "seed": 0}  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(body))
    response = connection.getresponse()
    while line := response.readline():
        if line.startswith(b"data: "):
            events.append(line[len(b"data: ") :].decode().strip())
            first.set()


def test_sigterm_drains_then_ends_what_is_left_and_exits(server) -> None:
    process, port = server
    long_events: list[str] = []
    short_events: list[str] = []
    started = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=stream, args=(port, LONG, long_events, started[0])),
        threading.Thread(target=stream, args=(port, SHORT, short_events, started[1])),
    ]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert call(port, "GET", "/health")[0] == 503
    status, late = call(port, "POST", "/v1/completions", {"model": "smollm2-135m", "prompt": "Hi"})
    assert status == 503 and "shutting down" in late["error"]["message"]
    for thread in threads:
        thread.join(GRACE_S + 30)
    # the short stream finished on its own within the grace
    assert short_events[-1] == "[DONE]", short_events[-3:]
    assert json.loads(short_events[-2]).get("choices", [{}])[0].get("finish_reason") == "length", (
        short_events[-2]
    )
    # the long one was ended at the grace, with an error event, then [DONE]
    assert long_events[-1] == "[DONE]"
    assert "shutting down" in json.loads(long_events[-2])["error"]["message"]
    assert process.wait(30) == 0
    assert GRACE_S <= time.monotonic() - signalled < GRACE_S + 10


def test_a_second_signal_exits_without_waiting_for_the_grace(server) -> None:
    process, port = server
    events: list[str] = []
    started = threading.Event()
    thread = threading.Thread(target=stream, args=(port, LONG, events, started), daemon=True)
    thread.start()
    assert started.wait(60)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    process.send_signal(signal.SIGTERM)
    process.wait(30)
    assert time.monotonic() - signalled < GRACE_S  # not drained to the grace


def test_serve_with_a_draft_model_starts_and_stops_without_a_traceback(tmp_path) -> None:
    served = serving(tmp_path, ["--draft", "smollm2-135m", "--num-draft-tokens", "2"])
    process, port = next(served)
    body = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4}
    assert call(port, "POST", "/v1/completions", body)[0] == 200
    events: list[str] = []
    started = threading.Event()
    threading.Thread(target=stream, args=(port, LONG, events, started), daemon=True).start()
    assert started.wait(60)
    process.send_signal(signal.SIGTERM)
    assert process.wait(GRACE_S + 30) == 0
    next(served, None)
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "Event loop is closed" not in log, log[-2000:]
    drafts = resolve_draft_quant("auto", 8)  # the format for --max-batch's default 8 rows
    assert f"draft smollm2-135m ({drafts})" in " ".join(log.split())  # rich wraps its lines


def test_serve_says_where_it_listens_and_how_long_start_up_took(tmp_path) -> None:
    """Once it answers, the log names the address and the start-up's seconds (no more than
    the test waited) and what it serves; the control: a second server on the same port
    cannot bind, fails, and prints no ready line."""
    launched = time.monotonic()
    process, port = next(serving(tmp_path, ["--drafter", "ngram"]))
    try:
        waited = time.monotonic() - launched
        log = (tmp_path / "serve.log").read_text()
        address = rf"listening on http://127\.0\.0\.1:{port} "
        ready = re.search(address + r"\(ready ([\d.]+) s after start", log)
        assert ready is not None and 0 < float(ready.group(1)) <= waited, log
        assert "serving smollm2-135m: verifier smollm2-135m" in log and "drafter ngram" in log
        assert "backend lean (our kernels: " in log  # float32 asked: ggml cannot run it
        cli = Path(sys.executable).with_name("cactus-spec")
        command = [str(cli), "serve", "--verifier", "smollm2-135m", "--method", "ar",
                   "--port", str(port), "--dtype", "float32"]  # fmt: skip
        second = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert second.returncode != 0 and "listening on" not in second.stderr, second.stderr
        assert "address already in use" in second.stderr
    finally:
        process.kill()
