"""y = x W^T (+ b) for a quantized weight (weights.py), on whichever device holds it.

- CPU, chunkwise's kernels loaded: up to SMALL_ROWS rows (decode) csrc/quant_linear.cpp reads the weight in
  its 8 or 4 bits and dequantizes it in registers (fp32 products); bf16 rows on a CPU with AMX, from
  AMX_MIN_ROWS up, csrc/quant_linear_amx.cpp converts each 16 x 32 block of weights to bf16 once for all the
  rows and multiplies on the tiles. Past SMALL_ROWS (a prefill chunk, compute-bound) blocks of rows are
  dequantized into the compute dtype (DEQUANT_BLOCK_BYTES at a time, never the whole layer) and multiplied
  through the CPU's matmul library (oneDNN).
- CUDA: fp8 with a scale per row through torch._scaled_mm with dynamic per-token activation scales
  (cuda_fp8.py, as vLLM's FP8 W8A8), int4 through a Triton dequant-GEMM (triton_int4.py); the rest (block
  scaled fp8, int8) as blocks of rows dequantized by torch.
- Anything else (no kernels): blocks of rows dequantized by torch, then F.linear.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from chunkwise.engine import kernels
from chunkwise.engine.hardware import cpu_isa
from chunkwise.engine.quant.weights import QuantizedWeight, dequantize

# Up to this many rows the CPU kernel streams the quantized weight; past it, dequantized blocks go through
# oneDNN (bench/cpu/quant_linear.py measures where the two cross).
SMALL_ROWS = 32
# From this many bf16 rows up, on a CPU with AMX, the tile kernel: below it the vector kernel's few rows
# cost less than converting the weight to bf16 (bench/cpu/quant_linear.py).
AMX_MIN_ROWS = 5
# The largest block of a layer's weight held dequantized at once on the prefill path.
DEQUANT_BLOCK_BYTES = 1 << 20


@functools.cache
def _kernels_here() -> bool:
    return kernels.available()


@functools.cache
def _amx_here() -> bool:
    return cpu_isa().name == "amx" and _kernels_here() and bool(torch.ops.chunkwise.has_quant_linear_amx())


@functools.cache
def _ops() -> tuple[Any, Any]:
    """(the vector kernel, the tile kernel or None): looked up once, as an attribute of torch.ops costs a
    microsecond or two a call."""
    return torch.ops.chunkwise.quant_linear.default, (
        torch.ops.chunkwise.quant_linear_amx.default if _amx_here() else None
    )


def amx_kernel_runs(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether csrc/quant_linear_amx.cpp computes this call: bf16 rows on a CPU whose AMX tiles this process
    may use (and CHUNKWISE_CPU_ISA does not rule out), whole 32-column chunks and groups."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and qw.tile_layout and _amx_here()


def cpu_kernel_runs(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether csrc/quant_linear.cpp computes this call (CPU, fp32 or bf16 rows, groups of whole vectors)."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() == 2
        and qw.vector_layout
        and _kernels_here()
    )


def quantized_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, small_rows: int = SMALL_ROWS
) -> torch.Tensor:
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, qw.out_features)
    if x.device.type == "cuda":
        return _cuda(x, qw, bias)
    if cpu_kernel_runs(x, qw):
        if x.stride(-1) != 1:
            x = x.contiguous()
        if m <= small_rows:
            y = x.new_empty(m, qw.out_features)
            vector, tiles = _ops()
            op = (
                tiles
                if tiles is not None and m >= AMX_MIN_ROWS and x.dtype == torch.bfloat16 and qw.tile_layout
                else vector
            )
            op(y, x, qw.data, qw.scale, qw.zero, qw.kind_id, qw.group_k, _bias(bias, x))
            return y
        return _blocks(x, qw, bias, _dequantize_cpu)
    return _blocks(x, qw, bias, _dequantize_torch)


def _bias(bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)


def _dequantize_cpu(qw: QuantizedWeight, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(stop - start, qw.in_features, dtype=dtype)
    torch.ops.chunkwise.quant_dequantize(out, qw.data, qw.scale, qw.zero, qw.kind_id, qw.group_k, start)
    return out


def _dequantize_torch(qw: QuantizedWeight, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(qw.rows(start, stop), dtype)


Dequantizer = Callable[[QuantizedWeight, int, int, torch.dtype], torch.Tensor]


def _blocks(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, dequantize_rows: Dequantizer
) -> torch.Tensor:
    """x W^T a block of weight rows at a time, each dequantized into x's dtype just before its multiply."""
    n = qw.out_features
    rows = max(1, DEQUANT_BLOCK_BYTES // (qw.in_features * x.element_size()))
    if rows >= n:
        return F.linear(x, dequantize_rows(qw, 0, n, x.dtype), _bias(bias, x))
    y = x.new_empty(x.shape[0], n)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        b = None if bias is None else bias[start:stop].to(x.dtype)
        y[:, start:stop] = F.linear(x, dequantize_rows(qw, start, stop, x.dtype), b)
    return y


def _cuda(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if qw.kind == "fp8":
        from chunkwise.engine.quant import cuda_fp8

        if cuda_fp8.fp8_rowwise_supported(qw):
            return cuda_fp8.fp8_scaled_mm_linear(x, qw, _bias(bias, x))
    elif qw.kind == "int4":
        try:
            from chunkwise.engine.quant import triton_int4
        except ImportError:  # no triton: the dequantized blocks below
            pass
        else:
            if triton_int4.int4_supported(x, qw):
                return triton_int4.int4_linear(x, qw, _bias(bias, x))
    return _blocks(x, qw, bias, _dequantize_torch)
