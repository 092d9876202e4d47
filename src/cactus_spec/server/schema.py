"""The server's OpenAPI description, as the routes really behave.

The completion routes read their bodies themselves (size limit, timeout, OpenAI-shaped 400s),
so FastAPI cannot see their request models; this module adds them, the answers' content
types (JSON, or server-sent events when ``stream`` is true) and every error status a route
gives, in OpenAI's error shape. Served at ``/openapi.json``; tested with schemathesis.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from cactus_spec.server.protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
#: Every status a completion route answers besides 200, and why.
ERRORS = {
    "400": "a field is missing, of the wrong type or out of range; the body is not JSON",
    "401": "the API key is missing or wrong (servers started with --api-key)",
    "404": "the model is not the one this server serves",
    "408": "the request's head or body did not arrive in time",
    "413": "the body exceeds --max-request-bytes",
    "429": "--max-queue requests are waiting",
    "500": "decoding failed",
    "503": "the server is shutting down",
}
#: The routes that read a body, and its model.
BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def install(app: FastAPI, model_id: str) -> None:
    """Make ``app.openapi()`` return the description above (built once)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = describe(app, model_id)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's way to replace it


def describe(app: FastAPI, model_id: str) -> dict:
    """The routes' OpenAPI document; ``model`` is the one model served (others get 404)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR
    errors = {
        status: {
            "description": why,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for status, why in ERRORS.items()
    }
    for path, model in BODIES.items():
        body = model.model_json_schema(ref_template=_REF)
        body["properties"]["model"] = {"type": "string", "enum": [model_id]}
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
            },
        }
        operation["responses"] = {
            "200": {
                "description": "the answer, or its server-sent events when stream is true",
                "content": {"application/json": {}, "text/event-stream": {}},
            },
            **errors,
        }
    return schema
