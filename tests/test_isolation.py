"""One request can never fail or see another: a row's own failure ends that request alone,
its neighbours keep exactly the tokens they give alone, no response carries another
request's content, unsound grammars and text are refused before decoding, seeded requests
reproduce, and the errors name the field at fault. SmolLM2-135M as verifier and draft, a
real server, the official ``openai`` client or raw HTTP where a client would refuse to send.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import openai
import pytest

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.models import load_model
from cactus_spec.loading.options import LoadOptions
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request
from cactus_spec.runtime.grammar import Grammar, GrammarLimits
from cactus_spec.runtime.scheduler import Scheduler
from cactus_spec.server.build import build_server
from cactus_spec.server.options import ServeOptions

pytestmark = pytest.mark.slow

MODEL_ID = "smollm2-135m"
SECRET = "ACME-SECRET-123"
#: Lexer work per token small enough that the schema below starts (its first mask is cheap)
#: and fails a few tokens in, at decode time, where its string's pattern is first lexed.
STEP_FUEL = 300
FAILS_LATE = {
    "type": "object",
    "description": SECRET,
    "properties": {"name": {"type": "string", "pattern": "[a-z]+(x|y|z){3,9}"}},
    "required": ["name"],
}
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture(scope="module")
def smollm():
    from cactus_spec.loading.fetch import fetch

    return load_model(fetch("smollm2-135m"), dtype="float32")


def _engine(smollm, limits: GrammarLimits | None = None) -> SpeculativeDecoder:
    spec = DecodeSpec.of("cactus", delta=1.0).with_num_draft_tokens(None)
    return SpeculativeDecoder(
        smollm, smollm, spec, max_draft_tokens=3, max_batch=4, backend="lean",
        grammar_limits=limits,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(smollm) -> SpeculativeDecoder:
    return _engine(smollm)


@pytest.fixture(scope="module")
def lean_fuel(smollm) -> SpeculativeDecoder:
    """An engine whose grammars get little lexer work per token (``STEP_FUEL``)."""
    return _engine(smollm, GrammarLimits(step_fuel=STEP_FUEL))


def _serve(smollm, **fields):
    """A server of ``_engine``'s models and spec (K auto, up to 3), ``fields`` changed."""
    spec = DecodeSpec.of("cactus", delta=1.0, num_draft_tokens=3)
    models = LoadOptions(verifier=smollm, draft=smollm, backend="lean")
    fields = {"max_batch": 4, "max_queue": 16, "default_max_tokens": 32, "port": 0, **fields}
    options = ServeOptions(spec, models, served_model_name=MODEL_ID, **fields)
    with build_server(options).running() as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def server(smollm):
    yield from _serve(smollm)


@pytest.fixture(scope="module")
def fuel_server(smollm):
    yield from _serve(smollm, grammar_step_fuel=STEP_FUEL)


def _post(url: str, route: str, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as \ud800
    request = urllib.request.Request(
        f"{url}/v1/{route}", data, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _metric(url: str, line_start: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    return float(next(x for x in text.splitlines() if x.startswith(line_start)).split()[-1])


# --- the engine: a row's own failure ends it alone --------------------------------------


def _run(engine, requests: list[Request]) -> dict[int, object]:
    """Each request's result or error, by its position, decoded in one scheduler."""
    outcomes: dict[int, object] = {}
    done = threading.Event()

    def record(i: int):
        def put(value):
            outcomes[i] = value
            if len(outcomes) == len(requests):
                done.set()

        return put

    scheduler = Scheduler(engine, max_queue=len(requests))
    for i, request in enumerate(requests):
        scheduler.submit(replace(request, on_done=record(i), on_error=record(i)))
    scheduler.start()
    assert done.wait(120)
    scheduler.stop()
    return outcomes


def _story(engine, seed: int, spec: DecodeSpec, **fields) -> Request:
    ids = engine.encode("Write a long story about a dragon.")
    k3 = spec.with_num_draft_tokens(3)
    return Request(
        prompt_ids=ids,
        max_new_tokens=32,
        sampling=SamplingConfig(temperature=1.0),
        seed=seed,
        spec=k3,
        **fields,
    )


def test_a_row_that_fails_ends_alone_and_its_neighbour_keeps_its_tokens(lean_fuel) -> None:
    engine = lean_fuel
    spec = DecodeSpec.of("cactus", delta=1.0)
    alone = _run(engine, [_story(engine, 7, spec)])[0].token_ids
    failing = _story(engine, 8, spec, grammar=Grammar.json_schema(FAILS_LATE))
    outcomes = _run(engine, [_story(engine, 7, spec), failing])
    assert outcomes[0].token_ids == alone
    assert "the grammar cannot go on" in str(outcomes[1])
    assert SECRET not in str(outcomes[1])
    other_seed = _run(engine, [_story(engine, 9, spec)])[0].token_ids
    assert other_seed != alone  # negative control: the equality above can fail


@pytest.mark.parametrize("other", ["tree", "traversal"])
def test_a_chain_or_block_row_beside_a_tree_row_keeps_its_tokens(engine, other) -> None:
    tree = DecodeSpec.of("sps", verification=other, branches=2)
    for spec in (
        DecodeSpec.of("sps"),
        DecodeSpec.of("sps", verification="block"),
        DecodeSpec.of("tas"),
    ):
        alone = _run(engine, [_story(engine, 7, spec)])[0].token_ids
        mixed = _run(engine, [_story(engine, 7, spec), _story(engine, 8, tree)])
        assert mixed[0].token_ids == alone, spec
        assert mixed[1].token_ids  # the tree row decoded too


# --- the server -------------------------------------------------------------------------


def test_a_request_failing_at_decode_time_leaks_nothing_to_its_neighbour(fuel_server) -> None:
    url, client = fuel_server
    story = {"messages": STORY, "max_tokens": 48, "seed": 3, "temperature": 1.0}
    alone = client.chat.completions.create(model=MODEL_ID, **story).choices[0].message.content
    failed_before = _metric(url, 'cactus_spec_requests_total{outcome="failed"}')
    invalid_before = _metric(url, 'cactus_spec_requests_total{outcome="invalid"}')
    answers: dict[str, object] = {}

    def innocent():
        answers["story"] = client.chat.completions.create(model=MODEL_ID, **story)

    thread = threading.Thread(target=innocent)
    thread.start()
    time.sleep(0.3)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": FAILS_LATE}}
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "secret"}],
        "max_tokens": 32,  # room for whitespace before the string (it can take 8 tokens)
        "seed": 0,
        "response_format": schema,
    }
    status, error = _post(url, "chat/completions", body)
    thread.join()
    assert status == 400 and error["error"]["param"] == "response_format"
    assert "cannot go on" in error["error"]["message"]
    assert SECRET not in json.dumps(error)
    story_answer = answers["story"]
    assert story_answer.choices[0].message.content == alone
    assert SECRET not in story_answer.model_dump_json()
    assert _metric(url, 'cactus_spec_requests_total{outcome="failed"}') == failed_before + 1
    assert _metric(url, 'cactus_spec_requests_total{outcome="invalid"}') == invalid_before


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    "response_format, words",
    [
        (_schema({"$ref": "#", "description": SECRET}), "cannot match any output"),
        ({"type": "regex", "regex": "(a{1000}){1000}"}, "cannot match any output"),
        (
            _schema(
                {
                    "type": "object",
                    "description": SECRET,
                    "properties": {f"p{i}": {"type": "string"} for i in range(2000)},
                }
            ),
            "bytes",
        ),
    ],
)
def test_unsound_grammars_are_a_short_400_before_decoding(server, response_format, words) -> None:
    url, _ = server
    started = _metric(url, "cactus_spec_prefix_cache_queries_total")
    messages = [{"role": "user", "content": f"{SECRET}: a story."}]
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": 8}
    status, error = _post(url, "chat/completions", {**body, "response_format": response_format})
    assert status == 400 and error["error"]["param"] == "response_format"
    assert words in error["error"]["message"], error
    assert SECRET not in json.dumps(error) and len(json.dumps(error)) < 1000
    assert _metric(url, "cactus_spec_prefix_cache_queries_total") == started  # never decoded


#: Four kinds of row (the server's four rows), TAS beside trees among them.
SERVED_KINDS = [
    {"method": "tas"},
    {"method": "cactus", "verification": "block"},
    {"method": "sps", "verification": "tree", "branches": 2},
    {"method": "cactus", "delta": 0.5, "verification": "traversal", "branches": 2},
]


def test_concurrent_clients_each_get_the_tokens_they_get_alone(server) -> None:
    """The batch law through the server: clients asking for different kinds at once, seeded
    at temperature 1, each get the text they get alone."""
    _, client = server

    def ask(i: int, seed: int) -> str:
        answer = client.completions.create(
            model=MODEL_ID,
            prompt="Once upon a time",
            max_tokens=24,
            seed=seed,
            temperature=1.0,
            extra_body={"speculative": SERVED_KINDS[i]},
        )
        return answer.choices[0].text

    alone = [ask(i, 50 + i) for i in range(len(SERVED_KINDS))]
    together: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, ask(i, 50 + i)))
        for i in range(len(SERVED_KINDS))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i] for i in range(len(SERVED_KINDS))] == alone
    assert ask(0, 51) != alone[0]  # negative control: another seed, another text


@pytest.mark.parametrize("verification", ["chain", "block", "tree", "traversal"])
def test_structured_outputs_work_with_every_verification(server, verification) -> None:
    _, client = server
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    for temperature in (0.0, 1.0):
        answer = client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "A person as JSON."}],
            max_tokens=24,
            temperature=temperature,
            seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
            extra_body={
                "speculative": {"method": "sps", "verification": verification}
                | ({"branches": 2} if verification in ("tree", "traversal") else {})
            },
        )
        assert answer.choices[0].message.content.startswith("{")


def test_seeded_requests_reproduce_whatever_came_before_and_streamed_or_not(server) -> None:
    _, client = server
    ask = {"model": MODEL_ID, "messages": STORY, "max_tokens": 24, "seed": 11, "temperature": 0.9}
    for extra in ({}, {"speculative": {"method": "cactus", "delta": 0.5}}):
        texts = [
            client.chat.completions.create(**ask, extra_body=extra).choices[0].message.content
            for _ in range(3)
        ]
        stream = client.chat.completions.create(**ask, extra_body=extra, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        assert len(set(texts)) == 1, texts
    other = client.chat.completions.create(**{**ask, "seed": 12}).choices[0].message.content
    assert other != texts[0]  # negative control


SURROGATE = "\ud800 hi"


@pytest.mark.parametrize(
    "route, body, param",
    [
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": SURROGATE}]},
            "messages[0].content",
        ),
        (
            "chat/completions",
            {
                "messages": [
                    {"role": "system", "content": SURROGATE},
                    {"role": "user", "content": "hi"},
                ]
            },
            "messages[0].content",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
            "messages[0].content[0].text",
        ),
        ("chat/completions", {"messages": STORY, "stop": [SURROGATE]}, "stop[0]"),
        ("completions", {"prompt": SURROGATE}, "prompt"),
        ("completions", {"prompt": ["ok", SURROGATE]}, "prompt[1]"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(server, route, body, param) -> None:
    url, _ = server
    status, error = _post(url, route, {"model": MODEL_ID, "max_tokens": 4, **body})
    assert status == 400 and error["error"]["param"] == param
    status, _ = _post(
        url,
        route,
        {"model": MODEL_ID, "max_tokens": 2, "prompt": "ok"}
        if route == "completions"
        else {"model": MODEL_ID, "max_tokens": 2, "messages": STORY},
    )
    assert status == 200  # and the server answers the next request


@pytest.mark.parametrize(
    "route, fields, param",
    [
        ("completions", {"temprature": 0.5}, "temprature"),
        ("chat/completions", {"temprature": 0.5}, "temprature"),
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("completions", {"logit_bias": {"\u0664\u0662": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"042": 1}}, "logit_bias"),
        (
            "completions",
            {"speculative": {"method": "sps", "verification": "tree", "branches": 1000000}},
            "speculative.branches",
        ),
        ("chat/completions", {"tool_choice": "bogus"}, "tool_choice"),
        (
            "chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages.content",
        ),
    ],
)
def test_errors_name_the_field_at_fault(server, route, fields, param) -> None:
    url, _ = server
    invalid = _metric(url, 'cactus_spec_requests_total{outcome="invalid"}')
    base = {"prompt": "hi"} if route == "completions" else {"messages": STORY}
    status, error = _post(url, route, {"model": MODEL_ID, "max_tokens": 4, **base, **fields})
    assert status == 400, error
    assert error["error"]["param"] == param, error
    assert _metric(url, 'cactus_spec_requests_total{outcome="invalid"}') == invalid + 1


def test_fields_that_change_nothing_are_still_accepted(server) -> None:
    url, _ = server
    body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "user": "u", "metadata": {}}
    assert _post(url, "completions", body)[0] == 200
