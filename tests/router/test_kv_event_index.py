"""The router's exact index between reads: a prompt sent to a replica counts as held there while in flight
and after it ends until a read that began after its end, then exactly as the replica's events say."""

from __future__ import annotations

import asyncio

import httpx

from chunkwise.engine.cache.events import hash_hex
from chunkwise.router.replica import InFlight, Replica

URL = "http://127.0.0.9:8000"


class Events:
    """One replica's /v1/kv_events, answering what the test queued next."""

    def __init__(self) -> None:
        self.seq = 0
        self.next: list[dict[str, object]] = []

    def emit(self, stored: tuple[int, ...] = (), removed: tuple[int, ...] = ()) -> None:
        self.seq += 1
        self.next.append(
            {
                "seq": self.seq,
                "stored": [hash_hex(h) for h in stored],
                "removed": [hash_hex(h) for h in removed],
            }
        )

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/kv_events/snapshot":
            return httpx.Response(200, json={"epoch": "e1", "seq": self.seq, "block_size": 16, "hashes": []})
        events, self.next = self.next, []
        return httpx.Response(200, json={"epoch": "e1", "seq": self.seq, "block_size": 16, "events": events})


async def test_a_finished_prompt_stays_held_until_a_read_that_began_after_it() -> None:
    events = Events()
    replica = Replica(URL, 1024)
    hashes = (101, 102, 103)
    async with httpx.AsyncClient(transport=httpx.MockTransport(events)) as client:
        await replica.read_kv_events(client, 1.0)  # the snapshot: synced, nothing cached
        assert replica.kv.synced and replica.cached_blocks(hashes) == 0
        request = InFlight(48, 48, 4, True, 0.0, 0.1, 0.2)
        replica.begin(request, hashes)
        assert replica.cached_blocks(hashes) == 3  # in flight: held once computed
        await replica.read_kv_events(client, 1.0)  # read before the replica computed it: no events yet
        replica.end(request)
        assert replica.cached_blocks(hashes) == 3  # ended after that read began: still counted
        events.emit(stored=hashes)
        await replica.read_kv_events(client, 1.0)
        assert replica.cached_blocks(hashes) == 3 and replica.kv.hashes == set(hashes)
        events.emit(removed=(102, 103))  # evicted under pressure
        await replica.read_kv_events(client, 1.0)
        assert replica.cached_blocks(hashes) == 1  # exactly what the events say, nothing of the past


async def test_a_prompt_that_ends_during_the_first_read_stays_held() -> None:
    """The snapshot that brings the index into sync can be taken before a request was computed and answered
    after it ended; the request's blocks must still count until the next read (a replica lost them for one
    pick under load in the router integration test, and the router sent the shared prefix elsewhere)."""
    answered = asyncio.Event()
    release = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        answered.set()
        await release.wait()  # the replica answered before computing the request; the answer is slow
        return httpx.Response(200, json={"epoch": "e1", "seq": 0, "block_size": 16, "hashes": []})

    replica = Replica(URL, 1024)
    hashes = (201, 202)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        request = InFlight(32, 32, 2, True, 0.0, 0.1, 0.2)
        replica.begin(request, hashes)
        read = asyncio.create_task(replica.read_kv_events(client, 1.0))
        await answered.wait()
        replica.end(request)  # computed and finished while the snapshot is on its way
        release.set()
        await read
        assert replica.kv.synced
        assert replica.cached_blocks(hashes) == 2


async def test_a_finished_prompt_stays_held_while_the_read_that_will_report_it_is_under_way() -> None:
    """Between the start of a read and its answer, a prompt that ended before the read began is held by the
    replica but in neither the index (the answer is not applied yet) nor the prompts ended since that read:
    it must still count (the router sent the shared prefix to the other replica in that window once)."""
    events = Events()
    answered = asyncio.Event()
    release = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        answered.set()
        await release.wait()
        return events(request)

    replica = Replica(URL, 1024)
    hashes = (301, 302)
    async with httpx.AsyncClient(transport=httpx.MockTransport(events)) as client:
        await replica.read_kv_events(client, 1.0)
    request = InFlight(32, 32, 2, True, 0.0, 0.1, 0.2)
    replica.begin(request, hashes)
    replica.end(request)
    events.emit(stored=hashes)
    async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
        read = asyncio.create_task(replica.read_kv_events(client, 1.0))
        await answered.wait()
        assert replica.cached_blocks(hashes) == 2  # the read is under way
        release.set()
        await read
    assert replica.kv.hashes == set(hashes) and replica.cached_blocks(hashes) == 2
    events.emit(removed=hashes)
    async with httpx.AsyncClient(transport=httpx.MockTransport(events)) as client:
        await replica.read_kv_events(client, 1.0)
    assert replica.cached_blocks(hashes) == 0  # the evictions count: nothing of the past is kept
