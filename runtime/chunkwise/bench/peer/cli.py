"""`chunkwise bench compare vllm` from its parsed flags: the modes' defaults, the checks, the workload,
and the printed report."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkwise.bench.peer.base import PeerError, PeerReport, PeerSettings, check_vllm
from chunkwise.bench.peer.convoy import compare_convoy, http_serve
from chunkwise.bench.peer.offline import compare_throughput, process_workers
from chunkwise.bench.peer.served import (
    compare_served,
    http_served,
    http_warm_up,
    vllm_client,
    vllm_random_shape,
)
from chunkwise.bench.peer.servers import process_servers
from chunkwise.bench.workloads import WorkItem
from chunkwise.engine.model.bundled import resolve_model_path

if TYPE_CHECKING:
    import argparse

MODES = ("throughput", "convoy", "served")

# Defaults that differ between the modes (the CLI leaves these flags unset and fills them in here).
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "throughput": {
        "workload": "long-tailed",
        "num_requests": 64,
        "min_prompt": 32,
        "max_prompt": 256,
        "median_output": 32,
        "sigma": 1.0,
        "max_output": 512,
        "max_model_len": 2048,
        "max_num_seqs": 32,
    },
    # The streams ask for as many tokens as fit beside their prompts: the client cuts them once the last long
    # prompt has its first token, and convoy_metrics refuses a stream that ended before.
    "convoy": {
        "workload": "convoy",
        "num_requests": 8,
        "min_prompt": 16,
        "max_prompt": 64,
        "median_output": 4000,
        "sigma": 0.0,
        "max_output": 4000,
        "max_model_len": 4096,
        "max_num_seqs": 32,
    },
    # vLLM's `vllm bench serve --dataset-name random --random-input-len 256 --random-output-len 128
    # --num-prompts 400 --max-concurrency 64 --ignore-eos`, on the bundled pylm, with room for all 64 to run.
    "served": {
        "model": "pylm",
        "workload": "long-tailed",
        "num_requests": 400,
        "min_prompt": 256,
        "max_prompt": 256,
        "median_output": 128,
        "sigma": 0.0,
        "max_output": 128,
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "max_concurrency": 64,
        # Sampled, as both servers do when a client sends no temperature (vllm bench serve sends none).
        "temperature": 1.0,
    },
}


# -- printing -------------------------------------------------------------------------------------------------
def format_report(report: PeerReport) -> str:
    lines: list[str] = []
    if report.mode == "throughput":
        lines.append(f"{'run':<28}{'output tok/s':>14}{'tok/s of CPU':>14}{'wall s':>10}{'CPU s':>10}")
        for r in report.runs:
            name = f"{r['engine']} {r['dtype']} #{r['repeat'] + 1}"
            lines.append(
                f"{name:<28}{r['output_throughput']:>14.1f}{r['cpu_output_throughput']:>14.1f}"
                f"{r['seconds']:>10.1f}{r['cpu_seconds']:>10.1f}"
            )
    elif report.mode == "convoy":
        lines.append(
            f"{'run':<28}{'p99 ITL in window ms':>22}{'max in window ms':>18}{'steady p50 ms':>15}"
            f"{'long TTFT ms':>22}"
        )
        for r in report.runs:
            name = f"{r['engine']} {r['dtype']} #{r['repeat'] + 1}"
            ttft = ", ".join(f"{t:.0f}" for t in r["long_ttft_ms"])
            lines.append(
                f"{name:<28}{r['window_p99_itl_ms']:>22.1f}{r['window_max_itl_ms']:>18.1f}"
                f"{r['steady_p50_itl_ms']:>15.1f}{ttft:>22}"
            )
    else:
        lines.append(
            f"{'run':<28}{'output tok/s':>14}{'mean TPOT ms':>14}{'median TPOT ms':>16}{'p99 ITL ms':>12}"
            f"{'mean TTFT ms':>14}"
        )
        for r in report.runs:
            name = f"{r['engine']} {r['dtype']} #{r['repeat'] + 1}"
            lines.append(
                f"{name:<28}{r['output_throughput']:>14.1f}{r['mean_tpot_ms']:>14.2f}{r['median_tpot_ms']:>16.2f}"
                f"{r['p99_itl_ms']:>12.2f}{r['mean_ttft_ms']:>14.1f}"
            )
    for key, value in report.info.items():
        lines.append(f"{key}: {json.dumps(value)}")
    lines += [ratio.line() for ratio in report.ratios]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------------------
def resolve_mode_defaults(args: argparse.Namespace) -> None:
    """Fill the flags the user left unset with the mode's defaults (MODE_DEFAULTS)."""
    for key, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def parse_dtypes(text: str) -> list[str]:
    from chunkwise.bench.peer_worker import DTYPES

    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"--dtype {text!r}: expected a comma-separated list of {', '.join(DTYPES)}")
    return list(dict.fromkeys(dtypes))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_from_args(args: argparse.Namespace) -> int:
    """`chunkwise bench compare vllm`, from its parsed flags (see chunkwise.bench.cli)."""
    import argparse as _argparse

    from chunkwise.bench.checkpoint import CheckpointSpec, ensure_checkpoint
    from chunkwise.bench.peer_worker import parse_cpus
    from chunkwise.bench.workload_args import build_workload, describe

    resolve_mode_defaults(args)
    try:
        dtypes = parse_dtypes(args.dtype)
        cpus = parse_cpus(args.cpus)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    allowed = sorted(os.sched_getaffinity(0))
    if not set(cpus) <= set(allowed):
        raise SystemExit(
            f"--cpus {args.cpus}: CPU(s) {sorted(set(cpus) - set(allowed))} not available (have {allowed})"
        )
    if args.tensor_parallel_size > 1 and args.mode != "throughput":
        raise SystemExit("--tensor-parallel-size applies to the throughput mode (chunkwise serves it too)")
    if len(cpus) % args.tensor_parallel_size:
        raise SystemExit(
            f"--cpus {args.cpus}: {len(cpus)} CPU(s) do not split evenly over --tensor-parallel-size "
            f"{args.tensor_parallel_size}"
        )
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.lora_adapters and args.mode != "throughput":
        raise SystemExit("--lora-adapters applies to the throughput mode")
    if args.mode == "convoy" and args.workload != "convoy":
        raise SystemExit("--mode convoy runs the convoy workload (--workload convoy)")
    if args.mode != "convoy" and args.workload == "convoy":
        raise SystemExit("the convoy workload needs the convoy's metrics: use --mode convoy")
    if args.mode != "served" and (
        args.max_concurrency is not None or args.vllm_client or args.temperature is not None
    ):
        raise SystemExit("--max-concurrency, --temperature and --vllm-client apply to --mode served")
    if args.mode == "served" and args.temperature is not None and args.temperature < 0:
        raise SystemExit(f"--temperature must be at least 0, got {args.temperature}")
    try:
        version = check_vllm(args.vllm_python)
    except PeerError as e:
        raise SystemExit(str(e)) from None
    _log(f"vLLM {version} under {args.vllm_python}")

    if args.model:
        model = resolve_model_path(args.model)
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
        made = False
    else:
        try:
            model, made = ensure_checkpoint(CheckpointSpec(), args.checkpoint_dir, log=_log)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if not made:
            _log(f"reusing the benchmark checkpoint in {model}")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    settings = PeerSettings(
        model=str(model.resolve()),
        cpus=args.cpus,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        tensor_parallel_size=args.tensor_parallel_size,
        vllm_python=args.vllm_python,
    )
    # Kept afterwards: it holds the engines' logs, which are what one reads when a ratio looks wrong.
    workdir = Path(tempfile.mkdtemp(prefix="chunkwise-peer-"))
    names: list[str] = []
    if args.lora_adapters:
        from chunkwise.bench.lora import write_random_adapter

        names = [f"adapter-{i}" for i in range(args.lora_adapters)]
        modules = tuple(
            (name, str(write_random_adapter(model, workdir / "adapters" / name, args.lora_rank, seed=i)))
            for i, name in enumerate(names)
        )
        # Every adapter resident at once in both engines: the comparison is of the per-row work.
        settings = dataclasses.replace(
            settings, lora_modules=modules, max_loras=len(names), max_lora_rank=args.lora_rank
        )
        _log(f"{len(names)} LoRA adapter(s) of rank {args.lora_rank} in {workdir / 'adapters'}")

    def make_workload(rep: int) -> list[WorkItem]:
        from chunkwise.bench.lora import spread_over_adapters

        # A fresh seed per repeat: no engine ever sees a prompt (or a prefix) twice.
        items = build_workload(
            _argparse.Namespace(**{**vars(args), "seed": args.seed + rep}), vocab_size=vocab
        )
        return spread_over_adapters(items, names, args.lora_zipf, args.seed + rep)

    first = make_workload(0)
    too_long = [it for it in first if len(it.token_ids()) + it.output_len > args.max_model_len]
    if too_long:
        raise SystemExit(
            f"{len(too_long)} request(s) need more than --max-model-len {args.max_model_len} tokens "
            f"(prompt + output); raise it or shorten the workload"
        )
    if args.mode == "served" and args.vllm_client:
        try:
            vllm_random_shape(first)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    _log(f"workload: {describe(first)}; {args.repeats} repeat(s), a fresh seed each")
    _log(f"workloads and engine logs in {workdir}")
    load_before = os.getloadavg()[0]
    if args.mode == "throughput":
        report = compare_throughput(
            make_workload, dtypes, args.repeats, process_workers(settings, workdir, _log), workdir, _log
        )
    elif args.mode == "convoy":
        report = compare_convoy(
            make_workload,
            dtypes,
            args.repeats,
            args.long_len,
            process_servers(settings, workdir, _log),
            http_serve(not args.no_progress, args.long_len),
            _log,
        )
    else:
        if args.vllm_client:
            client = vllm_client(
                settings,
                workdir,
                args.max_concurrency,
                args.seed,
                not args.no_progress,
                _log,
                temperature=args.temperature,
            )
        else:
            client = http_served(not args.no_progress, args.max_concurrency, temperature=args.temperature)
        report = compare_served(
            make_workload,
            dtypes,
            args.repeats,
            process_servers(settings, workdir, _log),
            client,
            http_warm_up(),
            _log,
        )
        report.info["client"] = "vllm bench serve" if args.vllm_client else "chunkwise.bench.serve"
        report.info["max_concurrency"] = args.max_concurrency
        report.info["temperature"] = args.temperature
    report.info.update(
        {
            "model": settings.model,
            "cpus": args.cpus,
            "settings": {k: v for k, v in asdict(settings).items() if not k.endswith("python")},
            "vllm_python": args.vllm_python,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "logs": str(workdir),
        }
    )
    print(format_report(report))
    if args.json_out:
        out = report.as_dict()
        out["workload"] = describe(first)
        out["command"] = " ".join(sys.argv)
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
        _log(f"wrote {args.json_out}")
    return 0
