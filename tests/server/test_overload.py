"""Past capacity the server sheds load at once (429 + Retry-After) and keeps its queue bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import MODEL, start_server, wait_for

MAX_WAITING = 4


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name} {labels} not exported")


def gauge(text: str, name: str) -> float:
    """One unlabelled-but-for-model gauge, read without parsing the whole exposition (cheap to poll)."""
    prefix = f'{name}{{model_name="{MODEL}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"{name} not exported")


async def test_flood_sheds_with_429_and_bounds_the_queue() -> None:
    server = start_server({"max_num_seqs": 2}, max_waiting=MAX_WAITING)
    try:
        body = {"model": MODEL, "prompt": "flood", "max_tokens": 64, "ignore_eos": True}
        waiting_seen: list[float] = []
        done = asyncio.Event()
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

            async def poll_queue() -> None:
                while not done.is_set():
                    text = (await client.get("/metrics")).text
                    waiting_seen.append(gauge(text, "vllm:num_requests_waiting"))
                    await asyncio.sleep(0.01)

            poller = asyncio.create_task(poll_queue())
            responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(32)))
            done.set()
            await poller
            text = (await client.get("/metrics")).text

        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, statuses
        accepted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        assert len(refused) > 0 and len(accepted) >= MAX_WAITING
        for r in accepted:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 64
        for r in refused:
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "rate_limit_exceeded" and err["code"] == "queue_full"
        assert waiting_seen and max(waiting_seen) <= MAX_WAITING
        rejected = metric(text, "chunkwise:admission_rejections_total", reason="queue_full")
        assert rejected == len(refused)

        # The loop publishes its stats just after delivering the last tokens: poll for the final state.
        def settled() -> bool:
            text = httpx.get(f"{server.url}/metrics").text
            return metric(text, "vllm:num_requests_running") == 0 and metric(
                text, "vllm:request_success_total", finished_reason="length"
            ) == len(accepted)

        wait_for(settled)
    finally:
        server.stop()


async def _first_event(lines: AsyncIterator[str]) -> str:
    async for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("the stream ended without an event")


async def test_predicted_delay_over_slo_is_429() -> None:
    # One request runs at a time; the objective is tiny, so any queued work ahead of a newcomer breaks it.
    server = start_server({"max_num_seqs": 1}, max_waiting=16, queue_delay_slo_s=1e-6)
    long = {"model": MODEL, "prompt": "slo", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=long) as running:
                assert running.status_code == 200
                # Keep the line iterator referenced: a discarded one closes the response (a disconnect).
                lines = running.aiter_lines()
                await _first_event(lines)
                # The second waits behind the first: admitted, since nothing is queued ahead of it.
                async with client.stream("POST", "/v1/completions", json=long) as queued:
                    assert queued.status_code == 200
                    wait_for(lambda: server.engine.load().num_waiting == 1)
                    assert server.engine.num_unfinished == 2
                    r = await client.post("/v1/completions", json={**long, "stream": False})
                    assert r.status_code == 429
                    assert r.json()["error"]["code"] == "slo"
                    assert int(r.headers["Retry-After"]) >= 1
            # Both streams closed mid-generation: aborted, blocks freed.
            core = server.engine.core
            wait_for(lambda: server.engine.num_unfinished == 0 and core.kv.num_free_blocks == core.num_blocks)
            text = (await client.get("/metrics")).text
            assert metric(text, "chunkwise:admission_rejections_total", reason="slo") == 1
    finally:
        server.stop()
