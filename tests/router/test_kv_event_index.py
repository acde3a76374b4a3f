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

    def emit(
        self,
        stored: tuple[int, ...] = (),
        removed: tuple[int, ...] = (),
        stored_host: tuple[int, ...] | None = None,
        removed_host: tuple[int, ...] = (),
    ) -> None:
        self.seq += 1
        event: dict[str, object] = {
            "seq": self.seq,
            "stored": [hash_hex(h) for h in stored],
            "removed": [hash_hex(h) for h in removed],
        }
        if stored_host is not None:  # an engine with a host tier; older ones send no host lists
            event["stored_host"] = [hash_hex(h) for h in stored_host]
            event["removed_host"] = [hash_hex(h) for h in removed_host]
        self.next.append(event)

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


def test_the_leading_run_across_the_index_and_the_requests_in_flight_is_the_naive_walk() -> None:
    """cached_blocks walks each source in C, switching between them; it must stop exactly where a walk
    asking every source about every hash stops."""
    import random

    from chunkwise.router.replica import InFlight, Replica

    rng = random.Random(3)
    for trial in range(300):
        r = Replica("http://x", 1000)
        r.kv.load_hashes("e", 1, (h for h in range(40) if rng.random() < 0.7))
        pending = tuple(h for h in range(40) if rng.random() < 0.3)
        if trial % 3:
            r.begin(InFlight(10, 10, 1, True, 0.0, 0.1, 0.2), pending)
        ended = tuple(h for h in range(40) if rng.random() < 0.2)
        if trial % 2:
            done = InFlight(10, 10, 1, True, 0.0, 0.1, 0.2)
            r.begin(done, ended)
            r.end(done)
        hashes = list(range(40))
        rng.shuffle(hashes)
        hashes = hashes[: rng.randint(0, 40)]
        sources = (r.kv.hashes, r._inflight_blocks, r._ended_since_read, r._ended_before_read)
        naive = 0
        for h in hashes:
            if not any(h in s for s in sources):
                break
            naive += 1
        assert r.cached_blocks(hashes) == naive


def test_a_remembered_walk_follows_every_change_to_what_the_replica_holds() -> None:
    """cached_blocks remembers how far a prefix was held; after a pick, an end or a KV read it must answer
    as a fresh walk does."""
    import random

    from chunkwise.router.replica import InFlight, Replica

    rng = random.Random(5)
    r = Replica("http://x", 1000)
    r.kv.load_hashes("e", 1, range(0, 30))
    prompts = [list(range(40)), list(range(25)), [*range(10), 99, 100]]
    flights: list[InFlight] = []

    def naive(hashes: list[int]) -> int:
        sources = (r.kv.hashes, r._inflight_blocks, r._ended_since_read, r._ended_before_read)
        n = 0
        for h in hashes:
            if not any(h in s for s in sources):
                break
            n += 1
        return n

    for _ in range(200):
        for p in prompts:
            assert r.cached_blocks(p) == naive(p)
        move = rng.randrange(3)
        if move == 0:
            f = InFlight(10, 10, 1, True, 0.0, 0.1, 0.2)
            r.begin(f, tuple(rng.choice(prompts)[: rng.randint(0, 40)]))
            flights.append(f)
        elif move == 1 and flights:
            r.end(flights.pop(rng.randrange(len(flights))))
        else:
            r.begin_kv_read()
            for p in prompts:  # a pick while the read is under way (the live router awaits its answer)
                assert r.cached_blocks(p) == naive(p)
            r.kv.load_hashes("e", 2, (h for h in range(45) if rng.random() < 0.8))
            r.end_kv_read()


async def test_a_host_tier_hit_counts_for_half_a_device_hit() -> None:
    """A replica's host tier (--kv-offloading-size) reports its blocks as medium cpu (stored_host and
    removed_host beside the device's lists): the index keeps them apart, and the cost model counts a prompt
    block found only there at HOST_HIT_WEIGHT of a device hit (a copy back, not a prefill)."""
    from chunkwise.router.cost import HOST_HIT_WEIGHT, CostModel

    from .conftest import BLOCK, request

    tokens = list(range(1, 8 * BLOCK + 2))  # 8 full blocks and one token
    req = request(tokens)
    hashes = req.block_hashes
    events = Events()
    replica = Replica(URL, 1024)
    cost = CostModel(BLOCK)
    async with httpx.AsyncClient(transport=httpx.MockTransport(events)) as client:
        await replica.read_kv_events(client, 1.0)
        events.emit(stored=hashes)  # all 8 on the device
        await replica.read_kv_events(client, 1.0)
        assert cost.cached_tokens(replica, req) == 8 * BLOCK
        # The last 6 are evicted to the host tier in one step: removed from the device, stored on host.
        events.emit(removed=hashes[2:], stored_host=hashes[2:])
        await replica.read_kv_events(client, 1.0)
        assert replica.kv.hashes == set(hashes[:2]) and replica.kv.host_hashes == set(hashes[2:])
        assert replica.cached_blocks(hashes) == 2 and replica.host_blocks(hashes, 2) == 6
        assert HOST_HIT_WEIGHT == 0.5
        assert cost.cached_tokens(replica, req) == (2 + 3) * BLOCK
        # The tier drops two of them: the run stops at the first gap.
        events.emit(stored_host=(), removed_host=hashes[4:6])
        await replica.read_kv_events(client, 1.0)
        assert replica.host_blocks(hashes, 2) == 2
        assert cost.cached_tokens(replica, req) == (2 + 1) * BLOCK
        # An engine without a tier (no host lists in its events): nothing changes on the host side.
        events.emit(removed=hashes[:1])
        await replica.read_kv_events(client, 1.0)
        assert replica.cached_blocks(hashes) == 0 and replica.host_blocks(hashes, 0) == 0
