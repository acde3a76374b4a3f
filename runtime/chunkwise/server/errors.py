"""OpenAI's error body, and the mapping of every failure onto it.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

400 invalid input (pydantic's validation errors too: FastAPI's 422 becomes 400, as OpenAI answers), 404 unknown
route, 405 wrong method, 413 body too large, 429 overload (with Retry-After), 503 loading or draining (with
Retry-After), 500 only for the server's own faults.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("chunkwise.server")

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _TYPES.get(status_code, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# SamplingParams and EngineCore.make_request start their messages with the offending field's name.
_PARAM_PREFIX = re.compile(r"^([a-z_]+) ")
_KNOWN_PARAMS = {
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "prompt_logprobs",
    "priority",
    "prompt",
}


def from_value_error(e: ValueError, prompt_param: str = "prompt") -> APIError:
    """The engine's ValueErrors (SamplingParams, make_request) are the client's fault: 400."""
    message = str(e)
    m = _PARAM_PREFIX.match(message)
    param = m.group(1) if m and m.group(1) in _KNOWN_PARAMS else None
    if param == "prompt":
        param = prompt_param
    return bad_request(message, param=param)


_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list of either",
    "stop": "must be a string or a list of strings",
}


def _loc_param(loc: Sequence[Any]) -> str | None:
    parts = [str(p) for p in loc[1:] if not isinstance(p, int)] if loc and loc[0] == "body" else []
    return parts[0] if parts else None


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the top-level field it concerns."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = list(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if loc == ["body"] and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    param = _loc_param(loc)
    if param in _UNION_HINTS and len(loc) > 1 and isinstance(loc[-1], str) and loc[-1] != param:
        # A union field: pydantic reports one failure per alternative; say what is accepted instead.
        return f"{param}: {_UNION_HINTS[param]}", param
    path = ".".join(str(p) for p in loc[1:] if p not in ("str", "int", "list[int]", "list[str]"))
    where = f"{path}: " if path else ""
    extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}{first.get('msg', 'invalid value')}{extra}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return bad_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = "not found: no such route"
        elif status == 405:
            message = "method not allowed for this route"
        else:
            message = str(exc.detail)
        return APIError(status, message, headers=exc.headers).response()

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return from_value_error(exc).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal server error: {type(exc).__name__}").response()
