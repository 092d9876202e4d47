"""The OpenAI-compatible server on SmolLM2-135M, driven by the official ``openai`` client over
loopback: answers equal offline ``generate`` token for token, streamed equals whole, bad
requests get their status and a message naming the field, backpressure, disconnects. Every
test runs on both backends a server of this model can have: lean (its float32 weights) and
ggml (llama.cpp over its GGUF file, which refuses draft trees by name)."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import need_llama_cpp, spec_of

from cactus_spec.backends.base import Backend
from cactus_spec.backends.ggml import GgmlBackend, GgufModel
from cactus_spec.backends.hf import TransformersBackend
from cactus_spec.core.rules import Cactus, SpS
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.models import LoadedModel, load_model
from cactus_spec.loading.options import LoadOptions
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.server.build import build_server
from cactus_spec.server.options import ServeOptions

pytestmark = pytest.mark.slow

MODEL_ID = "smollm2-135m"
K = 3
PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The capital of Italy is",
]


@pytest.fixture(scope="module", params=["lean", "ggml"])
def smollm(request) -> LoadedModel:
    """SmolLM2 as the server's backend ``auto`` runs it on ``request.param``: lean for its
    float32 weights, ggml for its GGUF loaded for llama.cpp."""
    from cactus_spec.loading.fetch import fetch

    if request.param == "ggml":
        need_llama_cpp()
        return load_model(fetch(MODEL_ID), backend="ggml")
    return load_model(fetch(MODEL_ID), dtype="float32")


def alone(smollm: LoadedModel) -> Backend:
    """The verifier alone on one row: transformers for the float32 weights (not the lean code
    the server runs), llama.cpp for the GGUF (a context of its own)."""
    if isinstance(smollm.model, GgufModel):
        return GgmlBackend(smollm.model, slots=1)
    return TransformersBackend(smollm.model)


def serve_options(smollm: LoadedModel, drafter: str, **fields) -> ServeOptions:
    """Cactus(1) drafting up to K with ``drafter`` on four rows, on a free port, as ``cactus-spec
    serve`` builds it: with the auto policy (the default), requests that give no K leave it to
    the policy."""
    models = LoadOptions(verifier=smollm, draft=smollm if drafter == "model" else None)
    fields = {"max_batch": 4, "max_queue": 32, "default_max_tokens": 32, **fields}
    spec = spec_of(Cactus(1.0), K, drafter)
    return ServeOptions(spec, models, served_model_name=MODEL_ID, port=0, **fields)


def decoder_for(smollm: LoadedModel, drafter: str) -> SpeculativeDecoder:
    """Cactus(1) drafting K with ``drafter`` on one row."""
    draft = smollm if drafter == "model" else None
    return SpeculativeDecoder(smollm, draft, spec_of(Cactus(1.0), K, drafter))


class Served:
    """A live server (``serve_options``' own, ``fields`` changed) and what it runs on."""

    def __init__(self, smollm, drafter="model", api_key=None, **fields):
        self.server = build_server(serve_options(smollm, drafter, api_key=api_key, **fields))
        self.decoder, self.scheduler = self.server.engine, self.server.scheduler
        self.running = self.server.running()
        self.url = self.running.__enter__()
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none")

    def close(self) -> None:
        self.running.__exit__(None, None, None)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics") as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith(f"cactus_spec_{name} "):
                return float(line.split()[1])
        raise KeyError(name)


@pytest.fixture(scope="module", params=["model", "ngram"])
def served(request, smollm):
    server = Served(smollm, request.param)
    yield server
    server.close()


@pytest.fixture(scope="module")
def offline(smollm):
    """Offline generate with each drafter: the reference every answer must equal (K fixed,
    as the requests give it)."""
    return {drafter: decoder_for(smollm, drafter) for drafter in ("model", "ngram")}


def drafter_of(served: Served) -> str:
    return served.decoder.spec.drafter


SPECULATIVE = {"method": "cactus", "delta": 1.0, "num_draft_tokens": K}


def complete(served: Served, prompt: str, seed: int, max_tokens: int = 24, **extra):
    return served.client.completions.create(
        model=MODEL_ID,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.8,
        top_p=0.95,
        seed=seed,
        extra_body={"top_k": 20, "speculative": SPECULATIVE},
        **extra,
    )


def offline_text(
    offline, served: Served, prompt: str, seed: int, chat: bool = False, max_tokens: int = 24
) -> str:
    decoder = offline[drafter_of(served)]
    return decoder.generate(prompt, max_tokens, 0.8, 20, 0.95, seed, chat=chat).text


def test_completion_equals_offline_generate(served: Served, offline) -> None:
    answer = complete(served, PROMPTS[0], seed=7)
    assert answer.choices[0].text == offline_text(offline, served, PROMPTS[0], 7)
    usage = answer.usage
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra["speculative"]
    assert extra["drafted_tokens"] >= extra["accepted_tokens"] >= 0
    assert extra["iterations"] > 0 and extra["kl_nats"] >= -1e-5  # exact KL, up to rounding
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streamed_text_equals_the_whole_answer(served: Served) -> None:
    whole = complete(served, PROMPTS[1], seed=3).choices[0].text
    chunks = list(
        complete(served, PROMPTS[1], seed=3, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_chat_streamed_and_whole_equal_offline(served: Served, offline) -> None:
    question = "Name a fruit that is yellow."
    args = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 24,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": 11,
        "extra_body": {"top_k": 20, "speculative": SPECULATIVE},
    }
    whole = served.client.chat.completions.create(**args).choices[0].message.content
    streamed = served.client.chat.completions.create(**args, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert whole == text == offline_text(offline, served, question, 11, chat=True)


def test_a_second_chat_turn_reuses_the_first_and_equals_offline(served: Served, offline) -> None:
    """The second turn resends the history: its row holds the first turn, so only the new
    tokens are read (``cached_tokens``, the metrics), and the answer is still offline's."""
    args = {"model": MODEL_ID, "max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 5}
    args["extra_body"] = {"top_k": 20, "speculative": SPECULATIVE}
    history = [{"role": "user", "content": "Name a fruit that is yellow."}]
    hits = served.metric("prefix_cache_hits_total")
    first = served.client.chat.completions.create(messages=history, **args)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And one that is red?"},
    ]
    second = served.client.chat.completions.create(messages=history, **args)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 2 <= cached < second.usage.prompt_tokens
    assert served.metric("prefix_cache_hits_total") >= hits + 1
    ids = offline[drafter_of(served)].encode_chat(history)
    expected = offline[drafter_of(served)].generate(ids, 16, 0.8, 20, 0.95, 5)
    assert second.choices[0].message.content == expected.text


def test_logprobs_are_the_verifiers_q_streamed_and_whole(served: Served, offline, smollm) -> None:
    """Each emitted token's logprob is log q recomputed offline from the verifier alone (after
    the request's temperature, top-k and top-p), streamed as whole; completions too."""
    args = {"model": MODEL_ID, "max_tokens": 10, "temperature": 0.8, "top_p": 0.95, "seed": 9}
    args["extra_body"] = {"top_k": 20, "speculative": SPECULATIVE}
    question = "Name a colour."
    messages = [{"role": "user", "content": question}]
    asked = {"logprobs": True, "top_logprobs": 2}
    whole = served.client.chat.completions.create(messages=messages, **asked, **args)
    content = whole.choices[0].logprobs.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in content)
    stream = served.client.chat.completions.create(messages=messages, **asked, stream=True, **args)
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [e.token for chunk in chunks for e in chunk.content] == [e.token for e in content]
    decoder = offline[drafter_of(served)]
    ids = decoder.generate(question, 10, 0.8, 20, 0.95, 9).token_ids  # the same tokens
    assert [e.token for e in content] == [decoder.tokenizer.decode([t]) for t in ids]
    backend = alone(smollm)
    feed = decoder.encode(question)
    for token, entry in zip(ids, content, strict=True):
        q = logits_to_probs(backend.append(feed, keep=1), SamplingConfig(0.8, 20, 0.95))[0]
        assert entry.logprob == pytest.approx(float(q[token].log()), abs=1e-3)
        feed = [token]
    done = complete(served, PROMPTS[3], seed=4, logprobs=1)
    shaped = done.choices[0].logprobs
    assert "".join(shaped.tokens).startswith(done.choices[0].text)  # and EOS, if emitted
    assert len(shaped.top_logprobs) == len(shaped.tokens) == done.usage.completion_tokens


def test_n_choices_each_equal_their_seeded_single_request(served: Served, offline) -> None:
    """Choice i decodes with seed + i: n = 3 gives the three answers of seeds 20, 21, 22,
    streamed or whole; a list of prompts gives n choices per prompt, in order."""
    whole = complete(served, PROMPTS[2], seed=20, max_tokens=12, n=3)
    texts = [offline_text(offline, served, PROMPTS[2], 20 + i, max_tokens=12) for i in range(3)]
    assert [c.text for c in whole.choices] == texts
    assert [c.index for c in whole.choices] == [0, 1, 2]
    singles = [complete(served, PROMPTS[2], seed=20 + i, max_tokens=12) for i in range(3)]
    assert [c.choices[0].text for c in singles] == texts
    assert whole.usage.completion_tokens == sum(c.usage.completion_tokens for c in singles)
    assert whole.usage.prompt_tokens == singles[0].usage.prompt_tokens  # counted once
    stream = complete(served, PROMPTS[2], seed=20, max_tokens=12, n=3, stream=True)
    pieces = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert pieces == texts
    listed = complete(served, [PROMPTS[0], PROMPTS[1]], seed=5, max_tokens=8, n=2)
    expected = [
        offline_text(offline, served, prompt, 5 + i, max_tokens=8)
        for prompt in PROMPTS[:2]
        for i in range(2)
    ]
    assert [c.text for c in listed.choices] == expected


def test_stop_token_ids_end_and_ignore_eos_runs_on(served: Served, offline) -> None:
    decoder = offline[drafter_of(served)]
    question = "Reply with the single word yes."
    seed, alone = next(  # the first seed whose answer ends at EOS within 24 tokens
        (seed, answer)
        for seed in range(16)
        if (answer := decoder.generate(question, 24, 0.8, 20, 0.95, seed)).finish_reason == "stop"
    )
    assert len(alone.token_ids) < 24
    args = {"model": MODEL_ID, "max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": seed}
    messages = [{"role": "user", "content": question}]
    extra = {"top_k": 20, "speculative": SPECULATIVE}
    on = served.client.chat.completions.create(
        messages=messages, extra_body={**extra, "ignore_eos": True}, **args
    )
    assert on.usage.completion_tokens == 24 and on.choices[0].finish_reason == "length"
    first = alone.token_ids[0]
    cut = served.client.chat.completions.create(
        messages=messages, extra_body={**extra, "stop_token_ids": [first]}, **args
    )
    assert cut.usage.completion_tokens == 1 and cut.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_clients_each_equal_offline(served: Served, offline) -> None:
    jobs = [(PROMPTS[i % len(PROMPTS)], 100 + i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda job: complete(served, *job, max_tokens=12), jobs))
    for (prompt, seed), answer in zip(jobs, answers, strict=True):
        expected = offline_text(offline, served, prompt, seed, max_tokens=12)
        assert answer.choices[0].text == expected, seed
    assert served.metric("batch_size") == 0 and served.metric("queue_length") == 0


def test_models_and_health(served: Served, smollm) -> None:
    """/health says what runs the models (and why auto chose it: nothing to say for a model
    loaded for its backend)."""
    assert [m.id for m in served.client.models.list().data] == [MODEL_ID]
    backend = "ggml" if isinstance(smollm.model, GgufModel) else "lean"
    with urllib.request.urlopen(f"{served.url}/health") as response:
        assert json.loads(response.read()) == {
            "status": "ok",
            "backend": backend,
            "backend_why": "",
        }


def raw_post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def one(smollm):
    server = Served(smollm, "model")
    yield server
    server.close()


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"temperature": 3.0}, "temperature", "less than or equal to 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": 9000}, "max_tokens", "context overflow"),
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "keys are token ids"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "is not in [0,"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "must lie in"),
        ({"echo": True}, "echo", "not supported"),
        ({"speculative": {"method": "sps", "delta": 1.0}}, "speculative.delta", "does not apply"),
        ({"speculative": {"method": "cactus", "delta": -1}}, "speculative.delta", "delta"),
        ({"speculative": {"method": "nope"}}, "speculative.method", "must be one of"),
        ({"speculative": {"num_draft_tokens": 0}}, "speculative.num_draft_tokens", "[1, 32]"),
        (
            {"speculative": {"method": "cactus", "kl_budget": "lots"}},
            "speculative.kl_budget",
            "kl_budget must be a finite number >= 0",
        ),
        ({"speculative": {"method": "sps", "kl_budget": 1}}, "speculative.kl_budget", "cactus"),
        (
            {"speculative": {"method": "cactus", "kl_budget": 1, "allocation": "all"}},
            "speculative.allocation",
            "allocation must be one of greedy, paced",
        ),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    ],
)
def test_a_bad_parameter_gets_400_naming_it(one: Served, change, param, words) -> None:
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, **change}
    status, answer = raw_post(f"{one.url}/v1/completions", json.dumps(body).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert words in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_an_answers_budget_is_reported_with_its_bound(one: Served) -> None:
    """usage.speculative gives the budget and Pinsker's bound, and the KL spent stays within
    it; without a budget neither is reported (the control)."""

    def usage(speculative: dict) -> dict:
        answer = one.client.completions.create(
            model=MODEL_ID,
            prompt="def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
            max_tokens=24,
            temperature=1.0,
            seed=3,
            extra_body={"top_k": 20, "speculative": speculative},
        )
        return answer.usage.model_extra["speculative"]

    for allocation in ("greedy", "paced"):
        budgeted = usage({"method": "cactus", "kl_budget": 0.1, "allocation": allocation})
        bound = budgeted["tv_bound"]
        assert budgeted["kl_budget"] == 0.1 and bound == pytest.approx(0.1**0.5 / 2**0.5)
        assert 0 <= budgeted["kl_nats"] <= 0.1 * (1 + 1e-9)
    assert "kl_budget" not in usage({"method": "cactus"})


def test_malformed_json_unknown_model_and_a_missing_field(one: Served) -> None:
    status, answer = raw_post(f"{one.url}/v1/completions", b'{"model": "smollm2-135m", ')
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer = raw_post(f"{one.url}/v1/completions", b'{"model": "smollm2-135m"}')
    assert status == 400 and answer["error"]["param"] == "prompt"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        one.client.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        one.client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], temperature=-1
        )
    assert complete(one, PROMPTS[3], seed=1).choices[0].text  # still serving


def test_a_client_that_disconnects_mid_stream_frees_its_row(one: Served) -> None:
    cancelled = one.metric('requests_total{outcome="cancelled"}'.replace(" ", ""))
    stream = one.client.completions.create(
        model=MODEL_ID,
        prompt=PROMPTS[2],
        max_tokens=2000,
        stream=True,
        extra_body={"speculative": SPECULATIVE, "ignore_eos": True},  # it must still run
    )
    for _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    deadline = time.monotonic() + 30
    while (
        one.metric("batch_size") > 0
        or one.metric('requests_total{outcome="cancelled"}') == cancelled
    ):
        assert time.monotonic() < deadline, "the row was never freed"
        time.sleep(0.05)
    assert complete(one, PROMPTS[3], seed=2).choices[0].text  # still serving


def test_a_full_queue_answers_429(smollm) -> None:
    server = Served(smollm, "model", policy="fixed", max_batch=1, max_queue=1)
    try:
        running = server.client.completions.create(
            model=MODEL_ID,
            prompt=PROMPTS[0],
            max_tokens=2000,
            stream=True,
            extra_body={"ignore_eos": True},  # it holds the row until closed
        )
        next(iter(running))  # the first request holds the only row
        waiting = threading.Thread(target=complete, args=(server, PROMPTS[1], 1))
        waiting.start()
        while server.metric("queue_length") < 1:
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            server.client.with_options(max_retries=0).completions.create(
                model=MODEL_ID, prompt="Hi", max_tokens=2
            )
        running.close()
        waiting.join(timeout=60)
        assert not waiting.is_alive()
    finally:
        server.close()


def test_the_api_key_guards_every_route_but_health(smollm) -> None:
    server = Served(smollm, "ngram", api_key="sesame")
    try:
        assert complete(server, PROMPTS[3], seed=5).choices[0].text
        stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"{server.url}/metrics")
        with urllib.request.urlopen(f"{server.url}/health") as response:
            assert response.status == 200
    finally:
        server.close()


def test_sps_and_ar_requests_share_a_batch_with_cactus(one: Served, offline, smollm) -> None:
    """Per-request methods: each row keeps its own rule in the shared batch."""
    methods = [
        {"method": "sps", "num_draft_tokens": 2},
        {"method": "ar"},
        {"method": "cactus", "delta": 0.5, "num_draft_tokens": 4},
    ]

    def ask(spec):
        return (
            one.client.completions.create(
                model=MODEL_ID,
                prompt=PROMPTS[0],
                max_tokens=24,
                temperature=0.8,
                top_p=0.95,
                seed=21,
                extra_body={"top_k": 20, "speculative": spec},
            )
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(ask, methods))
    rules = [(SpS(), 2), (None, 1), (Cactus(0.5), 4)]
    for text, (rule, k) in zip(texts, rules, strict=True):
        decoder = SpeculativeDecoder(smollm, smollm if rule else None, spec_of(rule, k))
        assert text == decoder.generate(PROMPTS[0], 24, 0.8, 20, 0.95, 21, chat=False).text


def test_a_draft_tree_is_decoded_or_refused_by_name(one: Served, smollm) -> None:
    """Lean reads token trees: a tree request equals offline ``generate``. ggml reads none:
    the request is a 400 naming ``speculative`` and what the verifier's backend lacks."""
    tree = {"method": "sps", "num_draft_tokens": 2, "verification": "tree", "branches": 2}
    body = {"model": MODEL_ID, "prompt": PROMPTS[0], "max_tokens": 12, "seed": 3}
    body |= {"temperature": 0.8, "top_p": 0.95, "top_k": 20, "speculative": tree}
    status, answer = raw_post(f"{one.url}/v1/completions", json.dumps(body).encode())
    if isinstance(smollm.model, GgufModel):
        assert status == 400, answer
        assert answer["error"]["param"] == "speculative"
        message = answer["error"]["message"]
        assert "verification tree needs token-tree attention" in message
        assert "verifier's backend (GgmlBackend) lacks" in message
    else:
        assert status == 200, answer
        decoder = SpeculativeDecoder(smollm, smollm, DecodeSpec.of(**tree))
        expected = decoder.generate(PROMPTS[0], 12, 0.8, 20, 0.95, 3, chat=False).text
        assert answer["choices"][0]["text"] == expected


def test_a_deeply_nested_body_is_a_400_not_a_500(one: Served) -> None:
    body = b'{"model": "smollm2-135m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, answer = raw_post(f"{one.url}/v1/completions", body)
    assert status == 400 and "nested too deeply" in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405), ("DELETE", "/health", 405)],
)
def test_unknown_routes_and_methods_answer_in_openais_error_shape(one, method, path, status):
    connection = http.client.HTTPConnection(one.url.removeprefix("http://"))
    connection.request(method, path)
    response = connection.getresponse()
    answer = json.loads(response.read())
    assert response.status == status
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer


def test_the_api_key_scheme_is_case_blind_and_a_non_ascii_key_is_utf8(smollm) -> None:
    server = Served(smollm, "ngram", api_key="sésame")
    try:
        host = server.url.removeprefix("http://")
        statuses = {}
        for label, value in {
            "utf-8 bearer": "Bearer sésame".encode(),
            "lowercase scheme": "bearer sésame".encode(),
            "latin-1, not the key": "Bearer sésame".encode("latin-1"),
        }.items():
            connection = http.client.HTTPConnection(host)
            connection.putrequest("GET", "/v1/models")
            connection.putheader("Authorization", value)
            connection.endheaders()
            statuses[label] = connection.getresponse().status
        want = {"utf-8 bearer": 200, "lowercase scheme": 200, "latin-1, not the key": 401}
        assert statuses == want
    finally:
        server.close()


def test_a_client_that_leaves_a_whole_answer_frees_its_row(one: Served) -> None:
    """Not streaming: the client closes its socket while the answer is being decoded."""
    cancelled = one.metric('requests_total{outcome="cancelled"}')
    request = {"model": MODEL_ID, "prompt": PROMPTS[2], "max_tokens": 6000, "ignore_eos": True}
    body = json.dumps(request).encode()
    host, port = one.url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    client.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while one.metric("batch_size") < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    client.close()
    deadline = time.monotonic() + 15  # 6000 tokens would take minutes
    while (
        one.metric("batch_size") > 0
        or one.metric('requests_total{outcome="cancelled"}') == cancelled
    ):
        assert time.monotonic() < deadline, "the row was never freed"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def strict(smollm):
    """A server that reads at most 1000 bytes within 0.5 s, and waits 0.5 s for a request's
    head."""
    limits = {"max_request_bytes": 1000, "body_timeout": 0.5, "header_timeout": 0.5}
    server = Served(smollm, "model", policy="fixed", **limits)
    yield server.url.removeprefix("http://")
    server.close()


def test_a_body_past_the_limit_is_413_before_it_is_read(strict) -> None:
    connection = http.client.HTTPConnection(strict)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Length", str(50 * 2**20))  # announced, never sent
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413
    assert "exceeds 1000 bytes" in json.loads(response.read())["error"]["message"]
    chunked = http.client.HTTPConnection(strict)  # no length announced: cut at the limit
    chunked.request("POST", "/v1/completions", body=iter([b"x" * 600] * 4), encode_chunked=True)
    assert chunked.getresponse().status == 413


def test_a_body_that_never_arrives_is_408(strict) -> None:
    host, port = strict.split(":")
    client = socket.create_connection((host, int(port)))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    client.settimeout(10)
    reply = client.recv(4096).decode()
    client.close()
    assert reply.startswith("HTTP/1.1 408"), reply[:80]


def send_raw(address: str, data: bytes, wait_s: float = 10.0) -> str:
    """What the server answers ``data`` within ``wait_s`` ("" if nothing, the socket open)."""
    host, port = address.split(":")
    client = socket.create_connection((host, int(port)))
    client.sendall(data)
    client.settimeout(wait_s)
    try:
        return client.recv(4096).decode()
    except TimeoutError:
        return ""
    finally:
        client.close()


def test_a_head_that_never_ends_is_408_and_closed(strict) -> None:
    reply = send_raw(strict, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
    assert reply.startswith("HTTP/1.1 408"), reply[:80]
    assert "the request head did not arrive within 0.5 s" in reply


def test_uvicorn_alone_holds_a_half_sent_head(one: Served) -> None:
    """The negative control: uvicorn's own protocol waits on (here for 1.5 s, the test's
    patience; it would wait forever)."""
    import uvicorn

    app = one.server.app
    port = socket.create_server(("127.0.0.1", 0)).getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, http="h11", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        assert send_raw(f"127.0.0.1:{port}", b"POST /v1/completions HTTP/1.1\r\nHo", 1.5) == ""
    finally:
        server.should_exit = True
        thread.join()


def test_the_head_deadline_ends_with_the_head(strict) -> None:
    """An answer that takes longer than the head's 0.5 s is not cut, and the connection then
    serves another request."""
    connection = http.client.HTTPConnection(strict, timeout=60)
    body = {"model": MODEL_ID, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True  # all 400 tokens: well past 0.5 s on any CPU
    began = time.monotonic()
    connection.request("POST", "/v1/completions", body=json.dumps(body))
    response = connection.getresponse()
    text = response.read().decode()
    assert time.monotonic() - began > 0.5
    assert response.status == 200 and text.rstrip().endswith("data: [DONE]")
    connection.request("GET", "/v1/models")
    assert connection.getresponse().status == 200


def test_a_client_that_leaves_mid_body_logs_no_traceback(strict, caplog) -> None:
    uvicorn_log = logging.getLogger("uvicorn.error")  # it does not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    host, port = strict.split(":")
    client = socket.create_connection((host, int(port)))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    client.sendall(head + b'{"model": ')
    time.sleep(0.1)
    client.close()
    time.sleep(0.5)
    uvicorn_log.removeHandler(caplog.handler)
    noisy = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]
