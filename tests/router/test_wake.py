"""Scale from zero in the router: requests held while no replica is ready, bounded, kept alive, and the
InferenceService's /scale raised (that last against kmock's API server)."""

from __future__ import annotations

import asyncio
import json

import httpx
import kubernetes

from chunkwise.engine.tokenizer import ByteTokenizer
from chunkwise.router.core import Router
from chunkwise.router.discovery import kube_api_client
from chunkwise.router.prompt import PromptReader
from chunkwise.router.proxy import build_app
from chunkwise.router.wake import GROUP, PLURAL, VERSION, KubeScaler, WakeConfig, Waker

from .conftest import URLS
from .fake_replicas import FakeFleet, body, make_router, sse


class Wake:
    """A router with no replica, and a scale-up that brings one `delay` seconds after it is asked."""

    def __init__(self, delay: float | None, **config: float) -> None:
        self.fleet = FakeFleet()
        self.router: Router = make_router(self.fleet, [])
        self.asked = 0
        self.delay = delay
        settings = {"queue_limit": 4, "wait_s": 5.0, "keepalive_s": 0.1, **config}
        self.config = WakeConfig(
            service="chat",
            namespace="ml",
            queue_limit=int(settings["queue_limit"]),
            wait_s=settings["wait_s"],
            keepalive_s=settings["keepalive_s"],
            retry_after_s=10,
        )
        self.waker = Waker(
            self.config, lambda: bool(self.router.candidates(self.router.clock())), self.scale_up
        )
        self._arrivals: list[asyncio.Task[None]] = []

    async def scale_up(self) -> bool:
        self.asked += 1
        if self.delay is not None and self.asked == 1:
            self._arrivals.append(asyncio.ensure_future(self._arrive()))
        return True

    async def _arrive(self) -> None:
        assert self.delay is not None
        await asyncio.sleep(self.delay)
        self.router.set_replicas(URLS[:1])
        await self.router.probe_all()

    def client(self) -> httpx.AsyncClient:
        app = build_app(self.router, PromptReader(ByteTokenizer(), 16, 64), waker=self.waker)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router", timeout=10)


async def test_a_request_held_at_zero_replicas_is_served_once_one_is_ready() -> None:
    w = Wake(delay=0.3)
    async with w.client() as c:
        resp = await c.post("/v1/completions", content=body())
    assert resp.status_code == 200
    assert resp.json()["served_by"] == URLS[0]
    assert w.asked == 1
    assert w.waker.held == 0


async def test_past_the_queue_limit_the_answer_is_503_with_retry_after() -> None:
    w = Wake(delay=None, queue_limit=1)
    async with w.client() as c:
        first = asyncio.ensure_future(c.post("/v1/completions", content=body()))
        while w.waker.held == 0:
            await asyncio.sleep(0.01)
        resp = await c.post("/v1/completions", content=body())
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "10"
    assert resp.json()["error"]["message"] == "no replica is ready and 1 requests already wait for one"


async def test_past_the_wait_the_answer_is_503_with_retry_after() -> None:
    w = Wake(delay=None, wait_s=0.3)
    async with w.client() as c:
        resp = await c.post("/v1/completions", content=body())
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "10"
    assert resp.json()["error"] == {
        "message": "no replica became ready within 0.3 s",
        "type": "service_unavailable",
        "param": None,
        "code": "no_replica",
    }
    assert w.asked == 1 and w.waker.held == 0


async def test_a_held_stream_gets_keepalive_comments_then_the_replicas_events() -> None:
    w = Wake(delay=0.45)
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]
    w.fleet.handlers[URLS[0]] = lambda request: sse(events)
    async with w.client() as c:
        resp = await c.post("/v1/completions", content=body(stream=True))
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    text = resp.content
    assert text.startswith(b": waiting for a replica to start\n\n")
    assert text.count(b": still waiting for a replica\n\n") >= 2
    assert text.endswith(b"".join(events))
    assert not w.router.replicas[URLS[0]].inflight


async def test_a_held_stream_that_times_out_ends_with_an_error_event() -> None:
    w = Wake(delay=None, wait_s=0.25)
    async with w.client() as c:
        resp = await c.post("/v1/completions", content=body(stream=True))
    data = [line for line in resp.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[0][len("data: ") :])["error"]["message"] == "no replica became ready within 0.25 s"


async def test_health_stays_ok_while_waking() -> None:
    w = Wake(delay=None)
    async with w.client() as c:
        resp = await c.get("/health")
    assert (resp.status_code, resp.json()["status"], resp.json()["held"]) == (200, "waking", 0)
    plain = build_app(make_router(FakeFleet(), []), PromptReader(ByteTokenizer(), 16, 64))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain), base_url="http://r") as c:
        assert (await c.get("/health")).status_code == 503


async def test_the_scaler_raises_zero_to_one_and_nothing_else(kube: str) -> None:
    api = kubernetes.client.CustomObjectsApi(
        kubernetes.client.ApiClient(kubernetes.client.Configuration(host=kube))
    )
    for name, replicas in (("idle", 0), ("busy", 3)):
        obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name}}
        obj["spec"] = {"replicas": replicas}
        await asyncio.to_thread(api.create_namespaced_custom_object, GROUP, VERSION, "ml", PLURAL, obj)

    def replicas(name: str) -> int:
        got = api.get_namespaced_custom_object(GROUP, VERSION, "ml", PLURAL, name)
        return int(got["spec"]["replicas"])  # type: ignore[index]

    assert await KubeScaler("idle", "ml", kube_api_client).scale_up() is True
    assert await asyncio.to_thread(replicas, "idle") == 1
    assert await KubeScaler("idle", "ml", kube_api_client).scale_up() is False  # already 1: left alone
    assert await KubeScaler("busy", "ml", kube_api_client).scale_up() is False
    assert await asyncio.to_thread(replicas, "busy") == 3


async def test_the_held_requests_are_a_metric_the_operator_can_scale_on() -> None:
    w = Wake(delay=None)
    async with w.client() as c:
        first = asyncio.ensure_future(c.post("/v1/completions", content=body()))
        second = asyncio.ensure_future(c.post("/v1/completions", content=body()))
        while w.waker.held < 2:
            await asyncio.sleep(0.01)
        metrics = (await c.get("/metrics")).text
        for task in (first, second):
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
    assert "chunkwise:router_held_requests 2.0" in metrics.splitlines()
