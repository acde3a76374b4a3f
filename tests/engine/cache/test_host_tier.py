"""The prefix cache's host tier (--kv-offloading-size): offload on eviction, lookups that continue into host
memory, restores registered on the device, the LRU's bound, and no host slot rewritten while a copy of the
same step still has to read it."""

from __future__ import annotations

from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.cache.hashing import hash_prefix_blocks
from chunkwise.engine.cache.host_tier import HostTier
from chunkwise.engine.cache.kv_cache_manager import HOST, KVCacheManager
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.datatypes.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 0.0, max_tokens=4)


def fill(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """A request allocated for all of its tokens (its full blocks registered), then freed: cached, idle."""
    r = req(rid, tokens)
    cached = kv.lookup_prefix(r)
    assert kv.allocate(r, len(tokens) - len(cached) * BS, cached)
    r.num_computed_tokens = len(tokens)  # its step ran: the KV is written
    kv.forget(r)
    return r


def check(kv: KVCacheManager) -> None:
    kv.pool.check_invariants()
    assert kv.tier is not None
    kv.tier.check_invariants()


A = list(range(100, 109))  # two full blocks and one token
B = list(range(200, 216))  # four full blocks


def test_an_evicted_block_is_offloaded_and_a_lookup_restores_it() -> None:
    kv = KVCacheManager(4, BS, True, num_host_blocks=2, num_tier_blocks=6)
    fill(kv, "a", A)
    assert kv.take_tier_copies() == ([], [])  # nothing evicted yet
    ha = hash_prefix_blocks(A, BS)
    a_blocks = [kv.pool.lookup(h) for h in ha]
    # B needs every block: A's two cached blocks are evicted, each copied to a tier slot after swap's two.
    b = req("b", B)
    assert kv.allocate(b, len(B))
    offloads, restores = kv.take_tier_copies()
    # A request frees its blocks tail first, so its tail is evicted (and offloaded) first.
    assert restores == [] and offloads == [(a_blocks[1], 2), (a_blocks[0], 3)]
    assert all(kv.pool.lookup(h) is None for h in ha)
    check(kv)
    b.num_computed_tokens = len(B)
    kv.forget(b)
    # A again: both blocks are missed on the device and found in the tier.
    a2 = req("a2", A)
    cached = kv.lookup_prefix(a2)
    assert list(cached) == [HOST, HOST] and [(i, s) for i, _, s in cached.host] == [(0, 3), (1, 2)]
    assert kv.num_idle(cached) == 2  # each takes a fresh block
    assert kv.allocate(a2, 1, cached)
    table = kv.block_tables["a2"]
    offloads, restores = kv.take_tier_copies()
    assert restores == [(3, table[0]), (2, table[1])]
    # Restored blocks hold their prefixes' KV now: registered on the device under their hashes.
    assert [kv.pool.lookup(h) for h in ha] == table[:2]
    # The restore's allocation (three blocks: two restored, one for A's last token) evicted three of B's.
    assert sorted(slot for _, slot in offloads) == [4, 5, 6]
    assert {b for b, _ in offloads} == set(table)
    check(kv)


def test_a_lookup_walks_device_hits_then_host_hits() -> None:
    kv = KVCacheManager(4, BS, True, num_tier_blocks=4)
    fill(kv, "a", A)
    ha = hash_prefix_blocks(A, BS)
    # Evict only A's second block (freed first: a request frees tail first, so its tail goes first).
    x = req("x", [1] * 12)
    assert kv.allocate(x, 12)
    kv.take_tier_copies()
    assert kv.pool.lookup(ha[0]) is not None and kv.pool.lookup(ha[1]) is None
    cached = kv.lookup_prefix(req("a2", A))
    assert list(cached) == [kv.pool.lookup(ha[0]), HOST]
    assert [h for _, h, _ in cached.host] == [ha[1]]
    # Without a tier the same lookup stops at the device's miss.
    plain = KVCacheManager(4, BS, True)
    fill(plain, "a", A)
    assert plain.allocate(req("x", [1] * 12), 12)
    assert len(plain.lookup_prefix(req("a2", A))) == 1


def test_the_tier_is_an_lru_bounded_by_its_slots() -> None:
    log = KVEventLog()
    tier = HostTier(2, first_slot=10, events=log)
    tier.offload(1, 0)
    tier.offload(2, 1)
    tier.offload(1, 2)  # already held: no copy, only most recent now
    tier.offload(3, 3)  # evicts 2, the least recently used
    assert len(tier) == 2 and 1 in tier and 3 in tier and 2 not in tier
    assert tier.num_offloads == 3 and tier.num_evictions == 1
    offloads, _ = tier.take_copies()
    # 2 was offloaded and evicted in the same step, unread: its copy is dropped, 3's reuses its slot.
    assert sorted(offloads) == [(0, 10), (3, 11)]
    assert tier.usage == 1.0
    tier.check_invariants()
    log.flush()
    since = log.since(0)
    assert since is not None
    (event,) = since.events
    assert set(event.stored_host) == {1, 3} and set(event.removed_host) == {2}
    assert set(log.snapshot().host_hashes) == {1, 3}


def test_a_slot_read_this_step_is_not_rewritten_before_the_read() -> None:
    tier = HostTier(1, first_slot=0)
    tier.offload(7, 4)
    assert tier.take_copies() == ([(4, 0)], [])
    # This step restores 7 from slot 0, then an eviction's offload pushes 7 out of the tier: slot 0 must not
    # take the new block before the restore has read it, so that offload is dropped.
    tier.hold(7, 0)
    tier.restore(0, 9)
    tier.offload(8, 5)
    assert 7 not in tier and 8 not in tier
    tier.check_invariants()
    assert tier.take_copies() == ([], [(0, 9)])
    # The step's copies taken, the slot is free again.
    tier.offload(8, 5)
    assert tier.take_copies() == ([(5, 0)], [])
    tier.check_invariants()


def test_an_offload_a_restore_of_the_same_step_reads_is_still_made() -> None:
    tier = HostTier(1)
    tier.offload(7, 4)  # evicted from device block 4 in this step ...
    tier.hold(7, 0)
    tier.restore(0, 9)  # ... and found by a lookup of the same step ...
    tier.offload(8, 5)  # ... then pushed out of the tier: its copy into slot 0 must still be made
    tier.check_invariants()
    assert tier.take_copies() == ([(4, 0)], [(0, 9)])


def test_no_block_or_slot_leaks_after_requests_finish() -> None:
    kv = KVCacheManager(6, BS, True, num_host_blocks=3, num_tier_blocks=5)
    prompts = [A, B, [*A, 1, 2, 3], B[:9], [5] * 13, A]
    for step in range(30):
        tokens = prompts[step % len(prompts)]
        r = req(f"r{step}", tokens)
        cached = kv.lookup_prefix(r)
        assert kv.allocate(r, len(tokens) - len(cached) * BS, cached)
        kv.take_tier_copies()
        check(kv)
        r.num_computed_tokens = len(tokens)
        kv.forget(r)
    assert kv.tier is not None and kv.tier.num_restores > 0 and kv.tier.num_evictions > 0
    assert kv.pool.num_free == kv.pool.num_blocks and kv.swap_space.num_free == 3
    assert kv.block_tables == {}
    check(kv)
