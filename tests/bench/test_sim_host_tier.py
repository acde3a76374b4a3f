"""The simulator with the prefix cache's host tier (--kv-offloading-size): each replica builds it as the
engine does, and a step's offloads and restores cost what swap's copies cost."""

from __future__ import annotations

from chunkwise.bench.workloads import shared_prefix, with_arrivals
from chunkwise.engine.sched.output import SchedulerOutput
from chunkwise.sim.profile import BUILTIN_PROFILES, StepFeatures, load_profile
from chunkwise.sim.replay import replay, scheduler_config


def test_the_tier_turns_evicted_system_prompts_into_hits() -> None:
    p = load_profile(next(iter(BUILTIN_PROFILES)))
    # Twelve system prompts of 64 blocks; a device cache of 256 blocks holds a third of them.
    items = shared_prefix(300, vocab_size=258, system_len=64 * p.block_size, num_system_prompts=12, seed=2)
    items = with_arrivals(items, [0.05 * i for i in range(len(items))])
    config = scheduler_config(p)
    plain = replay(items, p, config, num_blocks=256)
    tiered = replay(items, p, config, num_blocks=256, num_tier_blocks=12 * 64)
    assert all(r.success for r in plain.records + tiered.records)
    hits = {
        name: r.counters["prefix_cache_hits"] / r.counters["prefix_cache_queries"]
        for name, r in (("plain", plain), ("tiered", tiered))
    }
    assert hits["tiered"] > hits["plain"] + 0.1
    assert plain.counters["host_cache_restores"] == plain.counters["host_cache_hits"] == 0
    assert tiered.counters["host_cache_restores"] > 0 and tiered.counters["host_cache_offloads"] > 0
    # The same tokens, fewer of them prefilled.
    assert tiered.counters["num_prefill_tokens"] < plain.counters["num_prefill_tokens"]


def test_offloads_cost_what_swap_copies_cost() -> None:
    p = load_profile(next(iter(BUILTIN_PROFILES)))
    copies = [(i, i) for i in range(8)]
    swap = StepFeatures.of(SchedulerOutput([], 0, swap_out=copies), p.block_size)
    offload = StepFeatures.of(SchedulerOutput([], 0, offload=copies), p.block_size)
    assert offload.swap_tokens == swap.swap_tokens == 8 * p.block_size
    assert p.step_seconds(SchedulerOutput([], 0, offload=copies)) > p.step_seconds(SchedulerOutput([], 0))
