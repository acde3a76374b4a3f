"""One decode step's linear layers over quantized weights (engine/quant/) against the full-precision ones on
oneDNN's prepacked layout (what a bf16 or fp32 model runs), at a few rows.

Each quantized kind through each of its CPU paths: csrc/quant_linear.cpp's vector kernel, its AMX tile
version (bf16 on a CPU with AMX), and the prefill path (dequantized blocks through oneDNN). The weights are
the issue-13 benchmark model's shapes (hidden 512, intermediate 1536) over 12 layers (about 41M weights,
so every pass streams them from memory), each used once per pass. Prints the best of five passes.

    taskset -c 1 .venv/bin/python bench/cpu/quant_linear.py [--dtype bfloat16|float32] [ROWS,...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from chunkwise.engine import kernels
from chunkwise.engine.quant import compute
from chunkwise.engine.quant.weights import KINDS, QuantizedWeight, pack_int4, quantize_fp8, quantize_int8

p = argparse.ArgumentParser()
p.add_argument("rows", nargs="?", default="1,2,4,8,16,32,64,256")
p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
args = p.parse_args()
dtype = getattr(torch, args.dtype)
kernels.load()
torch.set_num_threads(1)
torch.manual_seed(0)
LAYER = [(1536, 512), (512, 512), (3072, 512), (512, 1536)]  # (out, in): qkv, o, gate_up, down
shapes = LAYER * 12
weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
packed = [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).contiguous()) for w in weights]


def int4(w: torch.Tensor, group: int = 128) -> QuantizedWeight:
    n, k = w.shape
    q = torch.randint(0, 16, (n, k))
    return QuantizedWeight(
        "int4", pack_int4(q), torch.rand(n, k // group) * 0.01, torch.full((n, k // group), 8.0), group, k
    )


quantized = {
    "int8": [quantize_int8(w) for w in weights],
    "fp8": [quantize_fp8(w) for w in weights],
    "int4": [int4(w) for w in weights],
}
amx = args.dtype == "bfloat16" and compute.amx_kernel_runs(
    torch.empty(1, 512, dtype=dtype), quantized["int8"][0]
)


def best(f: Callable[[], None], n: int = 20) -> float:
    f()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t0) / n)
    return min(times) * 1e3


print(f"{args.dtype}, ms a pass over {sum(n * k for n, k in shapes) / 1e6:.0f}M weights (AMX kernel: {amx})")


def measure(m: int) -> str:
    xs = {k: torch.randn(m, k).to(dtype) for k in (512, 1536)}

    def full() -> None:
        for w, (_, k) in zip(packed, shapes):
            torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

    def kernel(kind: str, op: Callable[..., None]) -> Callable[[], None]:
        def run() -> None:
            for qw, (n, k) in zip(quantized[kind], shapes):
                op(
                    xs[k].new_empty(m, n),
                    xs[k],
                    qw.data,
                    qw.scale,
                    qw.zero,
                    KINDS.index(qw.kind),
                    qw.group_k,
                    None,
                )

        return run

    def blocks(kind: str) -> Callable[[], None]:
        def run() -> None:
            for qw, (_, k) in zip(quantized[kind], shapes):
                compute.quantized_linear(xs[k], qw, None, small_rows=0)

        return run

    base = best(full)
    cells = [f"rows {m:4d}: full precision {base:6.2f}"]
    for kind in quantized:
        paths = {"vector": kernel(kind, torch.ops.chunkwise.quant_linear), "blocks": blocks(kind)}
        if amx:
            paths["amx"] = kernel(kind, torch.ops.chunkwise.quant_linear_amx)
        cells.append(f"{kind} " + " ".join(f"{name} {base / best(f):.2f}x" for name, f in paths.items()))
    return " | ".join(cells)


for rows in [int(v) for v in args.rows.split(",")]:
    print(measure(rows), flush=True)
