"""Quantized linears on a GPU (issue 35): are the CUDA paths right, and what do they buy over bf16?

    PYTHONPATH=runtime TRITON_INTERPRET=0 python bench/gpu/quant_check.py --out DIR   # on the GPU, < 1 minute
    PYTHONPATH=runtime python bench/gpu/quant_check.py --smoke --out DIR             # small, on CPU

For Llama-3-8B's projection shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336):
- correctness: fp8 per-channel through torch._scaled_mm (per-token activation scales) and int4 through the
  Triton dequant-GEMM (group 128) against x @ dequantize(W).T in fp32, at 1, 16 and 256 rows (relative
  error; fp8's activations are quantized too, so a few percent is expected there, int4 about bf16's);
- speed: each against bf16 F.linear on the same shapes, median of CUDA-event-timed repeats.
Writes DIR/quant_check.json and prints a table. Neither kernel had run on a GPU before this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime"))

from chunkwise.engine.quant import compute  # noqa: E402
from chunkwise.engine.quant.weights import QuantizedWeight, dequantize, pack_int4, quantize_fp8  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def int4_weight(n: int, k: int, device: str, group: int = 128) -> QuantizedWeight:
    q = torch.randint(0, 16, (n, k), device=device)
    scale = torch.rand(n, k // group, device=device) * 0.002 + 0.001
    zero = torch.randint(4, 12, (n, k // group), device=device).float()
    return QuantizedWeight("int4", pack_int4(q), scale, zero, group, k)


def timed(fn, device: str, repeats: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    if device != "cuda":
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="small shapes on CPU (the interpreter for Triton)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shapes = {k: (n // 64, kk // 64) for k, (n, kk) in SHAPES.items()} if args.smoke else SHAPES
    rows = (1, 16) if args.smoke else (1, 16, 256)
    torch.manual_seed(0)
    results = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device) * 0.02
        weights = {"fp8": quantize_fp8(w), "int4": int4_weight(n, k, device, 32 if args.smoke else 128)}
        w_bf16 = w.to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            base = timed(lambda x=x, w=w_bf16: torch.nn.functional.linear(x, w), device, args.repeats)
            for kind, qw in weights.items():
                ref = x.float() @ dequantize(qw).T
                y = compute.quantized_linear(x, qw, None)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                ms = timed(lambda x=x, qw=qw: compute.quantized_linear(x, qw, None), device, args.repeats)
                results.append(
                    {"layer": name, "rows": m, "kind": kind, "rel_error": err, "ms": ms, "bf16_ms": base}
                )
                print(
                    f"{name:8s} rows {m:4d} {kind}: rel. error {err:.2e}, {ms:.3f} ms against bf16 {base:.3f} ms"
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_check.json").write_text(json.dumps(results, indent=2))
    bad = [r for r in results if r["rel_error"] > (0.08 if r["kind"] == "fp8" else 0.02)]
    for r in bad:
        print(f"FAILED: {r}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
