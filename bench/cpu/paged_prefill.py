"""Prefill attention on the CPU backend: chunkwise's paged kernel (each prompt token a one-token query over its
own prefix) against torch's flash attention over the gathered context, by chunk and context length.
The heads of the issue-13 benchmark model (8 query heads over 2 KV heads of 64), fp32, 16-token blocks.
Prints the best of three per case; the crossover is PAGED_PREFILL_MAX_CONTEXT (attention/cpu_backend.py).

    taskset -c 1 .venv/bin/python bench/cpu/paged_prefill.py
"""

from __future__ import annotations

import time

import torch

from chunkwise.engine.attention.backend import AttentionMetadata, kv_cache_shape
from chunkwise.engine.attention.cpu_backend import CpuAttentionBackend
from chunkwise.engine.worker.inputs import InputBatch, Row

torch.set_num_threads(1)
BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 8, 2, 64
# (tokens already in the cache, tokens in this chunk) per request of the step.
CASES = [
    [(0, 150)] * 6,
    [(0, 256)] * 4,
    [(0, 512)],
    [(512, 512)],
    [(0, 1024)],
    [(1024, 512)],
    [(0, 2048)],
    [(2048, 512)],
]


def metadata(chunks: list[tuple[int, int]]) -> tuple[int, AttentionMetadata]:
    """The step the engine's InputBatch would build for these chunks, each request on its own blocks."""
    rows: list[Row] = []
    used = 0
    for before, n in chunks:
        blocks = (before + n + BLOCK - 1) // BLOCK
        rows.append(Row([1] * n, before, list(range(used, used + blocks))))
        used += blocks
    batch = InputBatch(
        max_num_tokens=sum(n for _, n in chunks),
        max_num_reqs=len(chunks),
        max_blocks_per_req=max(len(r.block_table) for r in rows),
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    return used, batch.fill(rows).meta


backend = CpuAttentionBackend()
print("chunks (in cache, new)   flash attention   paged kernel   flash/paged")
for chunks in CASES:
    blocks, meta = metadata(chunks)
    cache = torch.randn(kv_cache_shape(blocks, BLOCK, KV_HEADS, HEAD_DIM))
    query = torch.randn(meta.num_tokens, HEADS, HEAD_DIM)
    best: dict[str, float] = {}
    outs: dict[str, torch.Tensor] = {}
    for name, bound in (("flash", 0), ("paged", 10**9)):
        backend.paged_prefill_max_context = bound
        best[name] = float("inf")
        for _ in range(3):
            plan = backend.plan(meta, HEADS, KV_HEADS, HEAD_DIM)
            t0 = time.perf_counter()
            outs[name] = backend.attend(query, cache, plan, HEAD_DIM**-0.5)
            best[name] = min(best[name], time.perf_counter() - t0)
    torch.testing.assert_close(outs["paged"], outs["flash"], atol=1e-5, rtol=1e-5)
    label = f"{chunks[0]} x {len(chunks)}"
    print(
        f"{label:24s} {best['flash'] * 1e3:12.1f} ms {best['paged'] * 1e3:11.1f} ms"
        f" {best['flash'] / best['paged']:12.2f}x"
    )
