"""What the router believes each replica holds in its prefix cache.

The engine caches full KV blocks under chained block hashes (chunkwise.engine.cache.hashing): a block's hash
covers every token before it, so the longest run of a prompt's leading hashes found in a replica's index is
the prompt's cached prefix there. The router records, at pick time, the hashes of every prompt it sends to
a replica; it cannot see the replica's evictions, so the index is an LRU bounded by the replica's cache
capacity in blocks, which approximates the engine's own LRU of freed blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import takewhile

from chunkwise.engine.cache.hashing import BlockHash


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: BlockHash) -> bool:
        return block in self._blocks

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` are held (a lookup only: LRU order is left alone)."""
        return len(list(takewhile(self._blocks.__contains__, hashes)))

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Record a prompt sent to this replica: its blocks become the most recently used."""
        # Leading blocks last, so that they are the freshest: eviction then takes a chain's leaves before
        # its root, and a shared prefix outlives the suffixes that hang off it.
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
        self._evict()

    def resize(self, capacity_blocks: int) -> None:
        if capacity_blocks >= 1 and capacity_blocks != self.capacity_blocks:
            self.capacity_blocks = capacity_blocks
            self._evict()

    def clear(self) -> None:
        self._blocks.clear()

    def _evict(self) -> None:
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
