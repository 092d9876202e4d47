"""The OpenAI request bodies the server accepts, their checks, and the error shape.

Fields follow OpenAI's completions and chat completions; ``top_k`` and ``speculative`` are
extensions. ``speculative`` picks the method per request and is read by the same parser as
the command line (``core.spec.parse_spec``)::

    "speculative": {"method": "cactus", "delta": 1.0, "exact": false, "num_draft_tokens": 8}

Unknown top-level fields are ignored (as OpenAI-compatible servers do); every known field is
checked, and a bad one gets a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cactus_spec.core.checks import is_int
from cactus_spec.core.sampling import MAX_SEED
from cactus_spec.core.spec import DecodeSpec, parse_spec

#: Largest K a request may ask for.
MAX_DRAFT_TOKENS = 32


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
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: dict[str, Any] | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or not all(stops):
            raise APIError(400, "stop must be a non-empty string or up to 4 of them", "stop")
        return stops


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]

    def prompt_value(self) -> str | list[int]:
        """The one prompt: text or token ids (a list of one string is that string)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise APIError(400, "prompt: exactly one prompt per request (n = 1)", "prompt")
            return self.prompt[0]
        if not self.prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        return self.prompt


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


def parse(model: type[BaseModel], data: object) -> Any:
    """``data`` as ``model``, or a 400 APIError naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
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
