"""A quantized linear weight as chunkwise holds it, whatever checkpoint format it came from.

Every format is converted at load into one of three kinds, each with a scale per output row and per group of
`group_k` input columns (a per-tensor or per-block scale is repeated on each row it covers: a fused
projection stacks parts whose per-tensor scales differ, and a row's scales then never depend on its
neighbours):

- "int8": int8 [N, K], w = q * scale (symmetric; `--quantization int8`, compressed-tensors INT8).
- "fp8": float8_e4m3fn [N, K], w = float(q) * scale (DeepSeek-V3 / Qwen3-FP8 block scales, compressed-tensors
  FP8 per tensor or per channel, `--quantization fp8`).
- "int4": uint8 [N, K / 2], two unsigned 4-bit values a byte, w = (q - zero) * scale (AWQ, GPTQ). Within each
  block of 32 input columns, byte i holds column i in its low nibble and column 16 + i in its high one
  (INT4_BLOCK): a kernel loading 16 bytes gets two runs of 16 consecutive columns, one per nibble.

The dequantized weight (`dequantize`) is the numerical definition: the CPU kernel (csrc/quant_linear.cpp)
computes exactly these weights, in fp32, and tests compare against transformers on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("int8", "fp8", "int4")
# Input columns per int4 packing block (see the module docstring).
INT4_BLOCK = 32
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass
class QuantizedWeight:
    kind: str
    data: torch.Tensor  # int8 [N, K] | float8_e4m3fn [N, K] | uint8 [N, K // 2]
    scale: torch.Tensor  # float32 [N, ceil(K / group_k)]
    zero: torch.Tensor | None  # float32 [N, K // group_k] (int4), else None
    group_k: int
    in_features: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantized weight kind {self.kind!r}")
        # What the CPU kernels need of the layout, decided once (compute.py reads them on every call).
        self.kind_id = KINDS.index(self.kind)
        one_group = self.scale.shape[1] == 1
        self.vector_layout = one_group or self.group_k % 16 == 0
        self.tile_layout = self.in_features % 32 == 0 and (one_group or self.group_k % 32 == 0)

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        zero = self.zero.numel() * self.zero.element_size() if self.zero is not None else 0
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4 + zero

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows [start, stop) (views)."""
        zero = self.zero[start:stop] if self.zero is not None else None
        return QuantizedWeight(
            self.kind, self.data[start:stop], self.scale[start:stop], zero, self.group_k, self.in_features
        )


def empty_like_shape(
    kind: str, out_features: int, in_features: int, group_k: int, device: torch.device | str
) -> QuantizedWeight:
    """An uninitialised weight of this shape (the loader fills it)."""
    groups = -(-in_features // group_k)
    if kind == "int4":
        check_int4_shape(in_features, group_k)
        data = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        zero: torch.Tensor | None = torch.empty(out_features, groups, dtype=torch.float32, device=device)
    else:
        dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
        data = torch.empty(out_features, in_features, dtype=dtype, device=device)
        zero = None
    scale = torch.empty(out_features, groups, dtype=torch.float32, device=device)
    return QuantizedWeight(kind, data, scale, zero, group_k, in_features)


def check_int4_shape(in_features: int, group_k: int) -> None:
    if in_features % INT4_BLOCK or group_k % INT4_BLOCK or in_features % group_k:
        raise ValueError(
            f"4-bit weights need input features ({in_features}) and a group size ({group_k}) that are multiples "
            f"of {INT4_BLOCK}, the group size dividing the features"
        )


def group_scales(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """A [ceil(rows / block_rows), ceil(cols / block_cols)] block scale repeated on each row it covers:
    [rows, ceil(cols / block_cols)] float32."""
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    scale = scale.float().reshape(expected) if scale.numel() == expected[0] * expected[1] else scale
    if tuple(scale.shape) != expected:
        raise ValueError(f"a scale of shape {tuple(scale.shape)} where {expected} was expected")
    return scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in [0, 15] -> [N, K // 2] uint8 in chunkwise's layout (INT4_BLOCK)."""
    n, k = q.shape
    if k % INT4_BLOCK:
        raise ValueError(f"4-bit packing needs a multiple of {INT4_BLOCK} input features, got {k}")
    blocks = q.to(torch.uint8).reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [N, K // 2] uint8 -> [N, K] uint8 in [0, 15]."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)
    return torch.cat((blocks & 0xF, blocks >> 4), dim=2).reshape(n, half * 2)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full-precision weight [N, K] the quantized one stands for, computed in float32 then cast."""
    k = qw.in_features
    scale = qw.scale.float().repeat_interleave(qw.group_k, dim=1)[:, :k]
    if qw.kind == "int4":
        assert qw.zero is not None
        zero = qw.zero.float().repeat_interleave(qw.group_k, dim=1)[:, :k]
        w = (unpack_int4(qw.data).float() - zero) * scale
    else:
        w = qw.data.float() * scale
    return w.to(dtype)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with a scale per output row (absmax / 127), as vLLM's and torchao's weight-only int8:
    what `--quantization int8` does to each linear weight at load."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w32 / scale).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.contiguous(), scale.contiguous(), None, w.shape[1], w.shape[1])


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    """float8_e4m3fn with a scale per output row (absmax / 448): `--quantization fp8`."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", q.contiguous(), scale.contiguous(), None, w.shape[1], w.shape[1])
