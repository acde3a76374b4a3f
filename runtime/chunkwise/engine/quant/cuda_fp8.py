"""An fp8 linear layer on the GPU's fp8 tensor cores (W8A8): activations quantized per token on the fly,
multiplied with the fp8 weight by torch._scaled_mm, both scales applied in its epilogue.

Weight-only fp8 would dequantize the whole weight each step; here the weight is read as it is stored and the
product runs at fp8 rate. The activations lose about 3 bits of mantissa in the bargain, so results differ
from x @ dequantize(qw).T by a few percent relative (vLLM's dynamic per-token scheme, the same trade).

Only a weight with one scale per output row maps onto _scaled_mm's row-wise scaling (scale_b [1, N]);
block-scaled checkpoints (DeepSeek-V3, Qwen3-FP8: a scale per 128 input columns) need another kernel.

torch._scaled_mm's CUDA checks (aten/src/ATen/native/cuda/ScaledBlas.cpp), which its CPU version does not
enforce, so the call is shaped for them here: K and N multiples of 16 (M is free: torch pads the row scales
itself), the activations row-major and the weight column-major (qw.data.t()), fp32 scales, scale_a [M, 1]
and scale_b [1, N] contiguous, a bias only for bf16/fp16 outputs and in the output's dtype. CUDA also needs
compute capability 8.9 or more. Tested on CPU tensors (torch._scaled_mm runs there too); not yet run on a
GPU.
"""

from __future__ import annotations

import torch

from chunkwise.engine.quant.weights import FP8_MAX, QuantizedWeight

# _scaled_mm's CUDA kernels need K and N (the fp8 weight's both dimensions) to be multiples of this.
SCALED_MM_ALIGN = 16
# vLLM's floor on a per-token scale: an all-zero (or tiny) row still gets a finite 1 / scale.
MIN_TOKEN_SCALE = 1.0 / (FP8_MAX * 512.0)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_rowwise_supported(qw: QuantizedWeight) -> bool:
    """Whether fp8_scaled_mm_linear can take this weight: an fp8 weight with one scale per output row,
    dimensions _scaled_mm accepts, and (on CUDA) a GPU with fp8 tensor cores. False means: fall back to a
    dequantizing path, not an error."""
    if qw.kind != "fp8" or qw.scale.dim() != 2 or qw.scale.shape[1] != 1:
        return False
    n, k = qw.data.shape
    if n % SCALED_MM_ALIGN or k % SCALED_MM_ALIGN or k != qw.in_features or not qw.data.is_contiguous():
        return False
    return not (qw.data.is_cuda and torch.cuda.get_device_capability(qw.data.device) < (8, 9))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 [M, 1]) with x ~ q * scale row by row: each token gets
    the whole fp8 range, so a small row next to a large one keeps its precision (a per-tensor scale would
    push it into fp8's subnormals)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_TOKEN_SCALE)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def fp8_scaled_mm_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y [M, N] = x @ dequantize(qw).T (+ bias) in x's dtype, with x quantized per token to fp8. x: [M, K]
    bf16, fp16 or fp32. Raises ValueError for what fp8_rowwise_supported refuses (callers check it first)."""
    if not fp8_rowwise_supported(qw):
        raise ValueError(
            f"fp8 _scaled_mm needs an fp8 weight with one scale per output row and both dimensions multiples "
            f"of {SCALED_MM_ALIGN} (and a GPU of compute capability 8.9+); got kind {qw.kind!r}, weight "
            f"{tuple(qw.data.shape)}, scale {tuple(qw.scale.shape)}"
        )
    n, k = qw.data.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"activations of shape {tuple(x.shape)} for a weight of {k} input features")
    if x.dtype not in OUT_DTYPES:
        raise ValueError(f"activations in {x.dtype}: fp8 _scaled_mm outputs only {OUT_DTYPES}")
    if x.shape[0] == 0:
        return x.new_empty((0, n))
    xq, x_scale = quantize_per_token(x)
    w_scale = qw.scale.float().reshape(1, n).contiguous()
    # CUDA refuses a bias with an fp32 output, and wants it in the output's dtype otherwise.
    fused_bias = bias.to(x.dtype) if bias is not None and x.dtype != torch.float32 else None
    y = torch._scaled_mm(
        xq, qw.data.t(), scale_a=x_scale, scale_b=w_scale, bias=fused_bias, out_dtype=x.dtype
    )
    if bias is not None and fused_bias is None:
        y = y + bias.to(y.dtype)
    return y
