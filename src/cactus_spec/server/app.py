"""The OpenAI-compatible HTTP server: routes, streaming, metrics and the API key.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (through the tokenizer's chat
template), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).
Requests go to the ``Scheduler``, which decodes them in batches on its own thread; its
callbacks are handed to the event loop, so a route only ever awaits a queue. A client that
disconnects is cancelled, and its row is freed at the next iteration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cactus_spec.core.penalties import Penalties
from cactus_spec.core.sampling import MAX_SEED, SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime.generation import GenerationResult, Request, row_error_message
from cactus_spec.runtime.grammar import Grammar, GrammarError
from cactus_spec.runtime.logprobs import TokenLogprob
from cactus_spec.runtime.rows import ServingEngine
from cactus_spec.runtime.scheduler import QueueFullError, Scheduler
from cactus_spec.server import schema
from cactus_spec.server.answers import Answer
from cactus_spec.server.metrics import prometheus_text
from cactus_spec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse,
    speculative_spec,
)
from cactus_spec.server.tools import CLOSE, OPEN, defines_tool_calls, template_tools, tool_markers
from cactus_spec.server.wire import StrictJSONResponse as JSONResponse
from cactus_spec.server.wire import sse

#: max_tokens when a request gives none.
DEFAULT_MAX_TOKENS = 256
#: The largest request body read (a prompt filling a 32k context is well under it).
MAX_REQUEST_BYTES = 4 * 2**20
#: Seconds a request's body may take to arrive once its headers have.
BODY_TIMEOUT_S = 30.0
#: Seconds in-flight requests may run on after SIGTERM before they are ended.
SHUTDOWN_GRACE_S = 30.0
#: How often a non-streaming request checks that its client is still there.
_DISCONNECT_POLL_S = 0.25
_SHUTTING_DOWN = "the server is shutting down"
_DECODING_FAILED = "decoding_failed"  # the code of an error raised while a request decoded

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    api_key: str | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_request_bytes: int = MAX_REQUEST_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    chat_template: str | None = None  # None: the tokenizer's
    backend: str = "auto"  # what runs the models, as /health reports it
    backend_why: str = ""  # why auto chose it (``loading.backend_choice``)


def create_app(scheduler: Scheduler[ServingEngine], config: ServerConfig) -> FastAPI:
    """The FastAPI app over a started ``scheduler``. ``app.state.drain(grace)`` is what
    SIGTERM runs (``run.serve``): see ``_Handler.drain``."""
    app = FastAPI(
        title="cactus-spec", docs_url=None, redoc_url=None, default_response_class=JSONResponse
    )
    handler = _Handler(scheduler, config)
    app.state.drain = handler.drain
    schema.install(app, config.model_id)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
        handler.count(err)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HTTPRequest, err: StarletteHTTPException) -> JSONResponse:
        """Unknown routes (404) and methods (405) in OpenAI's error shape too."""
        answer = APIError(err.status_code, str(err.detail))
        return JSONResponse(answer.body(), status_code=err.status_code, headers=err.headers)

    if config.api_key:
        app.add_middleware(_RequireKey, key=config.api_key)

    @app.get("/health", responses={503: {"description": "the server is shutting down"}})
    async def health():
        if handler.closing:  # load balancers stop sending here
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "backend": config.backend, "backend_why": config.backend_why}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = prometheus_text(scheduler, handler.invalid, handler.unanswered)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": config.model_id, "object": "model", "created": 0, "owned_by": "cactus-spec"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = parse(CompletionRequest, await _json(request, config))
        return await handler.run(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = parse(ChatCompletionRequest, await _json(request, config))
        return await handler.run(request, body, chat=True)

    return app


class _RequireKey:
    """ASGI middleware: every route but /health needs ``Authorization: Bearer KEY`` (the
    scheme in any case, the key as UTF-8 bytes, compared in constant time). A plain ASGI
    layer, not Starlette's BaseHTTPMiddleware, which hides a client's disconnect from the
    route (a non-streaming request would then decode to its end for nobody)."""

    def __init__(self, app: Callable, key: str) -> None:
        self.app = app
        self.key = key.encode("utf-8")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not self._allowed(scope):
            err = APIError(401, "invalid or missing API key (Authorization: Bearer ...)")
            await JSONResponse(err.body(), status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: dict) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key)


async def _json(request: HTTPRequest, config: ServerConfig) -> object:
    """The request's JSON body: 413 past ``max_request_bytes`` (read no further), 408 when
    it does not arrive within ``body_timeout_s``, 400 when it is not JSON or the client
    left before it arrived."""
    limit = config.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    try:
        data = await asyncio.wait_for(_read(request, limit), config.body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {config.body_timeout_s:g} s"
        ) from None
    except ClientDisconnect:  # gone mid-body: nobody to answer, nothing to log
        raise APIError(400, "the client closed the connection before its body arrived") from None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


async def _read(request: HTTPRequest, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)")


class _Handler:
    """Turns a checked request body into a scheduler request and its answer."""

    def __init__(self, scheduler: Scheduler[ServingEngine], config: ServerConfig) -> None:
        self.scheduler = scheduler
        self.engine = scheduler.engine
        self.config = config
        self.closing = False
        self.live: dict[Request, asyncio.Queue] = {}  # submitted, not yet answered
        self.invalid = 0  # requests answered with a 4xx before decoding (429s: the queue's)
        self.unanswered = 0  # decoded to the end, but their answer could not be written
        self.tool_markers = tool_markers(self.engine.tokenizer)

    def count(self, err: APIError) -> None:
        """Count a request refused with a 4xx before it decoded (the scheduler counts 429s and
        what failed while decoding)."""
        if 400 <= err.status < 500 and err.status != 429 and err.code != _DECODING_FAILED:
            self.invalid += 1

    async def drain(self, grace_s: float) -> None:
        """Stop admitting (503), let the live requests run up to ``grace_s`` seconds, then end
        the rest: a stream gets a final error event and [DONE], a whole answer a 503."""
        self.closing = True
        await self._until_idle(grace_s)
        for pending, events in list(self.live.items()):
            self.scheduler.cancel(pending)
            events.put_nowait(("shutdown", None, None))
        await self._until_idle(5.0)  # their final answers go out

    async def _until_idle(self, seconds: float) -> None:
        """Wait until no request is live, or ``seconds`` have passed."""
        deadline = time.monotonic() + seconds
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def requests(
        self, body: CompletionRequest | ChatCompletionRequest, chat: bool
    ) -> list[Request]:
        """The scheduler requests of ``body``, one per choice (choice ``p n + i`` is prompt
        p's i-th, seeded ``seed + i``): every field checked, 400 naming the bad one."""
        self._check_model(body)
        sampling, spec = _sampling(body), self._spec(body)
        max_tokens = self._max_tokens(body)
        prompts = self._prompts(body, chat)
        for ids in prompts:
            self._check_context(len(ids), max_tokens, spec, body, chat)
        if len(prompts) * body.n > self.scheduler.max_queue:
            message = f"n: {len(prompts) * body.n} choices exceed the server's queue (--max-queue)"
            raise APIError(400, message, "n")
        grammar = body.grammar(self.tool_markers)
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        logprobs, stops = body.logprob_count(), body.stops()
        if logprobs is not None and self.engine.tokenizer is None:
            raise APIError(400, "logprobs: this model has no tokenizer to spell tokens", "logprobs")
        penalties, stop_ids = self._penalties(body), self._stop_token_ids(body)
        requests = []
        for ids in prompts:
            for i in range(body.n):
                choice_seed = (seed + i) % (MAX_SEED + 1)
                request = Request(
                    prompt_ids=ids,
                    max_new_tokens=max_tokens,
                    seed=choice_seed,
                    spec=spec,
                    sampling=sampling,
                    stop=tuple(stops),
                    stop_token_ids=stop_ids,
                    ignore_eos=body.ignore_eos,
                    logprobs=logprobs,
                    penalties=penalties,
                    grammar=grammar,
                )
                requests.append(request)
        return requests

    def _check_model(self, body: SamplingFields) -> None:
        if body.model != self.config.model_id:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves "
                f"{self.config.model_id!r}",
                "model",
                "model_not_found",
            )

    def _spec(self, body: SamplingFields) -> DecodeSpec:
        """The request's spec, resolved against the engine (``resolve``: a seeded request
        that leaves K open drafts the server's largest K, so its seed reproduces it); a 400
        naming ``speculative`` when the engine cannot decode by it."""
        spec = speculative_spec(body.speculative, self.engine.spec)
        if spec.drafts and not self.engine.spec.drafts:
            raise APIError(
                400,
                f"speculative.method: this server decodes by {self.engine.spec.method} and has "
                "no drafter, so only method ar is served",
                "speculative",
            )
        try:
            return self.engine.resolve(spec, seeded=body.seed is not None)
        except ValueError as err:
            raise APIError(400, f"speculative: {err}", "speculative") from None

    def _check_context(
        self,
        prompt_tokens: int,
        max_tokens: int,
        spec: DecodeSpec,
        body: SamplingFields,
        chat: bool,
    ) -> None:
        """A 400 when the prompt, the budget and a draft tree's extra nodes overflow the
        context, naming what the client sent that overflows: the prompt where it leaves no
        room for one token, ``speculative.<key>`` where the tree it asked for alone makes it
        overflow, else ``max_tokens``."""
        try:
            self.engine.check_context(prompt_tokens, max_tokens, spec)
        except ValueError as err:
            param = self._overflowing(prompt_tokens, max_tokens, body, chat)
            raise APIError(400, str(err), param, "context_length_exceeded") from None

    def _overflowing(
        self, prompt_tokens: int, max_tokens: int, body: SamplingFields, chat: bool
    ) -> str:
        """The field ``_check_context`` names (see there)."""
        if prompt_tokens >= self.engine.context_length:
            return "messages" if chat else "prompt"
        sent = body.speculative or {}
        asked = [key for key in ("branches", "num_draft_tokens", "verification") if key in sent]
        fits_as_chain = prompt_tokens + max_tokens <= self.engine.context_length
        return f"speculative.{asked[0]}" if asked and fits_as_chain else "max_tokens"

    def _penalties(self, body: SamplingFields) -> Penalties:
        penalties = body.penalties()
        try:
            penalties.check_tokens(self.engine.vocab_size)
        except ValueError as err:
            raise APIError(400, str(err), "logit_bias") from None
        return penalties

    def _stop_token_ids(self, body: SamplingFields) -> tuple[int, ...]:
        ids = tuple(body.stop_token_ids or ())
        if any(not 0 <= token < self.engine.vocab_size for token in ids):
            message = f"stop_token_ids: token ids must lie in [0, {self.engine.vocab_size})"
            raise APIError(400, message, "stop_token_ids")
        return ids

    def _token_text(self, token: int) -> str:
        assert self.engine.tokenizer is not None  # requests refuses logprobs without one
        return self.engine.tokenizer.decode([token])  # type: ignore[return-value]  # one text

    def _max_tokens(self, body: SamplingFields) -> int:
        given = body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None
        return given or body.max_tokens or self.config.default_max_tokens

    async def _check_grammar(self, body: SamplingFields, grammar: Grammar | None) -> None:
        """A 400 naming the field the grammar came from unless it compiles for the model's
        tokenizer and can start (``Grammars.compile``; in a thread: a large grammar takes up
        to a second, which the event loop must not wait)."""
        if grammar is None:
            return
        if body.ignore_eos:
            message = (
                f"ignore_eos cannot be used with {_grammar_param(body)}, whose grammar ends at EOS"
            )
            raise APIError(400, message, "ignore_eos")
        try:
            await asyncio.to_thread(self.engine.check_grammar, grammar)
        except ValueError as err:
            param = _grammar_param(body)
            raise APIError(400, f"{param}: {row_error_message(err)}", param) from None

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation through the chat template, with the tools offered (in
        ``tool_mode``); a 400 when the template defines no tool-call format."""
        template = self.config.chat_template or self.engine.chat_template
        uses_tools = body.tool_mode or any(m.uses_tools for m in body.messages)
        if uses_tools and not defines_tool_calls(template):
            param = "tools" if body.tools else "messages"
            message = (
                f"{param}: this model's chat template defines no tool-call format "
                f"({OPEN} ... {CLOSE}); serve it with --chat-template FILE that does"
            )
            raise APIError(400, message, param)
        messages = [m.as_template_message(i) for i, m in enumerate(body.messages)]
        tools = None
        if body.tool_mode:
            assert body.tools is not None  # tool_mode: tools are offered
            tools = template_tools(body.tools)
        return self.engine.encode_chat(messages, tools, template)

    def _prompts(
        self, body: CompletionRequest | ChatCompletionRequest, chat: bool
    ) -> list[list[int]]:
        try:
            if isinstance(body, ChatCompletionRequest):
                return [self._chat_prompt(body)]
            return [self.engine.encode(prompt, chat=False) for prompt in body.prompts()]
        except ValueError as err:
            param = "messages" if chat else "prompt"
            raise APIError(400, f"{param}: {err}", param) from None

    async def run(
        self, request: HTTPRequest, body: CompletionRequest | ChatCompletionRequest, chat: bool
    ):
        if self.closing:
            raise APIError(503, f"{_SHUTTING_DOWN}; retry elsewhere", code="shutting_down")
        pendings = self.requests(body, chat)
        await self._check_grammar(body, pendings[0].grammar)
        events: asyncio.Queue = asyncio.Queue()  # (kind, choice index, value)
        loop = asyncio.get_running_loop()

        def send(kind: str, index: int) -> Callable:
            def put(value: object) -> None:
                if not loop.is_closed():  # after shutdown nobody is left to tell
                    loop.call_soon_threadsafe(events.put_nowait, (kind, index, value))

            return put

        streams = body.stream and pendings[0].logprobs is not None  # every choice alike
        pendings = [
            replace(
                pending,
                on_text=send("text", index) if body.stream else None,
                on_logprobs=send("logprobs", index) if streams else None,
                on_done=send("done", index),
                on_error=send("error", index),
            )
            for index, pending in enumerate(pendings)
        ]
        self._submit(pendings)
        for pending in pendings:
            self.live[pending] = events
        text = None if pendings[0].logprobs is None else self._token_text
        prompt_tokens = sum(len(p.prompt_ids) for p in pendings[:: body.n])
        tools = isinstance(body, ChatCompletionRequest) and body.tool_mode
        answer = Answer(
            self.config.model_id, chat, prompt_tokens, len(pendings), body.n, text, tools
        )
        grammar_param = None if pendings[0].grammar is None else _grammar_param(body)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream(pendings, events, answer, usage, grammar_param),
                media_type="text/event-stream",
            )
        try:
            return await self._whole(request, pendings, events, answer, grammar_param)
        finally:
            self._forget(pendings)

    def _submit(self, pendings: list[Request]) -> None:
        """Queue every choice, or none: 429 when the queue cannot hold them all."""
        for count, pending in enumerate(pendings):
            try:
                self.scheduler.submit(pending)
            except QueueFullError as err:
                for submitted in pendings[:count]:
                    self.scheduler.cancel(submitted)
                raise APIError(429, f"{err}; retry later", code="queue_full") from None

    def _forget(self, pendings: list[Request]) -> None:
        """The request is answered (or its client left): cancel what still decodes."""
        for pending in pendings:
            self.live.pop(pending, None)
            self.scheduler.cancel(pending)

    async def _whole(
        self,
        request: HTTPRequest,
        pendings: list[Request],
        events: asyncio.Queue,
        answer,
        grammar_param: str | None,
    ):
        """Wait for every choice's result, cancelling them all if the client goes away."""
        results: dict[int, GenerationResult] = {}
        while len(results) < len(pendings):
            try:
                kind, index, value = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return JSONResponse({}, status_code=499)
                continue
            if kind == "error":
                raise _decode_error(value, grammar_param)
            if kind == "shutdown":
                raise APIError(503, f"{_SHUTTING_DOWN}; the answer was not finished")
            results[index] = value
        try:
            return JSONResponse(answer.whole([results[i] for i in range(len(pendings))]))
        except ValueError as err:
            raise self._unanswered(err) from None

    def _unanswered(self, err: ValueError) -> APIError:
        """A decoded request whose answer could not be written (a value strict JSON cannot
        carry): logged, counted as failed, answered with a 500."""
        _log.error("a decoded answer could not be written", exc_info=err)
        self.unanswered += 1
        return APIError(500, f"the answer could not be written: {err}", code=_DECODING_FAILED)

    async def _stream(
        self,
        pendings: list[Request],
        events: asyncio.Queue,
        answer,
        usage: bool,
        grammar_param: str | None,
    ) -> AsyncIterator[str]:
        """Server-sent events: per choice, one chunk per piece of text and its finish; then
        usage and [DONE]."""
        results: dict[int, GenerationResult] = {}
        entries: dict[int, list[TokenLogprob]] = {}  # per choice, since its last chunk
        try:
            if answer.chat:
                for index in range(len(pendings)):
                    yield sse(answer.chunk(index, {"role": "assistant", "content": ""}, None))
            while len(results) < len(pendings):
                kind, index, value = await events.get()
                if kind == "logprobs":
                    entries.setdefault(index, []).extend(value)
                elif kind == "text":
                    piece = answer.text(index, value)
                    if piece:
                        yield sse(answer.chunk(index, piece, None, entries.pop(index, None)))
                elif kind == "error":
                    yield sse(_decode_error(value, grammar_param).body())
                    break
                elif kind == "shutdown":
                    yield sse(APIError(503, f"{_SHUTTING_DOWN}; the answer ends here").body())
                    break
                else:
                    results[index] = value
                    for chunk in answer.ending(index, value, entries.pop(index, None)):
                        yield sse(chunk)
            if usage and len(results) == len(pendings):
                ordered = [results[i] for i in range(len(pendings))]
                last = {
                    **answer.envelope(stream=True),
                    "choices": [],
                    "usage": answer.usage(ordered),
                    "timings": answer.timings(ordered),
                }
                try:
                    yield sse(last)
                except ValueError as err:
                    yield sse(self._unanswered(err).body())
            yield "data: [DONE]\n\n"
        finally:
            self._forget(pendings)


def _grammar_param(body: SamplingFields) -> str:
    """The field a request's grammar came from."""
    return "response_format" if body.response_format is not None else "tool_choice"


def _decode_error(err: BaseException, grammar_param: str | None) -> APIError:
    """The answer to a request whose decoding failed with ``err``, its own error (or a
    ``BatchError``, which names no request): a 400 naming the grammar's field where its
    grammar could not go on, else a 500; either way one bounded line."""
    message = row_error_message(err)
    if isinstance(err, GrammarError) and grammar_param is not None:
        return APIError(400, f"{grammar_param}: {message}", grammar_param, _DECODING_FAILED)
    return APIError(500, f"decoding failed: {message}", code=_DECODING_FAILED)


def _sampling(body: SamplingFields) -> SamplingConfig:
    """The request's sampling, the defaults where it gives none; 400 when invalid."""
    defaults = SamplingConfig()
    try:
        return SamplingConfig(
            defaults.temperature if body.temperature is None else body.temperature,
            defaults.top_k if body.top_k is None else body.top_k,
            defaults.top_p if body.top_p is None else body.top_p,
            body.min_p or 0.0,
        )
    except ValueError as err:
        raise APIError(400, str(err)) from None
