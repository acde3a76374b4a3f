"""Decode attention on the CPU backend's kernel (torch.ops.chunkwise.paged_attention): 32 rows of one query
token each, every row at the same context, blocks of 16 tokens in a shuffled order, the 57M benchmark model's
heads (8 over 2 KV heads of 64), bf16. Prints the best of 20 calls per context and the KV bytes read per second;
where this process may use AMX tiles, the same for the AMX op (csrc/paged_attention_amx.cpp, the scores on the
tiles), its largest difference from the AVX-512 kernel's output, and the speed-up.

    PYTHONPATH=runtime taskset -c 1 .venv/bin/python bench/cpu/decode_attention.py [--library PATH]

--library loads another build of the kernels instead of this checkout's (`python -m chunkwise.engine.kernels` at
another commit prints its path): how the bf16 dot-product path (csrc/paged_attention_bf16.cpp) was compared
with the generic kernel it replaced on AVX512-BF16.
"""

from __future__ import annotations

import argparse
import time

import torch

HEADS, KV_HEADS, BLOCK, ROWS = 8, 2, 16, 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--library", help="a built kernels library to load instead of this checkout's")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--contexts", default="100,500,2000")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.library:
        torch.ops.load_library(args.library)
    else:
        from chunkwise.engine import kernels

        print(f"kernels: {kernels.load()}")
    d = args.head_dim
    gen = torch.Generator().manual_seed(0)
    for ctx in (int(c) for c in args.contexts.split(",")):
        per_row = -(-ctx // BLOCK)
        blocks = ROWS * per_row + 1
        cache = torch.randn(2, blocks, BLOCK, KV_HEADS, d, generator=gen).to(torch.bfloat16)
        tables = torch.randperm(blocks - 1, generator=gen)[: ROWS * per_row].view(ROWS, per_row)
        q = torch.randn(ROWS, HEADS, d, generator=gen).to(torch.bfloat16)
        rows = torch.arange(ROWS)
        lens = torch.full((ROWS,), ctx, dtype=torch.int64)
        kv = ROWS * ctx * KV_HEADS * d * 2 * 2
        ops = [("paged_attention", torch.ops.chunkwise.paged_attention)]
        if torch.ops.chunkwise.has_paged_attention_amx():
            ops.append(("paged_attention_amx", torch.ops.chunkwise.paged_attention_amx))
        times, outs = [], []
        for name, op in ops:
            out = torch.empty_like(q)
            best = float("inf")
            for _ in range(21):
                t0 = time.perf_counter()
                op(out, q, cache, tables, rows, rows, lens, d**-0.5)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
            outs.append(out)
            print(f"context {ctx}, {name}: {best * 1e6:.0f} us, {kv / best / 1e9:.1f} GB/s of K/V")
        if len(outs) == 2:
            diff = (outs[0].float() - outs[1].float()).abs().max().item()
            print(
                f"context {ctx}: AMX {times[0] / times[1]:.2f}x the AVX-512 kernel, max difference {diff:.4f}"
            )


if __name__ == "__main__":
    main()
