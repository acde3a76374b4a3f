"""One engine in its own process for `chunkwise bench compare vllm`, driven over JSON lines.

Run as a file, under whichever interpreter has the engine (vLLM lives in its own virtualenv, without
chunkwise):

    python peer_worker.py --engine chunkwise|vllm --model DIR --dtype float32 --cpus 1 [engine sizes]

so this module imports only the standard library at module level; each engine is imported inside its own
factory. The worker pins itself to --cpus before any engine is imported (threads started later inherit the
mask), starts the engine, runs a short warm-up, then answers one JSON line per command on stdin:

    (at start)                         -> {"ready": true, "startup_seconds": ..., "warmup_seconds": ..., ...}
    {"cmd": "run", "workload": PATH}   -> {"output_tokens": N, "prompt_tokens": P, "seconds": wall,
                                           "cpu_seconds": process CPU time, "tokens": [[ids], ...]}
    {"cmd": "quit"}                    -> {"bye": true}, then exit 0
    (a bad command or a failed run)    -> {"error": "..."}; the worker keeps serving

PATH is a JSONL workload (chunkwise.bench.workloads.save_jsonl): each line's prompt_token_ids and max_tokens;
every request is greedy with EOS ignored, so it produces exactly max_tokens tokens on either engine.

Engines print to stdout (vLLM's logger, tqdm, C extensions writing to fd 1). The protocol therefore goes out
on a private duplicate of the original stdout, and fd 1 itself is pointed at stderr before anything else
runs: nothing an engine prints can reach the protocol stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

ENGINES = ("chunkwise", "vllm")
DTYPES = ("float32", "bfloat16", "float16")

# Generate: prompts (token ids) and each one's max_tokens -> each one's output token ids.
# Each request's LoRA adapter by name (None: the base model), or None for a workload without adapters.
LoRAs = list[str | None] | None
Generate = Callable[[list[list[int]], list[int], LoRAs], list[list[int]]]


def parse_cpus(text: str) -> list[int]:
    """A CPU list as taskset -c and VLLM_CPU_OMP_THREADS_BIND write it: "1", "0,2", "0-3", "0-1,4"."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"bad CPU list {text!r}: expected e.g. 1, 0,2 or 0-3") from None
    if not cpus:
        raise ValueError(f"bad CPU list {text!r}: no CPUs")
    return sorted(cpus)


def split_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """`cpus` in `parts` consecutive equal shares, one per tensor-parallel rank."""
    if parts < 1 or len(cpus) % parts:
        raise ValueError(f"{len(cpus)} CPU(s) do not split evenly over {parts} rank(s)")
    k = len(cpus) // parts
    return [cpus[i * k : (i + 1) * k] for i in range(parts)]


def take_stdout() -> TextIO:
    """The protocol stream: a private copy of fd 1, with fd 1 (and sys.stdout) sent to stderr from now on."""
    sys.stdout.flush()
    private = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(private, "w", buffering=1, encoding="utf-8")


def send(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj, separators=(",", ":")) + "\n")
    out.flush()


def load_workload(path: str) -> tuple[list[list[int]], list[int], list[str | None]]:
    prompts: list[list[int]] = []
    max_tokens: list[int] = []
    loras: list[str | None] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            ids, n = obj.get("prompt_token_ids"), obj.get("max_tokens")
            if not isinstance(ids, list) or not ids or not isinstance(n, int) or n < 1:
                raise ValueError(f"{path}:{lineno}: each request needs prompt_token_ids and max_tokens >= 1")
            prompts.append([int(t) for t in ids])
            max_tokens.append(n)
            loras.append(obj.get("lora"))
    if not prompts:
        raise ValueError(f"{path}: no requests")
    return prompts, max_tokens, loras


# -- engines ------------------------------------------------------------------------------------------------
def chunkwise_engine(args: argparse.Namespace, threads: int) -> tuple[Generate, dict[str, Any]]:
    import torch

    torch.set_num_threads(threads)
    import chunkwise
    from chunkwise import LLM, LoRARequest, SamplingParams

    lora = {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        seed=0,
        **(lora if args.lora_modules else {}),
    )
    adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(args.lora_modules)}

    def generate(prompts: list[list[int]], max_tokens: list[int], loras: LoRAs = None) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        requests = [adapters[name] if name else None for name in loras or [None] * len(prompts)]
        outs = llm.generate(prompts, params, lora_request=requests)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, {"version": chunkwise.__version__, "torch": torch.__version__, "threads": threads}


def vllm_engine(args: argparse.Namespace, threads: int) -> tuple[Generate, dict[str, Any]]:
    # vLLM reads these at import. The engine core runs in this process (no multiprocessing), so this
    # process's CPU time is all of the engine's, and its threads are bound to the same cores.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
    # One CPU list per rank, "|" between them (vLLM's CPU worker binds rank r's threads to the r-th).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, part)) for part in split_cpus(parse_cpus(args.cpus), args.tensor_parallel_size)
    )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    lora = {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=0,
        **(lora if args.lora_modules else {}),
    )
    adapters = {}
    if args.lora_modules:
        from vllm.lora.request import LoRARequest

        adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(args.lora_modules)}

    def generate(prompts: list[list[int]], max_tokens: list[int], loras: LoRAs = None) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
            for n in max_tokens
        ]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        requests = [adapters[name] if name else None for name in loras or [None] * len(prompts)]
        outs = llm.generate(inputs, params, use_tqdm=False, lora_request=requests if adapters else None)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, {"version": vllm.__version__, "torch": torch.__version__, "threads": threads}


FACTORIES = {"chunkwise": chunkwise_engine, "vllm": vllm_engine}


# -- the loop -----------------------------------------------------------------------------------------------
def run_once(generate: Generate, path: str, with_tokens: bool) -> dict[str, Any]:
    prompts, max_tokens, loras = load_workload(path)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    outputs = generate(prompts, max_tokens, loras if any(loras) else None)
    seconds, cpu_seconds = time.perf_counter() - wall0, time.process_time() - cpu0
    reply: dict[str, Any] = {
        "output_tokens": sum(len(o) for o in outputs),
        "prompt_tokens": sum(len(p) for p in prompts),
        "num_requests": len(prompts),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }
    if with_tokens:
        reply["tokens"] = outputs
    return reply


def serve(generate: Generate, commands: TextIO, out: TextIO) -> int:
    for line in commands:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if not isinstance(cmd, dict):
                raise ValueError("a command is a JSON object")
        except ValueError as e:
            send(out, {"error": f"bad command {line.strip()[:200]!r}: {e}"})
            continue
        if cmd.get("cmd") == "quit":
            send(out, {"bye": True})
            return 0
        if cmd.get("cmd") != "run" or not isinstance(cmd.get("workload"), str):
            send(
                out,
                {"error": f'unknown command {cmd!r}; expected {{"cmd": "run", "workload": PATH}} or quit'},
            )
            continue
        try:
            send(out, run_once(generate, cmd["workload"], bool(cmd.get("tokens", True))))
        except Exception as e:
            traceback.print_exc()
            send(out, {"error": f"{type(e).__name__}: {e}"})
    return 0  # stdin closed: the harness is gone


def warm_up(generate: Generate) -> None:
    """A few short requests, so the first measured run pays for no first-touch allocation or lazy init."""
    generate([[3 + (i + j) % 200 for j in range(32)] for i in range(4)], [4] * 4, None)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=ENGINES, required=True, help="which engine this worker runs")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--dtype", choices=DTYPES, required=True, help="weights and activations dtype")
    p.add_argument("--cpus", default=None, help="CPU list to pin to, as taskset -c takes it (default: all)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most requests running at once (32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="step token budget (1024)")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output (2048)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache size in GiB (2)")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is sharded over, --cpus split (1)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lambda v: tuple(v.split("=", 1)),
        default=[],
        help="LoRA adapters NAME=PATH both engines serve (the workload's requests name them)",
    )
    p.add_argument("--max-loras", type=int, default=1, help="adapters resident at once (1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (16)")
    return p.parse_args(argv)


def drop_script_dir() -> None:
    """Run as a file, this directory comes first on sys.path, and its modules (serve.py, metrics.py,
    spec.py, ...) would shadow any top-level module of the same name that an engine's dependencies import."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


def main(argv: Sequence[str] | None = None) -> int:
    out = take_stdout()
    drop_script_dir()
    args = parse_args(argv)
    if args.cpus is not None:
        try:
            os.sched_setaffinity(0, parse_cpus(args.cpus))
        except (ValueError, OSError) as e:
            send(out, {"error": f"cannot pin to CPUs {args.cpus!r}: {e}"})
            return 2
    cpus = sorted(os.sched_getaffinity(0))
    if args.cpus is None:
        args.cpus = ",".join(map(str, cpus))
    t0 = time.perf_counter()
    try:
        generate, info = FACTORIES[args.engine](args, len(cpus))
        startup = time.perf_counter() - t0
        t1 = time.perf_counter()
        warm_up(generate)
        warmup = time.perf_counter() - t1
    except Exception as e:
        traceback.print_exc()
        send(out, {"error": f"{args.engine} failed to start: {type(e).__name__}: {e}"})
        return 1
    send(
        out,
        {
            "ready": True,
            "engine": args.engine,
            "dtype": args.dtype,
            "cpus": cpus,
            "startup_seconds": startup,
            "warmup_seconds": warmup,
            "pid": os.getpid(),
            **info,
        },
    )
    return serve(generate, sys.stdin, out)


if __name__ == "__main__":
    sys.exit(main())
