"""Reading a replica's /metrics and learning its speed from counter deltas."""

from __future__ import annotations

import pytest

from chunkwise.engine.loop.metrics import EngineMetrics
from chunkwise.engine.sched.output import SchedulerStats
from chunkwise.router.estimates import (
    WARMUP_INTERVALS,
    MetricsSample,
    ReplicaEstimates,
    StepCostFit,
    fleet_mean,
    parse_metrics,
)


def exposition(metrics: EngineMetrics) -> str:
    return metrics.exposition().decode()


def test_parse_reads_the_engines_own_exposition() -> None:
    stats = SchedulerStats(num_running=3, num_waiting=5, kv_usage=0.25)
    m = EngineMetrics("tiny", stats_source=lambda: stats)
    for seconds, tokens in ((0.01, 100), (0.02, 300)):
        m.step_duration.observe(seconds)
        m.iteration_tokens.observe(tokens)
    m.itl.observe(0.004)
    m.itl.observe(0.006)
    sample = parse_metrics(exposition(m), now=12.0)
    assert sample == MetricsSample(
        time=12.0,
        waiting=5.0,
        running=3.0,
        kv_usage=0.25,
        step_seconds=pytest.approx(0.03),
        steps=2.0,
        iteration_tokens=400.0,
        itl_seconds=pytest.approx(0.01),
        itl_count=2.0,
        cache_blocks=None,
        model_name="tiny",  # the metrics' model_name label: the base model a request's model is held to
    )


def test_parse_reads_vllm_cache_info_and_ignores_unknown_families() -> None:
    text = (
        '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",num_gpu_blocks="512"} 1.0\n'
        "# TYPE something_else gauge\nsomething_else 7\n"
    )
    sample = parse_metrics(text, now=0.0)
    assert (sample.cache_blocks, sample.waiting) == (512, 0.0)


def test_step_cost_fit_separates_overhead_from_per_token_cost() -> None:
    fit = StepCostFit()
    a, b = 0.002, 0.00005  # 2 ms a step, 20k tokens/s
    for steps, tokens in ((10, 100), (10, 2000), (5, 4000), (20, 300)):
        fit.add(steps, tokens, a * steps + b * tokens)
    solved = fit.solve()
    assert solved is not None
    assert solved[0] == pytest.approx(a) and solved[1] == pytest.approx(b)


def test_step_cost_fit_falls_back_when_steps_are_all_alike() -> None:
    fit = StepCostFit()
    assert fit.solve() is None
    # Every interval with the same tokens per step: overhead and per-token cost cannot be told apart, so
    # all the time is charged to tokens (a lower bound of the rate).
    fit.add(10, 1000, 0.5)
    fit.add(20, 2000, 1.0)
    assert fit.solve() == (0.0, pytest.approx(0.0005))


def sample(
    t: float, steps: float, tokens: float, seconds: float, itl: float = 0, n: float = 0
) -> MetricsSample:
    return MetricsSample(
        time=t, steps=steps, iteration_tokens=tokens, step_seconds=seconds, itl_seconds=itl, itl_count=n
    )


def warmed_up(est: ReplicaEstimates) -> MetricsSample:
    """Feed the warm-up intervals a fresh replica's estimates ignore; returns the last sample."""
    last = sample(0, 0, 0, 0)
    est.observe(last)
    for i in range(WARMUP_INTERVALS):
        last = sample(i + 1, (i + 1) * 10, (i + 1) * 5000, (i + 1) * 5.0, itl=(i + 1) * 9.0, n=(i + 1) * 10)
        est.observe(last)
    assert (est.prefill_rate, est.tpot) == (None, None)  # warm-up: slow first steps teach nothing
    return last


def after(
    base: MetricsSample, t: float, steps: float, tokens: float, seconds: float, itl: float = 0, n: float = 0
) -> MetricsSample:
    return sample(
        t,
        base.steps + steps,
        base.iteration_tokens + tokens,
        base.step_seconds + seconds,
        itl=base.itl_seconds + itl,
        n=base.itl_count + n,
    )


def test_replica_estimates_learn_from_deltas_only_when_steps_carry_prefill() -> None:
    est = ReplicaEstimates()
    base = warmed_up(est)
    # Decode only: 1 token a step teaches nothing about prefill speed, but gives a TPOT.
    base = after(base, 10, 100, 100, 0.2, itl=0.2, n=100)
    est.observe(base)
    assert est.prefill_rate is None
    assert est.tpot == pytest.approx(0.002)
    # Prefill-heavy intervals: 2 ms + 50 us a token; the estimate is used from the third fitted one.
    for steps, tokens in ((10, 2000), (20, 500)):
        base = after(base, base.time + 1, steps, tokens, steps * 0.002 + tokens * 0.00005)
        est.observe(base)
        assert est.prefill_rate is None
    base = after(base, base.time + 1, 5, 3000, 5 * 0.002 + 3000 * 0.00005)
    est.observe(base)
    assert est.prefill_rate == pytest.approx(20000, rel=1e-3)
    assert est.step_overhead == pytest.approx(0.002, rel=1e-3)
    # Smoothing: a new TPOT moves the estimate part of the way.
    est.observe(after(base, base.time + 1, 10, 10, 0.04, itl=0.04, n=10))
    assert est.tpot == pytest.approx(0.7 * 0.002 + 0.3 * 0.004)


def test_restarted_replica_counters_are_not_deltas() -> None:
    est = ReplicaEstimates()
    est.observe(sample(0, 1000, 100000, 10.0))
    est.observe(sample(1, 5, 500, 0.01))
    assert est.prefill_rate is None


def test_fleet_mean() -> None:
    assert fleet_mean([None, 2.0, 4.0, 0.0], default=9.0) == 3.0
    assert fleet_mean([None], default=9.0) == 9.0


def test_idle_intervals_make_the_tpot_estimate_stale() -> None:
    est = ReplicaEstimates()
    base = after(warmed_up(est), 10, 10, 10, 0.1, itl=0.5, n=10)
    est.observe(base)
    assert (est.tpot, est.staleness) == (pytest.approx(0.05), 0)
    est.observe(after(base, 11, 0, 0, 0))
    est.observe(after(base, 12, 0, 0, 0))
    assert est.staleness == 2
