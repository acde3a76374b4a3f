"""One model pass of bf16 linear layers at a given row count: F.linear over the plain weights (what chunkwise
ran before issue 29 on a CPU with bf16 units) against oneDNN over weights reordered once into its layout
(`torch.ops.mkldnn._reorder_linear_weight`, what Linear.prepare does now), and the LM head alone.

The weights are those of the issue-13 benchmark model (hidden 512, intermediate 1536, 8 layers, vocab 32000),
each used once per pass as a real step does. Prints the best of five passes per row count and the ratio; each
packed result is checked against F.linear's.

    taskset -c 1 .venv/bin/python bench/cpu/linear_bf16.py [ROWS,...]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
LAYER = [(768, 512), (512, 512), (3072, 512), (512, 1536)]  # (out, in): qkv, o, gate_up, down
weights = [(torch.randn(n, k) * 0.02).bfloat16() for _ in range(8) for n, k in LAYER]
head = (torch.randn(32000, 512) * 0.02).bfloat16()
weights.append(head)
packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
rows = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 16, 32, 64, 128, 256, 1024]


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def best(fn, xs: list[torch.Tensor], ws: list[torch.Tensor]) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for x, w in zip(xs, ws):
            fn(x, w)
        times.append(time.perf_counter() - t0)
    return min(times) * 1000


print("rows  F.linear  oneDNN packed  ratio   LM head: F.linear  packed  ratio")
for m in rows:
    xs = [torch.randn(m, w.shape[1]).bfloat16() for w in weights]
    for x, w, p in zip(xs, weights, packed):
        torch.testing.assert_close(onednn(x, p), plain(x, w), atol=1e-2, rtol=1e-2)
    a, b = best(plain, xs, weights), best(onednn, xs, packed)
    ha, hb = best(plain, xs[-1:], weights[-1:]), best(onednn, xs[-1:], packed[-1:])
    print(f"{m:4}  {a:7.2f} ms  {b:9.2f} ms  {a / b:5.2f}x  {ha:14.2f} ms  {hb:6.2f} ms  {ha / hb:4.2f}x")
