"""The router's exact index between reads: a prompt sent to a replica counts as held there while in flight
and after it ends until a read that began after its end, then exactly as the replica's events say."""

from __future__ import annotations

import httpx

from chunkwise.cache.events import hash_hex
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
