"""The pass-through: status, body and headers come back as the replica sent them; retries only where safe."""

from __future__ import annotations

import json

import httpx
import pytest

from chunkwise.engine.tokenizer import ByteTokenizer
from chunkwise.router.core import Router
from chunkwise.router.prompt import PromptReader
from chunkwise.router.proxy import REPLICA_HEADER, build_app

from .conftest import URLS
from .fake_replicas import FakeFleet, body, make_router, sse


def client(router: Router) -> httpx.AsyncClient:
    app = build_app(router, PromptReader(ByteTokenizer(), 16, 64))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


async def test_errors_pass_through_with_status_body_and_headers() -> None:
    error = {"error": {"message": "bad", "type": "invalid_request_error", "param": "model", "code": "x"}}
    fleet = FakeFleet(
        handlers={URLS[0]: lambda r: httpx.Response(429, json=error, headers={"Retry-After": "7"})}
    )
    router = make_router(fleet, URLS[:1])
    await router.probe_all()
    async with client(router) as c:
        resp = await c.post("/v1/completions", content=body(), headers={"content-type": "application/json"})
    # A 429 is the fleet's overload signal: not retried elsewhere, given to the client as it came.
    assert resp.status_code == 429
    assert resp.json() == error
    assert resp.headers["retry-after"] == "7"
    assert resp.headers[REPLICA_HEADER] == URLS[0]
    assert fleet.served() == [URLS[0]]
    assert not router.replicas[URLS[0]].inflight


async def test_request_body_and_headers_reach_the_replica_unchanged() -> None:
    fleet = FakeFleet()
    router = make_router(fleet, URLS[:1])
    await router.probe_all()
    raw = body("the same bytes", max_tokens=3)
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    fleet.handlers[URLS[0]] = record
    async with client(router) as c:
        resp = await c.post(
            "/v1/completions?x=1",
            content=raw,
            # The tenant header, whatever its name (`chunkwise serve --tenant-header`, the operator's
            # spec.router.tenantHeader): the replica names the tenant from it (issue 37).
            headers={"authorization": "Bearer k", "x-request-id": "r1", "x-tenant-id": "a", "X-Org-Id": "b"},
        )
    assert resp.json() == {"ok": True}
    (req,) = seen
    assert req.content == raw
    assert (req.headers["authorization"], req.headers["x-request-id"]) == ("Bearer k", "r1")
    assert (req.headers["x-tenant-id"], req.headers["x-org-id"]) == ("a", "b")
    assert req.url.params["x"] == "1"


async def test_streams_are_relayed_and_their_first_token_observed() -> None:
    events = [b'data: {"role": 1}\n\n', b'data: {"c": "a"}\n\n', b"data: [DONE]\n\n"]
    fleet = FakeFleet(handlers={URLS[0]: lambda r: sse(events)})
    router = make_router(fleet, URLS[:1])
    await router.probe_all()
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    async with client(router) as c:
        resp = await c.post("/v1/chat/completions", content=chat)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream"
    assert resp.content == b"".join(events)
    assert router.metrics.observed_ttft._sum.get() > 0  # type: ignore[attr-defined]
    assert not router.replicas[URLS[0]].inflight


async def test_connect_error_is_retried_on_another_replica_and_ejects() -> None:
    fleet = FakeFleet()
    router = make_router(fleet, URLS[:2])
    await router.probe_all()
    fleet.down.add(URLS[0])  # dies after the probe: the first pick still goes there
    async with client(router) as c:
        resp = await c.post("/v1/completions", content=body())
    assert resp.status_code == 200
    assert resp.json()["served_by"] == URLS[1]
    assert not router.replicas[URLS[0]].candidate(router.clock())
    assert router.metrics.retries.labels("ConnectError")._value.get() == 1.0


async def test_draining_replica_503_is_retried_elsewhere() -> None:
    draining = {"error": {"message": "shutting down", "type": "service_unavailable", "code": "draining"}}
    fleet = FakeFleet(handlers={URLS[0]: lambda r: httpx.Response(503, json=draining)})
    router = make_router(fleet, URLS[:2])
    await router.probe_all()
    async with client(router) as c:
        resp = await c.post("/v1/completions", content=body())
        assert resp.json()["served_by"] == URLS[1]
        # When every replica says 503, the client gets the last one as it was.
        fleet.handlers[URLS[1]] = lambda r: httpx.Response(503, json=draining)
        router.replicas[URLS[0]].recovered()
        resp = await c.post("/v1/completions", content=body())
    assert resp.status_code == 503
    assert resp.json() == draining


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models"])
async def test_no_replica_is_an_openai_503(path: str) -> None:
    router = make_router(FakeFleet(down=set(URLS[:1])), URLS[:1])
    await router.probe_all()
    async with client(router) as c:
        resp = await c.post(path, content=body()) if path != "/v1/models" else await c.get(path)
        health = await c.get("/health")
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "2"
    assert resp.json()["error"]["code"] == "no_replica"
    assert (health.status_code, health.json()["healthy"]) == (503, 0)


async def test_health_models_and_metrics() -> None:
    fleet = FakeFleet(handlers={URLS[0]: lambda r: httpx.Response(200, json={"object": "list", "data": []})})
    router = make_router(fleet, URLS[:1])
    await router.probe_all()
    async with client(router) as c:
        health = await c.get("/health")
        models = await c.get("/v1/models")
        await c.post("/v1/completions", content=body())
        metrics = (await c.get("/metrics")).text
    assert health.json() == {"status": "ok", "replicas": 1, "healthy": 1}
    assert models.json() == {"object": "list", "data": []}
    assert f'chunkwise:router_picks_total{{policy="round-robin",replica="{URLS[0]}"}} 1.0' in metrics
    assert f'chunkwise:router_replica_healthy{{replica="{URLS[0]}"}} 1.0' in metrics
    assert "chunkwise:router_predicted_ttft_seconds_count 1.0" in metrics
