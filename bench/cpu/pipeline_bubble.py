"""The pipeline bubble at pipeline_parallel_size=2: each stage's busy time against the step's wall time.

    PYTHONPATH=runtime taskset -c 0,1 .venv/bin/python bench/cpu/pipeline_bubble.py

Without micro-batching the stages run one after the other within a step: stage 1 waits for stage 0's hidden
states, and stage 0 (rank 0, which also schedules and samples) waits for stage 1's logits, so each stage idles
about (PP - 1) / PP of the step. This measures it: every rank records, per step, when its step began and ended
and how long it sat blocked in a pipeline receive (stage 1: the hidden states; rank 0: the logits); busy is
the step less that wait. Rank 0's step is ModelRunner.execute (scheduling's host work is outside it); a
worker's is ModelRunner.follow. Each rank is pinned to its own core, one torch thread each.

The 57M Llama of `chunkwise bench compare vllm` (written there on first use); 16 prompts of 128 random
tokens, 64 greedy tokens each, max_num_seqs 16: a few prefill steps, then decode steps of 16 rows.

The instrumentation lives here, not in the engine: a spawned worker re-imports this file as its main module,
so the patches below are applied on every rank.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from chunkwise import LLM, SamplingParams
from chunkwise.engine.distributed.pipeline import PipelineStage
from chunkwise.engine.worker.model_runner import ModelRunner

MODEL = Path.home() / ".cache" / "chunkwise" / "bench" / "llama-57m"
LOG_DIR_ENV = "CHUNKWISE_PP_BUBBLE_DIR"

_wait = [0.0]  # this process's seconds blocked in a pipeline receive, during the current step
_pinned = [False]


def _pin() -> None:
    """Rank r on core r (of the cores this process may use), one torch thread."""
    if _pinned[0] or not dist.is_initialized():
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[dist.get_rank() % len(cores)]})
    torch.set_num_threads(1)
    _pinned[0] = True


def _timed_receive(name: str) -> None:
    original = getattr(PipelineStage, name)

    def receive(self: PipelineStage, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _wait[0] += time.perf_counter() - t0

    setattr(PipelineStage, name, receive)


def _timed_step(name: str) -> None:
    original = getattr(ModelRunner, name)

    def step(self: ModelRunner, arg: Any) -> Any:
        _pin()
        so = arg if name == "execute" else arg.so
        _wait[0] = 0.0
        t0 = time.perf_counter()
        result = original(self, arg)
        t1 = time.perf_counter()
        log_dir = os.environ.get(LOG_DIR_ENV)
        if log_dir and so.scheduled and dist.is_initialized():
            with open(Path(log_dir) / f"rank{dist.get_rank()}.txt", "a") as f:
                f.write(f"{t0} {t1} {_wait[0]} {so.num_batched_tokens}\n")
        return result

    setattr(ModelRunner, name, step)


for _name in ("recv_hidden", "recv_logits"):
    _timed_receive(_name)
for _name in ("execute", "follow"):
    _timed_step(_name)


def _read(path: Path) -> list[tuple[float, float, float, int]]:
    rows = []
    for line in path.read_text().splitlines():
        t0, t1, wait, tokens = line.split()
        rows.append((float(t0), float(t1), float(wait), int(tokens)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    if not (args.model / "config.json").exists():
        raise SystemExit(
            f"{args.model} has no config.json: run `chunkwise bench compare vllm` once to write it"
        )
    with tempfile.TemporaryDirectory() as log_dir:
        os.environ[LOG_DIR_ENV] = log_dir
        llm = LLM(
            model=str(args.model),
            dtype="float32",
            pipeline_parallel_size=2,
            max_num_seqs=args.prompts,
            max_num_batched_tokens=1024,
            max_model_len=1024,
        )
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], sp)  # warm-up
        # Rank 0's own lines are written by now (a worker's last may still be on its way): the timed steps
        # are rank 0's lines after these, and each worker's last as many.
        warm = len(_read(Path(log_dir) / "rank0.txt"))
        start = time.perf_counter()
        llm.generate(prompts, sp)
        seconds = time.perf_counter() - start
        llm.engine.close()
        rank0 = _read(Path(log_dir) / "rank0.txt")[warm:]
        rank1 = _read(Path(log_dir) / "rank1.txt")[-len(rank0) :]  # written before its process exited
    print(
        f"model {args.model.name}, pipeline_parallel_size 2, one core per rank: {len(rank0)} steps in {seconds:.2f} s"
    )
    for label, keep in (("prefill", lambda n: n > args.prompts), ("decode", lambda n: n <= args.prompts)):
        idx = [i for i, r in enumerate(rank0) if keep(r[3])]
        if not idx:
            continue
        wall = [rank0[i][1] - rank0[i][0] for i in idx]
        busy0 = [rank0[i][1] - rank0[i][0] - rank0[i][2] for i in idx]
        busy1 = [rank1[i][1] - rank1[i][0] - rank1[i][2] for i in idx]
        w, b0, b1 = (statistics.mean(x) * 1e3 for x in (wall, busy0, busy1))
        print(
            f"{label:8s} {len(idx):4d} steps  wall/step {w:7.2f} ms  stage 0 busy {b0:7.2f} ms ({b0 / w:4.0%})  "
            f"stage 1 busy {b1:7.2f} ms ({b1 / w:4.0%})  mean idle {1 - (b0 + b1) / (2 * w):4.0%}"
        )


if __name__ == "__main__":
    main()
