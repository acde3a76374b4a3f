"""The LoRA update on a GPU as two Triton kernels over each row's own adapter (vLLM's punica "bgmv" shape):
shrink, h[t] = x[t] A[s]^T for the slot s of row t; expand, y[t] += h[t] B[s]^T. A row of the base model
(slot -1) costs nothing. Unlike the masked form (lora/rows.py), a row reads only its own adapter's weights,
whatever the number of slots, in two launches a projection.

Importing this module imports triton: lora/rows.py does so only for activations on a CUDA device. Tests run
the kernels under TRITON_INTERPRET=1 on CPU tensors against the masked form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    h_ptr,
    x_ptr,
    a_ptr,
    slot_ptr,
    in_features,
    width,
    stride_xt,
    stride_ht,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per row: h[t, :width] = x[t] . A[s * width + w] for each w (fp32 accumulation)."""
    t = tl.program_id(0)
    s = tl.load(slot_ptr + t)
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < width
    acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
    if s >= 0:
        rows = s * width + offs_w
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < in_features
            x = tl.load(x_ptr + t * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + rows[:, None] * in_features + offs_k[None, :],
                mask=mask_w[:, None] & mask_k[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * stride_ht + offs_w, acc, mask=mask_w)


@triton.jit
def lora_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slot_ptr,
    out_features,
    width,
    b_cols,
    stride_yt,
    stride_ht,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (row, block of outputs): y[t, n] += sum_w h[t, w] B[n, s * width + w], in place."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    s = tl.load(slot_ptr + t)
    if s >= 0:
        offs_w = tl.arange(0, BLOCK_W)
        mask_w = offs_w < width
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < out_features
        h = tl.load(h_ptr + t * stride_ht + offs_w, mask=mask_w, other=0.0)
        b = tl.load(
            b_ptr + offs_n[:, None] * b_cols + s * width + offs_w[None, :],
            mask=mask_n[:, None] & mask_w[None, :],
            other=0.0,
        ).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        y = tl.load(y_ptr + t * stride_yt + offs_n, mask=mask_n, other=0.0)
        tl.store(y_ptr + t * stride_yt + offs_n, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_n)


def supports(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and y.dim() == 2
        and x.stride(-1) == 1
        and y.stride(-1) == 1
        and a.is_contiguous()
        and b.is_contiguous()
    )


def add_lora_triton(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, num_slots: int
) -> None:
    """y += x A[s]^T B[s]^T for each row's slot s (-1: nothing), in place. a: [slots x width, in], b: [out,
    slots x width] (lora/slots.py's layout), slots: [rows] int64 on the device."""
    rows, in_features = x.shape
    if rows == 0:
        return
    width = a.shape[0] // num_slots
    out_features = y.shape[1]
    block_w = triton.next_power_of_2(width)
    h = torch.empty(rows, block_w, dtype=torch.float32, device=x.device)
    lora_shrink_kernel[(rows,)](
        h, x, a, slots, in_features, width, x.stride(0), h.stride(0), BLOCK_W=block_w, BLOCK_K=128
    )
    block_n = 128
    lora_expand_kernel[(rows, triton.cdiv(out_features, block_n))](
        y,
        h,
        b,
        slots,
        out_features,
        width,
        b.shape[1],
        y.stride(0),
        h.stride(0),
        BLOCK_W=block_w,
        BLOCK_N=block_n,
    )
