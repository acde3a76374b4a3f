"""One replica as the router sees it: health, the last scrape, learned speed, prefix index, and the requests
the router itself has in flight there.

The in-flight accounting is what keeps a burst from herding: a scrape is up to a poll interval old, so
every pick adds the request to its replica at once (before the next pick can run, all on one event loop),
and every later prediction sees it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile

import httpx

from chunkwise.router.estimates import MetricsSample, ReplicaEstimates, bump_fleet_generation
from chunkwise.router.kv_events import KVEventIndex
from chunkwise.router.prefix_index import PrefixIndex


def leading_run(held: Container[int], hashes: Sequence[int], start: int = 0) -> int:
    """How many of hashes[start:] in a row `held` contains."""
    return len(list(takewhile(held.__contains__, islice(hashes, start, None))))


# Backoff of an unreachable replica: the first retry after one poll interval, doubling up to this. One that
# answers but is not ready (loading, draining) is asked again every poll interval: it is alive, and a
# loading replica should take requests as soon as it can.
MAX_EJECT_BACKOFF_S = 5.0

_ids = itertools.count(1)


@dataclass
class InFlight:
    """A request the router has sent to a replica and not yet seen finish."""

    prompt_tokens: int
    uncached_tokens: int
    output_tokens: int
    streaming: bool
    started_at: float
    predicted_ttft: float
    predicted_completion: float
    first_token_at: float | None = None
    id: int = 0
    block_hashes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.id = next(_ids)

    def prefilling(self, now: float) -> bool:
        """Still ahead of its first token. A non-streaming answer shows no first token: trust the prediction."""
        if self.first_token_at is not None:
            return False
        return self.streaming or now < self.started_at + self.predicted_ttft


@dataclass(frozen=True)
class Load:
    inflight: int = 0
    prefilling: int = 0
    decoding: int = 0
    pending_prefill_tokens: int = 0


class Replica:
    def __init__(self, url: str, index_capacity_blocks: int) -> None:
        self.url = url
        bump_fleet_generation()
        # The estimate (what the router sent there) and, while the replica's KV events are read, the
        # exact index as of the last read, plus the prompts of requests in flight there and of those that
        # finished since that read began: the replica holds those too, and the next read will say so.
        self.index = PrefixIndex(index_capacity_blocks)
        self.kv = KVEventIndex()
        self._inflight_blocks: Counter[int] = Counter()
        # Prompts of requests that ended since the last read began, and of those that ended before the read
        # under way began: the replica holds both, and only that read's answer can say so in their place.
        self._ended_since_read: set[int] = set()
        self._ended_before_read: set[int] = set()
        self._reading = False
        self.estimates = ReplicaEstimates()
        # None: not probed yet (a candidate, optimistically); True: /health answered 200.
        self.healthy: bool | None = None
        self.ejected_until = 0.0
        self.backoff = 0.0
        self.ejections = 0
        self.picks = 0
        # False once discovery no longer lists it; kept until its requests in flight finish.
        self.listed = True
        self.inflight: dict[int, InFlight] = {}
        # Streaming requests before their first token, and their uncached prompt tokens: kept as counters,
        # since a fleet of hundreds of replicas reads every replica's load on every pick. Non-streaming ones
        # leave their prefill on a predicted clock, so they are read when asked (`_unstreamed`).
        self._streams_prefilling = 0
        self._streams_pending_tokens = 0
        self._unstreamed: dict[int, InFlight] = {}
        # Moves whenever the accounting, the scrape or a prefix index changes: what the cost model keys its
        # per-replica state on (router/cost.py), and the walks below their memo.
        self.version = 0
        # Per prompt's first block hash: how far the last walk of a prompt starting there got (n, and the
        # chained hash of block n - 1, which names the whole prefix), as of `version`. Requests that share
        # a system prompt then walk it once per replica state, not once per pick.
        self._walks: dict[int, tuple[int, int]] = {}
        self._walks_version = -1
        self.scrape: MetricsSample | None = None
        # Own requests in each phase when the scrape was taken: the replica's gauges counted them too.
        self.own_prefilling_at_scrape = 0
        self.own_decoding_at_scrape = 0
        # Requests the replica runs at once (its max_num_seqs, or what its KV cache allows), learned from
        # scrapes that caught it full: requests waiting while others run. None until seen.
        self.slots: int | None = None

    def __repr__(self) -> str:
        return f"Replica({self.url!r})"

    # -- health ------------------------------------------------------------------------------------------
    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def eject(self, now: float, poll_interval: float, *, reachable: bool = False) -> None:
        self.healthy = False
        self.version += 1
        # A replica that stopped answering may come back as a fresh process with an empty cache.
        self.index.clear()
        self.kv.lose_sync()
        if reachable:
            self.backoff = poll_interval
        else:
            self.backoff = min(MAX_EJECT_BACKOFF_S, max(poll_interval, self.backoff * 2))
        self.ejected_until = now + self.backoff
        self.ejections += 1

    def recovered(self) -> None:
        self.healthy = True
        self.backoff = 0.0
        self.ejected_until = 0.0

    def candidate(self, now: float) -> bool:
        return self.listed and self.healthy is not False and not self.ejected(now)

    # -- load --------------------------------------------------------------------------------------------
    def load(self, now: float) -> Load:
        prefilling, pending = self._streams_prefilling, self._streams_pending_tokens
        for r in self._unstreamed.values():
            if r.prefilling(now):
                prefilling += 1
                pending += r.uncached_tokens
        return Load(len(self.inflight), prefilling, len(self.inflight) - prefilling, pending)

    @property
    def has_unstreamed(self) -> bool:
        """Requests whose prefill ends on a predicted clock: the load depends on `now`."""
        return bool(self._unstreamed)

    def others(self) -> tuple[float, float]:
        """(waiting, running) requests the last scrape saw that are not the router's own: other routers'."""
        if self.scrape is None:
            return 0.0, 0.0
        waiting = max(0.0, self.scrape.waiting - self.own_prefilling_at_scrape)
        running = max(0.0, self.scrape.running - self.own_decoding_at_scrape)
        return waiting, running

    def observe(self, sample: MetricsSample, now: float) -> None:
        if self.scrape is not None and sample.steps < self.scrape.steps:
            self.index.clear()  # counters began again: a restarted engine, its cache empty
        self.scrape = sample
        self.version += 1
        bump_fleet_generation()
        load = self.load(now)
        self.own_prefilling_at_scrape = load.prefilling
        self.own_decoding_at_scrape = load.decoding
        self.estimates.observe(sample)
        if sample.waiting >= 1 and sample.running >= 1:
            self.slots = max(self.slots or 0, int(sample.running))
        if sample.cache_blocks:
            self.index.resize(sample.cache_blocks)

    # -- prefixes ----------------------------------------------------------------------------------------
    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt the replica holds, or will once its requests in flight are computed:
        from its KV events while they are read, else from the router's own estimate."""
        if not hashes:
            return 0
        if self._walks_version != self.version:
            self._walks, self._walks_version = {}, self.version
        start = 0
        last = self._walks.get(hashes[0])
        if last is not None and last[0] <= len(hashes) and hashes[last[0] - 1] == last[1]:
            start = last[0]  # the same prefix as a prompt walked in this state: held that far
        n = self._walk(hashes, start)
        if n:
            self._walks[hashes[0]] = (n, hashes[n - 1])
        return n

    def host_blocks(self, hashes: Sequence[int], start: int) -> int:
        """Blocks of a prompt from `start` on (after those cached_blocks counts) that the replica's KV events
        say its host tier holds, in a row: each a copy back to the device, not a prefill (0 out of sync)."""
        host = self.kv.host_hashes
        if not host or not self.kv.synced:
            return 0
        return leading_run(host, hashes, start)

    def _walk(self, hashes: Sequence[int], start: int) -> int:
        if not self.kv.synced:
            return start + self.index.match(hashes[start:])
        held, pending = self.kv.hashes, self._inflight_blocks
        sources = [s for s in (held, pending, self._ended_since_read, self._ended_before_read) if s]
        # The leading run of hashes found in any source, walked a source at a time from where the last one
        # stopped, each walk in C (a pick reads every replica; a run rarely switches sources more than once).
        n, total = start, len(hashes)
        while n < total:
            at = n
            for source in sources:
                n += leading_run(source, hashes, n)
            if n == at:
                break
        return n

    async def read_kv_events(self, client: httpx.AsyncClient, timeout: float) -> None:
        """Bring the exact index up to date from the replica's KV events (see router/kv_events.py)."""
        self.begin_kv_read()
        try:
            await self.kv.sync(client, self.url, timeout)
        finally:
            self.end_kv_read()

    def begin_kv_read(self) -> None:
        """A read of the replica's KV events begins (the simulator reads them without HTTP, between these)."""
        self.version += 1
        # A request that ended before this read began was computed before the replica answers it: the
        # answer holds its blocks (or their eviction), so it stops counting once the answer is applied, not
        # when the read begins (a pick meanwhile would see neither). One that ends meanwhile waits for the
        # next read.
        self._ended_before_read |= self._ended_since_read
        self._ended_since_read = set()
        self._reading = True

    def end_kv_read(self) -> None:
        self.version += 1
        # In sync, the answer holds them now; out of sync, the estimate does (it is what picks read then).
        self._reading = False
        self._ended_before_read = set()

    # -- accounting --------------------------------------------------------------------------------------
    def begin(self, request: InFlight, block_hashes: tuple[int, ...]) -> None:
        self.inflight[request.id] = request
        self.version += 1
        if not request.streaming:
            self._unstreamed[request.id] = request
        elif request.first_token_at is None:
            self._streams_prefilling += 1
            self._streams_pending_tokens += request.uncached_tokens
        self.picks += 1
        # The replica will hold these blocks once it has computed them; later picks may count on it.
        self.index.insert(block_hashes)
        request.block_hashes = block_hashes
        self._inflight_blocks.update(block_hashes)

    def first_token(self, request: InFlight, now: float) -> None:
        if request.first_token_at is None:
            request.first_token_at = now
            self.version += 1
            if request.streaming and request.id in self.inflight:
                self._streams_prefilling -= 1
                self._streams_pending_tokens -= request.uncached_tokens

    def end(self, request: InFlight) -> None:
        if self.inflight.pop(request.id, None) is not None:
            self.version += 1
            if self._unstreamed.pop(request.id, None) is None and request.first_token_at is None:
                self._streams_prefilling -= 1
                self._streams_pending_tokens -= request.uncached_tokens
            held = self._inflight_blocks
            for h in request.block_hashes:  # drop the hashes no request in flight holds any more
                n = held.get(h, 0) - 1
                if n > 0:
                    held[h] = n
                else:
                    held.pop(h, None)
            # Out of sync the estimate holds them, except that a read under way may be the snapshot that
            # brings the index into sync, taken before this request was computed. (Never while no read
            # runs and none has synced: without KV events the set would only grow.)
            if self.kv.synced or self._reading:
                self._ended_since_read.update(request.block_hashes)
