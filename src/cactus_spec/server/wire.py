"""The server's one JSON encoder: strict, as JavaScript's ``JSON.parse``, Go and Rust read
JSON. Python's ``json`` writes ``Infinity`` and ``NaN`` by default; here they are a
ValueError, so a non-finite float is caught where it is made (``audit.reported_kl`` turns an
unbounded divergence into null), never sent."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


def dumps(payload: object) -> str:
    """``payload`` as strict JSON; ValueError for NaN or an infinity anywhere in it."""
    return json.dumps(payload, allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def sse(payload: object) -> str:
    """``payload`` as one server-sent event."""
    return f"data: {dumps(payload)}\n\n"


class StrictJSONResponse(JSONResponse):
    """A JSON response written by ``dumps``."""

    def render(self, content: object) -> bytes:
        return dumps(content).encode("utf-8")
