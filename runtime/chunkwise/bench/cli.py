"""`chunkwise bench ...`: the serving client, side-by-side comparisons that report ratios, and trace files.

    chunkwise bench serve --base-url http://127.0.0.1:8000 --model tiny --workload long-tailed --request-rate 4
    chunkwise bench compare batching|chunked|prefix|hf|sched-overhead|preemption [--model small]
    chunkwise bench compare vllm --vllm-python ~/vllm-venv/bin/python [--mode convoy]
    chunkwise bench workload --workload agent --num-requests 200 --out agent.jsonl

Everything heavy (torch, the engine, httpx, matplotlib) is imported inside the run functions, so that
`chunkwise --help` stays cheap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from chunkwise.argtypes import positive_float, positive_int

if TYPE_CHECKING:
    from chunkwise.bench.clock import ClockName
    from chunkwise.bench.compare import Comparison
    from chunkwise.bench.workloads import WorkItem

WORKLOADS = ("long-tailed", "agent", "convoy", "trace")
# On a 2-core machine shared with other work, one intra-op thread gives the steadiest timings (see
# docs/benchmarks.md); --threads changes it.
DEFAULT_THREADS = 1


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def _seconds_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated seconds, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_workload_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="long-tailed", help="the request shapes")
    g.add_argument("--trace", default=None, help="JSONL trace (with --workload trace)")
    g.add_argument("--num-requests", type=int, default=64, help="requests (streams, for convoy)")
    g.add_argument("--min-prompt", type=int, default=16, help="shortest prompt (tokens)")
    g.add_argument("--max-prompt", type=int, default=128, help="longest prompt (tokens)")
    g.add_argument("--median-output", type=int, default=32, help="median output length (long-tailed)")
    g.add_argument(
        "--sigma", type=float, default=1.0, help="log-normal sigma of output lengths (0: all equal)"
    )
    g.add_argument("--max-output", type=int, default=512, help="longest output")
    g.add_argument("--hide-lengths", action="store_true", help="the client gives no max_tokens (replay only)")
    g.add_argument("--system-len", type=int, default=1024, help="shared system prompt length (agent)")
    g.add_argument("--num-system-prompts", type=int, default=1, help="distinct system prompts (agent)")
    g.add_argument("--long-len", type=int, default=3000, help="injected long prompt length (convoy)")
    g.add_argument("--num-long", type=int, default=2, help="long prompts injected (convoy)")
    g.add_argument(
        "--long-at", type=_seconds_list, default=[2.0, 6.0], help="injection offsets in seconds (convoy)"
    )
    g.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests/s (default inf: all at once)"
    )
    g.add_argument("--burstiness", type=_rate, default=1.0, help="gamma shape of gaps: 1 Poisson, <1 bursty")
    g.add_argument("--burst-size", type=int, default=1, help="requests arriving together in each burst")
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    if defaults:
        p.set_defaults(**defaults)


def build_workload(ns: argparse.Namespace, vocab_size: int = 258) -> list[WorkItem]:
    from chunkwise.bench import workloads as w

    if ns.workload == "trace":
        if not ns.trace:
            raise SystemExit("--workload trace needs --trace FILE.jsonl")
        return w.load_jsonl(ns.trace)
    prompt = (ns.min_prompt, ns.max_prompt)
    if ns.workload == "agent":
        items = w.shared_prefix(
            ns.num_requests,
            vocab_size=vocab_size,
            system_len=ns.system_len,
            num_system_prompts=ns.num_system_prompts,
            suffix_len=prompt,
            output_len=(max(1, ns.median_output // 2), ns.median_output * 3 // 2),
            seed=ns.seed,
        )
    else:
        items = w.long_tailed(
            ns.num_requests,
            vocab_size=vocab_size,
            prompt_len=prompt,
            median_output=ns.median_output,
            sigma=ns.sigma,
            max_output=ns.max_output,
            seed=ns.seed,
            client_max_tokens=not ns.hide_lengths,
        )
    if ns.burst_size > 1:
        times = w.burst_arrivals(len(items), ns.request_rate, ns.burst_size, ns.seed)
    else:
        times = w.arrival_times(len(items), ns.request_rate, ns.burstiness, ns.seed)
    items = w.with_arrivals(items, times)
    if ns.workload == "convoy":
        items = w.with_long_prompts(
            items,
            vocab_size=vocab_size,
            num_long=ns.num_long,
            long_len=ns.long_len,
            at_s=ns.long_at,
            seed=ns.seed,
        )
    return items


def describe(items: Sequence[WorkItem]) -> str:
    from chunkwise.bench.workloads import offered_rate

    outs = sorted(it.output_len for it in items)
    prompts = sorted(len(it.prompt_token_ids or ()) for it in items)
    rate = offered_rate(items)
    return (
        f"{len(items)} requests; prompt tokens median {prompts[len(prompts) // 2]} max {prompts[-1]}; "
        f"output tokens median {outs[len(outs) // 2]} max {outs[-1]}; "
        f"arrivals {'all at once' if math.isinf(rate) else f'{rate:.2f}/s'}"
    )


def _common(p: argparse.ArgumentParser, model_default: str = "small") -> None:
    p.add_argument(
        "--model", default=model_default, help=f"built-in preset or HF directory ({model_default})"
    )
    p.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help=f"torch intra-op threads ({DEFAULT_THREADS})"
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved (2)")
    p.add_argument("--json", dest="json_out", default=None, help="write the results as JSON to this file")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--kv-cache-memory-bytes", type=int, default=None, help="KV cache per engine (default 512 MiB)"
    )
    p.add_argument(
        "--goodput", nargs="*", default=[], help="SLOs in ms for goodput: ttft:500 tpot:50 e2el:5000"
    )
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default=None,
        help="clock of the headline ratios: cpu (the engine thread's CPU time; default with --threads 1) or "
        "wall; both are recorded",
    )


def add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True)

    s = sub.add_parser("serve", help="drive an OpenAI-compatible endpoint and report latency and throughput")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default 127.0.0.1:8000)")
    s.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    s.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)"
    )
    s.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms: ttft:500 tpot:50 e2el:5000")
    s.add_argument("--no-ignore-eos", action="store_true", help="let the server stop at EOS")
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    s.add_argument("--json", dest="json_out", default=None, help="write the report as JSON to this file")
    s.add_argument("--plot-dir", default=None, help="write PNG plots here")
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_workload_args(s)

    wl = sub.add_parser("workload", help="write a generated workload as a JSONL trace")
    wl.add_argument("--out", required=True, help="the .jsonl file to write")
    add_workload_args(wl)

    c = sub.add_parser("compare", help="run configurations side by side on one workload and print ratios")
    csub = c.add_subparsers(dest="what", required=True)

    b = csub.add_parser("batching", help="continuous vs static batching on a long-tailed workload")
    _common(b)
    b.add_argument("--max-num-seqs", type=int, default=16, help="batch size of both (16)")
    add_workload_args(b, num_requests=48, max_output=256)

    ch = csub.add_parser("chunked", help="chunked vs unchunked prefill with long prompts injected")
    _common(ch)
    ch.add_argument("--max-model-len", type=int, default=4096, help="both engines' max_model_len (4096)")
    ch.add_argument(
        "--max-long-prefill-chunk",
        type=int,
        default=None,
        help="chunk cap for long prompts (half the budget)",
    )
    add_workload_args(
        ch,
        workload="convoy",
        num_requests=8,
        median_output=128,
        sigma=0.0,
        max_output=128,
        min_prompt=16,
        max_prompt=64,
    )

    px = csub.add_parser("prefix", help="prefix caching on vs off on a shared-system-prompt workload")
    _common(px)
    add_workload_args(
        px, workload="agent", num_requests=24, system_len=512, median_output=24, min_prompt=16, max_prompt=64
    )

    hf = csub.add_parser("hf", help="chunkwise vs transformers generate (padded static batches)")
    _common(hf)
    hf.add_argument("--concurrency", type=int, default=32, help="batch size of both (32)")
    add_workload_args(hf, num_requests=64, max_output=128)

    so = csub.add_parser(
        "sched-overhead",
        help="host work per step (schedule, prepare, sample, update, output) at a full batch",
    )
    _common(so)
    so.add_argument("--num-running", type=int, default=256, help="requests running at once (256)")
    so.add_argument("--prompt-len", type=int, default=32, help="prompt tokens each (32)")
    so.add_argument("--max-tokens", type=int, default=24, help="output tokens each (24)")
    so.set_defaults(repeats=1)

    pr = csub.add_parser("preemption", help="forced swap vs forced recompute preemption by context length")
    _common(pr)
    pr.add_argument("--contexts", type=_ints, default=[128, 512, 1024, 2048], help="context lengths")
    pr.set_defaults(repeats=3)

    vl = csub.add_parser(
        "vllm",
        help="chunkwise vs vLLM on one HF checkpoint, workload, dtype and pinned core",
        description="Both engines in their own processes, pinned to --cpus, on the same checkpoint (by "
        "default a random 57M-parameter Llama written to ~/.cache/chunkwise/bench), taking turns; prints "
        "chunkwise/vLLM ratios. throughput: offline output tok/s (defaults: 64 requests, 32-256-token "
        "prompts, long-tailed outputs, max_model_len 2048). convoy: both OpenAI servers driven by the same "
        "streaming client, 8 decoding streams (16-64-token prompts, 128 output tokens) with two 3000-token "
        "prompts injected at 2 s and 6 s (max_model_len 4096); reports the streams' p99 and max ITL and the "
        "long prompts' TTFT. vLLM runs under --vllm-python.",
    )
    vl.add_argument(
        "--mode",
        choices=["throughput", "convoy"],
        default="throughput",
        help="throughput: offline output tok/s; convoy: served, streams' ITL and long prompts' TTFT (throughput)",
    )
    vl.add_argument("--model", default=None, help="an existing HF model directory (default: the benchmark's)")
    vl.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where the benchmark checkpoint is written or reused (~/.cache/chunkwise/bench/llama-57m)",
    )
    vl.add_argument(
        "--dtype", default="float32,bfloat16", help="comma-separated dtypes, each compared (float32,bfloat16)"
    )
    vl.add_argument(
        "--cpus", default="1", help="CPU list both engines are pinned to, as taskset -c takes it (1)"
    )
    vl.add_argument(
        "--repeats", type=positive_int, default=2, help="runs per engine and dtype, alternating (2)"
    )
    vl.add_argument(
        "--vllm-python", default=sys.executable, help="the interpreter that has vllm (default: this one)"
    )
    vl.add_argument("--max-num-seqs", type=positive_int, default=32, help="both engines (32)")
    vl.add_argument("--max-num-batched-tokens", type=positive_int, default=1024, help="both engines (1024)")
    vl.add_argument(
        "--max-model-len", type=positive_int, default=None, help="both engines (2048; 4096 in convoy mode)"
    )
    vl.add_argument("--kv-cache-gib", type=positive_float, default=2.0, help="KV cache of each engine (2)")
    vl.add_argument("--json", dest="json_out", default=None, help="write the results as JSON to this file")
    vl.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    # Unset workload flags take the mode's defaults (chunkwise.bench.peer.MODE_DEFAULTS).
    add_workload_args(
        vl,
        workload=None,
        num_requests=None,
        min_prompt=None,
        max_prompt=None,
        median_output=None,
        sigma=None,
        max_output=None,
    )


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
    if what == "sched-overhead":

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
