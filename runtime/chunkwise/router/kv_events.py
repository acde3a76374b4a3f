"""A replica's prefix cache as its own KV events say (the engine's GET /v1/kv_events, server/kv_events.py).

While in sync the index is exact: the set of block hashes the replica's cache holds as of the last event
read. It falls out of sync when the replica's stream cannot be read (unreachable, events off, an answer it
cannot parse) and resyncs from a snapshot when the replica says the router fell behind (410) or a new
epoch shows a restarted engine. Out of sync, the router routes on its own estimate (prefix_index.py).

A replica with a host tier (--kv-offloading-size) also says which blocks it holds in host memory: a hit there
is a copy back to the device, cheaper than a prefill but not free, and the router counts it at a fraction of
a device hit (router/cost.py). An engine that publishes no host lists leaves that set empty.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import httpx

from chunkwise.engine.cache.events import KVEvent, hex_hash
from chunkwise.engine.cache.hashing import BlockHash

logger = logging.getLogger(__name__)


class KVEventIndex:
    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()
        self.host_hashes: set[BlockHash] = set()  # held in the replica's host tier
        self.epoch: str | None = None
        self.seq: int | None = None  # None: not in sync
        self.resyncs = 0

    @property
    def synced(self) -> bool:
        return self.seq is not None

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` the replica holds."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def lose_sync(self) -> None:
        self.seq = None

    def load_snapshot(self, body: dict[str, Any]) -> None:
        self.load_hashes(
            str(body["epoch"]),
            int(body["seq"]),
            (hex_hash(h) for h in body["hashes"]),
            (hex_hash(h) for h in body.get("host_hashes", ())),
        )

    def apply(self, body: dict[str, Any]) -> bool:
        """Apply an answer of /v1/kv_events; False (nothing applied) when it cannot follow what this index
        holds: another epoch, or events that do not continue from its seq."""
        events = [
            KVEvent(
                int(e["seq"]),
                tuple(hex_hash(h) for h in e["stored"]),
                tuple(hex_hash(h) for h in e["removed"]),
                tuple(hex_hash(h) for h in e.get("stored_host", ())),
                tuple(hex_hash(h) for h in e.get("removed_host", ())),
            )
            for e in body["events"]
        ]
        return self.apply_events(str(body["epoch"]), int(body["seq"]), events)

    def apply_events(self, epoch: str, seq: int, events: Sequence[KVEvent]) -> bool:
        """`apply` for events already decoded (the simulator reads its replicas' logs directly)."""
        if not self.synced or epoch != self.epoch:
            return False
        expected = self.seq
        for event in events:
            if expected is None or event.seq != expected + 1:
                return False
            expected = event.seq
        for event in events:
            self.hashes.update(event.stored)
            self.hashes.difference_update(event.removed)
            if event.stored_host or event.removed_host:
                self.host_hashes.update(event.stored_host)
                self.host_hashes.difference_update(event.removed_host)
        self.seq = seq if events else self.seq
        return True

    def load_hashes(
        self, epoch: str, seq: int, hashes: Iterable[BlockHash], host_hashes: Iterable[BlockHash] = ()
    ) -> None:
        """`load_snapshot` for a snapshot already decoded."""
        self.hashes = set(hashes)
        self.host_hashes = set(host_hashes)
        self.epoch = epoch
        self.seq = seq
        self.resyncs += 1

    async def sync(self, client: httpx.AsyncClient, url: str, timeout: float) -> None:
        """Catch up with the replica at `url`: the events since the last read, or a snapshot when they do
        not follow. Any failure leaves the index out of sync (the caller falls back to its estimate)."""
        try:
            if self.synced:
                resp = await client.get(f"{url}/v1/kv_events", params={"after": self.seq}, timeout=timeout)
                if resp.status_code == 200 and self.apply(resp.json()):
                    return
                if resp.status_code not in (200, 410):
                    self.lose_sync()
                    return
            snap = await client.get(f"{url}/v1/kv_events/snapshot", timeout=timeout)
            if snap.status_code != 200:
                self.lose_sync()
                return
            self.load_snapshot(snap.json())
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            if self.synced:
                logger.info("replica %s: KV events unreadable (%s); routing on the estimate", url, e)
            self.lose_sync()
