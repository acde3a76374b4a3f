"""The server's OpenAPI document (`GET /openapi.json`), from the request models the endpoints parse with.

The generation routes read their bodies themselves (`parse_body`: strict pydantic, a wrong type is OpenAI's
400, not FastAPI's 422), so FastAPI cannot see their schemas; this module writes them in: each body's
JSON schema from its pydantic model, and the error answers every route may give in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from chunkwise import __version__
from chunkwise.engine.datatypes.sampling_params import MAX_LOGPROBS, MAX_N, MAX_PENALTY
from chunkwise.server.chat import ROLES
from chunkwise.server.endpoints import MAX_BATCH_PROMPTS
from chunkwise.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)

if TYPE_CHECKING:
    from chunkwise.engine.loop.core import ModelInfo

REF = "#/components/schemas/{model}"
# The statuses a generation request can be answered with besides 200 (server/errors.py).
ERROR_STATUSES = {
    "400": "invalid request (a wrong type, a value out of range, an unsupported feature)",
    "404": "no such model",
    "413": "request body too large",
    "429": "overloaded: shed, with Retry-After",
    "503": "loading or draining, with Retry-After",
}
ERROR_SCHEMA: dict[str, Any] = {
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


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`, with its error answers."""
    errors = {
        status: {
            "description": why,
            "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}},
        }
        for status, why in ERROR_STATUSES.items()
    }
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        },
        "responses": errors,
    }


# What the request models' types cannot say: the ranges SamplingParams and the endpoints enforce (their
# messages are the 400s), and the OpenAI features this server refuses, documented as their one accepted value.
RANGES: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "presence_penalty": {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
    "frequency_penalty": {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "n": {"minimum": 1, "maximum": MAX_N},
    # best_of must equal n when given: a constraint between fields, left to the 400.
    "best_of": {"minimum": 1},
    "suffix": {"type": "null"},
    "logit_bias": {"type": "null"},
}


def _refine(schemas: dict[str, Any], served_model: str | None, info: ModelInfo | None) -> None:
    vocab_size = info.vocab_size if info is not None else None
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        for field, extra in RANGES.items():
            if field in props:
                props[field].update(extra)
        if info is not None:
            # This engine's bound: a request's choices must fit in one batch.
            props["n"]["maximum"] = min(MAX_N, info.max_num_seqs)
        if served_model is not None:
            props["model"] = {"anyOf": [{"enum": [served_model]}, {"type": "null"}], "title": "Model"}
    completion = schemas["CompletionRequest"]["properties"]
    completion["logprobs"].update({"minimum": 0, "maximum": MAX_LOGPROBS})
    ids: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        ids["maximum"] = vocab_size - 1
    # A non-empty string or list of token ids, or a batch of them.
    batch: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_PROMPTS}
    completion["prompt"] = {
        "title": "Prompt",
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": ids, "minItems": 1},
            {**batch, "items": {"type": "string", "minLength": 1}},
            {**batch, "items": {"type": "array", "items": ids, "minItems": 1}},
        ],
    }
    message = schemas["ChatMessageModel"]["properties"]
    message["role"] = {"title": "Role", "enum": list(ROLES)}
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    message["content"] = {
        "title": "Content",
        "anyOf": [{"type": "string"}, {"type": "array", "items": text_part}],
    }


def install_openapi(app: FastAPI, model_info: Callable[[], ModelInfo | None], served_model: str) -> None:
    """Serve the document at /openapi.json, built once the engine is known (its vocabulary bounds token ids)."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title="chunkwise", version=__version__, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (
            CompletionRequest,
            ChatCompletionRequest,
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        ):
            schema = model.model_json_schema(ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        schemas["ErrorResponse"] = ERROR_SCHEMA
        info = model_info()
        _refine(schemas, served_model, info)
        if info is None:
            return doc  # while loading: not cached, so the token-id bound appears once the engine has
        app.openapi_schema = doc
        return doc

    app.openapi = build  # type: ignore[method-assign]
