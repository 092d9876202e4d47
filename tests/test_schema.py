"""schemathesis against the live server (SmolLM2-135M, n-gram drafting), bounded: requests
generated from the server's own /openapi.json, valid and invalid, get no 5xx, and every
answer's status, content type and body match what the schema says."""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.options import LoadOptions
from cactus_spec.server.build import build_server
from cactus_spec.server.options import ServeOptions
from cactus_spec.server.schema import BODIES

pytestmark = pytest.mark.slow

#: The checks: no 5xx, and the answers as documented. (Valid-by-schema requests may still be
#: refused: a prompt past the context or a token id past the vocabulary is a 400.)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
#: Answers are cut to this many tokens in the test's copy of the schema, so generated
#: requests decode for seconds, not minutes.
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def api_schema():
    from cactus_spec.loading.fetch import fetch
    from cactus_spec.loading.models import load_model

    model = load_model(fetch("smollm2-135m"), dtype="float32")
    spec = DecodeSpec.of("cactus", num_draft_tokens=4, drafter="ngram")
    fields = {"max_batch": 4, "max_queue": 16, "default_max_tokens": MAX_TOKENS, "port": 0}
    options = ServeOptions(
        spec, LoadOptions(model), "fixed", served_model_name="smollm2-135m", **fields
    )
    with build_server(options).running() as url:
        with urllib.request.urlopen(f"{url}/openapi.json") as response:
            raw = json.loads(response.read())
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            properties = raw["components"]["schemas"][name]["properties"]
            for key in ("max_tokens", "max_completion_tokens"):
                if key in properties:
                    properties[key]["anyOf"][0]["maximum"] = MAX_TOKENS
        yield schemathesis.openapi.from_dict(raw), url


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
#: (method, path, generation mode): the routes without a body have nothing to make invalid.
CASES = [
    ("GET", "/health", POSITIVE),
    ("GET", "/metrics", POSITIVE),
    ("GET", "/v1/models", POSITIVE),
    *[("POST", path, mode) for path in BODIES for mode in (POSITIVE, NEGATIVE)],
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_the_server_answers_as_its_schema_says(api_schema, method, path, mode) -> None:
    schema, url = api_schema
    operation = schema[path][method]  # schemathesis' pytest plugin predates pytest 9

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    def answers_as_documented(case) -> None:
        case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)

    answers_as_documented()
