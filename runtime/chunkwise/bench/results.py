"""What one run produces, whoever ran it (the real engine offline, an HTTP client, the simulator)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chunkwise.bench.metrics import RequestRecord, summarize

# Scheduler counters reported per run (as deltas over the run).
COUNTERS = (
    "num_prefill_tokens",
    "num_decode_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "host_cache_hits",
    "host_cache_restores",
    "host_cache_offloads",
    "num_preemptions_swap",
    "num_preemptions_recompute",
    "num_priority_preemptions",
    "num_rows",
    "num_padding_rows",
)


@dataclass
class StepRecord:
    """One engine step as seen from outside: when it ended, what it held, and the queue after it."""

    t: float
    step_s: float
    schedule_s: float
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_rows: int
    num_running: int
    num_waiting: int
    kv_usage: float
    forward_s: float = 0.0
    replica: int = 0
    # The engine's own wall-clock measure of the step (StepStats.step_seconds), the base of schedule_s's share.
    engine_step_s: float = 0.0
    # The rest of the engine's host work (StepStats): inputs and plan, sampled ids to lists, scheduler
    # update, output processing.
    prepare_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    output_s: float = 0.0

    @property
    def host_s(self) -> float:
        """The engine's step outside the forward."""
        return self.engine_step_s - self.forward_s


@dataclass
class RunResult:
    name: str
    records: list[RequestRecord]
    steps: list[StepRecord]
    duration_s: float
    # Counter deltas over the run: prefill/decode tokens computed, prefix-cache lookups, preemptions, rows
    # computed (real, and static batching's padding rows).
    counters: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # Sampled from outside when there are no step records (an HTTP server's /metrics):
    # (seconds since start, running, waiting, KV-cache usage fraction).
    timeline: list[tuple[float, float, float, float]] = field(default_factory=list)
    # Which clock the times are on ("wall", "cpu", or "virtual" in the simulator), and the same run read
    # on the other clock where there is one.
    clock: str = "wall"
    other: RunResult | None = None

    def report(self, slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
        out = summarize(self.records, self.duration_s, slos_ms)
        out["name"] = self.name
        out["clock"] = self.clock
        out.update(self.counters)
        if self.steps:
            step_s = sorted(s.step_s for s in self.steps)
            sched_s = sorted(s.schedule_s for s in self.steps)
            out["num_steps"] = len(step_s)
            out["max_step_ms"] = step_s[-1] * 1000
            out["mean_step_ms"] = sum(step_s) / len(step_s) * 1000
            out["p99_step_ms"] = step_s[min(len(step_s) - 1, int(0.99 * len(step_s)))] * 1000
            out["mean_schedule_ms"] = sum(sched_s) / len(sched_s) * 1000
        out.update(self.extra)
        if self.other is not None:
            alt = summarize(self.other.records, self.other.duration_s, slos_ms)
            out[f"{self.other.clock}_clock"] = {
                k: alt[k]
                for k in ("duration", "output_throughput", "mean_ttft_ms", "p99_itl_ms", "max_itl_ms")
            }
        return out
