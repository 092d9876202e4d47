"""Emitted tokens' log-probabilities (``runtime.logprobs``) in OpenAI's two shapes.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``. Completions:
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``. JSON has
no -inf, so a token outside q's support reads ``LOGPROB_FLOOR``, as OpenAI's API does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from cactus_spec.runtime.logprobs import TokenLogprob

#: What log 0 reads as.
LOGPROB_FLOOR = -9999.0

TokenText = Callable[[int], str]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _chat_entry(token: int, logprob: float, text: TokenText) -> dict:
    piece = text(token)
    return {"token": piece, "logprob": _finite(logprob), "bytes": list(piece.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict:
    """The chat shape of ``entries``; ``text`` turns a token id into its text."""
    content = [
        {
            **_chat_entry(e.token, e.logprob, text),
            "top_logprobs": [_chat_entry(t, lp, text) for t, lp in e.top],
        }
        for e in entries
    ]
    return {"content": content}


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int) -> dict:
    """The completions shape of ``entries``, the first at character ``offset`` of the text."""
    tokens = [text(e.token) for e in entries]
    offsets = []
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [{text(t): _finite(lp) for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
