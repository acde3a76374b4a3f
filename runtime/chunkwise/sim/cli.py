"""`chunkwise replay ...`: the scheduler on a virtual clock.

chunkwise replay calibrate --model small --out small-cpu.json     # time real steps, fit the cost model
chunkwise replay profiles                                         # the built-in (derived) GPU profiles
chunkwise replay run --profile small-cpu.json --workload long-tailed --num-requests 2000 --request-rate 4
chunkwise replay compare batching|estimator|routers|chunked --profile llama3-8b-h100
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkwise.bench.results import RunResult
    from chunkwise.bench.workloads import WorkItem
    from chunkwise.sim.profile import Profile

ROUTER_NAMES = ("round-robin", "least-loaded", "predicted-completion")
# The scheduler options a replay can vary (SchedulerConfig's, plus prefix caching).
_SCHED_OPTIONS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "batching",
    "preemption_mode",
    "output_length_estimator",
    "output_length_quantile",
    "max_long_prefill_chunk",
)


def _sched_args(p: argparse.ArgumentParser) -> None:
    from chunkwise.engine.args import add_engine_args

    # The engine's own flags (help and defaults from its config), but for the two the profile sizes.
    add_engine_args(p, _SCHED_OPTIONS, title="replica (the engine's flags, same defaults)")
    g = p.add_argument_group("replica sizing")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the profile's")
    g.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per replica (default: the profile's)"
    )
    g.add_argument("--replicas", type=int, default=1, help="replicas behind the router (1)")
    g.add_argument("--router", choices=ROUTER_NAMES, default="round-robin")


def add_replay_args(p: argparse.ArgumentParser) -> None:
    from chunkwise.bench.cli import add_workload_args

    sub = p.add_subparsers(dest="replay_command", required=True)
    c = sub.add_parser("calibrate", help="time real steps of chosen shapes and write a profile (JSON)")
    c.add_argument("--model", default="small", help="built-in preset or HF directory (small)")
    c.add_argument("--out", required=True, help="profile file to write")
    c.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    c.add_argument("--repeats", type=int, default=1, help="runs of each calibration workload (1)")
    c.add_argument("--quick", action="store_true", help="smaller calibration workloads")
    c.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default=None,
        help="cpu (the engine thread's CPU time; default with one thread on a CPU device) or wall",
    )
    c.add_argument("--max-model-len", type=int, default=None, help="engine max_model_len")
    c.add_argument("--num-blocks", type=int, default=None, help="engine KV blocks (the profile's default)")
    c.add_argument("--device", default=None, help="cpu or cuda[:N]")
    c.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])

    sub.add_parser("profiles", help="list the built-in profiles")

    r = sub.add_parser("run", help="replay a workload and report it like `bench serve`")
    r.add_argument("--profile", required=True, help="profile JSON or a built-in name (see `replay profiles`)")
    r.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms: ttft:500 tpot:50 e2el:5000")
    r.add_argument("--json", dest="json_out", default=None)
    r.add_argument("--plot-dir", default=None)
    _sched_args(r)
    add_workload_args(r)

    cmp = sub.add_parser("compare", help="compare configurations in the simulator (deterministic)")
    cmp.add_argument("what", choices=["batching", "estimator", "routers", "chunked"])
    cmp.add_argument("--profile", required=True)
    cmp.add_argument(
        "--seeds", type=int, default=3, help="workload seeds to replay each configuration on (3)"
    )
    cmp.add_argument("--goodput", nargs="*", default=[])
    cmp.add_argument("--json", dest="json_out", default=None)
    cmp.add_argument("--plot-dir", default=None)
    _sched_args(cmp)
    add_workload_args(cmp)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _prefix_caching(ns: argparse.Namespace) -> bool:
    from chunkwise.engine.datatypes.config import CacheConfig

    flag = ns.enable_prefix_caching  # None when not given: the engine's default
    return CacheConfig().enable_prefix_caching if flag is None else bool(flag)


def _config_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    names = [n for n in _SCHED_OPTIONS if n != "enable_prefix_caching"] + ["max_model_len"]
    kw = {n: getattr(ns, n) for n in names if getattr(ns, n) is not None}
    if kw.get("enable_chunked_prefill") is False and "max_num_batched_tokens" not in kw:
        kw["max_num_batched_tokens"] = kw.get("max_model_len") or ns.profile_obj.max_model_len
    return kw


def run_replay_cli(args: argparse.Namespace) -> int:
    if args.replay_command == "calibrate":
        return _calibrate(args)
    from chunkwise.sim.profile import BUILTIN_PROFILES, load_profile

    if args.replay_command == "profiles":
        for name in BUILTIN_PROFILES:
            p = load_profile(name)
            print(f"{name}: {p.num_blocks * p.block_size} KV tokens; {p.source}")
        return 0
    try:
        args.profile_obj = load_profile(args.profile)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.replay_command == "run":
        return _run(args)
    return _compare(args)


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from chunkwise.bench.clock import check_clock
    from chunkwise.sim.calibrate import calibrate

    torch.set_num_threads(args.threads)
    device = args.device or "cpu"
    default_clock = "cpu" if args.threads == 1 and device == "cpu" else "wall"
    try:
        clock = check_clock(args.clock or default_clock, args.threads, device)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    engine_args = {
        k: getattr(args, k) for k in ("max_model_len", "num_blocks", "device", "dtype") if getattr(args, k)
    }
    profile = calibrate(
        args.model,
        engine_args=engine_args,
        repeats=args.repeats,
        quick=args.quick,
        progress=True,
        clock=clock,
    )
    profile.save(args.out)
    m = profile.meta
    for r in m["runs"]:
        print(
            f"{r['run']:<14} {r['steps']:5d} steps  measured {r['measured_s']:8.2f} s  "
            f"fit {r['fit_s']:8.2f} s  ({r['fit_error']:+.1%})"
        )
    print(f"per-step fit: median |error| {m['step_fit_median_abs_error']:.1%}")
    for k, v in m["coefficients"].items():
        print(f"  {k:<22} {v:.3e}")
    print(f"wrote {args.out} ({profile.source})")
    return 0


def _workload(args: argparse.Namespace, profile: Profile) -> list[WorkItem]:
    from chunkwise.bench.cli import build_workload, describe

    items = build_workload(args)
    _log(f"workload: {describe(items)}")
    return items


def _replay(args: argparse.Namespace, items: list[WorkItem], name: str, **changes: Any) -> RunResult:
    from chunkwise.sim.replay import replay, scheduler_config

    profile = args.profile_obj
    kw = {
        **_config_kwargs(args),
        **{k: v for k, v in changes.items() if k not in ("router", "replicas", "prefix")},
    }
    return replay(
        items,
        profile,
        scheduler_config(profile, **kw),
        num_replicas=changes.get("replicas", args.replicas),
        router=changes.get("router", args.router),
        num_blocks=args.num_blocks,
        enable_prefix_caching=changes.get("prefix", _prefix_caching(args)),
        name=name,
    )


def _run(args: argparse.Namespace) -> int:
    from chunkwise.bench.metrics import format_report, parse_slos

    slos = parse_slos(args.goodput)
    items = _workload(args, args.profile_obj)
    result = _replay(args, items, "replay")
    report = result.report(slos)
    print(format_report(report, title="Replay Result (simulated)"))
    print(f"profile: {args.profile_obj.name} ({args.profile_obj.source})")
    print(
        f"replicas {args.replicas}, router {args.router}; preemptions {report['num_preemptions']}; "
        f"replayed in {report['wall_seconds']:.1f} s of wall time"
    )
    if result.steps:
        # The scheduler here is the engine's own code: its CPU time per step is a real measurement.
        top = max(s.num_running for s in result.steps)
        full = sorted(s.schedule_s for s in result.steps if s.num_running == top)
        report["schedule_cpu_at_max_running"] = {
            "num_running": top,
            "steps": len(full),
            "median_ms": full[len(full) // 2] * 1000,
            "p99_ms": full[min(len(full) - 1, int(0.99 * len(full)))] * 1000,
        }
        print(
            f"scheduler CPU time per step with {top} running: median {full[len(full) // 2] * 1000:.3f} ms, "
            f"p99 {report['schedule_cpu_at_max_running']['p99_ms']:.3f} ms over {len(full)} steps"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot_dir:
        from chunkwise.bench.plots import write_plots

        for path in write_plots({"replay": result}, args.plot_dir, "replay"):
            _log(f"wrote {path}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    import statistics

    from chunkwise.bench.metrics import parse_slos

    slos = parse_slos(args.goodput)
    configs: list[tuple[str, dict[str, Any]]]
    hide = False
    if args.what == "batching":
        configs = [("static", {"batching": "static"}), ("continuous", {"batching": "continuous"})]
    elif args.what == "estimator":
        hide = True
        configs = [
            ("mean", {"output_length_estimator": "mean"}),
            ("p90", {"output_length_estimator": "quantile", "output_length_quantile": 0.9}),
            ("max", {"output_length_estimator": "quantile", "output_length_quantile": 1.0}),
        ]
    elif args.what == "routers":
        configs = [(r, {"router": r}) for r in ROUTER_NAMES]
    else:
        mml = args.max_model_len or args.profile_obj.max_model_len
        configs = [
            ("unchunked", {"enable_chunked_prefill": False, "max_num_batched_tokens": mml}),
            ("chunked", {"enable_chunked_prefill": True}),
        ]
    base_seed = args.seed
    results: dict[str, list[RunResult]] = {name: [] for name, _ in configs}
    for k in range(args.seeds):
        ns = argparse.Namespace(**vars(args))
        ns.seed = base_seed + k
        ns.hide_lengths = hide or args.hide_lengths
        items = _workload(ns, args.profile_obj)
        for name, changes in configs:
            results[name].append(_replay(args, items, name, **changes))
    keys = ("output_throughput", "mean_ttft_ms", "p99_itl_ms", "num_preemptions", "duration")
    print(f"profile: {args.profile_obj.name} ({args.profile_obj.source})")
    print(f"{'config':<22}" + "".join(f"{k:>20}" for k in keys))
    summary: dict[str, Any] = {}
    for name, runs in results.items():
        reps = [r.report(slos) for r in runs]
        med = {k: statistics.median(float(rep[k]) for rep in reps) for k in keys}
        per_req = statistics.median(rep["num_preemptions"] / max(1, rep["completed"]) for rep in reps)
        summary[name] = {**med, "preemptions_per_request": per_req, "runs": reps}
        for err in sorted({e for rep in reps for e in rep.get("errors", [])}):
            _log(f"{name}: failed requests: {err}")
        print(
            f"{name:<22}"
            + "".join(f"{med[k]:>20.2f}" for k in keys)
            + f"   preemptions/request {per_req:.3f}"
        )
    first = configs[0][0]
    for name, _ in configs[1:]:
        vals = [
            b.report()["output_throughput"] / max(a.report()["output_throughput"], 1e-12)
            for a, b in zip(results[first], results[name])
        ]
        print(
            f"{name}/{first} output throughput: {statistics.median(vals):.2f}x (median over {len(vals)} seeds, "
            f"range {min(vals):.2f}-{max(vals):.2f})"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "what": args.what,
                    "profile": args.profile_obj.name,
                    "source": args.profile_obj.source,
                    "command": " ".join(sys.argv),
                    "results": summary,
                },
                f,
                indent=2,
            )
    if args.plot_dir:
        from chunkwise.bench.plots import write_plots

        for path in write_plots(
            {n: runs[0] for n, runs in results.items()}, args.plot_dir, f"replay_{args.what}"
        ):
            _log(f"wrote {path}")
    return 0
