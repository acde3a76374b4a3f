"""Replicas faked at the transport: each URL answers as a test tells it to, through httpx.MockTransport."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from chunkwise.router.core import Router
from chunkwise.router.cost import CostModel, Defaults

Handler = Callable[[httpx.Request], httpx.Response]

METRICS = (
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
)


def completion(replica: str, text: str = "ok") -> httpx.Response:
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text}], "served_by": replica}
    return httpx.Response(200, json=body)


async def _events(events: list[bytes]) -> AsyncIterator[bytes]:
    for e in events:
        yield e


def sse(events: list[bytes]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_events(events))


@dataclass
class FakeFleet:
    """Per-URL behaviour for /health, /metrics and generation requests; records what each URL received."""

    health: dict[str, int] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)
    handlers: dict[str, Handler] = field(default_factory=dict)
    received: list[tuple[str, str, bytes]] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            status = self.health.get(base, 200)
            return httpx.Response(status, json={"status": "ok" if status == 200 else "loading"})
        if path == "/metrics":
            return httpx.Response(200, text=METRICS)
        if path.startswith("/v1/kv_events"):
            # A replica that publishes no KV events: the router routes on its own estimate.
            return httpx.Response(404, json={"error": {"message": "no KV events", "type": "not_found_error"}})
        self.received.append((base, path, request.content))
        handler = self.handlers.get(base)
        if handler is not None:
            return handler(request)
        return completion(base)

    def served(self) -> list[str]:
        return [base for base, _, _ in self.received]


def make_router(fleet: FakeFleet, urls: list[str], policy: str = "round-robin", **kw: object) -> Router:
    router = Router(
        policy=policy,
        cost=CostModel(16, Defaults()),
        client=httpx.AsyncClient(transport=httpx.MockTransport(fleet)),
        poll_interval_s=0.5,
        **kw,  # type: ignore[arg-type]
    )
    router.set_replicas(urls)
    return router


def body(prompt: str = "hello", **extra: object) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, **extra}).encode()
