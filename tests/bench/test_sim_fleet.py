"""The fleet in the simulator (issue 36): the live router's policies over simulated replicas, fed by scrapes
and KV events on the virtual clock; the autoscaler in the loop, with cold starts, draining and scale from
zero; the day-shaped arrival curve; the fleet benchmark's cells."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkwise.bench.workloads import WorkItem, arrival_times, day_shaped, shared_prefix, with_arrivals
from chunkwise.router.llmd import LlmD
from chunkwise.router.policies import POLICIES
from chunkwise.sim import cli as sim_cli
from chunkwise.sim.autoscaling import make_autoscaler
from chunkwise.sim.fleet import PREFIX_INDEXES, ROUTER_NAMES, RouterSpec, SimRouter
from chunkwise.sim.fleet_bench import format_table, offered, run_cell, scaled_workload
from chunkwise.sim.profile import LinearCost, Profile, load_profile
from chunkwise.sim.replay import Scaling, replay, scheduler_config

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 258


def profile(num_blocks: int = 1024, prefill_s_per_token: float = 1 / 2000) -> Profile:
    """10 ms a step plus 0.5 ms a prefill token: a cached prefix saves time, and the router can learn so."""
    return Profile(
        name="test",
        kind="linear",
        source="test",
        model="test",
        kv_bytes_per_token=1024,
        host_copy_bytes_per_s=1e9,
        prefill_tokens_per_s=1 / prefill_s_per_token,
        num_blocks=num_blocks,
        max_model_len=2048,
        linear=LinearCost(0.01, prefill_s_per_token, 0.0, 0.0, 0.0),
    )


def test_the_simulated_router_runs_the_live_policy_objects() -> None:
    """Not copies: the policy a replay routes with is the one `chunkwise router` builds for the name."""
    assert ROUTER_NAMES == sim_cli.ROUTER_NAMES and PREFIX_INDEXES == sim_cli.PREFIX_INDEXES
    for name in ROUTER_NAMES:
        policy = SimRouter(RouterSpec(name), 16).router.policy
        assert type(policy) is (LlmD if name == "llm-d" else POLICIES[name])
    with pytest.raises(ValueError, match="unknown router"):
        RouterSpec("random")
    with pytest.raises(ValueError, match="unknown prefix index"):
        RouterSpec("llm-d", prefix_index="psychic")
    # Each scrapes as deployed: llm-d's endpoint picker every 50 ms, chunkwise's router every 0.5 s.
    assert RouterSpec("llm-d").interval_s == 0.05
    assert RouterSpec("predicted-completion").interval_s == 0.5
    assert RouterSpec("llm-d", scrape_interval_s=0.2).interval_s == 0.2


def test_scrapes_teach_the_router_each_replicas_speed_and_the_exact_index_is_the_cache() -> None:
    """After a replay, each replica's view has learned the profile's prefill rate from the step counters
    (as the live router learns it from /metrics), and its exact index holds exactly the hashes in the
    replica's prefix cache as of the last scrape (its KV events, applied in order)."""
    p = profile()
    # Prefill-heavy (the router fits the per-token cost only from intervals whose steps carried prefills).
    items = with_arrivals(
        shared_prefix(
            60,
            vocab_size=VOCAB,
            system_len=256,
            num_system_prompts=3,
            suffix_len=(200, 400),
            output_len=(2, 4),
            seed=2,
        ),
        arrival_times(60, 20.0, seed=2),
    )
    spec = RouterSpec("predicted-completion", scrape_interval_s=0.25)
    seen: dict[str, object] = {}
    original = SimRouter.scrape

    def scrape(self: SimRouter, now: float, replicas: list) -> None:  # type: ignore[type-arg]
        original(self, now, replicas)
        seen["router"] = self
        for rep in replicas:
            view = self.router.replicas[f"sim://replica-{rep.index:05d}"]
            assert view.kv.synced
            assert view.kv.hashes == set(rep.kv_events.snapshot().hashes)
            assert view.scrape is not None and view.scrape.running == rep.gauges().num_running

    SimRouter.scrape = scrape  # type: ignore[method-assign]
    try:
        res = replay(items, p, scheduler_config(p), num_replicas=2, router=spec)
    finally:
        SimRouter.scrape = original  # type: ignore[method-assign]
    assert res.report()["completed"] == 60
    router = seen["router"]
    assert isinstance(router, SimRouter)
    rates = [v.estimates.prefill_rate for v in router.router.replicas.values()]
    assert all(r is not None and r == pytest.approx(2000, rel=0.2) for r in rates), rates


def test_prefix_aware_routers_keep_a_tenant_where_its_prefix_is_cached() -> None:
    p = profile()
    items = with_arrivals(
        shared_prefix(40, vocab_size=VOCAB, system_len=512, num_system_prompts=2, seed=1),
        [i * 0.5 for i in range(40)],
    )
    hits = {}
    for spec in (
        RouterSpec("round-robin"),
        RouterSpec("predicted-completion"),
        RouterSpec("predicted-completion", prefix_index="estimate"),
        RouterSpec("llm-d"),
    ):
        rep = replay(items, p, scheduler_config(p), num_replicas=4, router=spec).report()
        assert rep["completed"] == 40
        assert rep["router"] == spec.policy and rep["prefix_index"] == spec.index_name
        hits[spec.name] = rep["prefix_cache_hits"]
    # Round-robin computes each system prompt once per replica; the others about once per system prompt
    # (twice at most, while the router has not yet learned how fast a replica prefills).
    assert hits["round-robin (exact index)"] <= 32 * 512
    for name, h in hits.items():
        if not name.startswith("round-robin"):
            assert h >= 36 * 512, (name, hits)


def test_the_autoscaler_adds_replicas_under_load_and_each_serves_only_after_its_cold_start() -> None:
    p = load_profile("llama3-8b-h100")
    items = with_arrivals(
        shared_prefix(3000, vocab_size=VOCAB, system_len=256, num_system_prompts=4, seed=3),
        arrival_times(3000, 600.0, seed=3),
    )
    cold = 2.0
    scaling = Scaling(
        make_autoscaler("keda-queue", min_replicas=1, max_replicas=6, cold_start_s=cold),
        interval_s=0.5,
        cold_start_s=cold,
    )
    res = replay(
        items, p, scheduler_config(p, max_num_seqs=8), num_replicas=1, router="least-loaded", scaling=scaling
    )
    rep = res.report()
    assert rep["completed"] == 3000 and rep["failed"] == 0
    events = rep["scale_events"]
    assert events and events[0][1] > 1 and rep["max_replicas"] > 1
    first_up = events[0][0]
    # No replica added at first_up served a step before it was ready.
    added = [s for s in res.steps if s.replica >= 1]
    assert added and min(s.t - s.step_s for s in added) >= first_up + cold - 1e-9
    # Replica-seconds: the first replica all along, each added one from its request on.
    assert rep["replica_seconds"] > res.duration_s
    assert rep["replica_seconds"] < rep["max_replicas"] * (res.duration_s + cold)


def test_scale_from_zero_holds_requests_until_a_replica_is_ready() -> None:
    p = profile()
    items = [WorkItem((3, 4, 5, 6) * 8, 4, arrival_s=1.0 + 0.01 * i) for i in range(5)]
    cold = 3.0
    scaling = Scaling(
        make_autoscaler(
            "chunkwise", min_replicas=0, max_replicas=2, cold_start_s=cold, scale_to_zero_after_s=5.0
        ),
        interval_s=0.5,
        cold_start_s=cold,
    )
    res = replay(
        items, p, scheduler_config(p), num_replicas=0, router="predicted-completion", scaling=scaling
    )
    rep = res.report()
    assert rep["completed"] == 5 and rep["failed"] == 0
    # Held from their arrival until the first evaluation at or after it (1.0 s: arrivals go first at equal
    # times) plus the cold start; then served at once.
    assert rep["scale_events"][0] == (1.0, 1)
    assert all(1.0 + cold <= r.start_s + r.ttft < 1.0 + cold + 0.2 for r in res.records)


def test_a_removed_replica_finishes_what_it_holds() -> None:
    """Scale down drains: a removed replica takes no new request, loses none it holds, and stops counting
    once empty."""
    p = profile()
    first = [WorkItem((7,) * 40, 64, arrival_s=0.0) for _ in range(4)]
    later = [WorkItem((8,) * 40, 8, arrival_s=1.0 + 0.5 * i) for i in range(4)]
    scaling = Scaling(
        make_autoscaler("hpa-kv", min_replicas=1, max_replicas=4, target=0.9),
        interval_s=0.2,
        cold_start_s=0.0,
    )
    res = replay(first + later, p, scheduler_config(p), num_replicas=4, router="round-robin", scaling=scaling)
    rep = res.report()
    assert rep["completed"] == 8 and rep["failed"] == 0
    assert rep["scale_events"][0] == (0.2, 1)  # usage far under its target: down to the floor at once
    # The newest three drained: each kept its first request; every later one went to the one left.
    assert rep["requests_per_replica"] == [5, 1, 1, 1]
    drained_until = max(r.start_s + r.latency for r in res.records[1:4])
    assert rep["replica_seconds"] == pytest.approx(3 * drained_until + res.duration_s)


def test_a_day_shaped_curve_keeps_the_requests_and_moves_the_rate() -> None:
    times = arrival_times(20000, 100.0, seed=1)
    period = 100.0
    day = day_shaped(times, period)
    assert len(day) == len(times) and day == sorted(day)
    assert day[-1] == pytest.approx(times[-1], rel=0.05)  # two whole days: the same mean rate
    night = sum(1 for t in day if t < 10.0)
    noon = sum(1 for t in day if 45.0 <= t < 55.0)
    # rate(t) = r (1 - 0.8 cos(2 pi t / P)): 10 s of night hold about 0.26 r, 10 s of noon about 1.77 r.
    assert night == pytest.approx(0.26 * 100 * 10, rel=0.15)
    assert noon == pytest.approx(1.77 * 100 * 10, rel=0.1)
    with pytest.raises(ValueError, match="amplitude"):
        day_shaped(times, period, amplitude=1.0)


def test_fleet_bench_scales_a_workload_and_offers_it_at_a_fraction_of_capacity() -> None:
    small, big = scaled_workload("agent", 8, 50), scaled_workload("agent", 32, 50)
    assert big.tenants == 4 * small.tenants  # type: ignore[attr-defined]
    items = [WorkItem((3,), 1, arrival_s=float(i)) for i in range(11)]
    fast = offered(items, 5.0)
    assert fast[-1].arrival_s == pytest.approx(2.0) and [i.prompt_token_ids for i in fast] == [(3,)] * 11
    p = load_profile("llama3-8b-h200")
    cells = run_cell(
        "tenants",
        2,
        0.7,
        [RouterSpec("predicted-completion"), RouterSpec("llm-d")],
        p,
        requests_per_replica=30,
        ttft_slo_ms=1000.0,
    )
    assert [c.router for c in cells] == ["predicted-completion+exact", "llm-d"]
    assert all(c.completed == c.requests == 60 for c in cells)
    assert cells[0].rate == cells[1].rate > 0
    table = format_table(cells, baseline="llm-d", candidates=["predicted-completion+exact"])
    ratio = cells[1].p99_ttft_ms / cells[0].p99_ttft_ms
    assert f"**{ratio:.2f}x**" in table and "| tenants | 2 | 70% | 60 | predicted-completion+exact |" in table


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}"}
    return subprocess.run(
        [sys.executable, "-m", "chunkwise.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_replay_cli_routes_with_llm_d_and_autoscales(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    run = _cli(
        "replay", "run", "--profile", "llama3-8b-h100", "--workload", "agent", "--num-requests", "300",
        "--request-rate", "200", "--num-system-prompts", "4", "--replicas", "1", "--router", "llm-d",
        "--autoscaler", "chunkwise", "--max-replicas", "3", "--cold-start-seconds", "0.5",
        "--autoscale-interval-seconds", "0.25", "--goodput", "ttft:1000", "--json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 300 and report["router"] == "llm-d" and report["autoscaler"] == "chunkwise"
    assert "replica-seconds" in run.stdout and report["scrape_interval_s"] == 0.05
    bad = _cli(
        "replay", "run", "--profile", "llama3-8b-h100", "--autoscaler", "hpa-kv", "--min-replicas", "0"
    )
    assert bad.returncode != 0 and "min_replicas" in bad.stderr


def test_fleet_bench_cli_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "cells.jsonl"
    run = _cli(
        "replay", "fleet-bench", "--replicas", "2", "--workloads", "mixed", "--loads", "0.5",
        "--requests-per-replica", "20", "--json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["router"] for r in rows] == [
        "predicted-completion+exact",
        "predicted-completion+estimate",
        "llm-d",
    ]
    assert f"| mixed | 2 | 50% | {rows[0]['requests']} | predicted-completion+estimate |" in run.stdout
    assert RouterSpec.parse("least-loaded+estimate") == RouterSpec("least-loaded", "estimate")
    assert dataclasses.is_dataclass(RouterSpec)


def test_requests_held_with_no_replica_and_an_autoscaler_that_stays_at_zero_fail_and_the_replay_ends() -> (
    None
):
    """HPA does nothing at zero replicas: the requests the router holds can never be served, and the replay
    must say so rather than tick forever."""
    p = profile()
    items = [WorkItem((3, 4, 5, 6) * 8, 4, arrival_s=0.5 * i) for i in range(3)]
    scaling = Scaling(
        make_autoscaler("hpa-kv", min_replicas=1, max_replicas=2), interval_s=1.0, cold_start_s=0.0
    )
    rep = replay(
        items, p, scheduler_config(p), num_replicas=0, router="round-robin", scaling=scaling
    ).report()
    assert rep["completed"] == 0 and rep["failed"] == 3
    assert any("held" in e for e in rep["errors"])


def test_fleet_bench_refuses_bad_arguments_by_name() -> None:
    bad = _cli("replay", "fleet-bench", "--workloads", "chat", "--replicas", "2")
    assert bad.returncode != 0 and "unknown workload" in bad.stderr and "Traceback" not in bad.stderr
    bad = _cli("replay", "fleet-bench", "--workloads", "mixed", "--replicas", "0")
    assert bad.returncode != 0 and "must be positive" in bad.stderr and "Traceback" not in bad.stderr
