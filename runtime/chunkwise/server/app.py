"""The app factory: `build_app(engine, ...)` returns a FastAPI app serving that engine; nothing is global.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (200 ready; 503 while
loading, draining or after an engine failure), GET /metrics (Prometheus text), GET /v1/kv_events and
/v1/kv_events/snapshot (the prefix cache's changes, for the router: server/kv_events.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chunkwise.engine.loop.metrics import EngineMetrics
from chunkwise.engine.sched.shedding import SheddingPolicy
from chunkwise.server.args import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TENANT_HEADER
from chunkwise.server.endpoints import CHAT, COMPLETIONS
from chunkwise.server.errors import APIError, bad_request, install_error_handlers, validation_message
from chunkwise.server.kv_events import add_kv_event_routes
from chunkwise.server.lora import load_adapter, unload_adapter
from chunkwise.server.openapi import install_openapi, request_body
from chunkwise.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from chunkwise.server.serving import UNAVAILABLE_RETRY_AFTER_S, ServerState, serve

if TYPE_CHECKING:
    from chunkwise.engine import AsyncEngine

M = TypeVar("M", bound=BaseModel)


class _BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once from Content-Length, or as soon as a chunked body passes it
    (the app's own answer to the aborted read is replaced by the 413)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _response(self) -> Response:
        return APIError(
            413, f"request body exceeds the limit of {self.max_bytes} bytes", code="request_too_large"
        ).response()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False  # the server rejects a malformed Content-Length itself
                if too_large:
                    await self._response()(scope, receive, send)
                    return
        received = 0
        exceeded = False
        replaced = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal replaced
            if not exceeded:
                await send(message)
            elif not replaced:
                replaced = True
                await self._response()(scope, receive, send)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
            if not replaced:
                replaced = True
                await self._response()(scope, receive, send)


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as JSON whatever its Content-Type (`curl -d` sends form-urlencoded), validated strictly;
    every failure is a 400 with OpenAI's error body."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from e
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        message, param = validation_message(errors)
        raise bad_request(message, param=param) from e


def build_app(
    engine: AsyncEngine | None,
    *,
    served_model_name: str | None = None,
    max_waiting: int | None = None,
    queue_delay_slo_s: float | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics: EngineMetrics | None = None,
    allow_runtime_lora: bool = False,
    lora_cache_dir: Path | None = None,
    tenant_header: str = DEFAULT_TENANT_HEADER,
) -> FastAPI:
    """An app serving `engine` (which the caller starts and shuts down).

    `engine` may be None while it loads: /health answers 503 "loading" until `app.state.chunkwise.attach(e)`.
    served_model_name defaults to the engine's model; max_waiting to the engine's SchedulerConfig.max_waiting;
    None disables a load-shedding rule (see chunkwise.engine.sched.shedding).
    """
    if served_model_name is None:
        if engine is None:
            raise ValueError("served_model_name is required when the engine is not given")
        served_model_name = engine.model_info.model
    if max_waiting is None and engine is not None:
        max_waiting = engine.model_info.max_waiting
    shedding = SheddingPolicy(max_waiting=max_waiting, queue_delay_slo_s=queue_delay_slo_s)
    metrics = metrics or EngineMetrics(served_model_name)
    state = ServerState(
        engine, served_model_name, shedding, metrics, allow_runtime_lora, lora_cache_dir, tenant_header
    )

    app = FastAPI(title="chunkwise", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(
        app, lambda: state.engine.model_info if state.engine is not None else None, served_model_name
    )
    app.state.chunkwise = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serve(state, COMPLETIONS, await parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await serve(state, CHAT, await parse_body(request, ChatCompletionRequest), request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": state.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "chunkwise",
        }
        if state.engine is not None:
            card["root"] = state.engine.model_info.model
            card["max_model_len"] = state.engine.model_info.max_model_len
            # How the weights are quantized (null: full precision); OpenAI's clients keep unknown fields.
            card["quantization"] = state.engine.model_info.quantization
        return {"object": "list", "data": [card, *state.adapters.cards(state.created)]}

    @app.get("/health")
    async def health() -> JSONResponse:
        status = state.status
        if status == "ok":
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            {"status": status}, status_code=503, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    add_kv_event_routes(app, state)

    @app.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, LoadLoRAAdapterRequest)
        return await load_adapter(state.adapters, state.require_engine, body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, UnloadLoRAAdapterRequest)
        return unload_adapter(state.adapters, state.require_engine, body.lora_name)

    return app
