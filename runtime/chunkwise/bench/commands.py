"""The `chunkwise bench` commands, from their parsed flags (the parser is chunkwise.bench.cli): serve,
workload, and the in-process comparisons; `compare vllm` runs in chunkwise.bench.peer."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from chunkwise.bench.workload_args import build_workload, describe

if TYPE_CHECKING:
    from chunkwise.bench.clock import ClockName
    from chunkwise.bench.compare import Comparison
    from chunkwise.bench.workloads import WorkItem


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        return _serve(args)
    if args.bench_command == "workload":
        return _workload(args)
    if args.what == "vllm":
        from chunkwise.bench.peer import run_from_args

        return run_from_args(args)
    return _compare(args)


def _workload(args: argparse.Namespace) -> int:
    from chunkwise.bench.workloads import save_jsonl

    items = build_workload(args)
    save_jsonl(items, args.out)
    print(f"wrote {args.out}: {describe(items)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import httpx

    from chunkwise.bench.metrics import format_report, parse_slos
    from chunkwise.bench.serve import _base, run_serve

    slos = parse_slos(args.goodput)
    model = args.model
    if model is None:
        try:
            model = httpx.get(f"{_base(args.base_url)}/v1/models", timeout=10).json()["data"][0]["id"]
        except Exception as e:
            raise SystemExit(f"cannot ask {args.base_url} for its model ({e}); give --model") from None
    items = build_workload(args)
    _log(f"workload: {describe(items)}")
    result = run_serve(
        args.base_url,
        items,
        model=model,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout,
        ignore_eos=not args.no_ignore_eos,
        progress=not args.no_progress,
    )
    report = result.report(slos)
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {**report, "model": model, "base_url": args.base_url, "workload": describe(items)},
                f,
                indent=2,
            )
    if args.plot_dir:
        from chunkwise.bench.plots import write_plots

        for path in write_plots({"serve": result}, args.plot_dir, "serve"):
            _log(f"wrote {path}")
    return 0 if report["completed"] else 1


def _print_comparison(cmp: Comparison, slos: dict[str, float]) -> None:
    from chunkwise.bench.compare import noise

    keys = ("output_throughput", "mean_ttft_ms", "p99_itl_ms", "max_step_ms", "duration")
    print(f"{'run':<16}" + "".join(f"{k:>20}" for k in keys))
    for name, runs in cmp.results.items():
        for i, r in enumerate(runs):
            rep = r.report(slos)
            print(
                f"{name + ' #' + str(i + 1):<16}"
                + "".join(f"{rep.get(k, float('nan')):>20.2f}" for k in keys)
            )
    for k, v in cmp.info.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    for ratio in cmp.ratios:
        print(ratio.line())
    for name, by_clock in noise(cmp.results).items():
        spreads = ", ".join(f"{spread:.0%} on the {c} clock" for c, spread in by_clock.items())
        print(f"noise: {name} output throughput varied across repeats by {spreads}")
    for n in cmp.notes:
        print(f"note: {n}")


def _compare(args: argparse.Namespace) -> int:
    import torch

    from chunkwise.bench import compare as cmpmod
    from chunkwise.bench.clock import check_clock
    from chunkwise.bench.metrics import parse_slos

    torch.set_num_threads(args.threads)
    try:
        clock = check_clock(args.clock or ("cpu" if args.threads == 1 else "wall"), args.threads)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    slos = parse_slos(args.goodput)
    progress = not args.no_progress
    engine_args: dict[str, Any] = {}
    if args.kv_cache_memory_bytes:
        engine_args["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    info = cmpmod.machine_info()
    _log(
        f"torch threads {info['torch_threads']}, {info['cpus']} CPUs, load average {info['loadavg_1m']:.2f}; "
        f"headline clock: {clock}"
    )
    what = args.what
    if what == "preemption":
        return _preemption(args, engine_args, clock)
    run: Callable[[], Comparison]
    items: list[WorkItem] = []
    if what in ("fairness", "priority"):
        from chunkwise.bench.compare.tenants import compare_fairness, compare_priority
        from chunkwise.bench.workloads import two_tenants

        # The vocabulary every generated workload draws from (build_workload's): the built-in models' bytes.
        items = two_tenants(
            vocab_size=258,
            burst_requests=args.burst_requests,
            steady_requests=args.steady_requests,
            steady_interval_s=args.steady_interval_seconds,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            seed=args.seed,
        )
        if what == "priority":
            items = [dataclasses.replace(it, priority=1 if it.tenant == "burst" else 0) for it in items]
        _log(f"workload: {describe(items)}")
        compare = compare_fairness if what == "fairness" else compare_priority

        def run() -> Comparison:
            return compare(
                args.model,
                items,
                max_num_seqs=args.max_num_seqs,
                repeats=args.repeats,
                engine_args=engine_args,
                progress=progress,
                log=_log,
                clock=clock,
            )
    elif what == "sched-overhead":

        def run() -> Comparison:
            return cmpmod.scheduler_overhead(
                args.model,
                num_running=args.num_running,
                prompt_len=args.prompt_len,
                max_tokens=args.max_tokens,
                repeats=args.repeats,
                engine_args=engine_args,
                progress=progress,
                log=_log,
                clock=clock,
            )
    else:
        items = build_workload(args)
        _log(f"workload: {describe(items)}")
        common = {
            "repeats": args.repeats,
            "engine_args": engine_args,
            "progress": progress,
            "log": _log,
            "clock": clock,
        }
        if what == "batching":

            def run() -> Comparison:
                return cmpmod.compare_batching(args.model, items, max_num_seqs=args.max_num_seqs, **common)
        elif what == "chunked":
            if args.max_long_prefill_chunk:
                engine_args["max_long_prefill_chunk"] = args.max_long_prefill_chunk

            def run() -> Comparison:
                return cmpmod.compare_chunked(args.model, items, max_model_len=args.max_model_len, **common)
        elif what == "prefix":

            def run() -> Comparison:
                return cmpmod.compare_prefix(args.model, items, **common)
        elif what == "offload":
            from chunkwise.bench.compare.tenants import compare_offloading

            engine_args["max_num_seqs"] = args.max_num_seqs

            def run() -> Comparison:
                return compare_offloading(
                    args.model,
                    items,
                    num_blocks=args.num_blocks,
                    kv_offloading_size=args.kv_offloading_size,
                    **common,
                )
        elif what == "quantization":
            from chunkwise.bench.compare.quantization import compare_quantization, quantization_quality

            engine_args["dtype"] = args.dtype

            def run() -> Comparison:
                result = compare_quantization(
                    args.model,
                    items,
                    quantization=args.quantization,
                    max_num_seqs=args.max_num_seqs,
                    **common,
                )
                if not args.no_quality:
                    result.info["quality"] = quantization_quality(
                        args.model, args.quantization, dtype=args.dtype, log=_log
                    )
                return result
        else:

            def run() -> Comparison:
                return cmpmod.compare_hf(args.model, items, concurrency=args.concurrency, **common)

    result = run()
    info_after = cmpmod.machine_info()
    result.info["loadavg_1m_before_after"] = [info["loadavg_1m"], info_after["loadavg_1m"]]
    result.info["torch_threads"] = info["torch_threads"]
    _print_comparison(result, slos)
    if args.json_out:
        out = result.as_dict(slos)
        out["workload"] = describe(items) if items else ""
        out["command"] = " ".join(sys.argv)
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot_dir:
        from chunkwise.bench.plots import write_plots

        last = {name: runs[-1] for name, runs in result.results.items()}
        for path in write_plots(last, args.plot_dir, what):
            _log(f"wrote {path}")
    return 0


def _preemption(args: argparse.Namespace, engine_args: dict[str, Any], clock: ClockName) -> int:
    import statistics

    from chunkwise.bench.compare import compare_preemption, crossover

    timings, info = compare_preemption(
        args.model, args.contexts, repeats=args.repeats, engine_args=engine_args, log=_log, clock=clock
    )
    print(f"clock: {clock}")
    by = {(t.context, t.mode): statistics.median(t.extra_seconds) for t in timings}
    pred = info["predicted_s"]
    print(f"{'context':>8} {'swap ms':>10} {'recompute ms':>14} {'model swap':>12} {'model recomp':>14}")
    for i, ctx in enumerate(args.contexts):
        print(
            f"{ctx:>8} {by[(ctx, 'swap')] * 1000:>10.1f} {by[(ctx, 'recompute')] * 1000:>14.1f} "
            f"{pred['swap'][i] * 1000:>12.1f} {pred['recompute'][i] * 1000:>14.1f}"
        )
    swap = [by[(c, "swap")] for c in args.contexts]
    rec = [by[(c, "recompute")] for c in args.contexts]
    cross = crossover(args.contexts, swap, rec)
    model_cross = crossover(args.contexts, pred["swap"], pred["recompute"])

    def verdict(c: float | None, s: list[float], r: list[float]) -> str:
        if c is not None:
            return f"{c:.0f} tokens"
        cheaper = "swap" if s[0] < r[0] else "recompute"
        return f"none in {args.contexts[0]}-{args.contexts[-1]} tokens: {cheaper} is cheaper at every length"

    print(f"measured crossover: {verdict(cross, swap, rec)}")
    print(
        "recompute/swap cost by context: "
        + ", ".join(f"{c}: {r / s:.1f}x" for c, s, r in zip(args.contexts, swap, rec))
    )
    print(f"engine cost model's crossover: {verdict(model_cross, pred['swap'], pred['recompute'])}")
    print(f"rates: {info['rates']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "what": "preemption",
                    "contexts": args.contexts,
                    "measured_median_s": {"swap": swap, "recompute": rec},
                    "measured_all_s": {f"{t.mode}@{t.context}": t.extra_seconds for t in timings},
                    "crossover_tokens": cross,
                    "model_crossover_tokens": model_cross,
                    **info,
                    "command": " ".join(sys.argv),
                },
                f,
                indent=2,
            )
    return 0
