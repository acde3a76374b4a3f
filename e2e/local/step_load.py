"""The step-load scenario: an autoscaled, routed InferenceService on the local fleet, hit by a load step.

`python -m e2e.local.step_load [--workdir DIR] [--json FILE]` runs it and prints the report; tests/fleet
runs the same function and asserts on what it saw (never on timings).

Phases: one client (baseline); then a step to many clients, each looping over streaming requests, until
the fleet has scaled to its maximum and run there a while (or a cap); then no load until it is back at its
minimum. Throughout, the harness samples the desired and ready replica counts and the autoscaler's status.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2e.local.fleet import LocalFleet
from e2e.local.load import Result, percentile, run_clients

NAME = "chat"
# Engines take two requests at a time, so a dozen clients queue ten at one replica: queue depth is the
# signal, and the per-replica target of 2 asks for ceil(1 x 10 / 2) = 5 replicas, capped at 3.
SPEC: dict[str, Any] = {
    "model": {"preset": "tiny"},
    "image": "chunkwise:local",
    "replicas": 1,
    "engine": {"maxNumSeqs": 2, "kvCacheMemory": "64Mi", "drainGraceSeconds": 2},
    "router": {"enabled": True, "policy": "predicted-completion"},
    "autoscaling": {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 3,
        "targets": {
            "queueDepthPerReplica": 2,
            "preemptionRatePerSecond": 1000,
            "p99StepTimeSeconds": 60,
            "kvUsageFraction": 1.0,
        },
        "scaleUpStabilizationSeconds": 2,
        "scaleDownStabilizationSeconds": 8,
    },
}


@dataclass
class Config:
    baseline_s: float = 4.0
    step_clients: int = 12
    max_tokens: int = 32
    # The step ends this long after the fleet reached its maximum with every replica ready, or at the cap.
    hold_at_max_s: float = 6.0
    step_cap_s: float = 75.0
    scale_down_timeout_s: float = 60.0
    ttft_slo_s: float = 1.0


@dataclass
class Report:
    """Times are seconds since the step began."""

    replicas_timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, desired, ready)
    autoscaler_timeline: list[tuple[float, str, float | None]] = field(
        default_factory=list
    )  # (t, reason, queue)
    first_scale_up_s: float | None = None
    max_replicas_ready_s: float | None = None
    first_request_on_new_replica_s: float | None = None
    step_end_s: float | None = None
    scale_down_decided_s: float | None = None
    back_to_min_s: float | None = None
    direction_changes: int = 0
    requests_by_replica: dict[str, int] = field(default_factory=dict)
    requests_by_replica_at_capacity: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    ttft: dict[str, dict[str, float]] = field(default_factory=dict)
    scale_events: list[str] = field(default_factory=list)
    # The router's view of each replica when the step ended (its own /metrics).
    router_view: list[str] = field(default_factory=list)
    # Replica processes that exited on their own (a crash, or a signal from outside the harness).
    restarts: int = 0


def _ttft_stats(results: list[Result], slo: float) -> dict[str, float]:
    ttfts = [r.ttft for r in results if r.ttft is not None]
    if not ttfts:
        return {"requests": float(len(results))}
    return {
        "requests": float(len(results)),
        "mean": sum(ttfts) / len(ttfts),
        "p50": percentile(ttfts, 0.5),
        "p99": percentile(ttfts, 0.99),
        "slo_attainment": sum(1 for t in ttfts if t <= slo) / len(results),
    }


def _router_view(url: str) -> list[str]:
    try:
        text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError as e:
        return [f"unavailable: {e}"]
    keep = ("chunkwise:router_replica_", "chunkwise:router_picks_total")
    return [line for line in text.splitlines() if line.startswith(keep)]


def direction_changes(counts: list[int]) -> int:
    changes, last = 0, 0
    for a, b in itertools.pairwise(counts):
        if b != a:
            d = 1 if b > a else -1
            if last and d != last:
                changes += 1
            last = d
    return changes


def run(fleet: LocalFleet, cfg: Config | None = None) -> Report:
    cfg = cfg or Config()
    fleet.create_isvc(NAME, SPEC)
    url = fleet.wait_for(lambda: fleet.router_url(NAME), 90, "the router ready")
    fleet.wait_for(lambda: any(p.ready for p in fleet.runtime_pods(NAME)), 90, "a runtime replica ready")
    (first_pod,) = fleet.runtime_pods(NAME)

    baseline: list[Result] = []
    end = time.monotonic() + cfg.baseline_s
    asyncio.run(
        run_clients(
            url, clients=1, stop=lambda: time.monotonic() > end, max_tokens=cfg.max_tokens, results=baseline
        )
    )

    report = Report()
    step: list[Result] = []
    stop = threading.Event()
    t0 = time.monotonic()
    samples_from = len(fleet.timeline)

    def load() -> None:
        asyncio.run(
            run_clients(
                url,
                clients=cfg.step_clients,
                stop=stop.is_set,
                max_tokens=cfg.max_tokens,
                seed=1,
                results=step,
            )
        )

    loader = threading.Thread(target=load, name="step-load")
    loader.start()
    maxed_at: float | None = None
    try:
        while time.monotonic() - t0 < cfg.step_cap_s:
            now = time.monotonic()
            status = (fleet.isvc(NAME).get("status") or {}).get("autoscaler") or {}
            report.autoscaler_timeline.append(
                (
                    now - t0,
                    str(status.get("reason")),
                    (status.get("metrics") or {}).get("queueDepthPerReplica"),
                )
            )
            pods = fleet.runtime_pods(NAME)
            if len(pods) == SPEC["autoscaling"]["maxReplicas"] and all(p.ready for p in pods):
                maxed_at = maxed_at or now
                if now - maxed_at >= cfg.hold_at_max_s:
                    break
            time.sleep(0.5)
        report.router_view = _router_view(url)
    finally:
        stop.set()
        loader.join(120)
    t_end = time.monotonic()
    report.step_end_s = t_end - t0
    report.max_replicas_ready_s = None if maxed_at is None else maxed_at - t0

    deadline = time.monotonic() + cfg.scale_down_timeout_s
    while time.monotonic() < deadline:
        status = (fleet.isvc(NAME).get("status") or {}).get("autoscaler") or {}
        report.autoscaler_timeline.append(
            (
                time.monotonic() - t0,
                str(status.get("reason")),
                (status.get("metrics") or {}).get("queueDepthPerReplica"),
            )
        )
        if (
            len(fleet.runtime_pods(NAME)) == SPEC["autoscaling"]["minReplicas"]
            and fleet.isvc(NAME)["spec"]["replicas"] == 1
        ):
            report.back_to_min_s = time.monotonic() - t0
            break
        time.sleep(0.5)

    timeline = [s for s in fleet.timeline[samples_from:] if NAME in s.desired]
    report.replicas_timeline = [(round(s.time - t0, 2), s.desired[NAME], s.ready[NAME]) for s in timeline]
    desired = [d for _, d, _ in report.replicas_timeline]
    report.direction_changes = direction_changes(desired)
    for t, d, _ in report.replicas_timeline:
        if report.first_scale_up_s is None and d > 1:
            report.first_scale_up_s = t
        if (
            report.scale_down_decided_s is None
            and report.first_scale_up_s is not None
            and t > report.step_end_s
            and d < max(desired)
        ):
            report.scale_down_decided_s = t
    original = first_pod.url
    new = sorted(
        (r for r in step if r.replica and r.replica != original and r.status == 200), key=lambda r: r.start
    )
    if new:
        report.first_request_on_new_replica_s = new[0].start - t0
    report.requests_by_replica = dict(Counter(r.replica for r in step))
    report.statuses = dict(Counter(r.status for r in [*baseline, *step]))
    capacity_at = t0 + (
        report.max_replicas_ready_s if report.max_replicas_ready_s is not None else report.step_end_s
    )
    report.requests_by_replica_at_capacity = dict(Counter(r.replica for r in step if r.start >= capacity_at))
    report.ttft = {
        "baseline (1 client, 1 replica)": _ttft_stats(baseline, cfg.ttft_slo_s),
        "step, before full capacity": _ttft_stats([r for r in step if r.start < capacity_at], cfg.ttft_slo_s),
        "step, at full capacity": _ttft_stats([r for r in step if r.start >= capacity_at], cfg.ttft_slo_s),
    }
    report.restarts = sum(p.restarts for p in fleet.pods.values())
    report.scale_events = [
        f"{e.get('reason')}: {e.get('message')}"
        for e in fleet.events()
        if e.get("reason") in ("ScaledUp", "ScaledDown")
    ]
    return report


def format_report(report: Report) -> str:
    lines = ["step-load report (seconds since the step began)"]
    for key in (
        "first_scale_up_s",
        "first_request_on_new_replica_s",
        "max_replicas_ready_s",
        "step_end_s",
        "scale_down_decided_s",
        "back_to_min_s",
        "direction_changes",
        "restarts",
    ):
        value = getattr(report, key)
        lines.append(f"  {key}: {value:.1f}" if isinstance(value, float) else f"  {key}: {value}")
    lines.append(f"  requests by replica: {report.requests_by_replica}")
    lines.append(f"  requests by replica at full capacity: {report.requests_by_replica_at_capacity}")
    lines.append(f"  statuses: {report.statuses}")
    for phase, stats in report.ttft.items():
        shown = ", ".join(f"{k} {v:.3f}" if k != "requests" else f"{k} {int(v)}" for k, v in stats.items())
        lines.append(f"  TTFT {phase}: {shown}")
    lines.extend(f"  event {e}" for e in report.scale_events)
    lines.extend(f"  router {line}" for line in report.router_view)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.local.step_load", description=__doc__)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="logs and kubeconfig (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chunkwise-fleet-"))
    with LocalFleet(workdir) as fleet:
        report = run(fleet)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    print(f"logs: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
