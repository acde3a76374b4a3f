"""Prefill attention on the CPU: chunkwise's kernel (csrc/prefill_attention.cpp: bf16 on AVX512-BF16, fp32 on
AVX-512 FMA) against
torch's flash attention as the backend would otherwise call it (is_causal for a first chunk; the prefix and
the chunk's triangle merged by log-sum-exp after context), on the same tensors, alternating, best of N.
Every case is checked against fp32 attention first, and each path's error is printed beside its time. In bf16
on a CPU whose AMX tiles this process may use, the AMX kernel (csrc/prefill_attention_amx.cpp) is timed too.

    PYTHONPATH=runtime taskset -c 1 .venv/bin/python bench/cpu/prefill_attention.py [--repeats 5] [--dtype float32]

Needs the kernels built for an AVX-512 level (an AVX-512 CPU with bf16, Zen 4 or a Xeon from Cooper Lake on).
"""

from __future__ import annotations

import argparse
import platform
import time
from functools import partial

import torch
import torch.nn.functional as F

from chunkwise.engine import kernels
from chunkwise.engine.attention.cpu_backend import attend_after_prefix

# (heads, KV heads, head_dim, context before the chunk, chunk): the benchmark model's heads (8 over 2 of 64)
# at the convoy's chunks of a 3,000-token prompt under a 1,024-token budget, a Llama-3-8B layer's heads,
# and a short prompt.
CASES = [
    (8, 2, 64, 0, 1024),
    (8, 2, 64, 1024, 1024),
    (8, 2, 64, 2048, 952),
    (8, 2, 64, 0, 150),
    (32, 8, 128, 0, 512),
    (32, 8, 128, 1536, 512),
]


def torch_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if prefix == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = attend_after_prefix(qh, kh, vh, prefix, scale)
    return o[0].transpose(0, 1)


def ours(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    kernels.prefill_attention(out, q, k, v, scale)
    return out


def ours_amx(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    kernels.prefill_attention_amx(out, q, k, v, scale)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    if not kernels.prefill_attention_available(torch.empty(1, 1, 64, dtype=dtype)):
        raise SystemExit(f"the kernels are built for {kernels.isa()} here: no {args.dtype} prefill kernel")
    print(
        f"CPU: {platform.processor() or platform.machine()}, kernels {kernels.isa()}, torch {torch.__version__}, "
        f"{args.dtype}"
    )
    amx = dtype == torch.bfloat16 and kernels.prefill_attention_amx_available(
        torch.empty(1, 1, 64, dtype=dtype)
    )
    print(
        "| heads/KV/D | prefix | chunk | chunkwise ms | GFLOP/s | max err | torch flash ms | GFLOP/s | max err | speed-up |"
        + (" AMX kernel ms | GFLOP/s | max err | speed-up over torch |" if amx else "")
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if amx else ""))
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, d, prefix, n in CASES:
        q = torch.randn(n, heads, d, generator=gen).to(dtype)
        k = torch.randn(prefix + n, kv_heads, d, generator=gen).to(dtype)
        v = torch.randn(prefix + n, kv_heads, d, generator=gen).to(dtype)
        scale = d**-0.5
        out = torch.empty_like(q)
        ctx = prefix + n
        mask = torch.arange(ctx)[None, :] <= torch.arange(prefix, ctx)[:, None]
        truth = F.scaled_dot_product_attention(
            q.float().transpose(0, 1),
            k.float().transpose(0, 1),
            v.float().transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
        fns = {
            "chunkwise": partial(ours, out, q, k, v, scale),
            "torch": partial(torch_flash, q, k, v, prefix, scale),
        }
        if amx and d in kernels.AMX_ATTENTION_HEAD_DIMS:
            fns["amx"] = partial(ours_amx, torch.empty_like(q), q, k, v, scale)
        err = {name: float((fn().float() - truth).abs().max()) for name, fn in fns.items()}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        flops = 4 * heads * d * n * (prefix + n / 2)
        c, t = best["chunkwise"], best["torch"]
        print(
            f"| {heads}/{kv_heads}/{d} | {prefix} | {n} | {c * 1e3:.2f} | {flops / c / 1e9:.0f} | {err['chunkwise']:.4f} "
            f"| {t * 1e3:.2f} | {flops / t / 1e9:.0f} | {err['torch']:.4f} | {t / c:.2f}x |"
            + (
                f" {best['amx'] * 1e3:.2f} | {flops / best['amx'] / 1e9:.0f} | {err['amx']:.4f} | {t / best['amx']:.2f}x |"
                if "amx" in best
                else ""
            )
        )


if __name__ == "__main__":
    main()
