"""The serving path shared by /v1/completions and /v1/chat/completions: body -> SamplingParams (the
endpoint's `prepare`, endpoints.py) -> engine stream -> SSE chunks or one JSON answer, shaped by the
endpoint's formatter (formatters.py).

Every prompt of a request gets its own engine request and `RequestStream` (a batch of prompts is several;
n choices of one prompt are one, forked inside the engine), and every path out of a handler closes them all:
a finished request is left alone, anything else (client disconnect, cancellation, error) is aborted so its KV blocks are freed
within a step. Disconnects are watched for explicitly: a streaming response races its sender against the
ASGI `http.disconnect` message; a non-streaming one races collection against it.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from chunkwise.engine.datatypes.lora import LoRARequest
from chunkwise.engine.datatypes.outputs import RequestFailed
from chunkwise.engine.loop.metrics import EngineMetrics
from chunkwise.engine.sched.shedding import Overloaded, SheddingPolicy

# chat_prompt_ids is re-exported: the router's tests hold its prompt ids against the server's, from here.
from chunkwise.server.args import DEFAULT_TENANT_HEADER
from chunkwise.server.endpoints import B, Endpoint, Generation
from chunkwise.server.endpoints import chat_prompt_ids as chat_prompt_ids
from chunkwise.server.errors import APIError, from_value_error
from chunkwise.server.formatters import CollectedResponse, Formatter, Prompt, ResponseHead, Usage
from chunkwise.server.lora import ServedAdapters

if TYPE_CHECKING:
    from chunkwise.engine import AsyncEngine, RequestStream
    from chunkwise.engine.datatypes.outputs import RequestOutput

# What a refused client is told while the server loads or drains (another replica may take it sooner).
UNAVAILABLE_RETRY_AFTER_S = 5


class ServerState:
    """Everything one app holds: no module globals, so a process can build several apps."""

    def __init__(
        self,
        engine: AsyncEngine | None,
        served_model_name: str,
        shedding: SheddingPolicy,
        metrics: EngineMetrics,
        allow_runtime_lora: bool = False,
        lora_cache_dir: Path | None = None,
        tenant_header: str = DEFAULT_TENANT_HEADER,
    ) -> None:
        self.engine: AsyncEngine | None = None
        self.served_model_name = served_model_name
        self.adapters = ServedAdapters(served_model_name, allow_runtime_lora, lora_cache_dir)
        self.shedding = shedding
        self.tenant_header = tenant_header
        self.metrics = metrics
        self.draining = False
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: AsyncEngine) -> None:
        """Serve `engine` from now on (the server starts answering /health 200 once it runs)."""
        engine.add_observer(self.metrics.on_step)
        info = engine.model_info
        self.metrics.set_cache_config(info.block_size, info.num_blocks, info.enable_prefix_caching)
        self.metrics.set_scheduling_policy(info.scheduling_policy)
        self.metrics.set_stats_source(engine.scheduler_stats)
        self.engine = engine

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.engine is None:
            return "loading"
        if not self.engine.is_running:
            return "error"
        return "ok"

    def require_engine(self) -> AsyncEngine:
        status = self.status
        if status == "ok":
            assert self.engine is not None
            return self.engine
        messages = {
            "draining": "the server is shutting down; retry on another replica",
            "loading": "the model is still loading; retry shortly",
            "error": "the engine is not running",
        }
        raise APIError(
            503, messages[status], code=status, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}
        )

    def add(
        self,
        engine: AsyncEngine,
        endpoint: Endpoint[Any],
        gen: Generation,
        request_id: str,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> list[RequestStream]:
        """One engine request per prompt (ids `request_id`, or `request_id-k` for a batch); if one is
        refused, the ones already queued are aborted before the error is raised."""
        streams: list[RequestStream] = []
        try:
            for k, prompt in enumerate(gen.prompts):
                rid = request_id if len(gen.prompts) == 1 else f"{request_id}-{k}"
                streams.append(self._add_one(engine, endpoint, gen, prompt, rid, lora, tenant))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    def _add_one(
        self,
        engine: AsyncEngine,
        endpoint: Endpoint[Any],
        gen: Generation,
        prompt: str | list[int],
        request_id: str,
        lora: LoRARequest | None,
        tenant: str | None,
    ) -> RequestStream:
        model = lora.lora_name if lora is not None else self.served_model_name
        try:
            return engine.add_request(
                prompt,
                gen.params,
                request_id=request_id,
                # An adapter's outputs have lengths of their own: admission learns them apart.
                route=f"{model}:{endpoint.route}",
                shedding=self.shedding,
                lora_request=lora,
                tenant=tenant,
            )
        except Overloaded as e:
            d = e.decision
            assert d.reason is not None
            self.metrics.record_rejection(d.reason)
            raise APIError(
                429, d.message, code=d.reason, headers={"Retry-After": str(d.retry_after_s)}
            ) from e
        except ValueError as e:
            raise from_value_error(e, endpoint.prompt_param) from e
        except RuntimeError as e:
            raise APIError(503, str(e), code="error") from e

    def token_text(self, engine: AsyncEngine, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


# -- the one path ------------------------------------------------------------------------------------------
async def serve(state: ServerState, endpoint: Endpoint[B], body: B, request: Request) -> Response:
    engine = state.require_engine()
    lora = state.adapters.resolve(body.model)
    gen = endpoint.prepare(body, engine)
    rid = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
    # The tenant (--fairness vtc): the configured header, else OpenAI's `user` field.
    tenant = request.headers.get(state.tenant_header) or body.user or None
    streams = state.add(engine, endpoint, gen, rid, lora, tenant)
    prompts = tuple(
        Prompt(s.prompt_token_ids, _prompt_text(engine, p, s.prompt_token_ids) if gen.options.echo else "")
        for p, s in zip(gen.prompts, streams)
    )
    model = lora.lora_name if lora is not None else state.served_model_name
    head = ResponseHead(rid, int(time.time()), model, prompts, gen.params.n)
    fmt = endpoint.formatter(head, gen.options, functools.partial(state.token_text, engine))
    if gen.options.stream:
        return EngineStreamResponse(_events(fmt, streams), streams)
    try:
        result = await _collect(request, fmt, streams)
    except RequestFailed as e:
        raise _stream_error(e) from e
    if result is None:
        return Response(status_code=499)
    if result.aborted:
        raise _aborted_error()
    return _json(fmt.answer(result, _usage(streams, result.num_completion_tokens, result.num_cached_tokens)))


def _prompt_text(engine: AsyncEngine, prompt: str | list[int], ids: list[int]) -> str:
    # Echo repeats a text prompt as sent; a prompt of ids is shown as its tokens decode.
    return prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids, skip_special_tokens=False)


def _usage(streams: list[RequestStream], completion_tokens: int, cached_tokens: int) -> Usage:
    # Each prompt counts once, however many choices it forked into.
    return Usage(sum(s.num_prompt_tokens for s in streams), completion_tokens, cached_tokens)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as each arrives; one stream needs no tasks."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(k: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await q.put((k, out))
            await q.put(None)
        except Exception as e:
            await q.put(e)

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def _events(fmt: Formatter, streams: list[RequestStream]) -> AsyncIterator[bytes]:
    num_tokens = 0
    cached = [0] * len(streams)
    try:
        for data in fmt.opening():
            yield _sse(data)
        async for k, out in _merged(streams):
            cached[k] = out.num_cached_tokens
            fmt.add_prompt_logprobs(k, out.prompt_logprobs)
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                if c.finish_reason == "abort":
                    yield _sse(_aborted_error().body())
                    yield SSE_DONE
                    return
                if not c.token_ids and not c.text and c.finish_reason is None:
                    continue
                # A chunk for every step with new tokens, text or not (held back for a stop string, an
                # incomplete character, a model without a tokenizer): a client times every token, as with
                # vLLM.
                yield _sse(fmt.chunk(k, c))
    except Exception as e:
        yield _sse(_stream_error(e).body())
        yield SSE_DONE
        return
    if fmt.options.include_usage:
        yield _sse(fmt.usage_chunk(_usage(streams, num_tokens, sum(cached))))
    yield SSE_DONE


def _dumps(data: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON. orjson: 0.3 us a streamed chunk against json's 6, and a served step writes one chunk
    per running stream (NaN and infinities become null, where json would write invalid JSON)."""
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _json(data: dict[str, Any], status_code: int = 200) -> Response:
    return Response(_dumps(data), status_code=status_code, media_type="application/json")


def _aborted_error() -> APIError:
    return APIError(503, "the request was aborted: the server is shutting down", code="aborted")


def _stream_error(e: Exception) -> APIError:
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), code="engine_error")
    return APIError(500, f"engine error: {e}")


# -- disconnects -------------------------------------------------------------------------------------------
async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(
    request: Request, fmt: Formatter, streams: list[RequestStream]
) -> CollectedResponse | None:
    """All of one response's output, or None when the client went away first (its requests are aborted)."""
    result = CollectedResponse(fmt.head)

    async def consume() -> None:
        async for k, out in _merged(streams):
            result.add(k, out)
            fmt.add_prompt_logprobs(k, out.prompt_logprobs)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            return None  # disconnected
        consumer.result()  # re-raise the engine's error, if any
        return result
    finally:
        watcher.cancel()
        consumer.cancel()
        for s in streams:
            s.close()


class EngineStreamResponse(Response):
    """Server-sent events from an engine stream. Races the sender against the client's disconnect, and
    closes (aborts) the engine requests however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], streams: list[RequestStream]) -> None:
        self.body_iterator = body
        self.streams = streams
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            sender.cancel()
            for s in self.streams:
                s.close()
            try:
                await sender
            except (asyncio.CancelledError, OSError):
                pass  # the client went away
            finally:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
