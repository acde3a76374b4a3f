"""The GPU compute paths for quantized weights, on CPU: the fp8 W8A8 linear (quant/cuda_fp8.py) through CPU's
torch._scaled_mm, checked also against the CUDA op's argument rules the CPU one does not enforce; the int4
dequant-GEMM (quant/triton_int4.py) under TRITON_INTERPRET=1, and compiled (not run) for sm_90 and sm_80.
Both against dequantize(), the numerical definition. No GPU ran any of this."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkwise.engine.quant.cuda_fp8 import fp8_rowwise_supported, fp8_scaled_mm_linear
from chunkwise.engine.quant.triton_int4 import int4_linear, int4_supported
from chunkwise.engine.quant.weights import QuantizedWeight, dequantize, pack_int4, quantize_fp8

REPO = Path(__file__).resolve().parents[3]


def row_errors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Each row's relative error (L2): activation quantization's error is relative to the row's size."""
    return (got.float() - expected).norm(dim=1) / expected.norm(dim=1)


def fp8_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return quantize_fp8(torch.randn(n, k, generator=gen) / k**0.5)


def int4_weight(n: int, k: int, group_k: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group_k, generator=gen) * 0.05 + 0.005
    zero = torch.randint(0, 16, (n, k // group_k), generator=gen).float()
    return QuantizedWeight("int4", pack_int4(q), scale, zero, group_k, k)


# -- fp8: torch._scaled_mm with per-token activation scales ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_matches_the_dequantized_weight_within_activation_quantization(
    dtype: torch.dtype, rows: int, with_bias: bool
) -> None:
    """The weight is exactly fp8 already, so the only error is the activations' rounding to e4m3: a few
    percent of each row (a bias, exact, only dilutes it, so it is checked on the product alone too)."""
    qw = fp8_weight(64, 128)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=gen).to(dtype)
    bias = torch.randn(64, generator=gen).to(dtype) if with_bias else None
    got = fp8_scaled_mm_linear(x, qw, bias)
    product = x.float() @ dequantize(qw).T
    expected = product + bias.float() if bias is not None else product
    assert got.shape == (rows, 64) and got.dtype == dtype
    assert row_errors(got, expected).max() < 0.05
    if bias is not None:
        assert row_errors(got.float() - bias.float(), product).max() < 0.06


@pytest.mark.parametrize("ratio", [1e3, 1e6])
def test_fp8_scales_each_token_on_its_own(ratio: float) -> None:
    """A token 1000x (or 10^6x) larger than its neighbours must not cost them their precision, as a scale
    shared by the batch would: at 10^6 such a scale rounds the small rows to zero (the control below)."""
    qw = fp8_weight(64, 128, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 128, generator=gen)
    x[1] *= ratio
    got = fp8_scaled_mm_linear(x, qw)
    expected = x @ dequantize(qw).T
    assert row_errors(got, expected).max() < 0.05
    if ratio == 1e6:
        shared = x.abs().max() / 448.0
        per_tensor = (x / shared).to(torch.float8_e4m3fn).float() * shared @ dequantize(qw).T
        assert row_errors(per_tensor, expected)[[0, 2, 3]].min() > 0.5


def test_fp8_a_zero_token_gives_the_bias_not_nan() -> None:
    """Padding rows are all zeros: their scale is floored, not 0, so 0 / scale stays 0."""
    qw = fp8_weight(32, 64)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    x[1] = torch.randn(64).to(torch.bfloat16)
    bias = torch.randn(32).to(torch.bfloat16)
    got = fp8_scaled_mm_linear(x, qw, bias)
    assert torch.equal(got[0], bias) and torch.equal(got[2], bias)


def test_fp8_no_tokens_gives_an_empty_output() -> None:
    qw = fp8_weight(48, 64)
    got = fp8_scaled_mm_linear(torch.empty(0, 64, dtype=torch.bfloat16), qw, torch.zeros(48))
    assert got.shape == (0, 48) and got.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_calls_scaled_mm_as_its_cuda_version_requires(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU's _scaled_mm accepts layouts, scale shapes and bias dtypes that CUDA's refuses
    (aten/src/ATen/native/cuda/ScaledBlas.cpp): the arguments are checked against CUDA's rules here."""
    calls: list[dict[str, Any]] = []
    real = torch._scaled_mm

    def spy(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        calls.append({"a": a, "b": b, **kwargs})
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    qw = fp8_weight(48, 96)
    x = torch.randn(5, 96).to(dtype)
    bias = torch.randn(48)
    got = fp8_scaled_mm_linear(x, qw, bias)
    assert len(calls) == 1
    call = calls[0]
    a, b, scale_a, scale_b = call["a"], call["b"], call["scale_a"], call["scale_b"]
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert a.is_contiguous() and b.shape == (96, 48) and b.stride() == (1, 96)  # row-major x column-major
    assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
    # Row-wise scaling: fp32 scales, scale_a [M, 1] and scale_b [1, N], contiguous (as is scale_b.t()).
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.shape == (5, 1) and scale_a.is_contiguous()
    assert scale_b.shape == (1, 48) and scale_b.t().is_contiguous() and scale_b.stride(1) == 1
    assert call["out_dtype"] == dtype
    # No bias with an fp32 output (added after instead); otherwise one in the output's dtype.
    if dtype == torch.float32:
        assert call.get("bias") is None
    else:
        assert call["bias"].dtype == dtype
    expected = x.float() @ dequantize(qw).T + bias
    assert row_errors(got, expected).max() < 0.05


def test_fp8_takes_only_row_scaled_weights_of_aligned_shapes() -> None:
    """Block scales, other kinds and dimensions that are not multiples of 16 go to another path; calling
    anyway is a clear error, not a CUDA assertion."""
    assert fp8_rowwise_supported(fp8_weight(48, 64))
    qw = fp8_weight(48, 256)
    block_scaled = QuantizedWeight("fp8", qw.data, qw.scale.repeat(1, 2), None, 128, 256)
    int8 = QuantizedWeight("int8", torch.zeros(48, 64, dtype=torch.int8), torch.ones(48, 1), None, 64, 64)
    refused = [block_scaled, int8, fp8_weight(40, 64), fp8_weight(48, 72)]
    for weight in refused:
        assert not fp8_rowwise_supported(weight)
        x = torch.randn(2, weight.in_features)
        with pytest.raises(ValueError, match="multiples of 16"):
            fp8_scaled_mm_linear(x, weight)
    with pytest.raises(ValueError, match="input features"):
        fp8_scaled_mm_linear(torch.randn(2, 32), fp8_weight(48, 64))


# -- int4: the Triton dequant-GEMM, interpreted ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "n", "k", "group_k"),
    [(1, 40, 64, 32), (5, 100, 128, 64), (33, 70, 256, 128), (5, 130, 256, 32), (33, 65, 128, 128)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_fp32_matches_dequantize(rows: int, n: int, k: int, group_k: int, with_bias: bool) -> None:
    """fp32 activations get an fp32 dot: the result is dequantize()'s to rounding. The shapes cover row and
    column tiles cut short, one K tile per group (32) and two per group (128), and several groups."""
    qw = int4_weight(n, k, group_k, seed=rows + k)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = int4_linear(x, qw, bias)
    expected = x @ dequantize(qw).T + (bias if bias is not None else 0)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize(
    ("dtype", "rows", "n", "k", "group_k"),
    [
        (torch.bfloat16, 1, 40, 64, 32),
        (torch.bfloat16, 33, 70, 256, 128),
        (torch.float16, 5, 100, 128, 64),
    ],
)
def test_int4_16_bit_activations(dtype: torch.dtype, rows: int, n: int, k: int, group_k: int) -> None:
    """16-bit activations meet weights rounded to their dtype, summed in fp32, rounded once more on output.
    Loose for bf16: on top of its 8-bit mantissa, the interpreter truncates fp32 to bf16 where a GPU rounds
    to nearest (both the weights and the output), which biases results by up to ~1% of the largest."""
    qw = int4_weight(n, k, group_k, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    got = int4_linear(x, qw, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    expected = x.float() @ dequantize(qw).T + bias.float()
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_int4_strided_activations_and_a_weight_shard() -> None:
    """Activations that are a column slice of a wider tensor (rows strided) and a weight that is a view of
    some rows of a bigger one (qw.rows, as tensor parallelism shards it): the kernel follows the strides."""
    full = int4_weight(96, 128, 64, seed=5)
    qw = full.rows(32, 80)
    wide = torch.randn(7, 200)
    x = wide[:, 40:168]
    got = int4_linear(x, qw)
    torch.testing.assert_close(got, x @ dequantize(qw).T, rtol=1e-4, atol=1e-4 * got.abs().max().item())
    torch.testing.assert_close(got, (x @ dequantize(full).T)[:, 32:80], rtol=1e-4, atol=1e-3)


def test_int4_no_tokens_gives_an_empty_output() -> None:
    got = int4_linear(torch.empty(0, 64, dtype=torch.bfloat16), int4_weight(48, 64, 32))
    assert got.shape == (0, 48) and got.dtype == torch.bfloat16


def test_int4_supported_refuses_what_the_kernel_cannot_read() -> None:
    qw = int4_weight(48, 64, 32)
    x = torch.randn(3, 64)
    assert int4_supported(x, qw)
    fp8 = fp8_weight(48, 64)
    no_zero = QuantizedWeight("int4", qw.data, qw.scale, None, 32, 64)
    refused = [
        (x, fp8),
        (x, no_zero),
        (torch.randn(3, 32), qw),  # not the weight's input features
        (torch.randn(64, 3).t(), qw),  # columns strided
        (x.to(torch.float64), qw),
        (x[None], qw),
    ]
    for acts, weight in refused:
        assert not int4_supported(acts, weight)
        with pytest.raises(ValueError, match="int4_linear cannot take"):
            int4_linear(acts, weight)


def test_int4_kernel_compiles_for_nvidia_gpus(tmp_path: Path) -> None:
    """What the interpreter cannot catch (a shape tl.dot cannot tile, a type the compiler rejects): through
    int4_linear, the kernel compiles to cubins for sm_90 and sm_80 (tests/engine/triton_compile_check.py's
    stand-in driver; nothing launches), at an 8B model's projection in bf16, fp16 and fp32 and at decode and
    prefill row counts. Prefill tiles on sm_90 get Hopper's warpgroup MMA."""
    code = textwrap.dedent(
        """
        import runpy
        import torch
        from triton.runtime import driver
        from chunkwise.engine.quant import triton_int4 as T
        from chunkwise.engine.quant.weights import QuantizedWeight

        check = runpy.run_path("tests/engine/triton_compile_check.py", run_name="int4_compile_check")
        stand_in = check["StandInDriver"]
        driver.set_active(stand_in())
        assert not T.is_interpreted()
        kernel = T.int4_linear_kernel

        class Compile:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    compiled = kernel.warmup(*args, grid=grid, **kwargs)
                    assert compiled.asm["cubin"], "no cubin"
                    ptx = compiled.asm["ptx"]
                    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
                    print(f"{args[1].dtype} M={args[6]} sm_{stand_in.arch}: ok ({mma})", flush=True)
                return launch

        T.int4_linear_kernel = Compile()
        n, k, g = 4096, 4096, 128
        scale = torch.zeros(n, k // g)
        qw = QuantizedWeight("int4", torch.zeros(n, k // 2, dtype=torch.uint8), scale, scale.clone(), g, k)
        for arch in (90, 80):
            stand_in.arch = arch
            for dtype, m in ((torch.bfloat16, 1), (torch.bfloat16, 200), (torch.float16, 20), (torch.float32, 3)):
                T.int4_linear(torch.zeros(m, k, dtype=dtype), qw, torch.zeros(n, dtype=dtype))
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "runtime"),
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),
        "TRITON_DEFAULT_FP_FUSION": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 8 and all(": ok (" in line for line in lines), result.stdout
    assert "torch.bfloat16 M=200 sm_90: ok (wgmma)" in lines, result.stdout
    assert "torch.bfloat16 M=1 sm_80: ok (mma.sync)" in lines, result.stdout
