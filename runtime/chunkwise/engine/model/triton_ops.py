"""Triton kernels for the model's per-token elementwise layers on a GPU: RMSNorm (optionally fused with the
residual add before it) and the rotary embedding, each one launch.

Eager decode on a GPU is bound by the host: torch runs RMSNorm as ~8 ops (cast, pow, mean, add, rsqrt, mul,
cast, mul) and the rotation as ~7, each a dispatch and a launch, per layer and per step, for a few
kilobytes of activations at small batch. These do each in one launch, with the numerics of the torch path
in layers.py (Hugging Face's): the norm in fp32, rounded to the activations' dtype before the weight, the
residual sum rounded to the activations' dtype before it is normalised; the rotation in fp32 over the fp32
cos/sin table, rounded once.

Importing this module imports triton: layers.py only does so for a layer whose weights are on a CUDA
device. The CPU keeps its C++ kernels (chunkwise.engine.kernels). Tests run these under TRITON_INTERPRET=1 on CPU
tensors, and tests/engine/triton_compile_check.py compiles them for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    res_out_ptr,
    w_ptr,
    num_heads,
    dim,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_ot,
    stride_oh,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row: a token (num_heads == 1) or one head of a token (the per-head q/k norm)."""
    row = tl.program_id(0)
    t = row // num_heads
    h = row % num_heads
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum in the activations' dtype, as `x + residual` rounds it: the next layer's residual.
        r = tl.load(res_ptr + t * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_out_ptr + t * stride_rt + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
    # Rounded to the activations' dtype before the weight, as Hugging Face's RMSNorm does.
    y = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr,
    table_ptr,
    pos_ptr,
    num_heads,
    half,
    stride_xt,
    stride_xh,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per (token, block of heads), in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over
    the two halves of each head (the rotate-half layout). table: [positions, 2, half] fp32, cos then sin."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < half
    cos = tl.load(table_ptr + pos * 2 * half + offs_d, mask=mask_d, other=0.0)[None, :]
    sin = tl.load(table_ptr + pos * 2 * half + half + offs_d, mask=mask_d, other=0.0)[None, :]
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    p1 = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(p1, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(p1 + half, (b * cos + a * sin).to(x1.dtype), mask=mask)


def _norm_warps(dim: int) -> int:
    # A row of a large model (4-8k wide) is too much for 4 warps' registers at one element a thread pass.
    return 8 if dim >= 2048 else 4


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, token stride, head stride) of a [T, dim] or [T, heads, dim] view whose last dim is
    contiguous."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def supports_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() in (2, 3) and x.stride(-1) == 1 and x.dtype == weight.dtype and x.shape[-1] == weight.shape[0]
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x ([T, dim] or [T, heads, dim], last dim contiguous) into a new contiguous
    tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    t, heads, stride_xt, stride_xh = _rows(x)
    _, _, stride_ot, stride_oh = _rows(out)
    dim = x.shape[-1]
    if t:
        rms_norm_kernel[(t * heads,)](
            out,
            x,
            x,
            x,
            weight,
            heads,
            dim,
            stride_xt,
            stride_xh,
            0,
            stride_ot,
            stride_oh,
            eps,
            HAS_RESIDUAL=False,
            BLOCK_D=triton.next_power_of_2(dim),
            num_warps=_norm_warps(dim),
        )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (rounded to its dtype), in place; returns RMSNorm(residual) in a new tensor. x and
    residual: [T, dim], contiguous rows of the same strides."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    t, dim = x.shape
    if t:
        rms_norm_kernel[(t,)](
            out,
            x,
            residual,
            residual,
            weight,
            1,
            dim,
            x.stride(0),
            0,
            residual.stride(0),
            out.stride(0),
            0,
            eps,
            HAS_RESIDUAL=True,
            BLOCK_D=triton.next_power_of_2(dim),
            num_warps=_norm_warps(dim),
        )
    return out


def supports_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        supports_norm(x, weight)
        and x.dim() == 2
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and residual.stride(-1) == 1
    )


def rotary(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (last dim contiguous) rotated in place by the positions' rows of table
    [max_positions, 2, head_dim // 2] fp32 (contiguous); returns x."""
    t, heads, stride_xt, stride_xh = _rows(x)
    half = x.shape[-1] // 2
    block_h = min(triton.next_power_of_2(heads), 16)
    if t:
        rotary_kernel[(t, triton.cdiv(heads, block_h))](
            x,
            table,
            positions,
            heads,
            half,
            stride_xt,
            stride_xh,
            BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return x


def supports_rotary(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> bool:
    return (
        x.dim() == 3
        and x.stride(-1) == 1
        and x.shape[-1] % 2 == 0
        and table.is_contiguous()
        and table.dtype == torch.float32
        and positions.dtype == torch.int64
        and positions.is_contiguous()
    )
