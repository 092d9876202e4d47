"""The server's ``speculative`` object, read by the one spec parser over the server's spec."""

from __future__ import annotations

import pytest

from cactus_spec.core.rules import Cactus, SpS
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.server.protocol import (
    MAX_DRAFT_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
    speculative_spec,
)

#: A server decoding Cactus(1) whose policy picks K (requests may fix it).
BASE = DecodeSpec.of("cactus", delta=1.0).with_num_draft_tokens(None)


def test_no_speculative_object_is_the_servers_spec() -> None:
    assert speculative_spec(None, BASE) is BASE


def test_a_request_picks_its_method_parameters_and_k() -> None:
    spec = speculative_spec({"method": "cactus", "delta": 0.5, "num_draft_tokens": 4}, BASE)
    assert spec.rule == Cactus(0.5) and spec.num_draft_tokens == 4 and spec.drafter == "model"
    auto = speculative_spec({"method": "sps"}, BASE)
    assert auto.rule == SpS() and auto.num_draft_tokens is None  # the policy picks K
    assert speculative_spec({"method": "ar"}, BASE).rule is None
    block = speculative_spec({"method": "cactus", "verification": "block"}, BASE)
    assert block.verification == "block"
    tree = speculative_spec({"verification": "traversal", "branches": 3}, BASE)
    assert tree.trees and tree.branches == 3 and tree.auto_k  # the policy picks its depth


@pytest.mark.parametrize(
    ("options", "param", "words"),
    [
        ({"num_draft_tokens": 0}, "speculative.num_draft_tokens", f"[1, {MAX_DRAFT_TOKENS}]"),
        ({"num_draft_tokens": 33}, "speculative.num_draft_tokens", "got 33"),
        ({"num_draft_tokens": "4"}, "speculative.num_draft_tokens", "must be an integer"),
        ({"method": "ar", "num_draft_tokens": 4}, "speculative.num_draft_tokens", "method ar"),
        ({"drafter": "ngram"}, "speculative.drafter", "the drafter is the server's"),
        ({"method": "cactus", "delta": "1"}, "speculative.delta", "delta must be a number"),
        ({"method": "sps", "delta": 1.0}, "speculative.delta", "does not apply to"),
        ({"delta": 0.5}, "speculative.method", "method is required"),
        ({"method": "nope"}, "speculative.method", "method must be one of"),
        ({"method": "tas", "verification": "block"}, "speculative.verification", "block takes"),
        ({"verification": "trie"}, "speculative.verification", "must be one of chain, block"),
        ({"verification": "tree", "branches": 0}, "speculative.branches", "must be an integer"),
    ],
)
def test_a_bad_speculative_object_is_a_400_naming_its_key(options, param, words) -> None:
    with pytest.raises(APIError) as caught:
        speculative_spec(options, BASE)
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
        ({**CHAT, "function_call": "auto"}, "function_call"),
        ({**CHAT, "store": True}, "store"),
        ({**COMPLETION, "echo": True}, "echo"),
        ({**COMPLETION, "best_of": 3}, "best_of"),
        ({**COMPLETION, "suffix": "}"}, "suffix"),
    ],
)
def test_a_field_the_server_does_not_honour_is_a_400_naming_it(body, field) -> None:
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(APIError) as caught:
        parse(model, body)
    assert caught.value.status == 400 and caught.value.param == field
    assert "not supported" in caught.value.message


@pytest.mark.parametrize(
    "body",
    [
        {**CHAT, "frequency_penalty": 0, "presence_penalty": 0.0},
        {**CHAT, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"},
        {**CHAT, "logit_bias": {}, "store": False, "user": "u", "metadata": {"a": "b"}},
        {**COMPLETION, "logprobs": None, "echo": False, "best_of": 1, "suffix": ""},
    ],
)
def test_neutral_values_and_fields_that_change_nothing_pass(body) -> None:
    parse(ChatCompletionRequest if "messages" in body else CompletionRequest, body)
