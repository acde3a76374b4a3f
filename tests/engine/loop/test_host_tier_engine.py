"""The prefix cache's host tier end to end (--kv-offloading-size), on the offline API: a prefix evicted from a
small device cache is served from host memory on its next request, and the outputs are token for token those
of the engine without the tier (greedy, float32): the restored KV is the KV a prefill would compute."""

from __future__ import annotations

import random

from chunkwise import LLM, SamplingParams

# A few hundred KV blocks of the tiny model, in GiB: far more than the device cache below.
TIER_GIB = 0.001


def make_llm(kv_offloading_size: float) -> LLM:
    return LLM(
        "tiny",
        dtype="float32",
        num_blocks=24,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=32,
        swap_space_bytes=0,
        kv_offloading_size=kv_offloading_size,
    )


def test_an_evicted_prefix_is_cached_on_its_next_request_only_with_the_tier() -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 200) for _ in range(40)]
    others = [[rng.randrange(3, 200) for _ in range(40)] for _ in range(3)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = {}
    for size in (0.0, TIER_GIB):
        llm = make_llm(size)
        first = llm.generate([prefix], sp)[0]
        llm.generate(others, sp)  # 30 blocks of other prompts through a cache of 24: the prefix is evicted
        again = llm.generate([prefix], sp)[0]
        assert first.num_cached_tokens == 0
        stats = llm.engine.stats
        if size:
            assert again.num_cached_tokens == 36  # 9 full blocks of 4 (the last token is always computed)
            assert stats.host_cache_hits == 36 and stats.host_cache_restores >= 9
            assert stats.host_cache_offloads > 0 and stats.prefix_cache_hits >= 36
        else:
            assert again.num_cached_tokens == 0
            assert stats.host_cache_hits == stats.host_cache_restores == stats.host_cache_offloads == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        got[size] = (first.outputs[0].token_ids, again.outputs[0].token_ids)
    assert got[0.0] == got[TIER_GIB]


def test_outputs_are_the_same_with_and_without_the_tier() -> None:
    rng = random.Random(5)
    shared = [[rng.randrange(3, 200) for _ in range(rng.choice([12, 20, 28]))] for _ in range(4)]
    rounds = [
        [rng.choice(shared) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
        for _ in range(8)
    ]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = {}
    for size in (0.0, TIER_GIB):
        llm = make_llm(size)
        outputs[size] = [[o.outputs[0].token_ids for o in llm.generate(batch, sp)] for batch in rounds]
        llm.engine.kv.pool.check_invariants()
        if size:
            stats = llm.engine.stats
            assert stats.host_cache_restores > 10 and stats.host_cache_hits > 0
            tier = llm.engine.kv.tier
            assert tier is not None
            tier.check_invariants()
    assert outputs[TIER_GIB] == outputs[0.0]
