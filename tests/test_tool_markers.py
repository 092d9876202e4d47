"""A forced tool call on the default pair's tokenizer: Qwen2.5 writes ``<tool_call>`` as one
added token (151657), which the grammar engine matches only as that token. The grammar
must admit the token sequence the chat template's own example encodes to, and refuse a
call of another function; the grammar that spells the markers as text refuses the model's
own sequence (the defect this guards against)."""

from __future__ import annotations

import pytest
from default_tokenizer import default_tokenizer

from cactus_spec.runtime.grammar import Grammars
from cactus_spec.server.tools import CLOSE, DEFAULT_MARKERS, OPEN, Tool, tool_grammar, tool_markers

pytestmark = pytest.mark.slow

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
)


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def _call(tokenizer, name: str, arguments: str) -> list[int]:
    """The tokens of one call as the template asks for it (its markers as their tokens)."""
    text = f'{OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{CLOSE}'
    return tokenizer.encode(text, add_special_tokens=False)


def _constraint(tokenizer, markers):
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    grammar = tool_grammar([WEATHER], "required", False, markers)
    return Grammars(tokenizer, len(tokenizer), eos).constraint(grammar)


def test_the_template_writes_the_markers_as_single_tokens(tokenizer) -> None:
    assert OPEN in tokenizer.chat_template
    ids = _call(tokenizer, "get_weather", '{"city": "Paris"}')
    assert ids[0] == tokenizer.convert_tokens_to_ids(OPEN)
    assert ids[-1] == tokenizer.convert_tokens_to_ids(CLOSE)


def test_the_forced_call_grammar_admits_the_models_call_and_refuses_another(tokenizer) -> None:
    constraint = _constraint(tokenizer, tool_markers(tokenizer))
    good = _call(tokenizer, "get_weather", '{"city": "Paris"}')
    assert constraint.admitted(good) == len(good)
    bad = _call(tokenizer, "get_time", "{}")
    assert constraint.admitted(bad) < len(bad)
    constraint.advance(good)  # the call is whole: the grammar lets it end
    assert constraint.mask([])[tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_negative_control_markers_as_text_refuse_the_models_own_tokens(tokenizer) -> None:
    constraint = _constraint(tokenizer, DEFAULT_MARKERS)
    assert constraint.admitted(_call(tokenizer, "get_weather", '{"city": "Paris"}')) == 0
