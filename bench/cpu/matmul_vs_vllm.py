"""fp32 linear layers on one core: torch's oneDNN inner product (what chunkwise calls) against vLLM's oneDNN
matmul (`_C::onednn_mm`), over the shapes of the issue-13 benchmark model (hidden 512, intermediate 1536,
8 layers, fused q/k/v and gate/up, vocab 32000), cycling through 8 layers' weights so they stream from
memory as in a forward pass. Also: what a row count never seen before costs each (primitive creation).

Run it with vLLM's interpreter (it needs `vllm._custom_ops`; torch is the same 2.13.0 as chunkwise's):

    taskset -c 1 ~/vllm-venv/bin/python bench/cpu/matmul_vs_vllm.py
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch
import vllm._custom_ops as ops

torch.set_num_threads(1)
SHAPES = [(512, 768), (512, 512), (512, 3072), (1536, 512)]  # (in, out): qkv, o, gate_up, down
LAYERS = 8
ws = [[torch.randn(n, k) * 0.02 for (k, n) in SHAPES] for _ in range(LAYERS)]
lm = torch.randn(32000, 512) * 0.02
vllm_handlers = [[ops.create_onednn_mm(w.t(), 32) for w in layer] for layer in ws]
vllm_lm = ops.create_onednn_mm(lm.t(), 32)
torch_packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in ws]
torch_lm = torch.ops.mkldnn._reorder_linear_weight(lm, 32)


def forward_linears(rows: int) -> tuple[float, float]:
    x, x2, xl = torch.randn(rows, 512), torch.randn(rows, 1536), torch.randn(min(rows, 32), 512)

    def torch_pass() -> None:
        for layer in torch_packed:
            for (k, _), w in zip(SHAPES, layer):
                torch.ops.mkldnn._linear_pointwise(x if k == 512 else x2, w, None, "none", [], "")
        torch.ops.mkldnn._linear_pointwise(xl, torch_lm, None, "none", [], "")

    def vllm_pass() -> None:
        for layer in vllm_handlers:
            for (k, _), h in zip(SHAPES, layer):
                ops.onednn_mm(h, x if k == 512 else x2, None)
        ops.onednn_mm(vllm_lm, xl, None)

    for f in (torch_pass, vllm_pass, torch_pass, vllm_pass):
        f()
    times: dict[str, list[float]] = {"torch": [], "vllm": []}
    for _ in range(7):  # interleaved, so drift hits both alike
        for name, f in (("torch", torch_pass), ("vllm", vllm_pass)):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return sorted(times["torch"])[3], sorted(times["vllm"])[3]


def new_row_counts(count: int = 60) -> tuple[float, float]:
    """Seconds per call for row counts each seen for the first time, less the same calls again."""
    w = torch.randn(3072, 512) * 0.02
    packed, handler = torch.ops.mkldnn._reorder_linear_weight(w, 32), ops.create_onednn_mm(w.t(), 32)
    rng = random.Random(0)
    ms = rng.sample(range(40, 1000), 2 * count)
    xs = {m: torch.randn(m, 512) for m in ms}

    def run(f: Callable[[torch.Tensor], object], rows: list[int]) -> float:
        t0 = time.perf_counter()
        for m in rows:
            f(xs[m])
        return time.perf_counter() - t0

    def inner_product(x: torch.Tensor) -> object:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def matmul(x: torch.Tensor) -> object:
        return ops.onednn_mm(handler, x, None)

    torch_new = run(inner_product, ms[:count]) - run(inner_product, ms[:count])
    vllm_new = run(matmul, ms[count:]) - run(matmul, ms[count:])
    return torch_new / count, vllm_new / count


if __name__ == "__main__":
    for rows in (4, 32, 256, 1024):
        t, v = forward_linears(rows)
        print(
            f"{rows:5d} rows: torch inner product {t * 1e3:8.2f} ms, vLLM matmul {v * 1e3:8.2f} ms, ratio {t / v:.2f}"
        )
    tn, vn = new_row_counts()
    print(f"a new row count costs: torch {tn * 1e3:.2f} ms, vLLM {vn * 1e3:.2f} ms (per call, 512x3072)")
