"""The engine's host work per step at a full batch (`chunkwise bench compare sched-overhead`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from chunkwise.bench.clock import ClockName
from chunkwise.bench.compare.base import Comparison, _engine, _runner, interleave
from chunkwise.bench.workloads import WorkItem

# The step loop's own host work, and the output side's (AsyncEngine runs it on its output thread, beside the
# next step's forward; the offline API runs it after each step).
LOOP_PARTS = ("schedule", "prepare", "sample", "update")
HOST_PARTS = (*LOOP_PARTS, "output")


def scheduler_overhead(
    model: str,
    *,
    num_running: int,
    prompt_len: int,
    max_tokens: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    """The engine's host work per step (StepStats) over the steps that hold `num_running` decoding requests:
    the step loop's share (everything outside the forward but output processing), each part, and output
    processing beside it."""
    engine = _engine(model, {**(engine_args or {}), "max_num_seqs": num_running})
    items = [
        WorkItem(tuple(3 + (i * 7 + j) % 250 for j in range(prompt_len)), max_tokens)
        for i in range(num_running)
    ]
    results = interleave(
        [("full-batch", _runner(engine, items, "full-batch", progress, clock))], repeats, log
    )
    full = [
        s
        for r in results["full-batch"]
        for s in r.steps
        if s.num_running == num_running and s.num_prefill_tokens == 0
    ]
    if not full:
        raise RuntimeError(f"no step held {num_running} running requests; raise the KV cache or max_tokens")

    def ms(values: Sequence[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {
            "median_ms": statistics.median(ordered) * 1000,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
        }

    parts = {name: ms([getattr(s, f"{name}_s") for s in full]) for name in HOST_PARTS}
    loop = ms([s.host_s - s.output_s for s in full])
    for name, v in parts.items():
        log(f"  {name:>8}: median {v['median_ms']:.3f} ms, p99 {v['p99_ms']:.3f} ms")
    log(
        f"  step loop's host work (step - forward - output): median {loop['median_ms']:.3f} ms, "
        f"p99 {loop['p99_ms']:.3f} ms"
    )
    return Comparison(
        "sched-overhead",
        results,
        [],
        notes=[
            "host work = the step outside the forward (model, logits, sampler up to the ids on the host); the "
            "step loop's share excludes output processing (detokenization, stop strings), which the server "
            "runs on its output thread while the next step computes",
        ],
        info={
            "num_running": num_running,
            "steps_measured": len(full),
            "median_loop_host_ms": loop["median_ms"],
            "p99_loop_host_ms": loop["p99_ms"],
            "median_output_ms": parts["output"]["median_ms"],
            "host_parts": parts,
            "median_forward_ms": statistics.median(s.forward_s for s in full) * 1000,
            "median_loop_host_share_of_step": statistics.median(
                (s.host_s - s.output_s) / s.engine_step_s for s in full
            ),
            "median_schedule_ms": parts["schedule"]["median_ms"],
            "p99_schedule_ms": parts["schedule"]["p99_ms"],
        },
    )
