"""Preemption's mode: the cost model's crossover (swap's fixed cost per transfer against recompute's prefill),
`preemption_mode="auto"` choosing each side of it in a real schedule, and swap's fallback to recompute when the
host swap space is full (counted, exported, warned about once)."""

from __future__ import annotations

import logging
import math
from typing import Literal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkwise.engine import EngineCore
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig, engine_config_from_kwargs
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.loop.metrics import EngineMetrics
from chunkwise.engine.sched.policies import Preemption, preemption_policy
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler

# A hand-made profile: a transfer costs 1 ms fixed plus 10 us per token (10 kB at 1 GB/s), a prefill 100 us
# per token. Swap (two transfers) = 2 ms + 20 us/token, recompute = 100 us/token: equal at 25 tokens.
KV_BYTES_PER_TOKEN = 10_000
HOST_COPY_BYTES_PER_S = 1e9
PREFILL_TOKENS_PER_S = 1e4
FIXED_TRANSFER_S = 1e-3
CROSSOVER = 25


def cost_model() -> PreemptionCostModel:
    return PreemptionCostModel(
        KV_BYTES_PER_TOKEN, HOST_COPY_BYTES_PER_S, PREFILL_TOKENS_PER_S, fixed_transfer_s=FIXED_TRANSFER_S
    )


def preemption(mode: Literal["auto", "swap", "recompute"]) -> Preemption:
    return preemption_policy(SchedulerConfig(max_model_len=64, preemption_mode=mode), cost_model())


def request_with_context(num_tokens: int) -> Request:
    req = Request("r", list(range(num_tokens)), SamplingParams(max_tokens=1), 0.0, max_tokens=1)
    req.num_computed_tokens = num_tokens
    return req


def test_auto_recomputes_below_the_crossover_and_swaps_above_it() -> None:
    cm = cost_model()
    assert cm.crossover_tokens() == pytest.approx(CROSSOVER)
    # The crossover is where the two costs are equal.
    assert cm.swap_cost_s(CROSSOVER) == pytest.approx(cm.recompute_cost_s(CROSSOVER))
    assert cm.swap_cost_s(1) == pytest.approx(2 * (1e-3 + 1e-5))
    assert cm.recompute_cost_s(1) == pytest.approx(1e-4)
    for n in (1, 4, 16, CROSSOVER - 1):
        assert cm.mode(request_with_context(n)) == "recompute", n
    for n in (CROSSOVER + 1, 28, 100, 10_000):
        assert cm.mode(request_with_context(n)) == "swap", n
    # The policy the config names: a forced mode is obeyed whatever the cost, auto asks the cost model.
    assert preemption("swap").mode(request_with_context(1)) == "swap"
    assert preemption("recompute").mode(request_with_context(10_000)) == "recompute"
    assert [preemption("auto").mode(request_with_context(n)) for n in (1, 10_000)] == ["recompute", "swap"]


def test_crossover_edges() -> None:
    # No fixed cost (the old linear model) and swap cheaper per token: swap at every length.
    linear = PreemptionCostModel(KV_BYTES_PER_TOKEN, HOST_COPY_BYTES_PER_S, PREFILL_TOKENS_PER_S)
    assert linear.crossover_tokens() == 0
    assert linear.mode(request_with_context(1)) == "swap"
    # Swap dearer per token than a prefill: it never wins, however long the context.
    slow_copy = PreemptionCostModel(KV_BYTES_PER_TOKEN, 1e8, PREFILL_TOKENS_PER_S, fixed_transfer_s=1e-3)
    assert math.isinf(slow_copy.crossover_tokens())
    assert slow_copy.mode(request_with_context(1_000_000)) == "recompute"
    assert "recompute below 25 tokens, swap above" in cost_model().describe()


def make_sched(forced: Literal["auto", "swap", "recompute"], host_blocks: int) -> Scheduler:
    # 9 blocks of 4 tokens, prefix caching off so that a recompute really recomputes.
    kv = KVCacheManager(9, 4, False, host_blocks)
    config = SchedulerConfig(
        max_model_len=64, max_num_batched_tokens=64, cold_start_output_tokens=0, preemption_mode=forced
    )
    return Scheduler.from_config(config, kv, cost_model())


def add_three(s: Scheduler) -> tuple[Request, Request, Request]:
    """An oldest request (never the victim), a long one (28 tokens, above the crossover) and a short newest
    one (4 tokens, below it), admitted together by reserving nothing for their outputs: they fill the 9
    blocks exactly, so the oldest's first decode preempts the short one and the long one's first decode,
    with nothing left to take, preempts the long one itself."""
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    a = Request("a", list(range(1, 5)), sp, 1.0, max_tokens=8)
    long = Request("long", list(range(100, 128)), sp, 2.0, max_tokens=8)
    short = Request("short", list(range(200, 204)), sp, 3.0, max_tokens=8)
    for r in (a, long, short):
        s.add_request(r)
        r.output_length_estimate = 0
    return a, long, short


def run_step(s: Scheduler) -> None:
    out = s.schedule()
    s.update_from_output(out, {sr.req_id: [7] for sr in out.scheduled if sr.samples})
    s.kv.pool.check_invariants()


def run_to_completion(s: Scheduler, requests: tuple[Request, ...]) -> None:
    for _ in range(200):
        if not s.has_unfinished():
            break
        run_step(s)
    assert not s.has_unfinished()
    assert all(r.num_output_tokens == 8 for r in requests)
    assert s.kv.num_free_blocks == 9


def test_auto_recomputes_the_short_victim_and_swaps_the_long_one() -> None:
    s = make_sched("auto", host_blocks=16)
    a, long, short = add_three(s)
    run_step(s)  # all three prefill
    assert s.kv.num_free_blocks == 0
    run_step(s)  # a's decode preempts short (4 tokens), long's preempts long (28 tokens)
    assert short.status == RequestStatus.PREEMPTED and short.preempt_count == 1
    assert long.status == RequestStatus.SWAPPED and long.preempt_count == 1
    assert (s.stats.num_preemptions_recompute, s.stats.num_preemptions_swap) == (1, 1)
    assert s.stats.num_preemption_fallbacks == 0
    run_to_completion(s, (a, long, short))
    assert a.preempt_count == 0
    assert s.kv.swap_space.num_free == 16


def test_swap_falls_back_to_recompute_when_the_swap_space_is_full_counted_and_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Room on the host for the short request's one block, not for the long one's seven.
    s = make_sched("swap", host_blocks=2)
    a, long, short = add_three(s)
    with caplog.at_level(logging.WARNING, logger="chunkwise"):
        run_step(s)
        run_step(s)
        assert short.status == RequestStatus.SWAPPED
        assert long.status == RequestStatus.PREEMPTED  # swap chosen, fell back to recompute
        assert (s.stats.num_preemptions_swap, s.stats.num_preemptions_recompute) == (1, 1)
        assert s.stats.num_preemption_fallbacks == 1
        text = EngineMetrics("m", stats_source=lambda: s.stats).exposition().decode()
        # A further fallback is counted, not warned about again.
        s.kv.swap_space.allocate(s.kv.swap_space.num_free)
        s._preempt(a, [])
        assert a.status == RequestStatus.PREEMPTED
        assert s.stats.num_preemption_fallbacks == 2
    warnings = [r for r in caplog.records if "swap space is full" in r.getMessage()]
    assert len(warnings) == 1
    assert "request long" in warnings[0].getMessage()
    assert "--swap-space-bytes" in warnings[0].getMessage()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "chunkwise:preemption_fallbacks"]
    assert family.type == "counter"
    [sample] = [x for x in family.samples if x.name == "chunkwise:preemption_fallbacks_total"]
    assert sample.labels == {"model_name": "m"} and sample.value == 1


def test_the_engine_measures_and_logs_the_swap_constants(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="chunkwise.engine"):
        core = EngineCore(
            engine_config_from_kwargs(
                "tiny", num_blocks=64, max_model_len=256, block_size=8, swap_space_bytes=1 << 20
            )
        )
    cm = core.cost_model
    assert cm.fixed_transfer_s >= 0 and math.isfinite(cm.fixed_transfer_s)
    assert cm.host_copy_bytes_per_s > 1 and math.isfinite(cm.host_copy_bytes_per_s)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preemption cost model:")]
    assert " us + " in line and " GB/s" in line and "tokens/s" in line
