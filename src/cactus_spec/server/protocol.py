"""The OpenAI request bodies the server accepts, their checks, and the error shape.

Fields follow OpenAI's completions and chat completions; ``top_k`` and ``speculative`` are
extensions. ``speculative`` picks the method per request and is read by the same parser as
the command line (``core.spec.parse_spec``)::

    "speculative": {"method": "cactus", "delta": 1.0, "exact": false, "num_draft_tokens": 8}

An unknown top-level field (a misspelt ``temprature``) is a 400 naming it, as OpenAI answers;
every known field is checked, and a bad one gets a 400 naming it; a string anywhere in the
body that is not Unicode text (a lone surrogate, ``"\ud800"``) is a 400 naming its field.
Extensions besides ``top_k`` and
``speculative``: ``repetition_penalty``, ``min_p``, ``stop_token_ids``, ``ignore_eos`` (as in
vLLM), and ``response_format`` types ``regex`` and ``grammar`` (on completions too). OpenAI
fields the server does not honour (``NOT_HONOURED``) are accepted only with the value that
asks for nothing (``"echo": false``, ``"functions": []``); any other value is a 400 that
names the field, never a 200 that silently ignores it. Fields that do not change
the answer (``IGNORED``: ``user``, ``metadata``, ``service_tier``) are accepted.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cactus_spec.core.checks import is_int
from cactus_spec.core.penalties import Penalties
from cactus_spec.core.sampling import MAX_SEED
from cactus_spec.core.spec import SPEC_KEYS, DecodeSpec, parse_spec
from cactus_spec.runtime.grammar import Grammar
from cactus_spec.runtime.logprobs import MAX_TOP_LOGPROBS
from cactus_spec.server.tools import DEFAULT_MARKERS, Tool, ToolChoice, tool_grammar

#: Largest K a request may ask for.
MAX_DRAFT_TOKENS = 32
#: Most choices one request may ask for (``n`` times its prompts).
MAX_CHOICES = 16


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


#: Neutral values (the request asks for nothing) of the OpenAI fields not honoured yet; any
#: other value gets a 400. ``_ANY_EMPTY`` stands for an empty list or object.
_ANY_EMPTY = object()
_SHARED = {"store": (False,)}
NOT_HONOURED: dict[str, dict[str, tuple]] = {
    "completions": {
        **_SHARED,
        "echo": (False,),
        "best_of": (1,),
        "suffix": ("",),
    },
    "chat": {
        **_SHARED,
        "functions": (_ANY_EMPTY,),
        "function_call": ("none",),
        "audio": (),
        "modalities": (["text"],),
        "prediction": (),
        "web_search_options": (),
    },
}


#: OpenAI fields accepted and ignored: they do not change the answer.
IGNORED = ("user", "metadata", "service_tier")
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: ASCII decimal, no leading zero


def check_known(data: dict, model: type[BaseModel], route: str) -> None:
    """A 400 naming the first top-level field of ``data`` that ``model`` does not know."""
    known = {field.alias or name for name, field in model.model_fields.items()}
    known |= set(model.model_fields) | set(NOT_HONOURED[route]) | set(IGNORED)
    for name in data:
        if name not in known:
            raise APIError(400, f"{_printable(name)}: unknown field", _printable(name))


def check_text(value: object, path: str = "") -> None:
    """A 400 naming the first string (key or value) under ``value`` that is not Unicode
    text: a lone surrogate cannot be encoded, so no tokenizer can read it."""
    if isinstance(value, str):
        if not _encodable(value):
            message = f"{path or 'body'}: not valid Unicode text (a lone surrogate)"
            raise APIError(400, message, path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{_printable(key)}" if path else _printable(key)
            if not _encodable(key):
                raise APIError(400, f"{where}: a key is not valid Unicode text", path or None)
            check_text(item, where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{path}[{i}]")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(name: str) -> str:
    """``name`` safe to echo: its unencodable characters escaped, at most 64 characters."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")[:64]


def check_honoured(data: dict, route: str) -> None:
    """A 400 naming the first field of ``data`` that asks for what ``route`` (completions,
    chat) does not honour yet; null or the field's neutral value passes."""
    for name, neutral in NOT_HONOURED[route].items():
        value = data.get(name)
        if value is None or any(_same(value, n) for n in neutral):
            continue
        raise APIError(400, f"{name}: not supported by this server (see its README)", name)


def _same(value: object, neutral: object) -> bool:
    """``value`` is ``neutral`` in kind and content (``False`` is not ``0``)."""
    if neutral is _ANY_EMPTY:
        return isinstance(value, (list, dict)) and not value
    return type(value) is type(neutral) and value == neutral


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``json_schema`` response format. The schema is enforced whatever ``strict``
    says."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object``, ``json_schema`` (OpenAI's), and the extensions ``regex``
    (``{"type": "regex", "regex": "..."}``) and ``grammar`` (``{"type": "grammar",
    "grammar": "...", "syntax": "lark" | "gbnf"}``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None
    syntax: Literal["lark", "gbnf"] = "lark"

    def as_grammar(self) -> Grammar | None:
        """What the output must match, None for text; a 400 naming the missing field."""
        needed = {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}
        if self.type in needed and needed[self.type] is None:
            param = f"response_format.{self.type}"
            raise APIError(400, f"{param} is required with type {self.type}", param)
        try:
            if self.type == "json_object":
                return Grammar("json_object")
            if self.type == "json_schema":
                assert self.json_schema is not None  # required, checked above
                return Grammar.json_schema(self.json_schema.json_schema)
            if self.type == "regex":
                assert self.regex is not None  # required, checked above
                return Grammar("regex", self.regex)
            if self.type == "grammar":
                assert self.grammar is not None  # required, checked above
                return Grammar(self.syntax, self.grammar)
        except ValueError as err:
            raise APIError(400, f"response_format: {err}", "response_format") from None
        return None


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: dict[str, Any] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None

    def grammar(self, markers: tuple[str, str] = DEFAULT_MARKERS) -> Grammar | None:
        """What the output must match (``response_format``), None when anything goes;
        ``markers``: how the tokenizer writes a tool call's markers (``tools.tool_markers``)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", "stream_options")
        return None if self.response_format is None else self.response_format.as_grammar()

    def penalties(self) -> Penalties:
        """The request's penalties and logit biases (``core.penalties``); 400 naming the
        field."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                message = f"logit_bias: keys are token ids in ASCII decimal, got {key!r}"
                raise APIError(400, message, "logit_bias")
            bias.append((int(key), value))
        try:
            return Penalties(
                self.presence_penalty or 0.0,
                self.frequency_penalty or 0.0,
                1.0 if self.repetition_penalty is None else self.repetition_penalty,
                tuple(bias),
            )
        except ValueError as err:
            raise APIError(400, str(err), str(err).split()[0].split("[")[0]) from None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or not all(stops):
            raise APIError(400, "stop must be a non-empty string or up to 4 of them", "stop")
        return stops


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)

    def logprob_count(self) -> int | None:
        """Alternatives per token to report, or None: no log-probabilities."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: a string, a list of token ids, or a list of
        either (one choice per prompt, ``n`` each)."""
        prompt = self.prompt
        many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = list(prompt) if many else [prompt]
        if not prompt or any(not p for p in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise APIError(
                400,
                f"prompt: {len(prompts)} prompts x n = {self.n} exceed {MAX_CHOICES} choices",
                "prompt",
            )
        return prompts  # type: ignore[return-value]  # many: a list of texts or of id lists


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)

    def as_template_message(self, index: int) -> dict[str, Any]:
        """The message as chat templates take it (a call's arguments as an object); a 400
        naming ``messages[index]`` when it has no content and no calls."""
        content = self.content
        if content is None and not self.tool_calls:
            param = f"messages[{index}].content"
            raise APIError(400, f"{param} is required unless the message has tool_calls", param)
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call, index) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _template_call(call: ToolCall, index: int) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        param = f"messages[{index}].tool_calls"
        raise APIError(400, f"{param}: arguments must be JSON text", param) from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def tool_mode(self) -> bool:
        """Whether the model is offered tools (and its output read for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def grammar(self, markers: tuple[str, str] = DEFAULT_MARKERS) -> Grammar | None:
        """What the output must match: a forced tool call, else ``response_format``."""
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        shaped = super().grammar()
        if not self.tool_mode:
            return shaped
        choice = self.tool_choice or "auto"
        assert self.tools is not None  # tool_mode: tools are offered
        try:
            forced = tool_grammar(self.tools, choice, self.parallel_tool_calls, markers)
        except ValueError as err:
            raise APIError(400, str(err), "tool_choice") from None
        if forced is not None and shaped is not None:
            message = "response_format cannot be used with a tool_choice that forces a call"
            raise APIError(400, message, "response_format")
        return forced or shaped

    def logprob_count(self) -> int | None:
        """Alternatives per token to report, or None: no log-probabilities."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0


def parse(model: type[BaseModel], data: object) -> Any:
    """``data`` as ``model``, or a 400 APIError naming the first bad field or the first field
    asking for what the server does not honour."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    route = "chat" if model is ChatCompletionRequest else "completions"
    check_text(data)
    check_known(data, model, route)
    check_honoured(data, route)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        path = _input_path(data, first["loc"])
        field = ".".join(str(part) for part in path if not isinstance(part, int)) or None
        where = ".".join(str(part) for part in path)
        raise APIError(400, f"{where}: {first['msg']}", field) from None


def _input_path(data: object, loc: tuple) -> list:
    """The part of a validation error's ``loc`` that names fields of the input: pydantic
    adds the union member it tried (``str``, ``literal['none','auto']``), which no client
    wrote; a missing field ends the path."""
    path: list = []
    for part in loc:
        if isinstance(data, dict) and isinstance(part, str):
            path.append(part)
            if part not in data:
                break
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            path.append(part)
            data = data[part]
        else:
            break
    return path


def speculative_spec(options: dict[str, Any] | None, base: DecodeSpec) -> DecodeSpec:
    """The spec of a request's ``speculative`` object over the server's ``base`` (its method
    and K; K None leaves it to the server's policy), read by ``core.spec.parse_spec``: a
    400 naming the bad key. The drafter is the server's; K is at most ``MAX_DRAFT_TOKENS``."""
    if options is None:
        return base
    if "drafter" in options:
        message = "speculative.drafter: the drafter is the server's (--drafter)"
        raise APIError(400, message, "speculative.drafter")
    k = options.get("num_draft_tokens")
    if is_int(k) and not 1 <= k <= MAX_DRAFT_TOKENS:
        raise APIError(400, f"{_K} must be in [1, {MAX_DRAFT_TOKENS}], got {k}", _K)
    try:
        return parse_spec(options, base=base, label=_SPECULATIVE.__add__)
    except ValueError as err:
        raise _speculative_error(str(err), options) from None


_SPECULATIVE = "speculative."


def _speculative_error(message: str, options: dict[str, Any]) -> APIError:
    """A 400 naming the ``speculative`` key ``message`` is about: the key it opens with (the
    spec's parser names its keys ``speculative.<key>``, a rule its parameters bare), or the
    unknown key it quotes; ``speculative`` itself when it names none."""
    first = message.split(" ", 1)[0].removeprefix(_SPECULATIVE)
    unknown = [key for key in options if message.startswith(f"unknown key {key!r}")]
    key = unknown[0] if unknown else first if first in (*options, *SPEC_KEYS) else None
    if key is None:
        return APIError(400, f"speculative: {message}", "speculative")
    param = _SPECULATIVE + key
    return APIError(400, message if message.startswith(param) else f"{param}: {message}", param)


_K = "speculative.num_draft_tokens"
