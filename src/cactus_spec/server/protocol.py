"""The OpenAI request bodies the server accepts, their checks, and the error shape.

Fields follow OpenAI's completions and chat completions; ``top_k`` and ``speculative`` are
extensions. ``speculative`` picks the method per request and is checked by the same registry
as the command line (``methods``)::

    "speculative": {"method": "cactus", "delta": 1.0, "exact": false, "num_draft_tokens": 8}

Unknown top-level fields are ignored (as OpenAI-compatible servers do); every known field is
checked, and a bad one gets a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cactus_spec.core.methods import build_rule, get_method
from cactus_spec.core.rules import Rule
from cactus_spec.core.sampling import MAX_SEED

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
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")
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
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
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


def speculative_choice(
    options: dict[str, Any] | None, default_rule: Rule | None
) -> tuple[Rule | None, int | None]:
    """The rule (None: autoregressive) and K (None: the server's policy) of a request's
    ``speculative`` object, checked against the method registry."""
    if options is None:
        return default_rule, None
    given = dict(options)
    method = given.pop("method", None)
    k = given.pop("num_draft_tokens", None)
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise APIError(400, "speculative.num_draft_tokens must be an integer", _K_PARAM)
    if k is not None and not 1 <= k <= MAX_DRAFT_TOKENS:
        raise APIError(
            400, f"speculative.num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]", _K_PARAM
        )
    if method is None:
        if given:
            raise APIError(400, "speculative.method is required with method parameters")
        return default_rule, k
    try:
        spec = get_method(str(method))
        _check_types(spec, given)
        rule = build_rule(spec.name, given)
    except ValueError as err:
        raise APIError(400, f"speculative: {err}", "speculative") from None
    if rule is None and k is not None:
        raise APIError(400, "speculative.num_draft_tokens does not apply to method ar", _K_PARAM)
    return rule, k


_K_PARAM = "speculative.num_draft_tokens"


def _check_types(spec, given: dict[str, Any]) -> None:
    """A parameter's value has its default's type (an int is a float here)."""
    for name, value in given.items():
        default = spec.defaults.get(name)
        if default is None:
            continue  # build_rule names the methods that take it
        wanted = type(default)
        numbers = (int, float) if wanted is float else int
        if wanted is bool:
            ok = isinstance(value, bool)
        else:
            ok = not isinstance(value, bool) and isinstance(value, numbers)
        if not ok:
            raise ValueError(f"{name} must be a {wanted.__name__}, got {value!r}")
