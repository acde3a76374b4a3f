"""Where one offline run of the issue-13 workload spends its time, by op (torch.profiler), on one core.

The workload of `chunkwise bench compare vllm` at its defaults (64 requests, 32-256-token prompts,
long-tailed outputs, greedy, ignore_eos; max_num_seqs 32, max_num_batched_tokens 1024) on its benchmark
checkpoint (written to ~/.cache/chunkwise/bench/llama-57m if missing), driven through EngineCore directly.
To compare two trees, run it under each one's PYTHONPATH, one after the other.

    PYTHONPATH=runtime taskset -c 1 .venv/bin/python bench/cpu/profile_offline.py [--seed 0] [--dtype float32]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from chunkwise.bench import workloads
from chunkwise.bench.checkpoint import CheckpointSpec, ensure_checkpoint
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.loop.core import EngineCore

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--dtype", default="float32")
parser.add_argument("--rows", type=int, default=16, help="ops to list")
args = parser.parse_args()

torch.set_num_threads(1)
path, _ = ensure_checkpoint(CheckpointSpec(), log=print)
items = workloads.long_tailed(
    64,
    vocab_size=32000,
    prompt_len=(32, 256),
    median_output=32,
    sigma=1.0,
    max_output=512,
    seed=args.seed,
    client_max_tokens=True,
)
core = EngineCore(
    engine_config_from_kwargs(
        str(path),
        dtype=args.dtype,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        kv_cache_memory_bytes=1 << 30,
    )
)
for i, item in enumerate(items):
    params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(str(i), list(item.prompt_token_ids), params)
steps = 0
with profile(activities=[ProfilerActivity.CPU]) as prof:
    while core.has_unfinished():
        core.step()
        steps += 1
print(f"{steps} steps, {sum(it.max_tokens for it in items)} output tokens")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
