"""What a server is built from (``ServeOptions``), every field checked when it is made.

``cactus-spec serve``, the tests and the benchmarks fill the same options and hand them to
``build.build_server``. A bad field is a one-line ValueError naming it the way its caller
wrote it (``label``: the command line's ``--max-batch`` for ``max_batch``) and what it
allows, before any model loads. The decoding spec and the model options come checked by their
own parsers (``core.spec.parse_spec``, ``loading.options.parse_load``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import InitVar, dataclass

from cactus_spec import isa
from cactus_spec.core.checks import check_int, is_int
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.options import LoadOptions
from cactus_spec.runtime.grammar import GrammarLimits
from cactus_spec.runtime.policy import POLICIES
from cactus_spec.runtime.scheduler import PREFILL_CHUNK
from cactus_spec.server.app import (
    BODY_TIMEOUT_S,
    DEFAULT_MAX_TOKENS,
    MAX_REQUEST_BYTES,
    SHUTDOWN_GRACE_S,
    ServerConfig,
)
from cactus_spec.server.run import HEADER_TIMEOUT_S

_LIMITS = GrammarLimits()
#: The fields that must be integers >= 1, in the order they are checked.
_COUNTS = (
    "max_batch", "max_queue", "default_max_tokens", "max_request_bytes", "max_grammar_bytes",
    "max_grammar_symbols", "grammar_step_fuel",
)  # fmt: skip
#: The fields a command line gives as they are (the spec, the models and the chat template's
#: text come read).
SERVE_KEYS = (
    "policy", *_COUNTS, "prefill_chunk", "prefix_cache", "body_timeout", "header_timeout",
    "shutdown_grace", "served_model_name", "api_key", "host", "port",
)  # fmt: skip


@dataclass(frozen=True)
class ServeOptions:
    """What a server is built and run from: its engine's spec and models, its scheduler's
    policy and bounds, its app's limits and its socket. Times are in seconds; ``label`` names
    a field in errors."""

    spec: DecodeSpec  # for requests that give none; with policy auto its K caps the policy's
    models: LoadOptions
    policy: str = "auto"  # how K is chosen for requests that give none (POLICIES)
    max_batch: int = 8  # rows decoded at once
    max_queue: int = 64  # waiting requests before HTTP 429
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # max_tokens when a request has none
    max_request_bytes: int = MAX_REQUEST_BYTES  # larger bodies get 413
    max_grammar_bytes: int = _LIMITS.max_bytes  # a request's grammar source; larger: 400
    max_grammar_symbols: int = _LIMITS.max_symbols  # in its compiled grammar; more: 400
    grammar_step_fuel: int = _LIMITS.step_fuel  # lexer work per token; more ends it with 400
    prefill_chunk: int | None = PREFILL_CHUNK  # prompt tokens read a turn; None: all at once
    prefix_cache: bool = True  # a prompt reuses the longest prefix a free row holds
    body_timeout: float = BODY_TIMEOUT_S  # for a request's body to arrive; slower: 408
    header_timeout: float = HEADER_TIMEOUT_S  # for a request's head to arrive; slower: 408
    shutdown_grace: float = SHUTDOWN_GRACE_S  # in-flight requests run on after SIGTERM
    served_model_name: str | None = None  # the model's id in the API; None: the verifier's
    api_key: str | None = None  # None: no key asked for
    chat_template: str | None = None  # a Jinja template's text; None: the tokenizer's
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    label: InitVar[Callable[[str], str]] = str

    def __post_init__(self, label: Callable[[str], str]) -> None:
        if not isinstance(self.spec, DecodeSpec):
            raise TypeError(f"spec must be a DecodeSpec, got {type(self.spec).__name__}")
        if not isinstance(self.models, LoadOptions):
            raise TypeError(f"models must be LoadOptions, got {type(self.models).__name__}")
        if self.policy not in POLICIES:
            allowed = ", ".join(POLICIES)
            raise ValueError(f"{label('policy')} must be one of {allowed}, got {self.policy!r}")
        for name in _COUNTS:
            check_int(label(name), getattr(self, name))
        if self.prefill_chunk is not None:
            check_int(label("prefill_chunk"), self.prefill_chunk)
        for name in ("body_timeout", "header_timeout"):
            _check_seconds(label(name), getattr(self, name), positive=True)
        _check_seconds(label("shutdown_grace"), self.shutdown_grace, positive=False)
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"{label('port')} must be in [0, 65535], got {self.port!r}")
        for name in ("served_model_name", "api_key", "chat_template"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"{label(name)} must be text, got {getattr(self, name)!r}")

    @property
    def model_id(self) -> str:
        """The model's id in the API: ``served_model_name``, else the verifier's name."""
        return self.served_model_name or str(self.models.verifier)

    def grammar_limits(self) -> GrammarLimits:
        """What a request's grammar may cost."""
        return GrammarLimits(
            self.max_grammar_bytes, self.max_grammar_symbols, self.grammar_step_fuel
        )

    def app_config(self, backend: str) -> ServerConfig:
        """What the app reads of these options; ``backend``: what runs the models (the
        engine's ``backend``)."""
        return ServerConfig(
            self.model_id,
            self.api_key,
            self.default_max_tokens,
            self.max_request_bytes,
            self.body_timeout,
            self.chat_template,
            backend,
            self.models.backend_why,
        )

    def describe(self, backend: str) -> str:
        """What is served: the models and their weights, the drafting, the rows, the CPU and
        ``backend``, what runs the models (the engine's), with why ``auto`` chose it."""
        models, spec = self.models, self.spec

        def weights(quant: str) -> str:
            if models.backend == "ggml":
                return "the GGUF's own, llama.cpp"
            return "dense" if quant == "none" else quant

        draft = f"{models.draft} ({weights(models.draft_quant)})" if models.draft else "none"
        drafting = f"drafter {spec.drafter}, policy {self.policy}" if spec.drafts else "no drafting"
        why = f" ({models.backend_why})" if models.backend_why else ""
        return (
            f"serving {self.model_id}: verifier {models.verifier} "
            f"({weights(models.verifier_quant)}), draft {draft}, {drafting}, "
            f"{self.max_batch} rows, instruction set {isa.level()}, backend {backend}{why}"
        )


def _check_seconds(name: str, value: object, positive: bool) -> None:
    """ValueError unless ``value`` is a number of seconds > 0 (``positive``), else >= 0."""
    bound = "> 0" if positive else ">= 0"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (value > 0 if positive else value >= 0)
    ):
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
