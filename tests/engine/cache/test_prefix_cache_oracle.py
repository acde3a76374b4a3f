"""The prefix cache against a slot-level oracle: every cached block holds the KV of exactly its prefix.

The scheduler runs under random overload (preemption by swap and by recompute, aborts, shared prefixes) with a
stand-in forward that writes, into every KV slot it computes, an identity of the prefix that slot's KV depends
on (the token at that position and everything before it). Swaps copy slots between device blocks and host
slots, as the runner does, before the forward. After every step each block in the prefix cache must hold, in
every slot, the identity of the prefix its hash stands for; a block registered but never written (its request
gave way in the step that allocated it) would hold a stale identity or none.

With the prefix cache's host tier (--kv-offloading-size) the copies include its offloads (first, as the
runner makes them) and restores (with the swap-ins): every block the tier holds must hold its prefix in host
memory too, and every block restored from it, the KV of its prefix on the device.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from chunkwise.engine.cache.hashing import hash_prefix_blocks
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler

BLOCK = 4


class Oracle:
    def __init__(self, num_blocks: int, host_blocks: int) -> None:
        self.device: list[list[tuple[int, ...] | None]] = [[None] * BLOCK for _ in range(num_blocks)]
        self.host: list[list[tuple[int, ...] | None]] = [[None] * BLOCK for _ in range(max(1, host_blocks))]
        self.restored = 0
        # Every full-block hash ever computed, and the tokens of the prefix it stands for.
        self.prefixes: dict[int, tuple[int, ...]] = {}

    def learn(self, tokens: list[int]) -> None:
        for i, h in enumerate(hash_prefix_blocks(tokens, BLOCK)):
            self.prefixes[h] = tuple(tokens[: (i + 1) * BLOCK])

    def step(self, s: Scheduler, rng: random.Random) -> None:
        out = s.schedule()
        for block, slot in out.offload:
            self.host[slot] = list(self.device[block])
        for block, slot in out.swap_out:
            self.host[slot] = list(self.device[block])
        for slot, block in out.swap_in:
            self.device[block] = list(self.host[slot])
        self.restored += len(out.swap_in) - sum(
            1 for slot, _ in out.swap_in if slot < s.kv.swap_space.num_host_blocks
        )
        for sr in out.scheduled:
            tokens = s.requests[sr.req_id].token_ids
            for pos in range(sr.start_pos, sr.start_pos + len(sr.token_ids)):
                self.device[sr.block_table[pos // BLOCK]][pos % BLOCK] = tuple(tokens[: pos + 1])
        sampled = {sr.req_id: [rng.randrange(1, 50)] for sr in out.scheduled if sr.samples}
        for req in s.update_from_output(out, sampled):
            self.learn(req.token_ids)

    def check(self, s: Scheduler) -> int:
        """Every cached block's slots hold its own prefix; returns how many cached blocks were checked."""
        pool = s.kv.pool
        cached = [(h, b) for b, h in enumerate(pool.block_hash) if h is not None]
        for h, b in cached:
            prefix = self.prefixes[h]
            want = [prefix[: len(prefix) - BLOCK + i + 1] for i in range(BLOCK)]
            assert self.device[b] == want, f"block {b} is cached for a prefix its KV does not hold"
        tier = s.kv.tier
        if tier is not None:
            tier.check_invariants()
            for h, slot in tier._slots.items():
                prefix = self.prefixes[h]
                want = [prefix[: len(prefix) - BLOCK + i + 1] for i in range(BLOCK)]
                assert self.host[slot] == want, f"host slot {slot} holds another prefix than its hash's"
        return len(cached)


def run(seed: int, mode: str, num_blocks: int, host_blocks: int, tier_blocks: int = 0) -> Oracle:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, BLOCK, True, host_blocks, num_tier_blocks=tier_blocks)
    cost = PreemptionCostModel(64, 1e9 if mode != "auto" else 3e3, 1e4)
    s = Scheduler.from_config(
        SchedulerConfig(
            max_model_len=64,
            max_num_batched_tokens=rng.choice([8, 16, 32]),
            max_num_seqs=8,
            preemption_mode=mode,  # type: ignore[arg-type]
        ),
        kv,
        cost,
    )
    oracle = Oracle(num_blocks, host_blocks + tier_blocks)
    shared = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    checked = 0
    for step in range(3000):
        if step < 250 and rng.random() < 0.4:
            prompt = rng.choice(shared) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
            out_len = rng.randrange(1, 24)
            req = Request(f"r{step}", prompt, SamplingParams(max_tokens=out_len), float(step), out_len)
            s.add_request(req)
            req.output_length_estimate = 0  # under-reserve: memory runs out mid-decode, so preemption happens
            oracle.learn(prompt)
        if s.requests and rng.random() < 0.05:
            s.abort([rng.choice(sorted(s.requests))])
        oracle.step(s, rng)
        s.kv.pool.check_invariants()
        checked += oracle.check(s)
        if step >= 250 and not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert checked > 0
    return oracle


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    mode=st.sampled_from(["swap", "recompute", "auto"]),
    num_blocks=st.integers(14, 30),
    host_blocks=st.sampled_from([0, 6, 40]),
)
def test_every_cached_block_holds_the_kv_of_its_prefix(
    seed: int, mode: str, num_blocks: int, host_blocks: int
) -> None:
    run(seed, mode, num_blocks, host_blocks)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    mode=st.sampled_from(["swap", "recompute", "auto"]),
    num_blocks=st.integers(14, 30),
    host_blocks=st.sampled_from([0, 6]),
    tier_blocks=st.sampled_from([1, 3, 12, 60]),
)
def test_every_restored_block_holds_the_kv_of_its_prefix(
    seed: int, mode: str, num_blocks: int, host_blocks: int, tier_blocks: int
) -> None:
    run(seed, mode, num_blocks, host_blocks, tier_blocks)


def test_the_tier_workload_restores() -> None:
    """The workload above does exercise the tier: blocks are restored from host memory and checked."""
    assert run(1, "recompute", 14, 0, 12).restored > 20
    assert run(2, "swap", 18, 6, 3).restored > 5
