"""PNG plots of runs, one line per compared configuration (matplotlib, Agg backend: no display needed).

- step_time_hist.png: the distribution of step times (a histogram, not a mean: docs/scheduling.md, "What is measured");
- itl_cdf.png: the inter-token latency CDF, where a convoy shows as a long right tail;
- queue_kv.png: waiting requests and KV-cache usage over the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chunkwise.bench.results import RunResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_ticks(ax: Any) -> None:
    """Log axis, plain numbers (10, 20, 50) rather than powers of ten."""
    from matplotlib.ticker import FuncFormatter

    def minor(v: float, _: object) -> str:
        mantissa = v / 10 ** math.floor(math.log10(v)) if v > 0 else 0
        return f"{v:g}" if round(mantissa) in (2, 5) else ""

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(minor))


def step_time_hist(results: Mapping[str, RunResult], path: Path) -> Path | None:
    with_steps = {n: r for n, r in results.items() if r.steps}
    if not with_steps:
        return None
    plt = _pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    all_ms = [s.step_s * 1000 for r in with_steps.values() for s in r.steps]
    lo, hi = max(min(all_ms), 1e-3), max(all_ms)
    bins = np.logspace(np.log10(lo), np.log10(hi * 1.01), 40) if hi > lo * 1.5 else 40
    for name, r in with_steps.items():
        ax.hist([s.step_s * 1000 for s in r.steps], bins=bins, histtype="step", linewidth=1.5, label=name)
    if not isinstance(bins, int):
        ax.set_xscale("log")
        _plain_ticks(ax)
    ax.set_yscale("log")
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("steps")
    ax.set_title("Step time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def itl_cdf(results: Mapping[str, RunResult], path: Path) -> Path | None:
    plt = _pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for name, r in results.items():
        itl = np.sort([g * 1000 for rec in r.records if rec.success for g in rec.itl])
        if not len(itl):
            continue
        ax.plot(itl, np.arange(1, len(itl) + 1) / len(itl), label=name, linewidth=1.5)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log")
    _plain_ticks(ax)
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title("ITL CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _timeline(r: RunResult) -> tuple[list[float], list[float], list[float]]:
    if not r.steps:
        return (
            [t for t, *_ in r.timeline],
            [w for _, _, w, _ in r.timeline],
            [100 * k for *_, k in r.timeline],
        )
    # Several replicas: the fleet's total queue and mean KV usage, as of each step end.
    latest: dict[int, tuple[int, float]] = {}
    ts, waiting, kv = [], [], []
    for s in sorted(r.steps, key=lambda s: s.t):
        latest[s.replica] = (s.num_waiting, s.kv_usage)
        ts.append(s.t)
        waiting.append(float(sum(w for w, _ in latest.values())))
        kv.append(100 * sum(u for _, u in latest.values()) / len(latest))
    return ts, waiting, kv


def queue_and_kv(results: Mapping[str, RunResult], path: Path) -> Path | None:
    with_data = {n: r for n, r in results.items() if r.steps or r.timeline}
    if not with_data:
        return None
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, r in with_data.items():
        ts, waiting, kv = _timeline(r)
        ax1.plot(ts, waiting, label=name, linewidth=1.2)
        ax2.plot(ts, kv, label=name, linewidth=1.2)
    ax1.set_ylabel("waiting requests")
    ax1.set_title("Queue depth and KV-cache usage")
    ax2.set_ylabel("KV cache used (%)")
    ax2.set_xlabel("time (s)")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(results: Mapping[str, RunResult], plot_dir: str | Path, prefix: str = "") -> list[Path]:
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{prefix}_" if prefix else ""
    written = [
        step_time_hist(results, out / f"{stem}step_time_hist.png"),
        itl_cdf(results, out / f"{stem}itl_cdf.png"),
        queue_and_kv(results, out / f"{stem}queue_kv.png"),
    ]
    return [p for p in written if p is not None]
