"""Tool calls: the request's tools, the grammar that forces a call, and the calls read back
from the output.

The format is the one the model's chat template defines. Templates in the Hermes style
(Qwen2.5's, the default pair's) list the tools in the system turn and ask for each call as

    <tool_call>
    {"name": "<function name>", "arguments": {<arguments>}}
    </tool_call>

so that is what ``parse_tool_calls`` reads back, and what ``tool_grammar`` enforces (the
arguments matching the function's JSON schema) when ``tool_choice`` is ``required`` or names
a function. A template without ``<tool_call>`` defines no format: a request with tools gets
a 400. With ``auto`` the model chooses; text that does not parse as calls stays content.

A tokenizer may hold a marker as one added token (Qwen2.5: ``<tool_call>`` is id 151657),
which the model emits and which the grammar engine matches only as that token, never as
the text's bytes; the grammar then names the token (``<[151657]>``) beside the text
(``tool_markers``).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cactus_spec.runtime.generation import held_back
from cactus_spec.runtime.grammar import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: The markers as Lark terms when the tokenizer has no token of their own: their text.
DEFAULT_MARKERS = (json.dumps(OPEN), json.dumps(CLOSE))
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def defines_tool_calls(template: str | None) -> bool:
    """Whether a chat template defines the tool-call format read here."""
    return template is not None and OPEN in template


def template_tools(tools: list[Tool]) -> list[dict]:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def tool_markers(tokenizer: Any) -> tuple[str, str]:
    """Lark terms of ``OPEN`` and ``CLOSE`` for ``tokenizer``: the marker's own added token
    where it has one (matched only as that token), or its text."""
    return _marker(tokenizer, OPEN), _marker(tokenizer, CLOSE)


def _marker(tokenizer: Any, text: str) -> str:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = [i for i, token in added.items() if str(token) == text]
    return f"(<[{ids[0]}]> | {json.dumps(text)})" if ids else json.dumps(text)


def tool_grammar(
    tools: list[Tool],
    choice: ToolChoice,
    parallel: bool,
    markers: tuple[str, str] = DEFAULT_MARKERS,
) -> Grammar | None:
    """The grammar that forces a call (``required``: of any tool; a named function: of it),
    its arguments matching the function's parameters; ``parallel`` allows several calls;
    ``markers``: the Lark terms of ``OPEN`` and ``CLOSE`` (``tool_markers``). None for
    ``auto`` and ``none``. ValueError naming ``tool_choice`` for an unknown name."""
    if isinstance(choice, str):
        if choice != "required":
            return None
        functions = [tool.function for tool in tools]
    else:
        functions = [t.function for t in tools if t.function.name == choice.function.name]
        if not functions:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
    schema = {"anyOf": [_call_schema(f) for f in functions]}
    call = f'{markers[0]} "\\n" %json {json.dumps(schema)} "\\n" {markers[1]}'
    more = ' ("\\n" call)*' if parallel else ""
    return Grammar("lark", f"start: call{more}\ncall: {call}\n")


def _call_schema(function: FunctionDefinition) -> dict:
    arguments = function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of an output: the text before the first call, and each
    ``<tool_call>`` block as an OpenAI tool call (arguments as JSON text). Output that does
    not parse as calls is all content, with no calls."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _CALL.finditer(text, start):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = json.dumps(call.get("arguments", {}))
        function = {"name": call["name"], "arguments": arguments}
        calls.append(
            {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}
        )
    if not calls:
        return text, []
    return text[:start].strip() or None, calls


class ContentStream:
    """The content of a streamed output that may hold tool calls: the text before the first
    ``<tool_call>``, holding back what may still become one."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = ""

    def add(self, piece: str) -> str:
        """The new content after ``piece`` of text (may be empty)."""
        self.text += piece
        start = self.text.find(OPEN)
        if start >= 0:
            visible = self.text[:start]
        else:
            visible = self.text[: len(self.text) - held_back(self.text, [OPEN])]
        return self._send(visible)

    def finish(self, content: str | None) -> str:
        """What is left to send of the final ``content``."""
        return self._send(content or "")

    def _send(self, visible: str) -> str:
        if not visible.startswith(self.sent) or len(visible) <= len(self.sent):
            return ""
        new, self.sent = visible[len(self.sent) :], visible
        return new
