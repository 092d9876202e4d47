"""What a valid request gets back is valid: an unbounded divergence is JSON null with its
reason (never ``Infinity``), ``/metrics`` stays finite, bounds stay bounds, a context error
names the field the client sent, and nothing waits behind another request's long prompt.
SmolLM2-135M through the server, driven over HTTP, on both backends a server of it can have
(lean, its float32 weights; ggml, llama.cpp over its GGUF file)."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request

import pytest
from conftest import need_llama_cpp
from test_server import MODEL_ID, Served, raw_post

from cactus_spec.backends import native
from cactus_spec.backends.ggml import GgufModel
from cactus_spec.core.audit import reported_kl
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.fetch import fetch
from cactus_spec.loading.models import load_model
from cactus_spec.loading.options import LoadOptions
from cactus_spec.server.build import build_server
from cactus_spec.server.options import ServeOptions
from cactus_spec.server.wire import dumps

pytestmark = pytest.mark.slow


def strict_loads(text: str | bytes) -> dict:
    """JSON as JavaScript's ``JSON.parse`` reads it: NaN and infinities refused."""

    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_the_encoder_refuses_what_strict_json_cannot_carry() -> None:
    assert strict_loads(dumps({"kl_nats": 0.25})) == {"kl_nats": 0.25}
    for value in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="Out of range float"):
            dumps({"usage": {"kl_nats": value}})
    with pytest.raises(ValueError, match="not strict JSON"):  # what Python's json would send
        strict_loads(json.dumps({"kl_nats": math.inf}))
    assert reported_kl(math.inf) == {"kl_nats": None, "kl_unbounded": True}
    assert reported_kl(-0.0) == {"kl_nats": 0.0, "kl_unbounded": False}
    assert math.copysign(1, reported_kl(-0.0)["kl_nats"]) == 1


def smollm_as(weights: str):
    """SmolLM2 with ``weights``: float32 or int8 on the lean code, or ggml (its GGUF file
    loaded for llama.cpp)."""
    if weights == "ggml":
        need_llama_cpp()
        return load_model(fetch(MODEL_ID), backend="ggml")
    if weights == "int8":
        return load_model(fetch(MODEL_ID), quant="int8")
    return load_model(fetch(MODEL_ID), dtype="float32")


@pytest.fixture(scope="module", params=["float32", "ggml"])
def smollm(request):
    return smollm_as(request.param)


@pytest.fixture(scope="module")
def one(smollm):
    server = Served(smollm, "model")
    yield server
    server.close()


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics") as response:
        lines = response.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line[:1] != "#")}


INTERP = {
    "model": MODEL_ID,
    "prompt": "def add(a, b):\n",
    "max_tokens": 16,
    "temperature": 1.0,
    "seed": 5,
    "top_k": 20,
    "speculative": {"method": "interp", "alpha": 0.9},
}


def post_text(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as response:
        return response.status, response.read().decode()


def test_an_unbounded_divergence_is_null_with_its_reason(one: Served) -> None:
    """Interp at temperature 1 puts mass where q has none: 200, the body strict JSON,
    ``kl_nats`` null with ``kl_unbounded``, whole and streamed; ``/metrics`` stays finite,
    counts the request as finished and apart as unbounded. SpS (the control) reports a
    finite divergence."""
    url = f"{one.url}/v1/completions"
    before = metrics(one.url)
    status, text = post_text(url, INTERP)
    assert status == 200
    usage = strict_loads(text)["usage"]["speculative"]
    assert usage["kl_nats"] is None and usage["kl_unbounded"] is True, usage
    streamed = {**INTERP, "stream": True, "stream_options": {"include_usage": True}}
    status, text = post_text(url, streamed)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    last = strict_loads(events[-2])["usage"]["speculative"]
    assert last["kl_nats"] is None and last["kl_unbounded"] is True
    sps = {**INTERP, "speculative": {"method": "sps"}}
    control = strict_loads(post_text(url, sps)[1])["usage"]["speculative"]
    assert control["kl_nats"] == 0 and control["kl_unbounded"] is False
    after = metrics(one.url)
    assert all(math.isfinite(v) for v in after.values())
    assert after["cactus_spec_kl_unbounded_requests_total"] == (
        before["cactus_spec_kl_unbounded_requests_total"] + 2
    )
    finished = 'cactus_spec_requests_total{outcome="finished"}'
    assert after[finished] == before[finished] + 3


def test_the_bound_of_a_large_budget_is_at_most_one(one: Served) -> None:
    body = {**INTERP, "speculative": {"method": "cactus", "kl_budget": 5}}
    usage = strict_loads(post_text(f"{one.url}/v1/completions", body)[1])["usage"]
    assert usage["speculative"]["tv_bound"] == 1.0  # sqrt(5 / 2) = 1.58 says nothing more
    body = {**INTERP, "speculative": {"method": "cactus", "kl_budget": -0.0}}
    text = post_text(f"{one.url}/v1/completions", body)[1]
    assert '"kl_budget":0.0' in text and "-0.0" not in text


def test_a_context_error_names_what_the_client_sent(one: Served) -> None:
    context = one.decoder.context_length
    url = f"{one.url}/v1/completions"
    cases = [
        ({"prompt": [28] * (context + 5), "max_tokens": 1}, "prompt"),
        ({"prompt": [28] * (context - 100), "max_tokens": 200}, "max_tokens"),
    ]
    if not isinstance(one.decoder.verifier.model, GgufModel):  # ggml refuses trees first
        tree = {"method": "sps", "verification": "tree", "branches": 40}
        fields = {"prompt": [28] * (context - 100), "max_tokens": 50, "speculative": tree}
        cases.append((fields, "speculative.branches"))
    for fields, param in cases:
        status, error = raw_post(url, json.dumps({"model": MODEL_ID, **fields}).encode())
        assert status == 400 and error["error"]["param"] == param, (fields.keys(), error)
        assert error["error"]["code"] == "context_length_exceeded"
    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x " * (context + 5)}]}
    status, error = raw_post(f"{one.url}/v1/chat/completions", json.dumps(chat).encode())
    assert status == 400 and error["error"]["param"] == "messages"


LONG = 3000  # prompt tokens: several chunks of CHUNK
CHUNK = 64


def waits_behind_a_long_prompt(model, chunk: int | None) -> tuple[float, float, float]:
    """On a server of ``model`` reading ``chunk`` prompt tokens a turn (None: a prompt in one
    piece), while a long prompt is read: seconds to a bad regex's 400, to a short chat's first
    streamed token, and the long request's own time."""
    models = LoadOptions(verifier=model)
    fields = {"max_batch": 2, "max_queue": 8, "prefill_chunk": chunk, "port": 0}
    options = ServeOptions(
        DecodeSpec.of("ar"), models, "fixed", served_model_name=MODEL_ID, **fields
    )
    with build_server(options).running() as url:
        return _waits(url)


def admitted(url: str, tokens: int, timeout_s: float = 60.0) -> None:
    """Wait until requests of ``tokens`` prompt tokens in all have rows (``/metrics`` counts a
    prompt when its row is taken, before it is read)."""
    deadline = time.monotonic() + timeout_s
    while metrics(url).get("cactus_spec_prompt_tokens_total", 0.0) < tokens:
        assert time.monotonic() < deadline, f"no row took the {tokens}-token prompt"
        time.sleep(0.01)


def _waits(url: str) -> tuple[float, float, float]:
    long = {"model": MODEL_ID, "prompt": [28] * LONG, "max_tokens": 1}
    took: dict[str, float] = {}

    def read_long() -> None:
        start = time.monotonic()
        post_text(f"{url}/v1/completions", long)
        took["long"] = time.monotonic() - start

    thread = threading.Thread(target=read_long)
    thread.start()
    admitted(url, LONG)  # the long prompt's read has begun: what follows waits behind its rest
    bad = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "regex", "regex": '(["'},
    }
    start = time.monotonic()
    status, _ = raw_post(f"{url}/v1/chat/completions", json.dumps(bad).encode())
    refused = time.monotonic() - start
    assert status == 400
    chat = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(chat).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.monotonic()
    with urllib.request.urlopen(request) as response:
        for line in response:
            if b'"content":"' in line and b'"content":""' not in line:
                break
    first = time.monotonic() - start
    thread.join()
    return refused, first, took["long"]


@pytest.mark.parametrize("weights", ["float32", "int8", "ggml"])
def test_nothing_waits_behind_a_long_prompts_read(weights: str) -> None:
    """While a prompt of ``LONG`` tokens is read, a 400 that needs a grammar compiled and a
    short chat's first token come within a few chunks' time (the chunk measured here, on the
    same server), not after the whole read. The control reads the prompt in one piece: the
    chat waits for all of it, while the 400 still does not (the kernels release the GIL:
    int8 runs on the native blocks, float32 on torch's, ggml through ctypes)."""
    if weights == "int8" and not native.available():
        pytest.skip("no native kernels on this machine")
    model = smollm_as(weights)
    refused, first, whole = waits_behind_a_long_prompt(model, CHUNK)
    chunk_s = whole * CHUNK / LONG  # the long request's read, per chunk
    # the turn being read (four chunks, idle) and the next, a third for a loaded moment (the
    # full suite on 2 cores once took 8.2 chunks), and a decode: far below LONG / CHUNK = 47
    bound = 12 * chunk_s + 1.0
    assert refused < bound and first < bound, (refused, first, chunk_s)
    refused, first_unchunked, whole = waits_behind_a_long_prompt(model, None)
    assert refused < bound < first_unchunked, (refused, first_unchunked, bound, whole)


def test_an_answer_says_how_fast_its_prompt_was_read(one: Served) -> None:
    """``timings`` (llama-server's shape) counts the prompt tokens the server read: every one
    but the last (the first iteration reads it) and the cached ones, so the same prompt sent
    again reads only what its row did not hold; ``/metrics`` adds the same counts. Streamed,
    the usage chunk carries them too."""
    prompt = [3000 + i % 50 for i in range(300)]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}  # 4 tokens
    url = f"{one.url}/v1/completions"
    before = metrics(one.url)
    answers = [strict_loads(post_text(url, body)[1]) for _ in range(2)]
    read = []
    for answer in answers:
        usage, timings = answer["usage"], answer["timings"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert timings["prompt_n"] == usage["prompt_tokens"] - 1 - cached, answer
        assert timings["predicted_n"] == usage["completion_tokens"]
        if timings["prompt_n"]:
            rate = timings["prompt_n"] / timings["prompt_ms"] * 1e3
            assert timings["prompt_per_second"] == pytest.approx(rate)
        read.append(timings["prompt_n"])
    assert read[0] == 299 and read[1] < 299  # the second found its prompt cached
    after = metrics(one.url)
    assert after["cactus_spec_prompt_read_tokens_total"] == (
        before["cactus_spec_prompt_read_tokens_total"] + sum(read)
    )
    assert after["cactus_spec_prompt_tokens_per_second"] > 0
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = [e[6:] for e in post_text(url, streamed)[1].splitlines() if e.startswith("data: ")]
    assert strict_loads(events[-2])["timings"]["predicted_n"] == 4
