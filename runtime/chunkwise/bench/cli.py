"""`chunkwise bench ...`: the serving client, side-by-side comparisons that report ratios, and trace files.

    chunkwise bench serve --base-url http://127.0.0.1:8000 --model tiny --workload long-tailed --request-rate 4
    chunkwise bench compare batching|chunked|prefix|fairness|priority|offload|hf|sched-overhead|preemption|quantization [--model small]
    chunkwise bench compare vllm --vllm-python ~/vllm-venv/bin/python [--mode convoy|served]
    chunkwise bench workload --workload agent --num-requests 200 --out agent.jsonl

Everything heavy (torch, the engine, httpx, matplotlib) is imported inside the run functions, so that
`chunkwise --help` stays cheap.

The parser is built here (and the workload flags in workload_args.py); the commands it dispatches to
run in commands.py.
"""

from __future__ import annotations

import argparse
import sys

from chunkwise.argtypes import non_negative_int, positive_float, positive_int
from chunkwise.bench.commands import run_bench
from chunkwise.bench.workload_args import WORKLOADS, add_workload_args, build_workload, describe

__all__ = [
    "DEFAULT_THREADS",
    "WORKLOADS",
    "add_bench_args",
    "add_workload_args",
    "build_workload",
    "describe",
    "run_bench",
]

# On a 2-core machine shared with other work, one intra-op thread gives the steadiest timings (see
# docs/benchmarks.md); --threads changes it.
DEFAULT_THREADS = 1


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


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


def _two_tenants(p: argparse.ArgumentParser) -> None:
    """The workload of `compare fairness` and `compare priority` (bench.workloads.two_tenants)."""
    p.add_argument("--max-num-seqs", type=int, default=4, help="batch of both: the contended seats (4)")
    p.add_argument("--burst-requests", type=positive_int, default=48, help="the burst tenant's requests (48)")
    p.add_argument(
        "--steady-requests", type=positive_int, default=12, help="the steady tenant's requests (12)"
    )
    p.add_argument(
        "--steady-interval-seconds",
        type=positive_float,
        default=0.5,
        help="seconds between the steady tenant's requests (0.5)",
    )
    p.add_argument(
        "--prompt-len", type=positive_int, default=128, help="prompt tokens of every request (128)"
    )
    p.add_argument("--output-len", type=positive_int, default=32, help="output tokens of every request (32)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")


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

    fa = csub.add_parser(
        "fairness",
        help="--fairness vtc vs none: one tenant's burst beside another's steady stream",
        description="Tenant 'burst' sends --burst-requests at once; tenant 'steady' one request every "
        "--steady-interval-seconds (on the headline clock). Both engines take turns on the same workload. "
        "Reports the steady tenant's p99 TTFT (none/vtc), the burst's (vtc/none) and output throughput.",
    )
    _common(fa)
    _two_tenants(fa)
    pp = csub.add_parser(
        "priority",
        help="--scheduling-policy priority vs fcfs: a steady stream at priority 0 beside a burst at 1",
        description="The workload of `compare fairness`, the steady tenant's requests at priority 0 and the "
        "burst's at 1 (the fcfs engine runs them all at 0). Reports the steady stream's p99 TTFT "
        "(fcfs/priority), the burst's (priority/fcfs) and output throughput.",
    )
    _common(pp)
    _two_tenants(pp)

    of = csub.add_parser(
        "offload",
        help="the prefix cache's host tier on vs off with a device cache too small for the prefixes",
        description="Agent traffic (shared system prompts) on two engines with the same --num-blocks device "
        "cache, one with a host tier of --kv-offloading-size GiB, taking turns. The defaults size the device "
        "cache at a third of the system prompts' blocks (9 x 512 tokens = 288 blocks of 16; 96 blocks).",
    )
    _common(of)
    of.add_argument("--num-blocks", type=positive_int, default=96, help="device KV blocks of both (96)")
    of.add_argument("--kv-offloading-size", type=positive_float, default=1.0, help="the host tier in GiB (1)")
    of.add_argument("--max-num-seqs", type=positive_int, default=2, help="batch of both (2)")
    add_workload_args(
        of,
        workload="agent",
        num_requests=72,
        system_len=512,
        num_system_prompts=9,
        median_output=16,
        min_prompt=16,
        max_prompt=48,
        request_rate=4.0,
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

    qz = csub.add_parser(
        "quantization",
        help="a model with --quantization against its full-precision self: decode speed and output quality",
        description="The same checkpoint and dtype with and without --quantization, taking turns on a "
        "decode-heavy workload at --max-num-seqs (output tok/s and TPOT ratios); then, unless --no-quality, "
        "greedy agreement from held-out prompts and per-token log-probabilities of held-out text under both "
        "(the bundled pylm's held-out split of the Python standard library).",
    )
    _common(qz, model_default="pylm")
    qz.add_argument("--quantization", default="int8", choices=["int8", "fp8"], help="(int8)")
    qz.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="(bfloat16)")
    qz.add_argument("--max-num-seqs", type=int, default=16, help="decode batch of both (16)")
    qz.add_argument("--no-quality", action="store_true", help="speed only")
    add_workload_args(qz, num_requests=32, median_output=128, sigma=0.0, max_output=128, max_prompt=64)

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
        "streaming client, 8 decoding streams (16-64-token prompts, up to 4000 output tokens, cut when the "
        "window closes) with two 3000-token prompts injected at 2 s and 6 s (max_model_len 4096); reports the "
        "streams' p99 and max ITL inside the window (first long prompt's arrival to the last one's first "
        "token), their steady p50 ITL outside it, and the long prompts' TTFT. served: both OpenAI servers "
        "(the bundled pylm unless --model) driven by one client at --max-concurrency on vLLM's random shape "
        "(400 requests, 256-token prompts, 128 output tokens, EOS ignored; max_num_seqs 64); reports output "
        "tok/s, mean and median TPOT, p99 ITL and mean TTFT; --vllm-client measures with `vllm bench serve` "
        "instead. vLLM runs under --vllm-python.",
    )
    vl.add_argument(
        "--mode",
        choices=["throughput", "convoy", "served"],
        default="throughput",
        help="throughput: offline output tok/s; convoy: served, streams' ITL and long prompts' TTFT; "
        "served: one client at a fixed concurrency, output tok/s, TPOT, ITL (throughput)",
    )
    vl.add_argument(
        "--model",
        default=None,
        help="an existing HF model directory or a bundled model's name (default: the benchmark's; pylm in "
        "served mode)",
    )
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
    vl.add_argument(
        "--max-num-seqs", type=positive_int, default=None, help="both engines (32; 64 in served mode)"
    )
    vl.add_argument("--max-num-batched-tokens", type=positive_int, default=1024, help="both engines (1024)")
    vl.add_argument(
        "--max-model-len", type=positive_int, default=None, help="both engines (2048; 4096 in convoy mode)"
    )
    vl.add_argument("--kv-cache-gib", type=positive_float, default=2.0, help="KV cache of each engine (2)")
    vl.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks each engine shards the model over (throughput mode), the --cpus split evenly between "
        "them (1)",
    )
    vl.add_argument(
        "--lora-adapters",
        type=non_negative_int,
        default=0,
        help="throughput mode: serve this many random LoRA adapters in both engines (every projection, "
        "--lora-rank) and give every request one by Zipf popularity; 0: the base model alone (0)",
    )
    vl.add_argument("--lora-rank", type=positive_int, default=8, help="the adapters' rank (8)")
    vl.add_argument(
        "--lora-zipf", type=positive_float, default=1.0, help="the k-th adapter's weight is 1/k^s (1.0)"
    )
    vl.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="served mode: most requests the client keeps in flight, as vllm bench serve's (64)",
    )
    vl.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="served mode: the requests' temperature (1.0: what both servers use when a client sends none, "
        "as vllm bench serve sends none unless told; 0 for greedy)",
    )
    vl.add_argument(
        "--vllm-client",
        action="store_true",
        help="served mode: measure each server with vLLM's own `vllm bench serve` (under --vllm-python, "
        "its random dataset in the workload's shape) instead of chunkwise's client",
    )
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
