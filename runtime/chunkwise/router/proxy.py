"""The router's HTTP face: an OpenAI-compatible pass-through, plus its own /health and /metrics.

A generation request (POST /v1/completions, /v1/chat/completions) is read once for routing, sent unchanged
to the chosen replica, and the replica's answer comes back as it is: status, headers that are not
hop-by-hop, and body, streamed chunk by chunk when the replica streams. Errors are the replica's own, with
their status and OpenAI error body. The router answers for itself only when no replica could: a 503 in
OpenAI's error format.

A request is tried on another replica when the chosen one cannot have started it: the connection failed
(the replica is ejected), or it answered 503 (loading or draining; it says to retry elsewhere). A 429 is
the fleet's overload signal and goes back to the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from chunkwise.router.core import Pick, Router
from chunkwise.router.prompt import CHAT, COMPLETIONS, PromptReader, RoutedRequest
from chunkwise.router.slo import Shed, Slo, SloHeaderError, parse_slo
from chunkwise.router.sse import FirstTokenWatch
from chunkwise.router.wake import Waker

logger = logging.getLogger("chunkwise.router")

# Attempts per request across replicas (the first try included).
MAX_ATTEMPTS = 3
NO_REPLICA_RETRY_AFTER_S = 2
REPLICA_HEADER = "x-chunkwise-replica"
# RFC 9110 hop-by-hop fields, plus those the proxy recomputes (length, host) or must not pass on.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
    }
)


def _request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


def _response_headers(headers: httpx.Headers, replica: str) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP and k.lower() not in ("date", "server")}
    out[REPLICA_HEADER] = replica
    return out


def openai_error(status: int, message: str, code: str, headers: Mapping[str, str] | None = None) -> Response:
    kind = {
        400: "invalid_request_error",
        429: "rate_limit_exceeded",
        503: "service_unavailable",
        502: "bad_gateway",
    }.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


class _Relay(StreamingResponse):
    """A streamed answer that always releases its upstream response and accounting when it ends.

    In the response rather than in the body's generator: a client that disconnects before the first
    chunk cancels the response before the generator ever starts, and an unstarted generator's `finally`
    never runs.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        status_code: int,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(content, status_code=status_code, headers=dict(headers))
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


class Proxy:
    def __init__(self, router: Router, reader: PromptReader, waker: Waker | None = None) -> None:
        self.router = router
        self.reader = reader
        self.waker = waker

    async def generate(self, request: Request) -> Response:
        body = await request.body()
        try:
            slo = parse_slo(request.headers)
        except SloHeaderError as e:
            self.router.metrics.responses.labels("400").inc()
            return openai_error(400, str(e), "invalid_slo_header")
        routed = self.reader.read(request.url.path, body)
        waker = self.waker
        if waker is not None and not self.router.candidates(self.router.clock()):
            if not waker.admit():
                return self._no_replica(
                    f"no replica is ready and {waker.held} requests already wait for one",
                    waker.config.retry_after_s,
                )
            if routed.stream:
                return StreamingResponse(
                    self._held_stream(waker, request, body, routed, slo), media_type="text/event-stream"
                )
            if not await waker.wait():
                return self._no_replica(
                    f"no replica became ready within {waker.config.wait_s:g} s", waker.config.retry_after_s
                )
        return await self._forward(request, body, routed, slo)

    async def _held_stream(
        self, waker: Waker, request: Request, body: bytes, routed: RoutedRequest, slo: Slo | None
    ) -> AsyncIterator[bytes]:
        """A streaming request held for a replica: comments while it waits, then the replica's own stream."""
        waiting = asyncio.ensure_future(waker.wait())
        try:
            yield b": waiting for a replica to start\n\n"  # the 200 and its headers go out now
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=waker.config.keepalive_s)
                if not waiting.done():
                    yield b": still waiting for a replica\n\n"
        finally:
            waiting.cancel()  # a client that went away while held leaves the queue
        if not waiting.result():
            yield _error_event(f"no replica became ready within {waker.config.wait_s:g} s", "no_replica")
            return
        resp = await self._forward(request, body, routed, slo)
        if not isinstance(resp, _Relay):
            # The status line is sent already: a refusal (429, 503) travels as an error event.
            yield _error_event(bytes(resp.body).decode(errors="replace"), f"upstream_{resp.status_code}")
            return
        try:
            async for chunk in resp.body_iterator:
                yield chunk if isinstance(chunk, bytes) else str(chunk).encode()
        finally:
            await resp.on_close()

    async def passthrough(self, request: Request) -> Response:
        """Anything else under /v1 (models): any replica can answer, no accounting."""
        body = await request.body()
        tried: list[str] = []
        for _ in range(MAX_ATTEMPTS):
            replica = self.router.any_candidate(exclude=tried)
            if replica is None:
                break
            tried.append(replica.url)
            try:
                resp = await self.router.client.request(
                    request.method,
                    replica.url + request.url.path,
                    params=request.query_params,
                    content=body,
                    headers=_request_headers(request.headers),
                )
            except httpx.TransportError as e:
                self.router.eject(replica, type(e).__name__)
                continue
            self.router.metrics.responses.labels(str(resp.status_code)).inc()
            return Response(
                resp.content, resp.status_code, headers=_decoded(_response_headers(resp.headers, replica.url))
            )
        return self._no_replica()

    def _no_replica(
        self,
        message: str = "no replica is available to serve this request",
        retry_after_s: int = NO_REPLICA_RETRY_AFTER_S,
    ) -> Response:
        self.router.metrics.responses.labels("503").inc()
        return openai_error(503, message, "no_replica", {"Retry-After": str(retry_after_s)})

    async def _forward(
        self, request: Request, body: bytes, routed: RoutedRequest, slo: Slo | None = None
    ) -> Response:
        router = self.router
        headers = _request_headers(request.headers)
        tried: list[str] = []
        unavailable: tuple[int, dict[str, str], bytes] | None = None
        for attempt in range(MAX_ATTEMPTS):
            try:
                pick = router.pick(routed, exclude=tried, slo=slo)
            except Shed as e:
                router.metrics.responses.labels("429").inc()
                return openai_error(429, e.message, "slo_unattainable", {"Retry-After": str(e.retry_after_s)})
            if pick is None:
                break
            url = pick.replica.url
            tried.append(url)
            upstream = router.client.build_request(
                request.method,
                url + request.url.path,
                params=request.query_params,
                content=body,
                headers=headers,
            )
            try:
                resp = await router.client.send(upstream, stream=True)
            except httpx.TransportError as e:
                router.finish(pick)
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    router.eject(pick.replica, type(e).__name__)
                router.metrics.retries.labels(type(e).__name__).inc()
                continue
            except BaseException:
                router.finish(pick)
                raise
            if resp.status_code == 503 and attempt + 1 < MAX_ATTEMPTS:
                # Loading or draining: it did not start the request, and says another replica should.
                content = await _read_all(resp)
                router.finish(pick)
                router.eject(pick.replica, "unavailable", reachable=True)
                router.metrics.retries.labels("unavailable").inc()
                unavailable = (resp.status_code, _decoded(_response_headers(resp.headers, url)), content)
                continue
            return await self._relay(request, resp, pick)
        if unavailable is not None:
            status, hdrs, content = unavailable
            router.metrics.responses.labels(str(status)).inc()
            return Response(content, status, headers=hdrs)
        return self._no_replica()

    async def _relay(self, request: Request, resp: httpx.Response, pick: Pick) -> Response:
        router = self.router
        headers = _response_headers(resp.headers, pick.replica.url)
        router.metrics.responses.labels(str(resp.status_code)).inc()
        streaming = resp.headers.get("content-type", "").startswith("text/event-stream")
        if not streaming:
            try:
                content = await _read_all(resp)
            finally:
                router.finish(pick)
            return Response(content, resp.status_code, headers=_decoded(headers))

        watch = FirstTokenWatch(request.url.path) if resp.status_code == 200 else None

        async def relay() -> AsyncIterator[bytes]:
            nonlocal watch
            async for chunk in resp.aiter_raw():
                if watch is not None and watch.feed(chunk):
                    router.first_token(pick)
                    watch = None
                yield chunk

        async def close() -> None:
            # Also on a client disconnect: closing upstream makes the replica abort the request.
            await resp.aclose()
            router.finish(pick)

        return _Relay(relay(), close, status_code=resp.status_code, headers=headers)

    async def health(self, request: Request) -> Response:
        now = self.router.clock()
        replicas = self.router.replicas.values()
        ready = self.router.ready()
        body: dict[str, Any] = {
            # A router that wakes its service stays ready with no replica: it holds requests meanwhile.
            "status": "ok" if ready else "waking" if self.waker is not None else "unavailable",
            "replicas": len(replicas),
            "healthy": sum(1 for r in replicas if r.healthy and r.candidate(now)),
        }
        if self.waker is not None:
            body["held"] = self.waker.held
        status = 503 if body["status"] == "unavailable" else 200
        return JSONResponse(body, status_code=status)

    async def metrics(self, request: Request) -> Response:
        return Response(
            self.router.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )


async def _read_all(resp: httpx.Response) -> bytes:
    """The decoded body (so a buffered answer never carries the replica's content-encoding)."""
    try:
        return await resp.aread()
    finally:
        await resp.aclose()


def _decoded(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() != "content-encoding"}


def _error_event(message: str, code: str) -> bytes:
    """OpenAI's error body as one SSE event, then the end of the stream."""
    error = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def build_app(
    router: Router, reader: PromptReader, lifespan: Any = None, waker: Waker | None = None
) -> Starlette:
    proxy = Proxy(router, reader, waker)
    if waker is not None:
        router.metrics.held.set_function(lambda: waker.held)
    routes = [
        Route(COMPLETIONS, proxy.generate, methods=["POST"]),
        Route(CHAT, proxy.generate, methods=["POST"]),
        Route("/v1/{rest:path}", proxy.passthrough, methods=["GET", "POST"]),
        Route("/health", proxy.health, methods=["GET"]),
        Route("/metrics", proxy.metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
