"""Prefill attention on the CPU backend: chunkwise's paged kernel (each prompt token a one-token query over its
own prefix) against torch's flash attention over the gathered context, by chunk and context length.
The heads of the issue-13 benchmark model (8 query heads over 2 KV heads of 64), fp32, 16-token blocks.
Prints the best of three per case; the crossover is PAGED_PREFILL_MAX_CONTEXT (attention/cpu_backend.py).

    taskset -c 1 .venv/bin/python bench/cpu/paged_prefill.py
"""

from __future__ import annotations

import time

import torch

from chunkwise.attention.backend import AttentionMetadata, kv_cache_shape
from chunkwise.attention.cpu_backend import CpuAttentionBackend

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
    slots: list[int] = []
    tables: list[list[int]] = []
    qlens: list[int] = []
    slens: list[int] = []
    used = 0
    for before, n in chunks:
        end = before + n
        table = list(range(used, used + (end + BLOCK - 1) // BLOCK))
        used += len(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(before, end)]
        tables.append(table)
        qlens.append(n)
        slens.append(end)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(slens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        query_lens_host=qlens,
        seq_lens_host=slens,
        max_query_len=max(qlens),
        max_seq_len=max(slens),
        block_size=BLOCK,
    )
    return used, meta


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
