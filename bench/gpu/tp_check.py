"""Tensor parallel on CUDA, checked on a machine with one GPU.

    PYTHONPATH=runtime python bench/gpu/tp_check.py --out DIR           # on the GPU, about a minute
    PYTHONPATH=runtime python bench/gpu/tp_check.py --smoke --out DIR   # tiny, on CPU

NCCL refuses two ranks on one GPU, so what one GPU can show is everything around the collectives:
1. tensor_parallel_size=2 over gloo, both ranks on the GPU (distributed_backend="gloo"), in float32, gives
   the greedy tokens and log-probs of tensor_parallel_size=1 (token_gate.py, 1e-3 nats);
2. each rank sized its KV cache from its own memory profile (gpu_memory_utilization: the profile step runs on
   every rank, since its forward's collectives need them all) and the ranks took the smallest count;
3. NCCL asked for more GPUs than the machine has is refused before any process starts, naming the sizes.
Writes DIR/tp_check.json and DIR/tp_check.md. Needs only torch, triton and this repository.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for _dir in (REPO / "runtime", Path(__file__).resolve().parent):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

import token_gate  # noqa: E402  (beside this file; stdlib only)

TOLERANCE = 1e-3  # float32: summation order across ranks moves log-probs by far less


def tokens(engine: Any, vocab: int) -> list[list[token_gate.Step]]:
    """Greedy output of six prompts of different lengths, each token with its top-5 log-probs."""
    from chunkwise.engine.datatypes.sampling_params import SamplingParams

    prompts = [[3 + (i * 37 + j * 11) % (vocab - 3) for j in range(5 + 9 * i)] for i in range(6)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"tp-{i}", p, sp)
    out: dict[str, list[token_gate.Step]] = {f"tp-{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            c = o.outputs[0]
            out[o.request_id] += [(lp.token_id, lp.logprob, list(lp.top)) for lp in c.logprobs or []]
    return [out[f"tp-{i}"] for i in range(len(prompts))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from chunkwise.engine import EngineCore
    from chunkwise.engine.datatypes.config import engine_config_from_kwargs

    device = "cpu" if args.smoke else "cuda"
    model = "tiny" if args.smoke else args.model
    common: dict[str, Any] = {
        "device": device,
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_batched_tokens": 64,  # the longer prompts take several chunks
        "enable_prefix_caching": False,
        # Both ranks on one GPU: each profile sees the other's memory as someone else's, so each asks for
        # under half of the device.
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": model,
        "gpus": torch.cuda.device_count(),
        "runs": {},
        "errors": [],
    }
    reference = None
    for name, extra in (
        ("tp1", {}),
        ("tp2-gloo", {"tensor_parallel_size": 2, "distributed_backend": "gloo"}),
    ):
        t0 = time.monotonic()
        engine = EngineCore(engine_config_from_kwargs(model, **common, **extra))
        try:
            got = tokens(engine, engine.model_info.vocab_size)
            entry: dict[str, Any] = {
                "start_and_run_s": round(time.monotonic() - t0, 1),
                "kv_blocks": engine.num_blocks,
                "graphs": engine.runner.graphs is not None,
            }
        finally:
            engine.close()
            # Its KV cache and graphs' memory go back before the next engine profiles the device.
            del engine
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        if reference is None:
            reference = got
        else:
            entry["token_check"] = token_gate.compare(
                reference, got, logprob_tol=TOLERANCE, tie_tol=TOLERANCE
            ).as_dict()
        report["runs"][name] = entry
        print(f"== {name}: {entry}", flush=True)
    report["orphans"] = [p.name for p in multiprocessing.active_children()]
    if device == "cuda" and torch.cuda.device_count() < 2:
        try:
            EngineCore(engine_config_from_kwargs(model, **common, tensor_parallel_size=2))
            report["nccl_refusal"] = None
        except ValueError as e:
            report["nccl_refusal"] = str(e)
        print(f"== nccl on {torch.cuda.device_count()} GPU(s): {report['nccl_refusal']}", flush=True)
    return report


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Tensor parallel on one GPU" + (" (smoke run on CPU)" if report.get("smoke") else ""),
        "",
        f"{report['device']}, torch {report['torch']}, model {report['model']} float32, {report['gpus']} GPU(s)",
        "",
        "| run | KV blocks | graphs | token check against tp1 (compared/positions, max abs dlogprob) | s |",
        "|---|---|---|---|---|",
    ]
    for name, r in report["runs"].items():
        check = r.get("token_check")
        shown = (
            "reference"
            if check is None
            else f"{'ok' if check['ok'] else 'FAILED'} ({check['compared']}/{check['positions']}, "
            f"{check['max_abs_logprob_diff']:.2e})"
        )
        lines.append(f"| {name} | {r['kv_blocks']} | {r['graphs']} | {shown} | {r['start_and_run_s']} |")
    if "nccl_refusal" in report:
        lines += ["", f"NCCL at tensor_parallel_size 2: {report['nccl_refusal'] or 'NOT refused'}"]
    lines += ["", f"worker processes left after close: {report['orphans'] or 'none'}"]
    lines += [f"- error: {e}" for e in report["errors"]]
    return "\n".join(lines) + "\n"


def ok(report: dict[str, Any]) -> bool:
    checks = [r["token_check"] for r in report["runs"].values() if "token_check" in r]
    return (
        not report["errors"]
        and len(checks) == 1
        and all(c["ok"] and c["compared"] == c["positions"] > 0 for c in checks)
        and not report["orphans"]
        and report.get("nccl_refusal", "refused") is not None
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for tp_check.json and tp_check.md")
    p.add_argument("--smoke", action="store_true", help="the tiny model on CPU, to check the code paths")
    p.add_argument("--model", default="small", help="a built-in preset or a checkpoint directory (GPU run)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each rank's (one shared GPU)")
    p.add_argument("--budget-s", type=float, default=0.0, help="accepted for first_run.py; unused")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        report = run(args)
    except Exception:
        report = {"device": "?", "torch": "?", "model": args.model, "gpus": 0, "runs": {}, "orphans": []}
        report["errors"] = [traceback.format_exc()[-2000:]]
    report["smoke"] = args.smoke
    report["ok"] = ok(report)
    (out / "tp_check.json").write_text(json.dumps(report, indent=2))
    (out / "tp_check.md").write_text(render(report))
    print(render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
