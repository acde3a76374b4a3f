"""csrc/quant_linear.cpp against the dequantized weight (quant/weights.dequantize), for each kind, group
layout and row count, in fp32 and bf16: under `make isa` also the AVX2 build's 8-lane path."""

from __future__ import annotations

import pytest
import torch

from chunkwise.engine import kernels
from chunkwise.engine.quant import compute
from chunkwise.engine.quant.compute import quantized_linear
from chunkwise.engine.quant.weights import (
    KINDS,
    QuantizedWeight,
    dequantize,
    group_scales,
    pack_int4,
    quantize_fp8,
    quantize_int8,
    unpack_int4,
)

pytestmark = pytest.mark.isa


def _weights(kind: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    w = torch.randn(n, k, generator=gen)
    if kind == "int8":
        return quantize_int8(w)
    if kind == "fp8-channel":
        return quantize_fp8(w)
    if kind == "fp8-block":
        blocks = torch.rand(-(-n // 32), -(-k // 32), generator=gen) + 0.1
        # Every e4m3 code but NaN, subnormals included: the kernel builds them from normal floats.
        codes = torch.randint(0, 255, (n, k), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        return QuantizedWeight(
            "fp8", codes.view(torch.float8_e4m3fn), group_scales(blocks, n, k, 32, 32), None, 32, k
        )
    q = torch.randint(0, 16, (n, k), generator=gen)
    g = 32 if kind == "int4-32" else 64
    scale = torch.rand(n, k // g, generator=gen) + 0.05
    zero = torch.randint(0, 16, (n, k // g), generator=gen).float()
    return QuantizedWeight("int4", pack_int4(q), scale, zero, g, k)


def test_int4_packing_round_trips() -> None:
    q = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 48)
    assert torch.equal(unpack_int4(packed), q)
    # The layout itself: byte i of a 32-column block holds columns i and 16 + i.
    assert int(packed[0, 3]) == int(q[0, 3]) | (int(q[0, 19]) << 4)


@pytest.mark.parametrize("kind", ["int8", "fp8-channel", "fp8-block", "int4-32", "int4-64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [200, 224])
def test_kernel_computes_the_dequantized_weight(kind: str, dtype: torch.dtype, k: int) -> None:
    if not kernels.available():
        pytest.skip("the CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(3)
    # Rows past every tile width (and a last AMX tile of 13 rows); a column tail where the kind allows one
    # (200: the vector kernel only), and whole 32-column chunks (224, 192: the AMX kernel too).
    n, k = 77, 192 if kind.startswith("int4") else k
    qw = _weights(kind, n, k, gen)
    reference = dequantize(qw)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 4, 5, 9, 16, 21):
        x = torch.randn(m, k, generator=gen).to(dtype)
        assert compute.cpu_kernel_runs(x, qw)
        y = quantized_linear(x, qw, bias.to(dtype))
        expected = x.float() @ reference.T + bias.to(dtype).float()
        assert y.dtype == dtype and y.shape == (m, n)
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        err = ((y.float() - expected).abs().max() / expected.abs().max()).item()
        assert err < tol, (kind, dtype, m, err)
        if compute.amx_kernel_runs(x, qw):  # a CPU with AMX: the tile kernel and the vector one agree
            vector = torch.empty_like(y)
            torch.ops.chunkwise.quant_linear(
                vector, x, qw.data, qw.scale, qw.zero, KINDS.index(qw.kind), qw.group_k, bias.to(dtype)
            )
            tiles = torch.empty_like(y)
            torch.ops.chunkwise.quant_linear_amx(
                tiles, x, qw.data, qw.scale, qw.zero, KINDS.index(qw.kind), qw.group_k, bias.to(dtype)
            )
            assert ((tiles.float() - vector.float()).abs().max() / expected.abs().max()).item() < 1e-2


@pytest.mark.parametrize("kind", ["int8", "fp8-block", "int4-64"])
def test_prefill_rows_dequantize_blocks_through_the_matmul_library(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels.available():
        pytest.skip("the CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(4)
    qw = _weights(kind, 90, 128, gen)
    # Blocks of a few rows: the loop over blocks and the last, shorter one are exercised.
    monkeypatch.setattr(compute, "DEQUANT_BLOCK_BYTES", 128 * 4 * 16)
    x = torch.randn(40, 128, generator=gen)
    y = quantized_linear(x, qw, None, small_rows=8)
    expected = x @ dequantize(qw).T
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-4)


def test_strided_input_rows_and_empty_input() -> None:
    gen = torch.Generator().manual_seed(5)
    qw = _weights("int8", 33, 64, gen)
    wide = torch.randn(3, 100, generator=gen)
    x = wide[:, 10:74]  # rows strided 100 apart
    assert torch.allclose(quantized_linear(x, qw, None), x @ dequantize(qw).T, rtol=1e-5, atol=1e-5)
    assert quantized_linear(torch.empty(0, 64), qw, None).shape == (0, 33)


def test_online_quantization_rounds_to_the_nearest_level() -> None:
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [-2.0, 1.0, 0.0, 0.01]])
    qw = quantize_int8(w)
    assert qw.data.tolist() == [[127, -64, 32, 0], [-127, 64, 0, 1]]
    assert torch.allclose(qw.scale.squeeze(1), torch.tensor([1 / 127, 2 / 127]))
    assert (dequantize(qw) - w).abs().max() <= qw.scale.max() / 2 + 1e-7
