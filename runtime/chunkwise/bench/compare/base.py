"""What every in-process comparison shares: Ratio and Comparison (the reported figures), noise,
machine_info, interleave (configurations taking turns step by step), ratio, and engines built and
warmed up with the comparisons' default KV memory."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkwise.bench.clock import ClockName
from chunkwise.bench.metrics import summarize
from chunkwise.bench.results import RunResult
from chunkwise.bench.workloads import WorkItem

if TYPE_CHECKING:
    from chunkwise.bench.offline import EngineRun
    from chunkwise.engine import EngineCore


# Comparisons give each engine this much KV memory unless told otherwise: ample for their workloads, and two
# engines side by side stay well inside a small machine's memory.
DEFAULT_KV_BYTES = 512 << 20


@dataclass
class Ratio:
    label: str
    values: list[float]
    goal: str = ""
    clock: str = "wall"
    # The same ratio read on the run's other clock (wall when the headline is cpu, and vice versa).
    other_values: list[float] = field(default_factory=list)
    other_clock: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "median": self.median,
            "min": min(self.values),
            "max": max(self.values),
            "values": self.values,
            "goal": self.goal,
            "clock": self.clock,
            "other_clock": self.other_clock,
            "other_values": self.other_values,
        }

    def line(self) -> str:
        spread = f"range {min(self.values):.2f}-{max(self.values):.2f}" if len(self.values) > 1 else "one run"
        goal = f"  [goal: {self.goal}]" if self.goal else ""
        other = ""
        if self.other_values:
            o = self.other_values
            other = f"; {self.other_clock} clock {statistics.median(o):.2f}x, range {min(o):.2f}-{max(o):.2f}"
        on = f" on the {self.clock} clock" if self.clock else ""
        return f"{self.label}: {self.median:.2f}x{on} (median of {len(self.values)}; {spread}{other}){goal}"


@dataclass
class Comparison:
    what: str
    results: dict[str, list[RunResult]]
    ratios: list[Ratio]
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def as_dict(self, slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
        return {
            "what": self.what,
            "info": self.info,
            "notes": self.notes,
            "ratios": [r.as_dict() for r in self.ratios],
            "runs": {name: [r.report(slos_ms) for r in runs] for name, runs in self.results.items()},
            "noise": noise(self.results),
        }


def noise(
    results: dict[str, list[RunResult]], metric: str = "output_throughput"
) -> dict[str, dict[str, float]]:
    """Per configuration and clock, (max - min) / median of `metric` over its repeats: how much the
    machine wobbled."""
    out: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        if len(runs) < 2:
            continue
        readings = {runs[0].clock: runs}
        if all(r.other is not None for r in runs):
            readings[runs[0].other.clock] = [r.other for r in runs]  # type: ignore[union-attr,misc]
        for clock, rs in readings.items():
            values = [r.report()[metric] for r in rs]
            out.setdefault(name, {})[clock] = (max(values) - min(values)) / statistics.median(values)
    return out


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }


def interleave(
    configs: Sequence[tuple[str, Callable[[int], EngineRun | RunResult]]],
    repeats: int,
    log: Callable[[str], None],
) -> dict[str, list[RunResult]]:
    """Run each configuration `repeats` times. Engine runs take turns step by step (run_interleaved), each
    timed only on its own steps, so both see the same machine at the same moments; a configuration that
    cannot be stepped (transformers' generate) runs whole, first in one repeat and last in the next."""
    from chunkwise.bench.offline import EngineRun, run_interleaved

    results: dict[str, list[RunResult]] = {name: [] for name, _ in configs}
    for rep in range(repeats):
        order = list(configs) if rep % 2 == 0 else list(reversed(configs))
        lanes: list[tuple[str, EngineRun]] = []
        for name, make in order:
            run = make(rep)
            if isinstance(run, EngineRun):
                lanes.append((name, run))
                continue
            log(f"repeat {rep + 1}/{repeats}: {name} done")
            results[name].append(run)
        if lanes:
            log(f"repeat {rep + 1}/{repeats}: {' and '.join(n for n, _ in lanes)}, step by step")
            for (name, _), [res] in zip(lanes, run_interleaved([[r] for _, r in lanes])):
                results[name].append(res)
    return results


def ratio(
    label: str,
    results: dict[str, list[RunResult]],
    num: str,
    den: str,
    metric: str | Callable[[RunResult], float],
    goal: str = "",
) -> Ratio:
    def value(r: RunResult) -> float:
        return metric(r) if callable(metric) else float(r.report()[metric])

    pairs = list(zip(results[num], results[den]))
    # A counter (a callable metric here) reads the same on every clock.
    clock = "" if callable(metric) else pairs[0][0].clock
    out = Ratio(label, [value(a) / max(value(b), 1e-12) for a, b in pairs], goal, clock=clock)
    others = [(a.other, b.other) for a, b in pairs]
    # Counters read the same on both clocks: only time-based metrics get a second reading (step times are
    # kept on the headline clock only).
    if (
        not callable(metric)
        and all(a is not None and b is not None for a, b in others)
        and metric in summarize([], 1.0)
    ):
        out.other_values = [value(a) / max(value(b), 1e-12) for a, b in others]  # type: ignore[arg-type]
        out.other_clock = others[0][0].clock  # type: ignore[union-attr]
    return out


def _engine(model: str, args: dict[str, Any]) -> EngineCore:
    from chunkwise.bench.offline import build_engine, warm_up

    engine = build_engine(model, {"kv_cache_memory_bytes": DEFAULT_KV_BYTES, **args})
    warm_up(engine)
    return engine


def _runner(
    engine: EngineCore, items: Sequence[WorkItem], name: str, progress: bool, clock: ClockName
) -> Callable[[int], EngineRun]:
    from chunkwise.bench.offline import EngineRun

    return lambda rep: EngineRun(engine, items, name, salt=f"{name}-{rep}", progress=progress, clock=clock)


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
