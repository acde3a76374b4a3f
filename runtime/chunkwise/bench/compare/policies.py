"""Policy comparisons on one engine: continuous vs static batching, chunked vs unchunked prefill, prefix
caching on vs off (`chunkwise bench compare batching|chunked|prefix`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from chunkwise.bench.clock import ClockName
from chunkwise.bench.compare.base import Comparison, _engine, _runner, interleave, ratio
from chunkwise.bench.results import RunResult
from chunkwise.bench.workloads import WorkItem


# -- continuous vs static batching --------------------------------------------------------------------------
def compare_batching(
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
    from chunkwise.bench.workloads import useful_work_fraction

    args = {**(engine_args or {}), "max_num_seqs": max_num_seqs}
    static = _engine(model, {**args, "batching": "static"})
    cont = _engine(model, {**args, "batching": "continuous"})
    results = interleave(
        [
            ("static", _runner(static, items, "static", progress, clock)),
            ("continuous", _runner(cont, items, "continuous", progress, clock)),
        ],
        repeats,
        log,
    )
    u = useful_work_fraction([it.output_len for it in items], max_num_seqs)
    return Comparison(
        "batching",
        results,
        [
            ratio(
                "continuous/static output throughput",
                results,
                "continuous",
                "static",
                "output_throughput",
                "3x or more",
            ),
            ratio("static/continuous mean e2e latency", results, "static", "continuous", "mean_e2el_ms"),
        ],
        info={
            "useful_work_fraction": u,
            "max_num_seqs": max_num_seqs,
            "num_requests": len(items),
            # Static batching computes a padding row per held slot of a finished request, as a real static batch does.
            "static_padding_share": padding_share(results["static"]),
            "continuous_padding_share": padding_share(results["continuous"]),
        },
    )


def padding_share(runs: Sequence[RunResult]) -> float:
    """Padding rows over all rows computed (real + padding), over the runs together."""
    pad = sum(r.counters.get("num_padding_rows", 0) for r in runs)
    real = sum(r.counters.get("num_rows", 0) for r in runs)
    return pad / max(1, pad + real)


# -- chunked vs unchunked prefill ---------------------------------------------------------------------------
def compare_chunked(
    model: str,
    items: Sequence[WorkItem],
    *,
    max_model_len: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    args = {**(engine_args or {}), "max_model_len": max_model_len}
    unchunked = _engine(
        model, {**args, "enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len}
    )
    chunked = _engine(model, {**args, "enable_chunked_prefill": True})
    results = interleave(
        [
            ("unchunked", _runner(unchunked, items, "unchunked", progress, clock)),
            ("chunked", _runner(chunked, items, "chunked", progress, clock)),
        ],
        repeats,
        log,
    )
    budget = chunked.config.scheduler.max_num_batched_tokens
    return Comparison(
        "chunked",
        results,
        [
            ratio("unchunked/chunked p99 ITL", results, "unchunked", "chunked", "p99_itl_ms", "5x or more"),
            ratio("unchunked/chunked max ITL", results, "unchunked", "chunked", "max_itl_ms"),
            ratio("unchunked/chunked max step time", results, "unchunked", "chunked", "max_step_ms"),
            ratio(
                "chunked/unchunked output throughput", results, "chunked", "unchunked", "output_throughput"
            ),
        ],
        info={"max_model_len": max_model_len, "chunked_budget": budget, "num_requests": len(items)},
    )


# -- prefix caching on vs off -------------------------------------------------------------------------------
def compare_prefix(
    model: str,
    items: Sequence[WorkItem],
    *,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    args = dict(engine_args or {})
    off = _engine(model, {**args, "enable_prefix_caching": False})
    on = _engine(model, {**args, "enable_prefix_caching": True})
    results = interleave(
        [
            ("off", _runner(off, items, "off", progress, clock)),
            ("on", _runner(on, items, "on", progress, clock)),
        ],
        repeats,
        log,
    )

    def prefill(r: RunResult) -> float:
        return float(r.counters["num_prefill_tokens"])

    saved = [1 - prefill(a) / prefill(b) for a, b in zip(results["on"], results["off"])]
    hit = [
        r.counters["prefix_cache_hits"] / max(1, r.counters["prefix_cache_queries"]) for r in results["on"]
    ]
    return Comparison(
        "prefix",
        results,
        [
            ratio("off/on prefill tokens computed", results, "off", "on", prefill),
            ratio("on/off output throughput", results, "on", "off", "output_throughput"),
            ratio("off/on mean TTFT", results, "off", "on", "mean_ttft_ms"),
        ],
        info={
            "prefill_tokens_saved_fraction": statistics.median(saved),
            "prefix_cache_hit_rate": statistics.median(hit),
            "num_requests": len(items),
        },
    )
