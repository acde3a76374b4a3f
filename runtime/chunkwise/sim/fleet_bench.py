"""The routing table at fleet scale (issue 36): routers compared on the routing benchmark's workloads
(bench/routing/workloads.py: tenants, agent, mixed), scaled to N replicas and offered at a fraction of the
fleet's capacity, replayed on a GPU profile with the live router's policies (sim/fleet.py).

Scaling a workload to N replicas keeps each replica's share of it as the live benchmark's 8 CPU replicas
had it: N/8 times the tenants (tenants, agent) or documents (mixed), each replica's KV cache the workload's
`num_blocks` (too small to hold every prefix, so that where a request goes decides whether its prefix is
cached), and `requests_per_replica` requests per replica. The arrival times are then compressed or
stretched so that the offered rate is `load` times the fleet's capacity.

Capacity: one replica's completions per second when a sample of the workload (its first
`requests_per_replica` requests) arrives all at once, times N. It is a property of the workload and the
profile, not of a router, so every router is offered the same schedule; a router that keeps prefixes where
they are cached serves more than it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkwise.bench.routing.workloads import (
    AgentWorkload,
    Arrival,
    BenchWorkload,
    MixedWorkload,
    Workload,
)
from chunkwise.bench.workloads import WorkItem
from chunkwise.engine.tokenizer import ByteTokenizer
from chunkwise.sim.fleet import RouterSpec
from chunkwise.sim.profile import Profile
from chunkwise.sim.replay import capacity_rps, replay, scheduler_config

WORKLOADS = ("agent", "mixed", "tenants")
# The live routing benchmark's fleet, whose per-replica share of each workload the scaled ones keep.
BASE_REPLICAS = 8


def scaled_workload(name: str, replicas: int, requests_per_replica: int, seed: int = 0) -> BenchWorkload:
    """The routing benchmark's workload with N/8 times its tenants or documents and about
    `requests_per_replica` requests per replica (at its own rate; `offered` rescales the times)."""
    k = replicas / BASE_REPLICAS
    total = requests_per_replica * replicas
    if name == "tenants":
        base = Workload()
        return dataclasses.replace(
            base, tenants=max(1, round(base.tenants * k)), requests=total, rate=base.rate * k, seed=seed
        )
    if name == "agent":
        a = AgentWorkload()
        rate = a.session_rate * k
        per_session = (a.turns[0] + a.turns[1]) / 2
        return dataclasses.replace(
            a,
            tenants=max(1, round(a.tenants * k)),
            session_rate=rate,
            duration_s=total / (rate * per_session),
            seed=seed,
        )
    if name == "mixed":
        m = MixedWorkload()
        rate = m.rate * k
        return dataclasses.replace(
            m, documents=max(1, round(m.documents * k)), rate=rate, duration_s=total / rate, seed=seed
        )
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def work_items(arrivals: Sequence[Arrival]) -> list[WorkItem]:
    """The benchmark's requests as the replay takes them: the prompt tokenized as the built-in models' byte
    tokenizer does (BOS, then one token per byte), max_tokens as sent."""
    tok = ByteTokenizer()
    return [WorkItem(tuple(tok.encode(a.prompt)), a.max_tokens, a.at) for a in arrivals]


def offered(items: Sequence[WorkItem], rate: float) -> list[WorkItem]:
    """The same requests in the same order and rhythm, at `rate` requests per second on average."""
    span = items[-1].arrival_s - items[0].arrival_s
    if span <= 0 or len(items) < 2:
        return list(items)
    scale = (len(items) - 1) / rate / span
    t0 = items[0].arrival_s
    return [dataclasses.replace(it, arrival_s=(it.arrival_s - t0) * scale) for it in items]


@dataclass(frozen=True)
class CellResult:
    workload: str
    replicas: int
    load: float
    router: str
    requests: int
    rate: float
    completed: int
    mean_ttft_ms: float
    p99_ttft_ms: float
    hit_ratio: float
    goodput: float  # requests per second that met the TTFT SLO
    slo_attainment: float
    wall_s: float


def run_cell(
    workload: str,
    replicas: int,
    load: float,
    routers: Sequence[RouterSpec],
    profile: Profile,
    *,
    requests_per_replica: int,
    ttft_slo_ms: float,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> list[CellResult]:
    """Every router on one (workload, size, load) cell: the same requests at the same times."""
    w = scaled_workload(workload, replicas, requests_per_replica, seed)
    items = work_items(w.arrivals())
    config = scheduler_config(profile, **(config_overrides or {}))
    sample = items[:requests_per_replica]
    capacity = replicas * capacity_rps(sample, profile, config, num_blocks=w.num_blocks)
    if not capacity > 0:
        raise RuntimeError(f"{workload}: one replica completed nothing; cannot size the load")
    items = offered(items, load * capacity)
    out = []
    slos = {"ttft": ttft_slo_ms}
    for spec in routers:
        res = replay(
            items,
            profile,
            config,
            num_replicas=replicas,
            router=spec,
            num_blocks=w.num_blocks,
            keep_steps=False,
            name=f"{workload}-{replicas}-{spec.policy}",
        )
        rep = res.report(slos)
        ok = [r for r in res.records if r.success]
        met = sum(1 for r in ok if r.ttft * 1000 <= ttft_slo_ms)
        queries = rep.get("prefix_cache_queries", 0)
        out.append(
            CellResult(
                workload=workload,
                replicas=replicas,
                load=load,
                router=spec.label,
                requests=len(items),
                rate=load * capacity,
                completed=len(ok),
                mean_ttft_ms=float(rep["mean_ttft_ms"]),
                p99_ttft_ms=float(rep["p99_ttft_ms"]),
                hit_ratio=rep.get("prefix_cache_hits", 0) / queries if queries else 0.0,
                goodput=float(rep.get("request_goodput", 0.0)),
                slo_attainment=met / len(items) if items else 0.0,
                wall_s=float(rep["wall_seconds"]),
            )
        )
    return out


def format_table(results: Sequence[CellResult], baseline: str, candidates: Sequence[str]) -> str:
    """One row per cell and candidate: its p99 and mean TTFT, hit ratio and SLO attainment beside the
    baseline's, and baseline/candidate p99 TTFT (above 1: the candidate's tail is shorter)."""
    cells: dict[tuple[str, int, float], dict[str, CellResult]] = {}
    for r in results:
        cells.setdefault((r.workload, r.replicas, r.load), {})[r.router] = r
    lines = [
        f"| workload | replicas | load | requests | router | p99 TTFT ms (router / {baseline}) | "
        f"mean TTFT ms | hit ratio | SLO attainment | {baseline} / router p99 TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (w, n, load), by in sorted(cells.items()):
        b = by.get(baseline)
        if b is None:
            continue
        for name in candidates:
            c = by.get(name)
            if c is None:
                continue
            ratio = b.p99_ttft_ms / c.p99_ttft_ms if c.p99_ttft_ms > 0 else math.inf
            lines.append(
                f"| {w} | {n} | {load:.0%} | {c.requests} | {name} | {c.p99_ttft_ms:.0f} / {b.p99_ttft_ms:.0f} | "
                f"{c.mean_ttft_ms:.0f} / {b.mean_ttft_ms:.0f} | {c.hit_ratio:.2f} / {b.hit_ratio:.2f} | "
                f"{c.slo_attainment:.1%} / {b.slo_attainment:.1%} | **{ratio:.2f}x** |"
            )
    return "\n".join(lines)


def geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(statistics.fmean(math.log(v) for v in vals)) if vals else math.nan
