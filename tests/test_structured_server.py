"""Structured outputs and tool calls through the live server on SmolLM2-135M, driven by the
official ``openai`` client: every answer to a seeded ``json_schema`` request parses and
validates (whole and streamed, SpS and Cactus, model and n-gram drafters), forced tool calls
parse into ``tool_calls`` with valid arguments, and bad or unsupported requests get a 400
naming the field."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema_rs
import openai
import pytest
from test_server import MODEL_ID, serve_options

from cactus_spec.loading.models import LoadedModel, load_model
from cactus_spec.server.build import build_server
from cactus_spec.server.tools import ContentStream, parse_tool_calls

pytestmark = pytest.mark.slow

TEMPLATE = (Path(__file__).parent / "data" / "tool_template.jinja").read_text()
#: Bounded, so that every answer ends within its budget.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    from cactus_spec.loading.fetch import fetch

    return load_model(fetch("smollm2-135m"), dtype="float32")


class Server:
    """A live server with a fixed K of 3, the tool template optional."""

    def __init__(self, smollm: LoadedModel, drafter: str, template: str | None = None) -> None:
        options = serve_options(
            smollm,
            drafter,
            policy="fixed",
            max_queue=64,
            default_max_tokens=96,
            chat_template=template,
        )
        self.running = build_server(options).running()
        url = self.running.__enter__()
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def close(self) -> None:
        self.running.__exit__(None, None, None)


@pytest.fixture(scope="module", params=["model", "ngram"])
def server(smollm, request):
    served = Server(smollm, request.param, TEMPLATE)
    yield served
    served.close()


@pytest.fixture(scope="module")
def plain(smollm):
    """SmolLM2's own template, which defines no tool calls."""
    served = Server(smollm, "ngram")
    yield served
    served.close()


def ask_json(client, seed: int, method: str, stream: bool) -> tuple[str, str, dict]:
    """(content, finish reason, usage's speculative figures) of a json_schema request."""
    kwargs = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": f"Describe person number {seed} as JSON."}],
        "max_tokens": 96,
        "seed": seed,
        "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        "extra_body": {"speculative": {"method": method}},
    }
    if not stream:
        answer = client.chat.completions.create(**kwargs)
        speculative = answer.usage.model_extra["speculative"]
        return answer.choices[0].message.content, answer.choices[0].finish_reason, speculative
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return text, reasons[-1], chunks[-1].usage.model_extra["speculative"]


def test_json_schema_answers_all_parse_and_validate(server) -> None:
    """25 seeded requests per drafter (50 in all), SpS and Cactus, whole and streamed."""
    validator = jsonschema_rs.validator_for(PERSON)
    jobs = [(seed, ("sps", "cactus")[seed % 2], seed % 4 >= 2) for seed in range(25)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda job: ask_json(server.client, *job), jobs))
    for (seed, _, _), (text, reason, _) in zip(jobs, answers, strict=True):
        assert reason == "stop", (seed, text)
        validator.validate(json.loads(text))
    assert sum(s["drafted_tokens"] for _, _, s in answers) > 0  # speculation ran
    assert sum(s["accepted_tokens"] for _, _, s in answers) > 0


def test_negative_control_unconstrained_answers_do_not_validate(server) -> None:
    answer = server.client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=40,
        seed=0,
    )
    text = answer.choices[0].message.content
    with contextlib.suppress(ValueError):  # not JSON at all: fine too
        assert not jsonschema_rs.validator_for(PERSON).is_valid(json.loads(text))


def test_completions_take_a_response_format_too(server) -> None:
    answer = server.client.completions.create(
        model=MODEL_ID,
        prompt="A JSON object describing a dog:",
        max_tokens=48,
        seed=2,
        extra_body={"response_format": {"type": "regex", "regex": "(woof ){1,3}woof"}},
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text in ("woof woof", "woof woof woof", "woof woof woof woof")


def test_a_streamed_answer_equals_the_whole_one(server) -> None:
    whole = ask_json(server.client, 7, "cactus", stream=False)
    streamed = ask_json(server.client, 7, "cactus", stream=True)
    assert streamed[:2] == whole[:2]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_call_parses_into_tool_calls(server, choice) -> None:
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    answer = server.client.chat.completions.create(
        model=MODEL_ID,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        seed=3,
    )
    message, reason = answer.choices[0].message, answer.choices[0].finish_reason
    assert reason == "tool_calls" and len(message.tool_calls) == 1
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        if choice == "named":
            assert call.function.name == "get_weather"
        if call.function.name == "get_weather":
            jsonschema_rs.validate(WEATHER["function"]["parameters"], arguments)
        else:
            assert call.function.name == "get_time" and arguments == {}


def test_streamed_tool_calls_equal_the_whole_answers(server) -> None:
    kwargs = {
        "model": MODEL_ID,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "seed": 5,
    }
    whole = server.client.chat.completions.create(**kwargs).choices[0].message
    chunks = list(server.client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_tool_calls_and_results_is_accepted(server) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    answer = server.client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER], max_tokens=8, seed=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    alone = server.client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], max_tokens=1, seed=0
    )
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and result


def bad_request(client, **fields) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=4, **fields)
    return caught.value


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "Input should be"),
        ({"response_format": {"type": "regex", "regex": "(x"}}, "response_format", "compile"),
        (
            {"response_format": {"type": "grammar", "grammar": "start: nope"}},
            "response_format",
            "compile",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}},
            "ignore_eos",
            "ignore_eos cannot be used with response_format",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "no tool is named 'x'",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "forces a call",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.function.name",
            "pattern",
        ),
    ],
)
def test_bad_structured_requests_are_a_400_naming_the_field(server, fields, param, words):
    err = bad_request(server.client, **fields)
    assert err.body["param"] == param and words in err.body["message"]


def test_tools_on_a_template_without_a_format_are_a_400(plain) -> None:
    err = bad_request(plain.client, tools=[WEATHER])
    assert err.body["param"] == "tools" and "defines no tool-call format" in err.body["message"]
    # tool_choice none offers no tools: answered
    plain.client.chat.completions.create(
        model=MODEL_ID, messages=ASK, max_tokens=2, tools=[WEATHER], tool_choice="none"
    )


def test_tool_calls_are_read_from_output() -> None:
    text = (
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g"}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]
    assert parse_tool_calls("no calls") == ("no calls", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])  # malformed: content, as it is
    assert parse_tool_calls('<tool_call>\n{"name": "f"') == ('<tool_call>\n{"name": "f"', [])


def test_streamed_content_holds_back_what_may_become_a_call() -> None:
    stream = ContentStream()
    assert stream.add("Hello <tool") == "Hello "
    assert stream.add("_c") == ""
    assert stream.add("all>\n{") == ""
    assert stream.finish("Hello") == ""  # the final content is the text before the call
    other = ContentStream()
    assert other.add("a <to") == "a "
    assert other.add("day") == "<today"  # not a call after all
