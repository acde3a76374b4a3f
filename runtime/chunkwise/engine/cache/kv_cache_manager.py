"""Per-request block tables over the block pool, with prefix-cache lookups and swap bookkeeping.

The manager is the only writer of block tables. The scheduler asks it for room; the model runner reads the
tables the scheduler passes on.

With a host tier (cache/host_tier.py) a lookup goes on past the device's cached blocks into host memory: a
block found only there is restored into a fresh device block when its request is allocated, and registered
on the device under its hash. The copies the tier records in a step (restores, and the offloads of blocks
the pool evicts) go into the step's output through take_tier_copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from chunkwise.engine.cache.block_pool import BlockPool
from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.cache.hashing import BlockHash, block_extra, hash_prefix_blocks
from chunkwise.engine.cache.host_tier import HostTier
from chunkwise.engine.cache.swap import SwapSpace
from chunkwise.engine.datatypes.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A CachedPrefix's entry for a block found only in the host tier (it has no device block until restored).
HOST = -1


class CachedPrefix(list[int]):
    """A lookup's cached prefix, one entry per leading block: its device block, or HOST where the block is in
    the host tier only; `host` lists those as (position, hash, host slot). Its length counts both tiers, as
    admission does (each host block takes a fresh device block: num_idle counts it)."""

    __slots__ = ("host",)

    def __init__(self) -> None:
        super().__init__()
        self.host: list[tuple[int, BlockHash, int]] = []


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        events: KVEventLog | None = None,
        num_tier_blocks: int = 0,
    ) -> None:
        """`num_host_blocks`: host slots for preemption's swap space; `num_tier_blocks`: host slots for the
        prefix cache's host tier (--kv-offloading-size), numbered after the swap space's."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching, events)
        self.swap_space = SwapSpace(num_host_blocks)
        self.tier: HostTier | None = None
        if num_tier_blocks and enable_prefix_caching:
            self.tier = HostTier(num_tier_blocks, first_slot=num_host_blocks, events=events)
            self.pool.tier = self.tier
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        # Chained hashes of each request's full blocks, grown as tokens arrive, and how many of its leading
        # blocks are already registered in the pool's cache.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        self._host_slots: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def num_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of req's full blocks so far (extended incrementally, never recomputed)."""
        hashes = self._hashes.setdefault(req.request_id, [])
        full = req.num_tokens // self.block_size
        if len(hashes) < full:
            hashes.extend(
                hash_prefix_blocks(
                    req.token_ids,
                    self.block_size,
                    block_extra(req.cache_salt, req.lora_key),
                    start=len(hashes),
                    parent=hashes[-1] if hashes else None,
                    end=full,
                )
            )
        return hashes

    def lookup_prefix(self, req: Request) -> CachedPrefix:
        """Blocks holding the longest cached prefix of req. At least one token is always left to compute,
        because the step that finishes a prompt must produce its logits. A request that wants its prompt's
        log-probs gets none: every position it reports must be computed."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return CachedPrefix()
        return self.cached_blocks(self.block_hashes(req), req.num_tokens)

    def cached_blocks(self, hashes: Sequence[BlockHash], num_tokens: int) -> CachedPrefix:
        """The cached blocks of the longest prefix of `hashes` (a sequence of num_tokens tokens), read only:
        each block from the device cache, else from the host tier. A request's lookup; the simulator's router
        asks it of a prompt's hashes too."""
        hits = CachedPrefix()
        if not self.enable_prefix_caching:
            return hits
        lookup, tier = self.pool.lookup, self.tier
        for i, h in enumerate(hashes[: (num_tokens - 1) // self.block_size]):
            block_id = lookup(h)
            if block_id is None:
                slot = tier.lookup(h) if tier is not None else None
                if slot is None:
                    break
                hits.host.append((i, h, slot))
                block_id = HOST
            hits.append(block_id)
        return hits

    def num_idle(self, cached: Sequence[int]) -> int:
        """Cache hits that take a block off the allocatable count: device hits that sit in the free LRU
        (referencing them takes them out), and host hits (each is restored into a fresh block)."""
        ref_cnt = self.pool.ref_cnt
        return sum(1 for b in cached if b == HOST or ref_cnt[b] == 0)

    def blocks_to_allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> int:
        """New blocks req needs to hold num_new_tokens more tokens (after the cached prefix, if any)."""
        table = self.block_tables.get(req.request_id, ())
        have = len(table) + len(cached)
        start = req.num_computed_tokens + len(cached) * self.block_size
        return max(0, self.num_blocks(start + num_new_tokens) - have)

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow req's table to cover num_new_tokens more tokens; take references on its cached-prefix blocks.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        end = req.num_computed_tokens + num_new_tokens
        table = self.block_tables.get(req.request_id)
        if not cached and table is not None:
            # A running request growing (every decode step): the general path below, without its lookups.
            need = -(-end // self.block_size) - len(table)
            if need > 0:
                if need > self.pool.num_free:
                    return False
                table.extend(self.pool.allocate(need))
            self._register(req, end)
            return True
        need = self.blocks_to_allocate(req, num_new_tokens, cached)
        if need + self.num_idle(cached) > self.pool.num_free:
            return False
        table = self.block_tables.setdefault(req.request_id, [])
        if isinstance(cached, CachedPrefix) and cached.host:
            self._restore(table, cached)
            self._num_registered[req.request_id] = len(table)
        elif cached:
            self.pool.touch(cached)
            table.extend(cached)
            self._num_registered[req.request_id] = len(table)
        if need:
            table.extend(self.pool.allocate(need))
        end = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        self._register(req, end)
        return True

    def _restore(self, table: list[int], cached: CachedPrefix) -> None:
        """Take a cached prefix with host hits into `table`: its device blocks referenced, a fresh block for
        each host block, restored from its slot in this step and registered under its hash."""
        tier = self.tier
        assert tier is not None
        # The slots are held for this step's reads before the fresh blocks are allocated: the allocation may
        # evict cached blocks, whose offloads could otherwise push these out of the tier and take their slots.
        for _, h, slot in cached.host:
            tier.hold(h, slot)
        self.pool.touch([b for b in cached if b != HOST])
        fresh = self.pool.allocate(len(cached.host))
        table.extend(cached)
        for (i, h, slot), block in zip(cached.host, fresh):
            table[len(table) - len(cached) + i] = block
            tier.restore(slot, block)
            self.pool.cache(block, h)

    def take_tier_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's copies recorded since the last call: offloads (device block, host slot), made
        before anything else in the step, and restores (host slot, device block), made with its swap-ins."""
        if self.tier is None:
            return [], []
        return self.tier.take_copies()

    def _register(self, req: Request, num_tokens: int) -> None:
        """Put req's full blocks up to num_tokens into the prefix cache.

        Registering at allocation is safe: a request that hits these blocks in this same step runs in the same
        forward pass, where every layer writes the step's keys and values before any query reads them. A
        request that gives way before its step runs withdraws what it registered (`_withdraw_unwritten`).
        """
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        full = min(num_tokens, len(req.token_ids)) // self.block_size
        done = self._num_registered.get(rid, 0)
        if full <= done:
            return
        hashes = self._hashes.get(rid)
        if hashes is None or len(hashes) < full:
            hashes = self.block_hashes(req)
        table = self.block_tables[rid]
        cache = self.pool.cache
        for i in range(done, full):
            cache(table[i], hashes[i])
        self._num_registered[rid] = full

    def _withdraw_unwritten(self, req: Request, table: list[int]) -> None:
        """Unregister req's blocks past its computed tokens: registered at this step's allocation, their KV
        is not written, because req leaves the step (preempted or aborted) before the forward runs.

        A block up to num_computed_tokens holds written KV (a cache hit included); past it, the block is
        req's own: no other request can have hit it, since a step that preempts admits no one.
        """
        first = req.num_computed_tokens // self.block_size
        for i in range(first, min(len(table), self._num_registered.get(req.request_id, 0))):
            self.pool.uncache(table[i])

    def free(self, req: Request) -> None:
        """Release req's device blocks (tail first, so its tail is evicted first) and its host slots."""
        rid = req.request_id
        table = self.block_tables.pop(rid, None)
        if table:
            self._withdraw_unwritten(req, table)
            self.pool.free(reversed(table))
        self._num_registered.pop(rid, None)
        slots = self._host_slots.pop(rid, None)
        if slots:
            self.swap_space.free(slots)

    def forget(self, req: Request) -> None:
        """Drop every trace of a finished request (hashes included)."""
        self.free(req)
        self._hashes.pop(req.request_id, None)

    # -- n > 1 ------------------------------------------------------------------------------------------
    def fork(self, parent: Request, children: Sequence[Request]) -> tuple[list[tuple[int, int]], list[int]]:
        """Hand the parent's blocks to its children (sched/fork.py) and drop the parent.

        The parent's full blocks are shared: each child holds a reference to each (the pool's ref counts, as
        prefix-cache hits do). Its partial last block, which every child writes its next token into, is copied
        on write: the first child takes the parent's own, each other child a fresh block, returned as
        (source block, new block) copies for the model runner to make before the step's forward. A child the
        pool has no block for gets the full blocks only and computes the partial block's tokens itself (at
        most block_size - 1 tokens). Returns the copies and, for each child, how many tokens its table holds
        computed KV for (the parent's, or the full blocks' only): the scheduler, which owns request state,
        sets each child's num_computed_tokens from it.
        """
        rid = parent.request_id
        table = self.block_tables.pop(rid, [])
        hashes = self._hashes.pop(rid, [])
        registered = self._num_registered.pop(rid, 0)
        computed = parent.num_computed_tokens
        bs = self.block_size
        full = computed // bs
        used = self.num_blocks(computed)
        if len(table) > used:  # never expected: a fork follows a completed step
            self.pool.free(reversed(table[used:]))
            del table[used:]
        partial = table[full] if len(table) > full else None
        copies: list[tuple[int, int]] = []
        held: list[int] = []
        for i, child in enumerate(children):
            cid = child.request_id
            holds = computed
            if i == 0:
                own = table  # the parent's references, its partial block included
            else:
                own = table[:full]
                self.pool.touch(own)
                if partial is not None:
                    if self.pool.num_free:
                        (block,) = self.pool.allocate(1)
                        own.append(block)
                        copies.append((partial, block))
                    else:
                        holds = full * bs
            held.append(holds)
            self.block_tables[cid] = own
            self._hashes[cid] = list(hashes)
            self._num_registered[cid] = min(registered, full)
        return copies, held

    # -- swap -------------------------------------------------------------------------------------------
    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move req's blocks to host slots. Returns (device block, host slot) copies, or None if host space
        is short (the caller then recomputes instead)."""
        rid = req.request_id
        table = self.block_tables.get(rid, [])
        slots = self.swap_space.allocate(len(table))
        if slots is None:
            return None
        copies = list(zip(table, slots))
        self.block_tables.pop(rid, None)
        self._withdraw_unwritten(req, table)
        self._num_registered.pop(rid, None)
        self.pool.free(reversed(table))
        self._host_slots[rid] = slots
        return copies

    def can_swap_in(self, req: Request) -> bool:
        return len(self._host_slots.get(req.request_id, ())) <= self.pool.num_free

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Bring req's blocks back to device. Returns (host slot, device block) copies."""
        rid = req.request_id
        slots = self._host_slots.pop(rid)
        blocks = self.pool.allocate(len(slots))
        self.block_tables[rid] = blocks
        self.swap_space.free(slots)
        self._register(req, req.num_computed_tokens)
        return list(zip(slots, blocks))
