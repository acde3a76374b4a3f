"""Offline output throughput of the chunkwise tree on PYTHONPATH, for side-by-side runs of two trees:

    for t in OLD NEW; do PYTHONPATH=$t/runtime taskset -c 1 .venv/bin/python bench/cpu/offline_ab.py float32 $t; done

The 57M Llama of `chunkwise bench compare vllm` (written there on first use), 64 prompts of 32-255 random
tokens and log-normal output lengths (at most 401), greedy with EOS ignored; a short warm-up run first.

`--clock cpu` times the run on this process's CPU time (time.process_time) instead of the wall clock: on a
machine shared with other work, tokens per CPU second of the engine's own (one-thread) process move far less
with the load than tokens per wall second.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from chunkwise import LLM, SamplingParams

MODEL = Path.home() / ".cache" / "chunkwise" / "bench" / "llama-57m"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dtype", choices=["float32", "bfloat16"])
    p.add_argument("label", help="printed before the figure (which tree this is)")
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = p.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if not (args.model / "config.json").exists():
        raise SystemExit(
            f"{args.model} has no config.json: run `chunkwise bench compare vllm` once to write it"
        )
    llm = LLM(
        model=str(args.model),
        dtype=args.dtype,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        max_model_len=2048,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randrange(32, 256))] for _ in range(64)]
    params = [
        SamplingParams(
            max_tokens=min(400, int(rng.lognormvariate(3.6, 0.8))) + 1, temperature=0, ignore_eos=True
        )
        for _ in prompts
    ]
    llm.generate(prompts[:4], params[:4])
    start = clock()
    outs = llm.generate(prompts, params)
    seconds = clock() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"{args.label} {args.dtype} {tokens / seconds:.1f} tok/s ({tokens} tokens, {seconds:.2f} s, {args.clock} clock)"
    )


if __name__ == "__main__":
    main()
