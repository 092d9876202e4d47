"""The OpenAI request bodies the server accepts, their checks, and the error shape.

Fields follow OpenAI's completions and chat completions; ``top_k`` and ``speculative`` are
extensions. ``speculative`` picks the method per request and is read by the same parser as
the command line (``core.spec.parse_spec``)::

    "speculative": {"method": "cactus", "delta": 1.0, "exact": false, "num_draft_tokens": 8}

Unknown top-level fields are ignored (as OpenAI-compatible servers do); every known field is
checked, and a bad one gets a 400 naming it. Extensions besides ``top_k`` and
``speculative``: ``repetition_penalty``, ``min_p``, ``stop_token_ids``, ``ignore_eos`` (as in
vLLM). OpenAI fields the server does not honour yet (``NOT_HONOURED``) are accepted only with
the value that asks for nothing (``"echo": false``, ``"tools": []``); any other value is a
400 that names the field, never a 200 that silently ignores it. Fields that do not change
the answer (``user``, ``metadata``, ``store: false``, ...) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cactus_spec.core.checks import is_int
from cactus_spec.core.penalties import Penalties
from cactus_spec.core.sampling import MAX_SEED
from cactus_spec.core.spec import DecodeSpec, parse_spec
from cactus_spec.runtime.logprobs import MAX_TOP_LOGPROBS

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
        "response_format": ({"type": "text"},),
        "tools": (_ANY_EMPTY,),
        "tool_choice": ("none",),
        "functions": (_ANY_EMPTY,),
        "function_call": ("none",),
        "audio": (),
        "modalities": (["text"],),
        "prediction": (),
        "web_search_options": (),
    },
}


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

    def penalties(self) -> Penalties:
        """The request's penalties and logit biases (``core.penalties``); 400 naming the
        field."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise APIError(400, f"logit_bias: keys are token ids, got {key!r}", "logit_bias")
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
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

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
    check_honoured(data, "chat" if model is ChatCompletionRequest else "completions")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"] if not isinstance(part, int)) or None
        where = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", field) from None


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
        return parse_spec(options, base=base)
    except ValueError as err:
        param = _K if str(err).startswith("num_draft_tokens") else "speculative"
        raise APIError(400, f"speculative: {err}", param) from None


_K = "speculative.num_draft_tokens"
