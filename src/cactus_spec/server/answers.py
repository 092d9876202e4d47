"""The response objects of one request, in OpenAI's shapes: whole answers, stream chunks and
usage, for one or more choices (``n``, or several completion prompts), with tool calls read
from the output when the request offered tools (``tools``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

from cactus_spec.core.audit import reported_kl
from cactus_spec.runtime.generation import GenerationResult
from cactus_spec.runtime.logprobs import TokenLogprob
from cactus_spec.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from cactus_spec.server.tools import ContentStream, parse_tool_calls


class Answer:
    """One request's answers: ``n`` choices per prompt (choice ``p n + i`` is prompt p's i-th),
    ``choices`` in all, the prompts ``prompt_tokens`` tokens together; ``token_text`` turns
    token ids into text, None when no log-probabilities were asked for."""

    def __init__(
        self,
        model_id: str,
        chat: bool,
        prompt_tokens: int,
        choices: int,
        n: int,
        token_text: TokenText | None,
        tools: bool = False,
    ) -> None:
        self.chat = chat
        self.tools = tools  # read tool calls from each choice's output
        self.model_id = model_id
        self.prompt_tokens = prompt_tokens
        self.choices = choices
        self.n = n
        self.token_text = token_text
        self.offsets = [0] * choices  # characters whose logprobs were sent, per choice
        self.contents = [ContentStream() for _ in range(choices)] if tools else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def envelope(self, stream: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        if stream and self.chat:
            kind += ".chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id}

    def logprobs(self, index: int, entries: Sequence[TokenLogprob] | None) -> dict | None:
        """Choice ``index``'s ``entries`` in the route's shape; None when none were asked for
        or there are none."""
        if self.token_text is None or not entries:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_text)
        shaped = completion_logprobs(entries, self.token_text, self.offsets[index])
        self.offsets[index] += sum(len(token) for token in shaped["tokens"])
        return shaped

    def chunk(
        self,
        index: int,
        piece: str | dict,
        finish_reason: str | None,
        entries: Sequence[TokenLogprob] | None = None,
    ) -> dict:
        """A stream chunk of choice ``index``: a piece of text (a delta dict for chat)."""
        logprobs = self.logprobs(index, entries)
        if self.chat:
            delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
            choice: dict[str, object] = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": piece, "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        return {**self.envelope(stream=True), "choices": [choice]}

    def text(self, index: int, piece: str) -> str:
        """What of a streamed ``piece`` of choice ``index`` is content now (with tools, text
        from the first call on is held back)."""
        return piece if self.contents is None else self.contents[index].add(piece)

    def ending(
        self, index: int, result: GenerationResult, entries: Sequence[TokenLogprob] | None
    ) -> list[dict]:
        """The last chunks of streamed choice ``index``: content held back, the tool calls
        as one delta, and the finish."""
        chunks = []
        if self.contents is None:
            return [self.chunk(index, "", result.finish_reason or "stop", entries)]
        content, calls = parse_tool_calls(result.text or "")
        rest = self.contents[index].finish(content if calls else result.text)
        if rest:
            chunks.append(self.chunk(index, rest, None, entries))
            entries = None
        if calls:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
            chunks.append(self.chunk(index, delta, None, entries))
            entries = None
        chunks.append(self.chunk(index, "", _finish(result, calls), entries))
        return chunks

    def whole(self, results: Sequence[GenerationResult]) -> dict:
        """The whole answer: one choice per result, in order."""
        choices = []
        for index, result in enumerate(results):
            logprobs = self.logprobs(index, result.logprobs)
            calls: list[dict] = []
            choice: dict[str, object]
            if self.chat:
                message: dict[str, object] = {"role": "assistant", "content": result.text}
                if self.tools:
                    message["content"], calls = parse_tool_calls(result.text or "")
                    if calls:
                        message["tool_calls"] = calls
                choice = {"index": index, "message": message, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": result.text, "logprobs": logprobs}
            choice["finish_reason"] = _finish(result, calls)
            choices.append(choice)
        return {
            **self.envelope(stream=False),
            "choices": choices,
            "usage": self.usage(results),
            "timings": self.timings(results),
        }

    def timings(self, results: Sequence[GenerationResult]) -> dict:
        """How fast the prompt was read and the answer written, in llama-server's ``timings``
        shape: ``prompt_*`` over the prompt tokens read (cached ones are not), ``predicted_*``
        over the new tokens and the time after the prompt's read; each the longest of the
        choices' times (their rows run side by side)."""
        stats = [r.stats for r in results]
        prompts = stats[:: self.n]
        read = sum(s.read_prompt_tokens for s in prompts)
        reading = max((s.time_prompt_s for s in prompts), default=0.0)
        writing = max((s.time_total_s - s.time_prompt_s for s in stats), default=0.0)
        predicted = sum(len(r.token_ids) for r in results)
        return {
            **{f"prompt_{key}": value for key, value in _rates(read, reading).items()},
            **{f"predicted_{key}": value for key, value in _rates(predicted, writing).items()},
        }

    def usage(self, results: Sequence[GenerationResult]) -> dict:
        """Tokens and speculation figures, summed over the choices; each prompt counted once,
        its cached tokens as its first choice found them. The divergence is ``kl_nats``, or
        null with ``kl_unbounded`` true where a rule's law left q's support. With an answer's
        budget, the budget (each choice's) and the bound it puts on any event's probability."""
        stats = [r.stats for r in results]
        completion = sum(len(r.token_ids) for r in results)
        iterations = sum(s.iterations for s in stats)
        accepted = sum(s.accepted for s in stats)
        budget = stats[0].kl_budget if stats else None  # every choice has the request's
        bound = {} if budget is None else {"kl_budget": budget, "tv_bound": stats[0].tv_bound}
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(s.cached_prompt_tokens for s in stats[:: self.n])
            },
            "speculative": {
                "iterations": iterations,
                "drafted_tokens": sum(s.drafted for s in stats),
                "accepted_tokens": accepted,
                "mean_accepted_length": accepted / iterations if iterations else 0.0,
                **reported_kl(sum(s.kl_nats for s in stats)),
                **bound,
            },
        }


def _rates(tokens: int, seconds: float) -> dict:
    """Tokens, milliseconds, milliseconds a token and tokens a second (0 where none)."""
    return {
        "n": tokens,
        "ms": 1e3 * seconds,
        "per_token_ms": 1e3 * seconds / tokens if tokens else 0.0,
        "per_second": tokens / seconds if seconds else 0.0,
    }


def _finish(result: GenerationResult, calls: Sequence[dict]) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the output held calls and ended there."""
    if calls and result.finish_reason == "stop":
        return "tool_calls"
    return result.finish_reason or "stop"
