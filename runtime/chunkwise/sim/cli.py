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
    from chunkwise.sim.replay import Scaling

# sim/fleet.py's names (kept here so that `--help` imports nothing heavy; a test holds them equal).
ROUTER_NAMES = ("predicted-completion", "round-robin", "least-loaded", "prefix-affinity", "llm-d")
PREFIX_INDEXES = ("exact", "estimate")
AUTOSCALER_NAMES = ("chunkwise", "keda-queue", "hpa-kv")
# A fleet's replica when none is named: Llama-3-8B on an H200, derived from datasheet peaks (every report
# prints the profile's provenance).
DEFAULT_PROFILE = "llama3-8b-h200"
# The scheduler options a replay can vary (SchedulerConfig's, plus prefix caching and its host tier).
_SCHED_OPTIONS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "kv_offloading_size",
    "batching",
    "preemption_mode",
    "output_length_estimator",
    "output_length_quantile",
    "max_long_prefill_chunk",
)


def _sched_args(p: argparse.ArgumentParser) -> None:
    from chunkwise.argtypes import positive_float
    from chunkwise.engine.args import add_engine_args

    # The engine's own flags (help and defaults from its config), but for the two the profile sizes.
    add_engine_args(p, _SCHED_OPTIONS, title="replica (the engine's flags, same defaults)")
    g = p.add_argument_group("replica sizing")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the profile's")
    g.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per replica (default: the profile's)"
    )
    g.add_argument("--replicas", type=int, default=1, help="replicas behind the router (1)")
    a = p.add_argument_group(
        "autoscaling (the fleet's size follows an autoscaler; --replicas is where it starts)"
    )
    a.add_argument(
        "--autoscaler",
        choices=AUTOSCALER_NAMES,
        default=None,
        help="chunkwise: the operator's own decision (chunkwise_operator/autoscale.py); keda-queue: KEDA on "
        "queue depth; hpa-kv: HPA on KV-cache usage (default: none, a fixed fleet)",
    )
    a.add_argument(
        "--min-replicas", type=int, default=1, help="autoscaler's floor (1; 0 allows scale to zero)"
    )
    a.add_argument("--max-replicas", type=int, default=8, help="autoscaler's ceiling (8)")
    a.add_argument(
        "--cold-start-seconds",
        type=float,
        default=None,
        help="from asking for a replica to its first request: image pull, weights, warm-up (default: the "
        "profile's kind: 120 for a GPU profile, an 8B model; 20 for a CPU one)",
    )
    a.add_argument(
        "--autoscale-interval-seconds",
        type=positive_float,
        default=15.0,
        help="how often the autoscaler decides (15: the operator's and HPA's period)",
    )
    a.add_argument(
        "--scale-to-zero-after-seconds",
        type=float,
        default=300.0,
        help="chunkwise autoscaler: idle time before scaling to zero, with --min-replicas 0 (300)",
    )

    g = p.add_argument_group("router (chunkwise router's own policies, and llm-d's default scorers)")
    g.add_argument(
        "--router",
        choices=ROUTER_NAMES,
        default="round-robin",
        help="routing policy (round-robin); llm-d: its endpoint picker's default scoring (router/llmd.py)",
    )
    g.add_argument(
        "--prefix-index",
        choices=PREFIX_INDEXES,
        default="exact",
        help="what chunkwise's policies believe each replica caches: exact (its KV events, read at each "
        "scrape; the default) or estimate (the prompts the router sent there); llm-d keeps its own",
    )
    g.add_argument(
        "--scrape-interval-ms",
        type=positive_float,
        default=None,
        help="how often the router reads each replica's metrics (and KV events); default: as deployed, "
        "500 for chunkwise's router (--poll-interval-seconds), 50 for llm-d's endpoint picker",
    )


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
    r.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"profile JSON or a built-in name (see `replay profiles`; default {DEFAULT_PROFILE}, derived)",
    )
    r.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms: ttft:500 tpot:50 e2el:5000")
    r.add_argument("--json", dest="json_out", default=None)
    r.add_argument("--plot-dir", default=None)
    _sched_args(r)
    add_workload_args(r)

    fb = sub.add_parser(
        "fleet-bench",
        help="routers at fleet scale: the routing benchmark's workloads scaled to N replicas, at a fraction "
        "of the fleet's capacity (sim/fleet_bench.py)",
    )
    fb.add_argument(
        "--profile", default=DEFAULT_PROFILE, help=f"profile JSON or built-in name ({DEFAULT_PROFILE})"
    )
    fb.add_argument("--replicas", default="8,32,128,256", help="fleet sizes, comma-separated (8,32,128,256)")
    fb.add_argument(
        "--workloads", default="agent,mixed,tenants", help="comma-separated (agent,mixed,tenants)"
    )
    fb.add_argument("--loads", default="0.7,0.9", help="offered load, fractions of capacity (0.7,0.9)")
    fb.add_argument(
        "--routers",
        default="predicted-completion+exact,predicted-completion+estimate,llm-d",
        help="comma-separated, NAME or NAME+exact|estimate (the prefix index); the last is the baseline "
        "(predicted-completion+exact,predicted-completion+estimate,llm-d)",
    )
    fb.add_argument(
        "--prefix-index",
        choices=PREFIX_INDEXES,
        default="exact",
        help="for routers named without one (exact)",
    )
    fb.add_argument("--requests-per-replica", type=int, default=300, help="requests per replica (300)")
    fb.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="TTFT SLO for goodput (1000)")
    fb.add_argument("--seed", type=int, default=0)
    fb.add_argument("--json", dest="json_out", default=None, help="append each cell's results (JSONL)")

    cmp = sub.add_parser("compare", help="compare configurations in the simulator (deterministic)")
    cmp.add_argument("what", choices=["batching", "estimator", "routers", "chunked", "autoscalers"])
    cmp.add_argument("--profile", default=DEFAULT_PROFILE, help=f"as for run (default {DEFAULT_PROFILE})")
    cmp.add_argument(
        "--seeds", type=int, default=3, help="workload seeds to replay each configuration on (3)"
    )
    cmp.add_argument("--goodput", nargs="*", default=[])
    cmp.add_argument("--json", dest="json_out", default=None)
    cmp.add_argument("--plot-dir", default=None)
    _sched_args(cmp)
    add_workload_args(cmp)

    # `replay validate` (sim/validate.py): exits 0 whatever the ratios; with --strict, 1 when one misses.
    from chunkwise.engine.args import add_engine_args
    from chunkwise.sim.validate import ENGINE_OPTIONS

    v = sub.add_parser(
        "validate",
        help="run a workload on the real engine and replay it on a profile calibrated alongside; print "
        "replay/real of mean and p99 TTFT, mean TPOT and output throughput against the 5%% goal",
    )
    v.add_argument("--model", default="tiny", help="built-in preset or HF directory (tiny)")
    v.add_argument("--profile", default=None, help="a saved profile (JSON) to replay instead of calibrating")
    v.add_argument("--rounds", type=int, default=4, help="real runs, each beside the calibration runs (4)")
    v.add_argument("--warmup-rounds", type=int, default=1, help="unrecorded rounds first (1)")
    v.add_argument("--quick", action="store_true", help="the smaller calibration workloads")
    v.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1; the cpu clock needs 1)")
    v.add_argument(
        "--clock", choices=["cpu", "wall"], default=None, help="cpu (default with 1 thread) or wall"
    )
    v.add_argument("--goal", type=float, default=0.05, help="largest |ratio - 1| that passes (0.05)")
    v.add_argument("--strict", action="store_true", help="exit 1 when a ratio misses the goal")
    v.add_argument("--json", dest="json_out", default=None, help="write the result (and the profile) as JSON")
    v.add_argument("--save-profile", default=None, help="write the profile calibrated here (JSON)")
    add_engine_args(v, ENGINE_OPTIONS, title="engine (the real run's; the replay uses the same)")
    add_workload_args(v)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# Of _SCHED_OPTIONS, the cache's (CacheConfig's): each replica's KVCacheManager takes them, not the scheduler.
_CACHE_OPTIONS = ("enable_prefix_caching", "kv_offloading_size")


def _tier_blocks(ns: argparse.Namespace, profile: Profile) -> int:
    """--kv-offloading-size (GiB) in the profile's KV blocks: each replica's host tier."""
    gib = ns.kv_offloading_size or 0.0
    return int(gib * (1 << 30)) // (profile.kv_bytes_per_token * profile.block_size)


def _prefix_caching(ns: argparse.Namespace) -> bool:
    from chunkwise.engine.datatypes.config import CacheConfig

    flag = ns.enable_prefix_caching  # None when not given: the engine's default
    return CacheConfig().enable_prefix_caching if flag is None else bool(flag)


def _config_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    names = [n for n in _SCHED_OPTIONS if n not in _CACHE_OPTIONS] + ["max_model_len"]
    kw = {n: getattr(ns, n) for n in names if getattr(ns, n) is not None}
    if kw.get("enable_chunked_prefill") is False and "max_num_batched_tokens" not in kw:
        kw["max_num_batched_tokens"] = kw.get("max_model_len") or ns.profile_obj.max_model_len
    return kw


def run_replay_cli(args: argparse.Namespace) -> int:
    if args.replay_command == "calibrate":
        return _calibrate(args)
    if args.replay_command == "validate":
        return _validate(args)
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
    if args.replay_command == "fleet-bench":
        return _fleet_bench(args)
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
    from chunkwise.sim.fleet import RouterSpec
    from chunkwise.sim.replay import replay, scheduler_config

    profile = args.profile_obj
    kw = {
        **_config_kwargs(args),
        **{k: v for k, v in changes.items() if k not in ("router", "replicas", "prefix", "autoscaler")},
    }
    return replay(
        items,
        profile,
        scheduler_config(profile, **kw),
        num_replicas=changes.get("replicas", args.replicas),
        router=RouterSpec(
            policy=changes.get("router", args.router),
            prefix_index=args.prefix_index,
            scrape_interval_s=args.scrape_interval_ms / 1000 if args.scrape_interval_ms else None,
        ),
        num_blocks=args.num_blocks,
        enable_prefix_caching=changes.get("prefix", _prefix_caching(args)),
        num_tier_blocks=_tier_blocks(args, profile),
        name=name,
        scaling=_scaling(args, changes.get("autoscaler", args.autoscaler)),
    )


def _scaling(args: argparse.Namespace, name: str | None) -> Scaling | None:
    from chunkwise.sim.autoscaling import make_autoscaler
    from chunkwise.sim.replay import Scaling, default_cold_start_s

    if name is None:
        return None
    cold = args.cold_start_seconds
    if cold is None:
        cold = default_cold_start_s(args.profile_obj)
    kw: dict[str, Any] = {
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "cold_start_s": cold,
    }
    if name == "chunkwise":
        kw["scale_to_zero_after_s"] = args.scale_to_zero_after_seconds
    try:
        autoscaler = make_autoscaler(name, **kw)
        return Scaling(autoscaler, interval_s=args.autoscale_interval_seconds, cold_start_s=cold)
    except ValueError as e:
        raise SystemExit(f"--autoscaler {name}: {e}") from None


def _run(args: argparse.Namespace) -> int:
    from chunkwise.bench.metrics import format_report, parse_slos

    slos = parse_slos(args.goodput)
    items = _workload(args, args.profile_obj)
    result = _replay(args, items, "replay")
    report = result.report(slos)
    print(format_report(report, title="Replay Result (simulated)"))
    print(f"profile: {args.profile_obj.name} ({args.profile_obj.source})")
    if "autoscaler" in report:
        print(_scaling_line(report))
    print(
        f"replicas {args.replicas}, router {report['router']} ({report['prefix_index']} index); preemptions {report['num_preemptions']}; "
        f"replayed in {report['wall_seconds']:.1f} s of wall time"
    )
    queries = result.counters.get("prefix_cache_queries", 0)
    if queries:
        c = result.counters
        print(
            f"prefix cache: {c['prefix_cache_hits'] / queries:.1%} of prompt tokens hit, "
            f"{c['host_cache_hits'] / queries:.1%} from the host tier ({c['host_cache_restores']} blocks "
            f"restored, {c['host_cache_offloads']} offloaded)"
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


def _scaling_line(report: dict[str, Any]) -> str:
    attained = (
        report.get("request_goodput", 0.0)
        * report["duration"]
        / max(1, report["completed"] + report["failed"])
    )
    slo = f"SLO attainment {attained:.1%}; " if "slos_ms" in report else ""
    return (
        f"autoscaler {report['autoscaler']} (cold start {report['cold_start_s']:.0f} s): {slo}"
        f"{report['replica_seconds']:.0f} replica-seconds, at most {report['max_replicas']} replicas, "
        f"{len(report['scale_events'])} scale events"
    )


def _compare_autoscalers(args: argparse.Namespace) -> int:
    """Every autoscaler on the same requests: SLO attainment against replica-seconds."""
    from chunkwise.bench.metrics import parse_slos

    slos = parse_slos(args.goodput)
    if not slos:
        raise SystemExit("compare autoscalers needs --goodput SLOs (e.g. ttft:2000) to count attainment")
    items = _workload(args, args.profile_obj)
    rows = []
    print(f"profile: {args.profile_obj.name} ({args.profile_obj.source})")
    print(f"{'autoscaler':<14}{'SLO attained':>14}{'replica-s':>12}{'max replicas':>14}{'p99 TTFT ms':>14}")
    for name in AUTOSCALER_NAMES:
        rep = _replay(args, items, name, autoscaler=name).report(slos)
        attained = (
            rep.get("request_goodput", 0.0) * rep["duration"] / max(1, rep["completed"] + rep["failed"])
        )
        rows.append({"autoscaler": name, "slo_attainment": attained, **rep})
        print(
            f"{name:<14}{attained:>14.1%}{rep['replica_seconds']:>12.0f}{rep['max_replicas']:>14d}"
            f"{rep['p99_ttft_ms']:>14.0f}"
        )
        _log(_scaling_line(rep))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"what": "autoscalers", "command": " ".join(sys.argv), "results": rows}, f, indent=2)
    return 0


def _compare(args: argparse.Namespace) -> int:
    import statistics

    from chunkwise.bench.metrics import parse_slos

    if args.what == "autoscalers":
        return _compare_autoscalers(args)
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


def _fleet_bench(args: argparse.Namespace) -> int:
    import dataclasses

    from chunkwise.sim.fleet import RouterSpec
    from chunkwise.sim.fleet_bench import format_table, run_cell

    def names(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    try:
        sizes = [int(x) for x in names(args.replicas)]
        loads = [float(x) for x in names(args.loads)]
        routers = [RouterSpec.parse(r, args.prefix_index) for r in names(args.routers)]
    except ValueError as e:
        raise SystemExit(f"fleet-bench: {e}") from None
    if len(routers) < 2:
        raise SystemExit("fleet-bench: --routers needs a candidate and a baseline")
    from chunkwise.sim.fleet_bench import WORKLOADS

    unknown = [w for w in names(args.workloads) if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"fleet-bench: unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    if args.requests_per_replica < 1 or any(n < 1 for n in sizes) or not all(x > 0 for x in loads):
        raise SystemExit("fleet-bench: --replicas, --requests-per-replica and --loads must be positive")
    results = []
    for n in sizes:
        for w in names(args.workloads):
            for load in loads:
                _log(f"{w}: {n} replicas at {load:.0%} of capacity ...")
                cell = run_cell(
                    w,
                    n,
                    load,
                    routers,
                    args.profile_obj,
                    requests_per_replica=args.requests_per_replica,
                    ttft_slo_ms=args.ttft_slo_ms,
                    seed=args.seed,
                )
                for c in cell:
                    _log(
                        f"  {c.router:<22} p99 TTFT {c.p99_ttft_ms:9.1f} ms  mean {c.mean_ttft_ms:8.1f} ms  "
                        f"hits {c.hit_ratio:.2f}  SLO {c.slo_attainment:.1%}  ({c.requests} requests at "
                        f"{c.rate:.0f}/s, replayed in {c.wall_s:.1f} s)"
                    )
                    if args.json_out:
                        with open(args.json_out, "a") as f:
                            f.write(json.dumps(dataclasses.asdict(c)) + "\n")
                results += cell
    print(f"profile: {args.profile_obj.name} ({args.profile_obj.source})")
    print(format_table(results, baseline=routers[-1].label, candidates=[r.label for r in routers[:-1]]))
    return 0


def _validate(args: argparse.Namespace) -> int:
    """`replay validate` (sim/validate.py). Exit status 0 whatever the ratios, so that a measurement is never
    an error; with --strict, 1 when any ratio misses --goal."""
    import torch

    from chunkwise.bench.cli import build_workload, describe
    from chunkwise.bench.clock import check_clock
    from chunkwise.sim.profile import load_profile
    from chunkwise.sim.validate import ENGINE_OPTIONS, run_validation

    if args.rounds < 1 or args.warmup_rounds < 0:
        raise SystemExit("--rounds must be at least 1 and --warmup-rounds at least 0")
    torch.set_num_threads(args.threads)
    try:
        clock = check_clock(args.clock or ("cpu" if args.threads == 1 else "wall"), args.threads)
        profile = load_profile(args.profile) if args.profile else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    items = build_workload(args)
    if any(it.max_tokens is None for it in items):
        raise SystemExit(
            "validate runs the workload on the real engine, which needs each request's max_tokens"
        )
    _log(f"workload: {describe(items)}")
    engine_args = {n: getattr(args, n) for n in ENGINE_OPTIONS if getattr(args, n) is not None}
    try:
        result = run_validation(
            args.model,
            engine_args,
            items,
            args.rounds,
            profile=profile,
            quick=args.quick,
            clock=clock,
            workload=args.workload,
            progress=True,
            goal=args.goal,
            warmup_rounds=args.warmup_rounds,
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(result.table())
    if args.save_profile and result.calibrated:
        result.profile.save(args.save_profile)
        _log(f"wrote {args.save_profile}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**result.to_json(), "command": " ".join(["chunkwise", *sys.argv[1:]])}, f, indent=2)
    return 1 if args.strict and not result.passed else 0
