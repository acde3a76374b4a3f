"""A 4-bit (AWQ/GPTQ) linear layer on a GPU as one Triton dequant-GEMM: each program unpacks its tile of the
packed weight in registers, so the weight crosses memory at half a byte an element and a full-precision copy
never exists (dequantizing first would write and read 4-8x the bytes each step).

Numerics are dequantize()'s: w = (q - zero) * scale in fp32, then cast to the activations' dtype for the
dot, fp32 accumulation. fp32 activations get an exact fp32 dot (input_precision="ieee"): tl.dot would
otherwise round them to tf32. The interpreter's tl.dot is wrong on 16-bit operands, so there (UPCAST) the
operands, already cast to the activations' dtype, are widened to fp32 first: the same products, except
that the interpreter's casts to bf16 truncate where a GPU rounds to nearest.

The packing layout (weights.py, INT4_BLOCK) puts columns i and 16 + i of each 32-column block in one byte,
so a tile's low nibbles are the runs of 16 columns starting at 0, 32, 64... and its high nibbles those
starting at 16, 48...: rather than interleave them back, the kernel loads the activations' matching
columns for each half and does two dots of BLOCK_K / 2. A K tile never straddles two scale groups
(BLOCK_K divides group_k), so each tile needs one scale and zero per output row.

Importing this module imports triton: only for activations on a CUDA device. Interpreter-tested
(TRITON_INTERPRET=1 on CPU tensors); not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chunkwise.engine.quant.weights import INT4_BLOCK, QuantizedWeight

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def int4_linear_kernel(
    y_ptr,
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    M,
    N,
    K,
    group_k,
    stride_xm,
    stride_ym,
    stride_wn,
    stride_sn,
    stride_zn,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] output tile, looping over K in tiles of BLOCK_K (a multiple of
    32 dividing group_k, so K needs no mask)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Byte j of a tile: column (j // 16) * 32 + j % 16 in its low nibble, 16 more in its high one.
    offs_byte = tl.arange(0, BLOCK_K // 2)
    cols_lo = (offs_byte // 16) * 32 + offs_byte % 16
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_lo = tl.load(x_rows + (k0 + cols_lo)[None, :], mask=mask_m[:, None], other=0.0)
        x_hi = tl.load(x_rows + (k0 + 16 + cols_lo)[None, :], mask=mask_m[:, None], other=0.0)
        packed = tl.load(w_rows + (k0 // 2 + offs_byte)[None, :], mask=mask_n[:, None], other=0)
        group = k0 // group_k
        scale = tl.load(scale_ptr + offs_n * stride_sn + group, mask=mask_n, other=0.0)[:, None]
        zero = tl.load(zero_ptr + offs_n * stride_zn + group, mask=mask_n, other=0.0)[:, None]
        w_lo = (((packed & 0xF).to(tl.float32) - zero) * scale).to(x_lo.dtype)
        w_hi = (((packed >> 4).to(tl.float32) - zero) * scale).to(x_hi.dtype)
        if UPCAST:
            x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
            w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
        if IEEE:
            acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo))
            acc += tl.dot(x_hi, tl.trans(w_hi))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def is_interpreted() -> bool:
    """True when the kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(int4_linear_kernel).__name__ == "InterpretedFunction"


def int4_supported(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether int4_linear can take these activations and weight; False means another path (a dequantizing
    fallback), not an error."""
    k = qw.in_features
    return (
        qw.kind == "int4"
        and qw.zero is not None
        and x.dim() == 2
        and x.dtype in DTYPES
        and x.shape[1] == k
        and x.stride(1) == 1
        and k % INT4_BLOCK == 0
        and qw.group_k % INT4_BLOCK == 0
        and k % qw.group_k == 0
        and tuple(qw.data.shape) == (qw.out_features, k // 2)
        and qw.data.dtype == torch.uint8
        and qw.data.stride(1) == 1
        and qw.scale.dtype == torch.float32
        and qw.zero.dtype == torch.float32
        and tuple(qw.scale.shape) == tuple(qw.zero.shape) == (qw.out_features, k // qw.group_k)
        and qw.scale.stride(1) == 1
        and qw.zero.stride(1) == 1
    )


def block_k_for(group_k: int) -> int:
    """The K tile: 64 where the group allows (two 32-column packing blocks, dots of 32), else one block."""
    return 64 if group_k % 64 == 0 else INT4_BLOCK


def int4_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x @ dequantize(qw).T (+ bias) in x's dtype. x: [M, K] bf16, fp16 or fp32 (rows may be
    strided, columns contiguous). Raises ValueError where int4_supported is False."""
    if not int4_supported(x, qw):
        raise ValueError(
            f"int4_linear cannot take activations {tuple(x.shape)} {x.dtype} with a {qw.kind} weight "
            f"{tuple(qw.data.shape)} (in_features {qw.in_features}, group_k {qw.group_k})"
        )
    assert qw.zero is not None
    m, k = x.shape
    n = qw.out_features
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"a bias of shape {tuple(bias.shape)} for {n} output features")
    if bias is not None:
        bias = bias.contiguous()
    # tl.dot needs every dimension >= 16; decode's few rows fill a 16-row tile.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    int4_linear_kernel[grid](
        y,
        x,
        qw.data,
        qw.scale,
        qw.zero,
        bias if bias is not None else y,  # never read without HAS_BIAS
        m,
        n,
        k,
        qw.group_k,
        x.stride(0),
        y.stride(0),
        qw.data.stride(0),
        qw.scale.stride(0),
        qw.zero.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        UPCAST=is_interpreted(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k_for(qw.group_k),
    )
    return y
