"""KV-cache events: blocks entering and leaving the prefix cache, for consumers outside the engine.

The fleet router keeps an exact per-replica prefix index from them (router/kv_events.py) instead of
guessing from the prompts it routed. The block pool records each change as it happens (on the engine
thread); `flush()`, at the end of each step, turns what the step changed into one event with the next
sequence number: a hash both stored and removed in one step appears once, with its last state, so
applying the events in order to a set of hashes reproduces the pool's cache exactly. Readers on any
thread take the events after a sequence number, or, when they have fallen behind what is kept (or the
engine restarted: a new epoch), a snapshot of every cached hash and the sequence number it is at.

With a host tier (--kv-offloading-size, cache/host_tier.py) the events also say which hashes entered and
left host memory (medium "cpu"), in lists of their own beside the device's: a block evicted from the device
into the tier is removed (device) and stored_host in one event, and a restore stores it on the device again
while the tier keeps its copy. A reader that knows only stored and removed reads the device cache as before.

The wire format (server/app.py, GET /v1/kv_events and /v1/kv_events/snapshot) writes hashes as 32 hex
digits: they are 128-bit integers (cache/hashing.py), beyond what JSON numbers carry exactly elsewhere.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from dataclasses import dataclass

from chunkwise.engine.cache.hashing import HASH_BYTES, BlockHash


@dataclass(frozen=True)
class KVEvent:
    seq: int
    stored: tuple[BlockHash, ...]
    removed: tuple[BlockHash, ...]
    # The host tier's (medium "cpu"): hashes whose KV entered or left host memory.
    stored_host: tuple[BlockHash, ...] = ()
    removed_host: tuple[BlockHash, ...] = ()


@dataclass(frozen=True)
class EventsSince:
    epoch: str
    seq: int  # the last event's sequence number (0 before the first)
    events: tuple[KVEvent, ...]


@dataclass(frozen=True)
class KVSnapshot:
    epoch: str
    seq: int
    hashes: tuple[BlockHash, ...]
    host_hashes: tuple[BlockHash, ...] = ()


def hash_hex(h: BlockHash) -> str:
    return f"{h:0{2 * HASH_BYTES}x}"


def hex_hash(text: str) -> BlockHash:
    if len(text) != 2 * HASH_BYTES:
        raise ValueError(f"a block hash is {2 * HASH_BYTES} hex digits, got {text!r}")
    return int(text, 16)


class KVEventLog:
    def __init__(self, max_events: int = 4096) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        # Tells a consumer that the sequence numbers began again (a new engine process).
        self.epoch = secrets.token_hex(8)
        # This step's changes so far, hash -> stored (True) or removed (False); the engine thread's only.
        self._pending: dict[BlockHash, bool] = {}
        self._pending_host: dict[BlockHash, bool] = {}  # the same for the host tier
        self._lock = threading.Lock()
        # Under the lock: the events kept, the last sequence number, and the cache as of it.
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._seq = 0
        self._cached: set[BlockHash] = set()
        self._host: set[BlockHash] = set()

    # -- the engine thread ------------------------------------------------------------------------------
    def record(self, block_hash: BlockHash, stored: bool) -> None:
        self._pending[block_hash] = stored

    def record_host(self, block_hash: BlockHash, stored: bool) -> None:
        self._pending_host[block_hash] = stored

    def flush(self) -> None:
        """Close this step's changes into one event (nothing when nothing changed)."""
        if not self._pending and not self._pending_host:
            return
        pending, self._pending = self._pending, {}
        stored = tuple(h for h, s in pending.items() if s)
        removed = tuple(h for h, s in pending.items() if not s)
        host, self._pending_host = self._pending_host, {}
        stored_host = tuple(h for h, s in host.items() if s)
        removed_host = tuple(h for h, s in host.items() if not s)
        with self._lock:
            self._seq += 1
            self._events.append(KVEvent(self._seq, stored, removed, stored_host, removed_host))
            self._cached.update(stored)
            self._cached.difference_update(removed)
            if host:
                self._host.update(stored_host)
                self._host.difference_update(removed_host)

    # -- readers, any thread ----------------------------------------------------------------------------
    def since(self, after: int) -> EventsSince | None:
        """The events after sequence number `after`; None when some of them are no longer kept (or `after`
        is ahead of the log, as after an engine restart): the reader must resync from a snapshot."""
        with self._lock:
            oldest = self._events[0].seq if self._events else self._seq + 1
            if after > self._seq or after < oldest - 1:
                return None
            events = tuple(e for e in self._events if e.seq > after)
            return EventsSince(self.epoch, self._seq, events)

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self.epoch, self._seq, tuple(self._cached), tuple(self._host))
