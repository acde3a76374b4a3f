"""The simulator: chunkwise's scheduler on a virtual clock, hand-checked timings, routers, profiles."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from chunkwise.bench.workloads import WorkItem, long_tailed, shared_prefix, with_arrivals
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.sim.calibrate import fit_nonnegative
from chunkwise.sim.profile import BUILTIN_PROFILES, LinearCost, Profile, StepFeatures, load_profile
from chunkwise.sim.replay import replay, scheduler_config

VOCAB = 258


def profile(base_s: float = 1.0, per_row_s: float = 0.0, num_blocks: int = 1024) -> Profile:
    return Profile(
        name="test",
        kind="linear",
        source="test",
        model="test",
        kv_bytes_per_token=1024,
        host_copy_bytes_per_s=1e9,
        prefill_tokens_per_s=1000.0,
        num_blocks=num_blocks,
        max_model_len=2048,
        linear=LinearCost(base_s, 0.0, per_row_s, 0.0, 0.0),
    )


def test_one_second_steps_by_hand() -> None:
    # A arrives at 0: step 1 (0-1 s) prefills it and samples token 1; tokens 2-4 end at 2, 3, 4 s.
    # B arrives at 0.5 while step 1 runs: it joins step 2 (1-2 s), so its first token is at 2 s.
    p = profile()
    items = [WorkItem(tuple(range(3, 35)), 4, 0.0), WorkItem(tuple(range(5, 21)), 2, 0.5)]
    result = replay(items, p, scheduler_config(p))
    a, b = result.records
    assert (a.ttft, a.latency, a.itl, a.output_len) == (1.0, 4.0, [1.0, 1.0, 1.0], 4)
    assert (b.ttft, b.latency, b.itl, b.output_len) == (1.5, 2.5, [1.0], 2)
    report = result.report()
    assert report["duration"] == 4.0 and report["num_steps"] == 4
    assert report["mean_tpot_ms"] == pytest.approx(1000.0)
    assert [s.num_running for s in result.steps] == [1, 2, 2, 1]


def test_hidden_lengths_end_at_their_target_and_feed_the_estimator() -> None:
    p = profile()
    items = [WorkItem(tuple(range(3, 19)), None, float(i), target_len=7) for i in range(3)]
    result = replay(items, p, scheduler_config(p, cold_start_output_tokens=4))
    assert [r.output_len for r in result.records] == [7, 7, 7]
    assert all(r.success for r in result.records)


def test_continuous_beats_static_by_about_one_over_u_when_steps_cost_the_same() -> None:
    from chunkwise.bench.workloads import useful_work_fraction

    p = profile(base_s=0.05)
    items = long_tailed(128, vocab_size=VOCAB, seed=2, max_output=256)
    u = useful_work_fraction([it.output_len for it in items], 16)
    static = replay(items, p, scheduler_config(p, max_num_seqs=16, batching="static")).report()
    cont = replay(items, p, scheduler_config(p, max_num_seqs=16)).report()
    ratio = cont["output_throughput"] / static["output_throughput"]
    # A flat step cost is a GPU's padded batch: the gain approaches 1/U (prefill steps dilute it a little).
    assert 0.7 / u < ratio < 1.05 / u


def test_replay_is_deterministic_and_reports_like_bench_serve() -> None:
    p = load_profile("llama3-8b-h100")
    times = [i * 0.05 for i in range(100)]
    items = with_arrivals(long_tailed(100, vocab_size=VOCAB, seed=4, max_output=128), times)
    a = replay(items, p, scheduler_config(p), num_replicas=2, router="least-loaded").report()
    b = replay(items, p, scheduler_config(p), num_replicas=2, router="least-loaded").report()
    drop = ("wall_seconds", "median_schedule_cpu_ms", "mean_schedule_ms")
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert a["completed"] == 100 and a["simulated"] is True
    assert sum(a["requests_per_replica"]) == 100
    assert "derived" in a["profile_source"]


def test_requests_too_big_for_the_cache_fail_alone() -> None:
    p = profile(num_blocks=8)
    items = [WorkItem(tuple(range(3, 200)), 4), WorkItem(tuple(range(3, 20)), 4)]
    records = replay(items, p, scheduler_config(p)).records
    assert not records[0].success and "KV blocks" in records[0].error
    assert records[1].success and records[1].output_len == 4


def test_routers() -> None:
    p = profile(base_s=0.01, per_row_s=0.001)
    # Round-robin: strictly in turn.
    items = [WorkItem((3, 4, 5, 6), 4, 0.0) for _ in range(9)]
    rr = replay(items, p, scheduler_config(p), num_replicas=3, router="round-robin")
    assert rr.extra["requests_per_replica"] == [3, 3, 3]
    # Least-loaded: a long request pins replica 0, so the short ones that follow go elsewhere.
    items = [WorkItem((3,) * 8, 500, 0.0)] + [WorkItem((4,) * 8, 2, 0.1 + i) for i in range(4)]
    ll = replay(items, p, scheduler_config(p), num_replicas=2, router="least-loaded")
    assert ll.extra["requests_per_replica"] == [1, 4]


def test_predicted_completion_follows_the_cached_prefix_until_the_queue_costs_more() -> None:
    # Two system prompts of 512 tokens; requests arrive slowly, so queues are empty: the router sends
    # each to the replica that already holds its system prompt, and nearly every prompt token hits.
    # Prefill costs 0.5 ms a token: the router learns that rate from the replicas' step counters (as it does
    # live), and a cached system prompt then saves 0.25 s of prefill.
    p = profile(base_s=0.01, per_row_s=0.0)
    p = dataclasses.replace(p, prefill_tokens_per_s=2000.0, linear=LinearCost(0.01, 1 / 2000, 0.0, 0.0, 0.0))
    items = shared_prefix(40, vocab_size=VOCAB, system_len=512, num_system_prompts=2, seed=1)
    items = with_arrivals(items, [i * 2.0 for i in range(len(items))])
    pc = replay(items, p, scheduler_config(p), num_replicas=4, router="predicted-completion").report()
    rr = replay(items, p, scheduler_config(p), num_replicas=4, router="round-robin").report()
    assert pc["prefix_cache_hits"] > rr["prefix_cache_hits"]
    # Only the first request of each system prompt misses it (39 tokens short of 20 * 512 per prompt).
    assert pc["prefix_cache_hits"] >= 36 * 512


def test_features_of_a_step() -> None:
    from chunkwise.engine.datatypes.sampling_params import SamplingParams
    from chunkwise.engine.sched.output import ScheduledRequest, SchedulerOutput

    sp = SamplingParams()
    so = SchedulerOutput(
        [
            ScheduledRequest("d", [1], 99, [0] * 7, True, sp),
            ScheduledRequest("p", [1] * 4, 10, [0] * 1, False, sp),
        ],
        5,
        swap_out=[(1, 2)],
    )
    f = StepFeatures.of(so, block_size=16)
    assert (f.prefill_tokens, f.decode_rows, f.decode_context, f.swap_tokens) == (4, 1, 100, 16)
    assert f.prefill_attention == 4 * (10 + 2.5)


def test_nonnegative_fit_recovers_coefficients() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(40), rng.integers(0, 1000, 40), rng.integers(0, 64, 40)])
    true = np.array([0.01, 2e-4, 0.0])
    y = x @ true * (1 + rng.normal(0, 0.01, 40))
    coef = fit_nonnegative(x, y)
    assert coef[0] == pytest.approx(0.01, rel=0.1) and coef[1] == pytest.approx(2e-4, rel=0.05)
    assert (coef >= 0).all()


def test_profiles_round_trip_and_builtins_are_labelled_derived(tmp_path: Path) -> None:
    p = profile()
    path = tmp_path / "p.json"
    p.save(path)
    assert load_profile(str(path)) == p
    for name in BUILTIN_PROFILES:
        g = load_profile(name)
        assert g.kind == "roofline" and g.source.startswith("derived, not measured")
        # A decode step of a big batch costs more than one of a single row, and a long prefill more still.
        one = g.decode_step_seconds(1, 1024)
        assert one < g.decode_step_seconds(256, 1024) < g.features_seconds(StepFeatures(prefill_tokens=8192))
    with pytest.raises(ValueError, match="neither a built-in"):
        load_profile(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="not a chunkwise profile"):
        load_profile(str(tmp_path / "bad.json"))


def test_queued_work_counts_each_of_a_queued_parents_n_outputs() -> None:
    """A simulated replica's queue is the engine's (Scheduler.snapshot, what its load shedding and /metrics
    read): a queued n > 1 request has n outputs to come, so its estimated output counts n times."""
    from chunkwise.engine.datatypes.request import Request
    from chunkwise.engine.datatypes.sampling_params import SamplingParams
    from chunkwise.sim.replica import SimReplica

    p = profile()
    rep = SimReplica(0, p, scheduler_config(p))
    req = Request("p", list(range(3, 13)), SamplingParams(n=3, max_tokens=5), 0.0, max_tokens=5)
    rep.add(req, None)
    assert req.output_length_estimate == 5
    snap = rep.scheduler.snapshot()
    assert (snap.num_queued, snap.queued_prefill_tokens, snap.queued_decode_tokens) == (1, 10, 15)
    assert rep.gauges().num_waiting == 1


def test_a_simulated_replica_needs_a_resolved_max_model_len() -> None:
    from chunkwise.sim.replica import SimReplica

    with pytest.raises(ValueError, match="max_model_len must be resolved"):
        SimReplica(0, profile(), SchedulerConfig())
