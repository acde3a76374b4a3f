"""GET /v1/kv_events over a real server, read by the router's own consumer: the router's exact index holds
the replica's cache, resyncs from a snapshot when it fell behind, and routes on its estimate when a
replica publishes no events."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from chunkwise.engine.cache.hashing import hash_prefix_blocks
from chunkwise.router.replica import InFlight, Replica
from tests.server.harness import LiveServer, start_server, wait_for

PROMPTS = ["the same long system prompt, then question one", "the same long system prompt, then two"]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # Two events kept: a reader that misses a few steps must resync.
    live = start_server({"kv_events_buffer": 2, "block_size": 4, "num_blocks": 256})
    yield live
    live.stop()


def cached(live: LiveServer) -> set[int]:
    return set(live.engine.core.kv.pool._cached)


def complete(live: LiveServer, prompt: str, max_tokens: int = 6) -> None:
    client = OpenAI(base_url=live.base_url, api_key="none")
    client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    wait_for(lambda: not live.engine.core.has_unfinished())


def test_the_router_index_follows_the_replica_cache_and_resyncs(server: LiveServer) -> None:
    replica = Replica(server.url, 1024)

    async def sync() -> None:
        async with httpx.AsyncClient() as client:
            await replica.kv.sync(client, server.url, 5.0)

    complete(server, PROMPTS[0])
    asyncio.run(sync())
    assert replica.kv.synced and replica.kv.resyncs == 1  # the first read is a snapshot
    assert replica.kv.hashes == cached(server)
    complete(server, PROMPTS[1], max_tokens=24)  # more cache changes than the two events kept
    asyncio.run(sync())
    assert replica.kv.resyncs == 2 and replica.kv.hashes == cached(server)
    # Routing reads the exact index: the second prompt's blocks are all there, a fresh one's are not.
    ids = server.engine.tokenizer.encode(PROMPTS[1])
    full = hash_prefix_blocks(ids, 4)
    assert replica.cached_blocks(full) == len(full) > 0
    assert (
        replica.cached_blocks(hash_prefix_blocks(server.engine.tokenizer.encode("fresh words " * 3), 4)) == 0
    )
    # A step's events, read in time, are applied without a snapshot.
    client = OpenAI(base_url=server.base_url, api_key="none")
    stream = client.completions.create(model="tiny", prompt="x" * 9, max_tokens=3, stream=True)
    for _ in stream:
        pass
    wait_for(lambda: not server.engine.core.has_unfinished())
    seq = replica.kv.seq
    asyncio.run(sync())
    assert replica.kv.hashes == cached(server) and replica.kv.resyncs == 2
    assert replica.kv.seq is not None and seq is not None and replica.kv.seq > seq


def test_bad_after_is_a_400_with_the_openai_error_body(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/v1/kv_events", params={"after": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    gone = httpx.get(f"{server.url}/v1/kv_events", params={"after": 10**9})
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "resync"


def test_a_replica_without_events_is_routed_on_the_estimate() -> None:
    live = start_server({"kv_events_buffer": 0})
    try:
        assert httpx.get(f"{live.url}/v1/kv_events").status_code == 404
        replica = Replica(live.url, 1024)

        async def sync() -> None:
            async with httpx.AsyncClient() as client:
                await replica.kv.sync(client, live.url, 5.0)

        asyncio.run(sync())
        assert not replica.kv.synced
        request = InFlight(8, 8, 4, False, 0.0, 0.1, 0.2)
        replica.begin(request, (11, 12))
        assert replica.cached_blocks((11, 12, 13)) == 2  # the estimate answers
        replica.end(request)
        # Nothing kept for an exact index that is not there: a router in front of such replicas for days
        # holds no more than its estimate's bound.
        assert not replica._ended_since_read and not replica._inflight_blocks
    finally:
        live.stop()
