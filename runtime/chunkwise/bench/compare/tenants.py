"""The multi-tenant features against their absence, on the real engine (issue 37):

- fairness: --fairness vtc against none on one tenant's burst beside another's steady stream (`chunkwise
  bench compare fairness`). The figure is the steady tenant's p99 time to first token, which FIFO makes wait
  behind the whole burst, and what the burst pays for it.
- priority: --scheduling-policy priority against fcfs on the same two streams, the steady one at priority 0
  and the burst at 1 (`chunkwise bench compare priority`): the steady stream's p99 TTFT, which priority
  makes the time to preempt a burst request and prefill, and what the burst pays.
- offload: the prefix cache's host tier (--kv-offloading-size) on against off, with a device cache too small
  for the workload's prefixes (`chunkwise bench compare offload`): p99 TTFT, the hit ratio, prefill saved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from chunkwise.bench.clock import ClockName
from chunkwise.bench.compare.base import Comparison, _engine, _runner, interleave, ratio
from chunkwise.bench.metrics import summarize
from chunkwise.bench.results import RunResult
from chunkwise.bench.workloads import WorkItem


def tenant_stat(items: Sequence[WorkItem], tenant: str, key: str) -> Callable[[RunResult], float]:
    """`key` of the run's report over `tenant`'s requests only (the records are in item order)."""
    idx = [i for i, it in enumerate(items) if it.tenant == tenant]
    if not idx:
        raise ValueError(f"the workload has no request of tenant {tenant!r}")

    def value(r: RunResult) -> float:
        return float(summarize([r.records[i] for i in idx], r.duration_s)[key])

    return value


def _turns(
    model: str,
    args: dict[str, Any],
    configs: Sequence[tuple[str, dict[str, Any], Sequence[WorkItem]]],
    repeats: int,
    progress: bool,
    log: Callable[[str], None],
    clock: ClockName,
) -> dict[str, list[RunResult]]:
    """Each (name, engine options on top of `args`, its workload) an engine of its own, all taking turns."""
    runners = [
        (name, _runner(_engine(model, {**args, **changes}), work, name, progress, clock))
        for name, changes, work in configs
    ]
    return interleave(runners, repeats, log)


def per_tenant(items: Sequence[WorkItem], results: dict[str, list[RunResult]]) -> dict[str, Any]:
    """Each configuration's runs, each as the two tenants' TTFT percentiles and mean latency."""
    return {
        name: [
            {
                f"{tenant}_{key}": tenant_stat(items, tenant, key)(r)
                for tenant in ("steady", "burst")
                for key in ("p50_ttft_ms", "p99_ttft_ms", "mean_e2el_ms")
            }
            for r in runs
        ]
        for name, runs in results.items()
    }


def compare_fairness(
    model: str,
    items: Sequence[WorkItem],
    *,
    max_num_seqs: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    args = {**(engine_args or {}), "max_num_seqs": max_num_seqs}
    results = _turns(
        model,
        args,
        [("none", {"fairness": "none"}, items), ("vtc", {"fairness": "vtc"}, items)],
        repeats,
        progress,
        log,
        clock,
    )
    steady_p99 = tenant_stat(items, "steady", "p99_ttft_ms")
    burst_p99 = tenant_stat(items, "burst", "p99_ttft_ms")
    burst_mean = tenant_stat(items, "burst", "mean_ttft_ms")
    return Comparison(
        "fairness",
        results,
        [
            ratio("none/vtc steady tenant p99 TTFT", results, "none", "vtc", steady_p99, "well above 1"),
            ratio("vtc/none burst tenant p99 TTFT", results, "vtc", "none", burst_p99),
            ratio("vtc/none burst tenant mean TTFT", results, "vtc", "none", burst_mean),
            ratio("vtc/none output throughput", results, "vtc", "none", "output_throughput", "about 1"),
        ],
        info={
            "max_num_seqs": max_num_seqs,
            "num_requests": len(items),
            "per_tenant": per_tenant(items, results),
        },
    )


def compare_priority(
    model: str,
    items: Sequence[WorkItem],
    *,
    max_num_seqs: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    """`items` carry their priorities; the fcfs engine runs them all at 0 (it refuses any other), the same
    requests in the same order, so per-tenant figures line up."""
    args = {**(engine_args or {}), "max_num_seqs": max_num_seqs}
    flat = [dataclasses.replace(it, priority=0) for it in items]
    results = _turns(
        model,
        args,
        [
            ("fcfs", {"scheduling_policy": "fcfs"}, flat),
            ("priority", {"scheduling_policy": "priority"}, items),
        ],
        repeats,
        progress,
        log,
        clock,
    )
    steady_p99 = tenant_stat(items, "steady", "p99_ttft_ms")
    burst_p99 = tenant_stat(items, "burst", "p99_ttft_ms")
    return Comparison(
        "priority",
        results,
        [
            ratio(
                "fcfs/priority steady (priority 0) p99 TTFT",
                results,
                "fcfs",
                "priority",
                steady_p99,
                "well above 1",
            ),
            ratio("priority/fcfs burst (priority 1) p99 TTFT", results, "priority", "fcfs", burst_p99),
            ratio(
                "priority/fcfs output throughput", results, "priority", "fcfs", "output_throughput", "about 1"
            ),
        ],
        info={
            "max_num_seqs": max_num_seqs,
            "num_requests": len(items),
            "priority_preemptions": [
                r.counters.get("num_priority_preemptions", 0) for r in results["priority"]
            ],
            "per_tenant": per_tenant(items, results),
        },
    )


def compare_offloading(
    model: str,
    items: Sequence[WorkItem],
    *,
    num_blocks: int,
    kv_offloading_size: float,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    # The device cache in blocks, so that "a third of the working set" is what the command says.
    args = {**(engine_args or {}), "kv_cache_memory_bytes": None, "num_blocks": num_blocks}
    results = _turns(
        model,
        args,
        [("off", {}, items), ("on", {"kv_offloading_size": kv_offloading_size}, items)],
        repeats,
        progress,
        log,
        clock,
    )

    def prefill(r: RunResult) -> float:
        return float(r.counters["num_prefill_tokens"])

    def hit_ratio(r: RunResult) -> float:
        return r.counters["prefix_cache_hits"] / max(1, r.counters["prefix_cache_queries"])

    return Comparison(
        "offload",
        results,
        [
            ratio("off/on p99 TTFT", results, "off", "on", "p99_ttft_ms", "above 1"),
            ratio("off/on mean TTFT", results, "off", "on", "mean_ttft_ms"),
            ratio("off/on prefill tokens computed", results, "off", "on", prefill),
            ratio("on/off output throughput", results, "on", "off", "output_throughput"),
        ],
        info={
            "num_blocks": num_blocks,
            "kv_offloading_size_gib": kv_offloading_size,
            "num_requests": len(items),
            "prefix_hit_ratio_off": [hit_ratio(r) for r in results["off"]],
            "prefix_hit_ratio_on": [hit_ratio(r) for r in results["on"]],
            "host_hit_share_on": [
                r.counters.get("host_cache_hits", 0) / max(1, r.counters["prefix_cache_queries"])
                for r in results["on"]
            ],
        },
    )
