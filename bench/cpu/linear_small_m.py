"""One decode step's linear layers at a few rows: chunkwise's small-row kernel (torch.ops.chunkwise.linear_small_m,
over Hugging Face's row-major weights) against oneDNN over weights prepacked for it (what chunkwise used before,
and what torch.compile's freezing does) and over the plain weights (what chunkwise calls past the kernel's rows).

The weights are those of the issue-13 benchmark model (hidden 512, intermediate 1536, 8 layers, vocab 32000),
each used once per pass as a real step does, so every pass streams them from memory. Prints the best of five
passes per row count, and the ratio.

    taskset -c 1 .venv/bin/python bench/cpu/linear_small_m.py [ROWS,...]
"""

from __future__ import annotations

import sys
import time

import torch

from chunkwise.engine import kernels

kernels.load()
torch.set_num_threads(1)
LAYER = [(768, 512), (512, 512), (3072, 512), (512, 1536)]  # (out, in): qkv, o, gate_up, down
weights = [torch.randn(n, k) * 0.02 for _ in range(8) for n, k in LAYER] + [torch.randn(32000, 512) * 0.02]
packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
rows = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8, 16, 32, 64, 128]


def onednn(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> None:
    for x, w in zip(xs, ws):
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def small_m(xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    for x, w, out in zip(xs, weights, outs):
        torch.ops.chunkwise.linear_small_m(out, x, w, None)


print("rows  oneDNN packed  oneDNN plain  small-row kernel  packed/kernel  plain/kernel")
for m in rows:
    xs = [torch.randn(m, w.shape[1]) for w in weights]
    outs = [torch.empty(m, w.shape[0]) for w in weights]
    small_m(xs, outs)
    for x, w, out in zip(xs, weights, outs):
        torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-5)
    runs = {
        "packed": (onednn, packed),
        "plain": (onednn, weights),
        "kernel": (small_m, outs),
    }
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(5):
        for name, (run, arg) in runs.items():
            t0 = time.perf_counter()
            run(xs, arg)
            best[name] = min(best[name], time.perf_counter() - t0)
    ms = {k: v * 1e3 for k, v in best.items()}
    print(
        f"{m:4d}  {ms['packed']:10.1f} ms  {ms['plain']:9.1f} ms  {ms['kernel']:13.1f} ms"
        f"  {best['packed'] / best['kernel']:12.2f}x  {best['plain'] / best['kernel']:11.2f}x",
        flush=True,
    )
