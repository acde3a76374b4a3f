import hashlib
import random
import struct

import pytest

from chunkwise.engine.cache.block_pool import BlockPool
from chunkwise.engine.cache.hashing import HASH_BYTES, hash_block, hash_prefix_blocks
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.datatypes.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 0.0, max_tokens=4, cache_salt=salt)


def test_allocate_in_order_and_free_uncached_first():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1])
    # An uncached free block goes first in line; block 3 was never used.
    assert pool.allocate(2) == [1, 3]
    assert pool.num_free == 0
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.check_invariants()


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_cached_blocks_are_evicted_lru_and_can_be_revived():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, 111)
    pool.cache(b, 222)
    pool.free([b])  # freed first: least recently freed
    pool.free([a])
    assert pool.lookup(222) == b and pool.lookup(111) == a
    pool.touch([a])  # a cache hit takes it back out of the free LRU
    assert pool.ref_cnt[a] == 1 and pool.num_free == 1
    assert pool.allocate(1) == [b]  # evicts b
    assert pool.lookup(222) is None and pool.num_evictions == 1
    pool.free([c, a, b])
    pool.check_invariants()


def test_first_registered_block_keeps_a_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 5)
    pool.cache(b, 5)
    assert pool.lookup(5) == a and pool.block_hash[b] is None
    pool.check_invariants()


def test_chained_hashes_cover_the_prefix_and_salt():
    t = list(range(10))
    h = hash_prefix_blocks(t, 4)
    assert len(h) == 2  # the partial third block is not hashed
    assert h[1] == hash_block(h[0], t[4:8])
    # Same block tokens, different parent: different hash.
    assert hash_prefix_blocks([9, 9, 9, 9, *t[4:8]], 4)[1] != h[1]
    assert hash_prefix_blocks(t, 4, extra="tenant-a")[0] != h[0]
    # Deterministic across processes (not Python's salted hash): a fixed value.
    assert hash_block(None, [1, 2, 3]) == hash_block(None, [1, 2, 3])


def test_prefix_lookup_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(8)))
    assert kv.allocate(a, 8)
    assert kv.block_tables["a"] == [0, 1]
    a.num_computed_tokens = 8  # the step ran: both blocks hold their KV
    kv.free(a)
    b = make_req("b", list(range(8)))  # identical 8 tokens: only the first block may be a hit
    assert kv.lookup_prefix(b) == [0]
    c = make_req("c", [*range(8), 99])
    assert kv.lookup_prefix(c) == [0, 1]
    assert kv.lookup_prefix(make_req("d", list(range(8)), salt="other")) == []


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_req("a", list(range(12)))
    assert not kv.allocate(a, 12)
    assert "a" not in kv.block_tables and kv.num_free_blocks == 2
    kv.pool.check_invariants()


def test_swap_round_trip_keeps_block_count():
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=2)
    a = make_req("a", list(range(6)))
    assert kv.allocate(a, 6)
    a.num_computed_tokens = 6
    copies = kv.swap_out(a)
    assert copies == [(0, 0), (1, 1)]
    assert kv.num_free_blocks == 4 and kv.swap_space.num_free == 0
    assert kv.swap_out(make_req("z", [1])) == []  # nothing to move
    assert kv.can_swap_in(a)
    back = kv.swap_in(a)
    assert [h for h, _ in back] == [0, 1] and len(kv.block_tables["a"]) == 2
    kv.forget(a)
    assert kv.num_free_blocks == 4 and kv.swap_space.num_free == 2
    kv.pool.check_invariants()


def test_blocks_of_a_request_that_gave_way_before_its_step_are_not_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(12)))
    assert kv.allocate(a, 8)  # blocks 0 and 1 registered at allocation
    a.num_computed_tokens = 8  # that step ran
    assert kv.allocate(a, 4)  # block 2 registered for the next step ...
    kv.free(a)  # ... which a leaves (preempted) before it runs
    c = make_req("c", [*range(12), 99])
    assert kv.lookup_prefix(c) == [0, 1]  # the written blocks stay cached; the unwritten one is withdrawn
    kv.pool.check_invariants()


def test_block_hash_is_the_documented_blake2b_of_parent_tokens_and_salt():
    """The bytes hashed are the wire format the router and KV-event readers rely on: the parent's 16
    little-endian bytes (or the root tag), the tokens as little-endian int64, then the salt."""
    rng = random.Random(0)
    for _ in range(50):
        tokens = [rng.randrange(0, 2**40) for _ in range(rng.choice([1, 4, 16]))]
        parent = rng.choice([None, rng.randrange(2**128)])
        salt = rng.choice([None, "tenant-a"])
        data = b"chunkwise-v2" if parent is None else parent.to_bytes(HASH_BYTES, "little")
        data += struct.pack(f"<{len(tokens)}q", *tokens)
        if salt:
            data += b"\x00salt\x00" + salt.encode()
        want = int.from_bytes(hashlib.blake2b(data, digest_size=HASH_BYTES).digest(), "little")
        assert hash_block(parent, tokens, salt) == want
