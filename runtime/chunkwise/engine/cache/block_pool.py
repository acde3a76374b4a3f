"""The pool of KV blocks: free list, reference counts and the LRU of cached blocks.

One free queue serves both purposes. A block whose reference count drops to zero goes to the queue's tail
but keeps its hash, so a later request with the same prefix can take it back (a cache hit) until allocation
reaches it at the head and evicts it. Allocation therefore evicts the least recently freed cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.cache.hashing import BlockHash
from chunkwise.engine.cache.host_tier import HostTier


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Insertion order is eviction order: head = least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        # Where each hash entering or leaving _cached is recorded, for consumers outside the engine.
        self.events = events
        # The host tier that takes a copy of each cached block evicted here (--kv-offloading-size), if any.
        self.tier: HostTier | None = None

    @property
    def num_free(self) -> int:
        """Blocks allocatable now, cached-but-unreferenced ones included."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            h = self.block_hash[block_id]
            if h is not None:
                # Evict: the block is about to hold other tokens.
                self._drop(h, block_id)
                self.num_evictions += 1
                if self.tier is not None:
                    self.tier.offload(h, block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. Pass a request's blocks tail first so its tail is evicted first."""
        for block_id in block_ids:
            rc = self.ref_cnt[block_id]
            if rc <= 0:
                raise RuntimeError(f"BlockPool: double free of block {block_id}")
            self.ref_cnt[block_id] = rc - 1
            if rc == 1:
                if self.block_hash[block_id] is None or not self.enable_caching:
                    self.block_hash[block_id] = None
                    # Uncached blocks are worthless once free: put them first in line for reuse.
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference to cached blocks (a prefix-cache hit), pulling free ones out of the LRU."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Register a full block under its chained hash. The first block registered for a hash keeps it."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.events is not None:
            self.events.record(block_hash, True)

    def uncache(self, block_id: int) -> None:
        """Withdraw a block's hash: its KV was never written (its request gave way before the step ran)."""
        h = self.block_hash[block_id]
        if h is not None:
            self._drop(h, block_id)

    def _drop(self, h: BlockHash, block_id: int) -> None:
        """The block no longer holds h's KV."""
        if self._cached.get(h) == block_id:
            del self._cached[h]
            if self.events is not None:
                self.events.record(h, False)
        self.block_hash[block_id] = None

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (tests call this after workloads)."""
        for b in range(self.num_blocks):
            rc = self.ref_cnt[b]
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            assert (rc == 0) == (b in self._free), (
                f"block {b}: refcount {rc} but in free list: {b in self._free}"
            )
        for h, b in self._cached.items():
            assert self.block_hash[b] == h, f"cached hash {h} maps to block {b} holding {self.block_hash[b]}"
        for b, bh in enumerate(self.block_hash):
            if bh is not None:
                assert self._cached.get(bh) == b, f"block {b} has hash {bh} not in the cache map"
