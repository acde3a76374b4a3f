"""The routing benchmark's results and report: per workload, replica count and policy; ratios side by side."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

# The goal: with the exact prefix index, p99 TTFT at least this much lower than the llm-d baseline's.
BASELINE = "llm-d"
GOAL_POLICY = "predicted-completion+kv-events"
GOAL_P99_RATIO = 1.3


@dataclass
class Outcome:
    group: int
    start: float
    ttft: float | None = None
    latency: float = 0.0
    status: int = 0
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass
class PolicyResult:
    policy: str
    requests: int
    errors: int
    mean_ttft: float
    p50_ttft: float
    p99_ttft: float
    mean_latency: float
    hit_ratio: float
    spread: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)
    workload: str = ""
    replicas: int = 0
    run_s: float = 0.0  # the whole run: processes started and stopped included


@dataclass
class Run:
    """One workload at one replica count: every policy's result."""

    workload: str
    replicas: int
    results: list[PolicyResult]


@dataclass(frozen=True)
class Ratio:
    metric: str  # "mean" or "p99" TTFT
    baseline: str
    policy: str
    value: float


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(
    policy: str, outcomes: Sequence[Outcome], wall_s: float, workload: str = "", replicas: int = 0
) -> PolicyResult:
    ok = [o for o in outcomes if o.status == 200 and o.ttft is not None]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    return PolicyResult(
        policy=policy,
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        mean_ttft=sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        p50_ttft=percentile(ttfts, 0.5),
        p99_ttft=percentile(ttfts, 0.99),
        mean_latency=sum(o.latency for o in ok) / len(ok) if ok else float("nan"),
        hit_ratio=sum(o.cached_tokens for o in ok) / prompt_tokens if prompt_tokens else 0.0,
        spread=dict(sorted(Counter(o.replica.rsplit("/", 1)[-1] for o in ok).items())),
        wall_s=wall_s,
        error_samples=[f"{o.status} {o.error}".strip() for o in outcomes if o not in ok][:5],
        workload=workload,
        replicas=replicas,
    )


def _divide(a: float, b: float) -> float:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else float("nan")


def ratios(results: Sequence[PolicyResult]) -> list[Ratio]:
    """The ratios the goals are stated in, for the policies present: mean TTFT of round-robin and p99 of
    least-loaded over predicted-completion's (the original goal), and p99 of the llm-d baseline over each
    other policy's."""
    by = {r.policy: r for r in results}
    out = []
    pc, rr, ll = by.get("predicted-completion"), by.get("round-robin"), by.get("least-loaded")
    if pc and rr:
        out.append(Ratio("mean", rr.policy, pc.policy, _divide(rr.mean_ttft, pc.mean_ttft)))
    if pc and ll:
        out.append(Ratio("p99", ll.policy, pc.policy, _divide(ll.p99_ttft, pc.p99_ttft)))
    base = by.get(BASELINE)
    if base:
        out.extend(
            Ratio("p99", base.policy, r.policy, _divide(base.p99_ttft, r.p99_ttft))
            for r in results
            if r.policy != BASELINE
        )
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}ms" if math.isfinite(seconds) else "-"


def format_results(results: Sequence[PolicyResult]) -> str:
    width = max([22, *(len(r.policy) + 2 for r in results)])
    lines = [
        f"{'policy':<{width}}{'mean TTFT':>11}{'p50':>10}{'p99':>10}{'mean e2e':>11}{'hit ratio':>11}"
        f"{'errors':>8}  spread"
    ]
    for r in results:
        spread = "/".join(str(n) for n in r.spread.values())
        lines.append(
            f"{r.policy:<{width}}{_ms(r.mean_ttft):>11}{_ms(r.p50_ttft):>10}{_ms(r.p99_ttft):>10}"
            f"{_ms(r.mean_latency):>11}{r.hit_ratio:>11.2f}{r.errors:>8}  {spread}"
        )
        lines.extend(f"    failed: {e}" for e in r.error_samples)
    for q in ratios(results):
        line = f"{q.metric} TTFT, {q.baseline} / {q.policy}: {q.value:.2f}x"
        if q.baseline == BASELINE and q.policy == GOAL_POLICY:
            line += f" (goal >= {GOAL_P99_RATIO}x: {'met' if q.value >= GOAL_P99_RATIO else 'not met'})"
        lines.append(line)
    return "\n".join(lines)


def format_report(runs: Sequence[Run]) -> str:
    """Every run's table, then the p99 ratios against the baseline side by side."""
    parts = []
    for run in runs:
        n = run.results[0].requests if run.results else 0
        parts.append(f"== {run.workload}, {run.replicas} replicas, {n} requests")
        parts.append(format_results(run.results))
    columns = [
        (run, {q.policy: q.value for q in ratios(run.results) if q.baseline == BASELINE}) for run in runs
    ]
    columns = [(run, by) for run, by in columns if by]
    if columns:
        policies = list(dict.fromkeys(p for _, by in columns for p in by))
        width = max(len(p) for p in policies) + 2
        heads = [f"{run.workload} x{run.replicas}" for run, _ in columns]
        parts.append(f"== p99 TTFT, {BASELINE} / policy")
        parts.append(f"{'policy':<{width}}" + "".join(f"{h:>12}" for h in heads))
        for p in policies:
            cells = [by.get(p) for _, by in columns]
            parts.append(
                f"{p:<{width}}" + "".join(f"{c:>11.2f}x" if c is not None else f"{'-':>12}" for c in cells)
            )
    return "\n".join(parts)
