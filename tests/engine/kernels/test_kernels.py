"""chunkwise's C++ CPU kernels against the torch code they replace, and how they are built and chosen."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from chunkwise.engine import kernels
from chunkwise.engine.model.layers import SMALL_M_ROWS, Linear, Rope, RotaryEmbedding, onednn_bf16_available

# Its expectations depend on the CPU's choices: `make test` runs it again under each CHUNKWISE_CPU_ISA.
pytestmark = pytest.mark.isa

kernels.load()
ops = torch.ops.chunkwise
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def assert_close_in(dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32: reduction order only. Half precision: one unit in the last place of the dtype, where the
    # kernel's fp32 intermediate landed on the other side of a rounding boundary.
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf(dtype):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(37, 96, generator=gen) * 3
    x = base.to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-5)
    assert_close_in(dtype, out, hf_rms_norm(x, weight, 1e-5))
    # Rows with a stride (a view into a wider tensor) read correctly.
    wide = torch.randn(37, 200, generator=gen).to(dtype)
    view = wide[:, 8:104]
    out2 = torch.empty(37, 96, dtype=dtype)
    ops.rms_norm(out2, view, weight, 1e-5)
    assert_close_in(dtype, out2, hf_rms_norm(view, weight, 1e-5))


@pytest.mark.parametrize("dim", [96, 100])  # 100: a row that ends in part of a vector
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(dtype, dim):
    """residual += x (rounded to the dtype, as torch's add rounds it), x = rms_norm(residual), in place: the
    same bits as the unfused path it replaces in RMSNorm.add, on rows with a stride."""
    gen = torch.Generator().manual_seed(dim)
    wide_x = (torch.randn(37, dim + 8, generator=gen) * 3).to(dtype)
    wide_r = (torch.randn(37, dim + 24, generator=gen) * 3).to(dtype)
    x, residual = wide_x[:, 8:], wide_r[:, :dim]
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    want_sum = x + residual
    want = torch.empty_like(want_sum)
    ops.rms_norm(want, want_sum, weight, 1e-5)
    untouched = wide_r[:, dim:].clone()
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, want_sum)
    assert torch.equal(x, want)
    assert torch.equal(wide_r[:, dim:], untouched)
    assert_close_in(dtype, x, hf_rms_norm(want_sum, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_add_runs_the_fused_kernel_with_the_unfused_results(dtype):
    """RMSNorm.add on CPU: the fused kernel (the sum into `residual`, the norm into `x`), the same values as
    the layer's torch path."""
    from chunkwise.engine.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    x, residual = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
    norm.fused = False
    want_sum, want = norm.add(x.clone(), residual.clone())
    norm.prepare()
    assert norm.fused
    got_sum, got = norm.add(x, residual)
    assert got_sum is residual and got is x  # in place, as vLLM's fused_add_rms_norm
    assert torch.equal(got_sum, want_sum)
    assert_close_in(dtype, got, want)


def test_write_kv_refuses_what_it_does_not_write():
    cache = torch.zeros(2, 3, 4, 2, 8)
    kv = torch.randn(5, 2, 2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_kv(cache, kv[:, 0], kv[:, 1], torch.tensor([0, 1, 2, 3, 12]))
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.write_kv(cache, kv[:, 0].half(), kv[:, 1].half(), torch.arange(5))
    with pytest.raises(RuntimeError, match="one contiguous row"):
        ops.write_kv(cache, kv[:, 0].transpose(0, 1).contiguous().transpose(0, 1), kv[:, 1], torch.arange(5))
    with pytest.raises(RuntimeError, match="int64, one per token"):
        ops.write_kv(cache, kv[:, 0], kv[:, 1], torch.arange(5, dtype=torch.int32))
    assert torch.count_nonzero(cache) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_torch_path_in_place_on_a_strided_view(dtype):
    head_dim, heads = 64, 6
    rotary = RotaryEmbedding(head_dim, max_positions=512, theta=10000.0)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 512, (23,), generator=gen)
    # q and k inside a fused qkv output: rows are strided, as the model hands them over.
    qkv = torch.randn(23, (heads + 2) * head_dim, generator=gen).to(dtype)
    x = qkv[:, : heads * head_dim].view(23, heads, head_dim)
    rope: Rope = rotary.lookup(positions, dtype)
    want = rotary.apply(x.clone(), rope)  # not fused: a rotated copy
    untouched = qkv[:, heads * head_dim :].clone()
    ops.rotary_embedding(x, rope.table, positions)
    assert_close_in(dtype, x, want)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(19, 2 * 130, generator=gen) * 6).to(dtype)
    out = torch.empty(19, 130, dtype=dtype)
    ops.silu_and_mul(out, x)
    assert_close_in(dtype, out, F.silu(x[:, :130]) * x[:, 130:])
    # Saturated inputs: silu(-100) = 0 (not NaN), silu(100) = 100.
    extreme = torch.tensor([[-100.0, 100.0, 2.0, 3.0]])
    out = torch.empty(1, 2)
    ops.silu_and_mul(out, extreme)
    torch.testing.assert_close(out, torch.tensor([[0.0, 300.0]]))


@pytest.mark.parametrize("k", [512, 67])  # a multiple of the vector width, and one with a scalar tail
@pytest.mark.parametrize("n", [1, 24, 101, 250])  # every tile width's remainder; blocks across threads
def test_linear_small_m_matches_torch_at_every_row_count_of_its_tiles(k, n):
    torch.manual_seed(n * k)
    w = torch.randn(n, k)
    bias = torch.randn(n)
    # Rows are taken from a wider buffer: the kernel reads the input's row stride, not a contiguous copy.
    wide = torch.randn(SMALL_M_ROWS, k + 5)
    for m in [*range(0, 10), 31, SMALL_M_ROWS]:
        x = wide[:m, 2 : 2 + k]
        for b in (None, bias):
            out = torch.full((m, n), float("nan"))
            ops.linear_small_m(out, x, w, b)
            torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_runs_the_small_row_kernel_up_to_its_rows_and_onednn_past_them(monkeypatch):
    """Both paths of a prepared fp32 Linear compute F.linear; which one ran is seen by counting the kernel's
    calls (the op is looked up at call time, so a counting wrapper stands in for it). An AVX2 CPU's choice,
    pinned so it runs on any x86 build (with AVX-512 the weight is packed for oneDNN instead)."""
    if kernels.isa() not in ("avx2", "avx512"):
        pytest.skip(f"the small-row kernel runs on x86 builds only (this build: {kernels.isa()})")
    monkeypatch.setattr("chunkwise.engine.model.layers.cpu_has_avx512", lambda: False)
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    want_w, want_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepare(widen_half_on_cpu=True)
    assert layer.kernel == "small-m+onednn"
    calls = []
    real = torch.ops.chunkwise.linear_small_m

    class CountingOps:
        def linear_small_m(self, *args):
            calls.append(args[1].shape[0])
            return real(*args)

    monkeypatch.setattr(torch.ops, "chunkwise", CountingOps())
    bound = SMALL_M_ROWS
    for m in (1, bound, bound + 1, 300):
        x = torch.randn(m, 96)
        torch.testing.assert_close(layer(x), F.linear(x, want_w, want_b), atol=1e-4, rtol=1e-5)
    assert calls == [1, bound]


def test_the_build_is_keyed_by_source_torch_and_isa(monkeypatch, tmp_path):
    name = kernels._library_name("avx2", ["-mavx2"])
    assert name != kernels._library_name("avx2", ["-mavx2", "-mfma"])
    assert name != kernels._library_name("x86_64", [])
    assert name.startswith("chunkwise_cpu_ops-avx2-")
    # A fresh cache directory gets its own build; a second call reuses it.
    monkeypatch.setenv("CHUNKWISE_KERNEL_CACHE", str(tmp_path / "cache"))
    first = kernels.build()
    assert first.parent == tmp_path / "cache" and first.is_file()
    mtime = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == mtime
    # A build baked into an image is used from there, with no compiler to be found.
    baked = tmp_path / "baked"
    baked.mkdir()
    (baked / first.name).write_bytes(first.read_bytes())
    monkeypatch.setenv("CHUNKWISE_KERNEL_DIR", str(baked))
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert kernels.build() == baked / first.name


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CHUNKWISE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-anywhere")
    with pytest.raises(kernels.KernelUnavailable, match="no C\\+\\+ compiler"):
        kernels.build()
    monkeypatch.setenv("CXX", "false")  # runs, prints nothing, fails
    with pytest.raises(kernels.KernelUnavailable, match="failed"):
        kernels.build()
    assert not list(tmp_path.glob("*.so")), "a failed build must leave nothing to load"


def test_auto_falls_back_to_the_torch_reference_and_says_so(tmp_path):
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        "from chunkwise.engine.attention import get_attention_backend\n"
        "print('backend', get_attention_backend('auto', 'cpu').name)\n"
        "try:\n"
        "    get_attention_backend('cpu', 'cpu')\n"
        "except Exception as e:\n"
        "    print('explicit', type(e).__name__)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "CXX": "no-such-compiler", "CHUNKWISE_KERNEL_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "backend torch" in result.stdout
    assert "CPU kernels are unavailable: no C++ compiler" in result.stdout
    assert "explicit KernelUnavailable" in result.stdout


def test_the_build_command_prints_the_library():
    result = subprocess.run(
        [sys.executable, "-m", "chunkwise.engine.kernels"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    path = result.stdout.strip().splitlines()[-1]
    assert path.endswith(".so") and kernels.load().name == path.rsplit("/", 1)[-1]


@pytest.mark.parametrize("cols", [1, 5, 16, 17, 1000, 32003])
def test_argmax_is_torchs_first_largest_index(cols):
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(9, cols, generator=gen)
    # Ties: the first index wins, wherever the copies fall relative to the vector lanes.
    x[1] = 0.0
    x[2, cols // 2 :] = x[2].max() + 1
    x[3] = float("-inf")
    x[4, cols - 1] = float("inf")
    x[5, cols // 3] = float("nan")  # torch answers the NaN's index
    x[6, :] = 1.0
    x[6, cols - 1] = float("nan")
    x[7] = torch.randint(0, 3, (cols,), generator=gen).float()  # many ties
    out = torch.full((9,), -1, dtype=torch.int64)
    ops.argmax(out, x)
    assert out.tolist() == x.argmax(dim=-1).tolist()
    # Rows of a wider tensor, and the dispatching helper that picks the kernel or torch.
    wide = torch.randn(4, cols + 7, generator=gen)[:, 3 : 3 + cols]
    assert kernels.argmax(wide).tolist() == wide.argmax(dim=-1).tolist()
    half = x[:, : max(cols // 2, 1)].bfloat16()
    assert kernels.argmax(half).tolist() == half.argmax(dim=-1).tolist()


def test_avx512_builds_target_avx512_with_bf16_and_the_isa_override_never_builds_above_the_cpu(monkeypatch):
    from chunkwise.engine import hardware

    def kernels_for(asked: str, detected: str) -> tuple[str, list[str]]:
        monkeypatch.setattr(hardware, "cpu_isa", lambda: hardware.CpuIsa(asked, detected, "test"))
        return kernels._isa_flags()

    name, flags = kernels_for("amx", "amx")
    assert name == "avx512" and "-mavx512bf16" in flags and "-mavx2" in flags
    assert kernels_for("avx512", "avx512")[0] == "avx512"
    # Asked above the hardware (the suite's override on an AVX2 machine): choices follow, the build does not.
    assert kernels_for("amx", "avx2") == ("avx2", kernels.AVX2_FLAGS)
    # Asked below it: an AVX2 build on an AVX-512 machine, as a real AVX2 CPU gets.
    assert kernels_for("avx2", "amx") == ("avx2", kernels.AVX2_FLAGS)
    assert kernels_for("aarch64", "aarch64") == ("aarch64", [])


@pytest.mark.parametrize("vocab", [5, 17, 40])
def test_exponential_race_draws_from_the_softmax_of_the_scaled_row(vocab):
    """Token frequencies over many rows (one seed each) against softmax(x / T), by chi-square at p = 0.001;
    -inf tokens never drawn; the same seed draws the same token, wherever its row sits."""
    gen = torch.Generator().manual_seed(vocab)
    row = torch.randn(vocab, generator=gen) * 1.5
    row[vocab // 2] = float("-inf")
    rows = 60000
    x = row.expand(rows, vocab).contiguous()
    seeds = torch.randint(0, 1 << 62, (rows,), generator=gen)
    for temperature in (1.0, 0.5, 3.0):
        tokens = kernels.exponential_race(x, torch.full((rows,), 1 / temperature), seeds)
        counts = torch.bincount(tokens, minlength=vocab).double()
        assert counts[vocab // 2] == 0
        probs = (row.double() / temperature).softmax(-1)
        keep = probs > 0
        expected = probs[keep] * rows
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        # The 0.001 critical value of chi-square grows about as df + 3.1 sqrt(df) + 6 up to df = 40.
        df = int(keep.sum()) - 1
        assert chi2 < df + 3.1 * df**0.5 + 6, (temperature, chi2, df)
    again = kernels.exponential_race(x[:50].flip(0), torch.ones(50), seeds[:50].flip(0))
    assert torch.equal(again.flip(0), kernels.exponential_race(x[:50], torch.ones(50), seeds[:50]))
    # Different seeds do not all agree (the hash is not constant).
    assert len(set(kernels.exponential_race(x[:200], torch.ones(200), seeds[:200]).tolist())) > 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_computes_f_linear_at_every_row_count(monkeypatch, dtype):
    """With AVX-512 (pinned here, so this runs on any CPU) fp32 and bf16 weights go to oneDNN's layout."""
    monkeypatch.setattr("chunkwise.engine.model.layers.cpu_has_avx512", lambda: True)
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    layer.to(dtype)
    want_w, want_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepare(widen_half_on_cpu=False)
    if dtype == torch.bfloat16 and not onednn_bf16_available():
        assert layer.kernel == "torch"  # an AVX2 CPU's oneDNN refuses bf16; torch's GEMM still computes it
    else:
        assert layer.kernel == "onednn-packed" and layer.weight.is_mkldnn
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # 33, 300, 1000: row counts the layer pads up to onednn_rows' (34, 304, 1024) and cuts back.
    for m in (0, 1, 3, 33, 64, 300, 1000):
        x = torch.randn(m, 96).to(dtype)
        got = layer(x)
        assert got.dtype == dtype and got.shape == (m, 200)
        torch.testing.assert_close(got, F.linear(x, want_w, want_b), atol=tol * 10, rtol=tol)


def test_onednn_rows_are_exact_for_decode_and_few_per_doubling_past_it():
    from chunkwise.engine.model.layers import ONEDNN_EXACT_ROWS, onednn_rows

    counts = [onednn_rows(m) for m in range(1, 8193)]
    assert counts[:ONEDNN_EXACT_ROWS] == list(range(1, ONEDNN_EXACT_ROWS + 1))
    for m, c in enumerate(counts, start=1):
        assert m <= c <= m + m / 16, (m, c)
        assert onednn_rows(c) == c  # a count is its own bucket: padded inputs are not padded again
    assert counts == sorted(counts)
    # Sixteen counts per doubling past the exact ones: 32 + 16 * 8 kernels per layer shape up to 8,192 rows.
    assert len(set(counts)) == ONEDNN_EXACT_ROWS + 16 * 8


# -- bf16 and fp32 prefill attention (csrc/prefill_attention.cpp) --------------------------------------------------


def _masked_fp32(q, k, v, scale, dtype=torch.float32):
    """The reference: fp32 (or `dtype`) SDPA with the chunk's queries at the end of the context."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    out = F.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1),
        k.to(dtype).transpose(0, 1),
        v.to(dtype).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _need_prefill_kernel(dtype=torch.bfloat16):
    if not kernels.prefill_attention_available(torch.empty(1, 1, 64, dtype=dtype)):
        pytest.skip(f"the kernels are built for {kernels.isa()} here: no {dtype} prefill kernel")


# fp32: the sums' order and the exp polynomial (relative error about 2e-7); bf16: the probabilities are
# rounded to bf16 before the values are summed (as torch's flash attention does in bf16), and the output to
# bf16: errors of a few bf16 ulps.
PREFILL_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("head_dim", kernels.ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "prefix", "n"),
    [
        (8, 2, 0, 1),  # one token, nothing before it
        (8, 2, 0, 37),  # a first chunk: the causal triangle alone
        (4, 4, 130, 5),  # a group of one: a tile's four rows are four queries
        (6, 2, 17, 23),  # a group of three: tiles straddle queries
        (16, 2, 300, 129),  # a group of eight: two tiles a query; ctx past two key blocks of 128
        (8, 8, 1000, 64),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_attention_kernel_matches_fp32_attention(dtype, head_dim, heads, kv_heads, prefix, n):
    _need_prefill_kernel(dtype)
    gen = torch.Generator().manual_seed(head_dim * 1000 + prefix + n)
    # Strided rows, as the backend passes them: query a slice of a wider [tokens, H, D] batch, key and value
    # one half of a [ctx, 2, KV, D] pair.
    q = (torch.randn(n + 3, heads, head_dim, generator=gen) * 1.5).to(dtype)[2 : 2 + n]
    kv = torch.randn(prefix + n, 2, kv_heads, head_dim, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    scale = head_dim**-0.5
    out = torch.full((n, heads, head_dim), float("nan"), dtype=dtype)
    kernels.prefill_attention(out, q, k, v, scale)
    want = _masked_fp32(q, k, v, scale)
    tol = PREFILL_TOL[dtype]
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_attention_kernel_with_a_peaked_softmax_and_a_late_maximum(dtype):
    """Scores that grow along the context: each key block brings a new maximum, so the running sums and
    outputs are rescaled block after block; and one query's scores dwarf the others."""
    _need_prefill_kernel(dtype)
    n, prefix, heads, d = 40, 600, 4, 64
    ctx = prefix + n
    k = (torch.linspace(0, 6, ctx)[:, None, None] * torch.ones(ctx, 1, d)).to(dtype)
    v = torch.randn(ctx, 1, d, generator=torch.Generator().manual_seed(0)).to(dtype)
    q = torch.ones(n, heads, d).to(dtype)
    q[3] *= 4
    out = torch.empty(n, heads, d, dtype=dtype)
    kernels.prefill_attention(out, q, k, v, d**-0.5)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), _masked_fp32(q, k, v, d**-0.5), atol=2e-2, rtol=2e-2)
        return
    # fp32 scores near 190 (query 3) carry rounding of 1e-5 into every weight, whichever way they are summed:
    # against fp64 attention torch's fp32 flash attention is off by 9e-5 here, its masked fp32 SDPA by 1.3e-4,
    # this kernel by 8.5e-5. So fp64 is the reference, with room for that.
    want = _masked_fp32(q, k, v, d**-0.5, torch.float64)
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=2e-4)


# -- bf16 prefill attention on AMX tiles (csrc/prefill_attention_amx.cpp) --------------------------------------


def _need_amx_kernel(head_dim=64):
    if not kernels.prefill_attention_amx_available(torch.empty(1, 1, head_dim, dtype=torch.bfloat16)):
        pytest.skip("no AMX tiles here (lscpu: amx_bf16, amx_tile): the AMX prefill kernel cannot run")


@pytest.mark.parametrize("head_dim", kernels.AMX_ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "prefix", "n"),
    [
        (8, 2, 0, 1),  # one token, nothing before it
        (8, 2, 0, 37),  # a first chunk: three row blocks, the last partial
        (4, 4, 130, 5),  # fewer rows than a block, after a prefix that ends inside a 32-key group
        (6, 2, 17, 23),
        (16, 2, 300, 129),
        (8, 8, 1000, 64),
    ],
)
def test_prefill_attention_amx_matches_fp32_attention(head_dim, heads, kv_heads, prefix, n):
    _need_amx_kernel(head_dim)
    gen = torch.Generator().manual_seed(head_dim * 1000 + prefix + n)
    bf = torch.bfloat16
    q = (torch.randn(n + 3, heads, head_dim, generator=gen) * 1.5).to(bf)[2 : 2 + n]
    kv = torch.randn(prefix + n, 2, kv_heads, head_dim, generator=gen).to(bf)
    k, v = kv[:, 0], kv[:, 1]
    scale = head_dim**-0.5
    out = torch.full((n, heads, head_dim), float("nan"), dtype=bf)
    kernels.prefill_attention_amx(out, q, k, v, scale)
    tol = PREFILL_TOL[bf]
    torch.testing.assert_close(out.float(), _masked_fp32(q, k, v, scale), atol=tol, rtol=tol)


def test_prefill_attention_amx_with_a_peaked_softmax_and_a_late_maximum():
    _need_amx_kernel()
    n, prefix, heads, d = 40, 600, 4, 64
    ctx = prefix + n
    bf = torch.bfloat16
    k = (torch.linspace(0, 6, ctx)[:, None, None] * torch.ones(ctx, 1, d)).to(bf)
    v = torch.randn(ctx, 1, d, generator=torch.Generator().manual_seed(0)).to(bf)
    q = torch.ones(n, heads, d).to(bf)
    q[3] *= 4
    out = torch.empty(n, heads, d, dtype=bf)
    kernels.prefill_attention_amx(out, q, k, v, d**-0.5)
    torch.testing.assert_close(out.float(), _masked_fp32(q, k, v, d**-0.5), atol=2e-2, rtol=2e-2)


def test_prefill_attention_amx_refuses_what_it_does_not_compute():
    _need_amx_kernel()
    bf = torch.bfloat16
    q, k = torch.zeros(4, 8, 64, dtype=bf), torch.zeros(8, 2, 64, dtype=bf)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="bf16 tensors only"):
        kernels.prefill_attention_amx(out, q.float(), k, k, 1.0)
    with pytest.raises(RuntimeError, match="context must include the chunk"):
        kernels.prefill_attention_amx(out, q, k[:3], k[:3], 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernels.prefill_attention_amx(
            out[:, :6], q[:, :6], torch.zeros(8, 4, 64, dtype=bf), k.new_zeros(8, 4, 64), 1.0
        )
    q80 = torch.zeros(4, 8, 80, dtype=bf)
    with pytest.raises(RuntimeError, match="no kernel for head_dim 80"):
        kernels.prefill_attention_amx(
            torch.empty_like(q80), q80, torch.zeros(8, 2, 80, dtype=bf), torch.zeros(8, 2, 80, dtype=bf), 1.0
        )


def test_prefill_attention_amx_says_why_it_cannot_run_without_tiles():
    """Where the tiles are missing (no AMX, or the kernels built below AVX-512) the op refuses by name rather
    than computing anything; where they exist this is the availability the backend reads."""
    if kernels.prefill_attention_amx_available(torch.empty(1, 1, 64, dtype=torch.bfloat16)):
        assert torch.ops.chunkwise.has_prefill_attention_amx()
        return
    kernels.load()
    assert not torch.ops.chunkwise.has_prefill_attention_amx()
    q = torch.zeros(4, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="no AMX tiles here"):
        kernels.prefill_attention_amx(torch.empty_like(q), q, q[:, :2], q[:, :2], 1.0)


# -- bf16 decode attention with the scores on AMX tiles (csrc/paged_attention_amx.cpp) --------------------------


def _decode_case(heads, kv_heads, head_dim, block_size, lens, seed):
    """Rows of one query token over paged contexts of `lens` tokens, blocks shuffled, every slot no row owns
    NaN (a kernel that reads past a context poisons its row)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    blocks = sum(per_row) + 3
    cache = torch.full((2, blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    order = torch.randperm(blocks, generator=gen)
    tables = torch.zeros(len(lens), max(per_row), dtype=torch.int64)
    k_rows, v_rows, used = [], [], 0
    for r, n in enumerate(lens):
        tables[r, : per_row[r]] = order[used : used + per_row[r]]
        used += per_row[r]
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        for p in range(n):
            b, o = tables[r, p // block_size], p % block_size
            cache[0, b, o], cache[1, b, o] = k[p], v[p]
        k_rows.append(k)
        v_rows.append(v)
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * 1.5).to(torch.bfloat16)
    rows = torch.arange(len(lens))
    return q, cache, tables, rows, torch.tensor(lens, dtype=torch.int64), k_rows, v_rows


@pytest.mark.parametrize("head_dim", kernels.AMX_ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (8, 8), (16, 1), (14, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_amx_matches_fp32_attention_and_the_avx512_kernel(
    head_dim, heads, kv_heads, block_size
):
    if not kernels.paged_attention_amx_available(torch.bfloat16, heads, kv_heads, head_dim, block_size):
        pytest.skip("no AMX tiles here (lscpu: amx_bf16, amx_tile): the AMX decode kernel cannot run")
    # Lengths around a 16-key group and a block: a group's last key, one past it, several blocks.
    lens = [1, 15, 16, 17, 33, 100, 301]
    q, cache, tables, rows, lens_t, k_rows, v_rows = _decode_case(
        heads, kv_heads, head_dim, block_size, lens, 7
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    torch.ops.chunkwise.paged_attention_amx(out, q, cache, tables, rows, rows, lens_t, scale)
    other = torch.full_like(q, float("nan"))
    torch.ops.chunkwise.paged_attention(other, q, cache, tables, rows, rows, lens_t, scale)
    for r in range(len(lens)):
        want = F.scaled_dot_product_attention(
            q[r : r + 1].float().transpose(0, 1)[None],
            k_rows[r].float().transpose(0, 1)[None],
            v_rows[r].float().transpose(0, 1)[None],
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[r : r + 1].float(), want, atol=1.6e-2, rtol=1.6e-2)
    # The same arithmetic as the AVX-512 bf16 kernel but for the order of the score sums: bf16 ulps apart.
    torch.testing.assert_close(out.float(), other.float(), atol=8e-3, rtol=8e-3)


def test_paged_attention_amx_refuses_what_it_does_not_compute():
    if not kernels.paged_attention_amx_available(torch.bfloat16, 8, 2, 64, 16):
        kernels.load()
        assert not torch.ops.chunkwise.has_paged_attention_amx()
        q, cache, tables, rows, lens_t, _, _ = _decode_case(8, 2, 64, 16, [5], 0)
        with pytest.raises(RuntimeError, match="no AMX tiles here"):
            torch.ops.chunkwise.paged_attention_amx(
                torch.empty_like(q), q, cache, tables, rows, rows, lens_t, 1.0
            )
        return
    op = torch.ops.chunkwise.paged_attention_amx
    q, cache, tables, rows, lens_t, _, _ = _decode_case(8, 2, 64, 8, [5], 0)
    with pytest.raises(RuntimeError, match="multiple of 16 tokens, got 8"):
        op(torch.empty_like(q), q, cache, tables, rows, rows, lens_t, 1.0)
    q, cache, tables, rows, lens_t, _, _ = _decode_case(32, 1, 64, 16, [5], 0)
    with pytest.raises(RuntimeError, match="at most 16 per KV head"):
        op(torch.empty_like(q), q, cache, tables, rows, rows, lens_t, 1.0)
    q, cache, tables, rows, lens_t, _, _ = _decode_case(8, 2, 64, 16, [5], 0)
    with pytest.raises(RuntimeError, match="bf16 query, output and cache only"):
        op(torch.empty_like(q.float()), q.float(), cache.float(), tables, rows, rows, lens_t, 1.0)
    q, cache, tables, rows, lens_t, _, _ = _decode_case(8, 2, 80, 16, [5], 0)
    with pytest.raises(RuntimeError, match="no kernel for head_dim 80"):
        op(torch.empty_like(q), q, cache, tables, rows, rows, lens_t, 1.0)
    assert not kernels.paged_attention_amx_available(torch.bfloat16, 8, 2, 80, 16)
    assert not kernels.paged_attention_amx_available(torch.float32, 8, 2, 64, 16)


def test_prefill_attention_kernel_refuses_what_it_does_not_compute():
    _need_prefill_kernel()
    bf = torch.bfloat16
    q, k = torch.zeros(4, 8, 64, dtype=bf), torch.zeros(8, 2, 64, dtype=bf)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="bf16 or fp32 tensors, all of one dtype"):
        kernels.prefill_attention(out, q.float(), k, k, 1.0)
    with pytest.raises(RuntimeError, match="bf16 or fp32 tensors, all of one dtype"):
        h = q.half()
        kernels.prefill_attention(torch.empty_like(h), h, k.half(), k.half(), 1.0)
    with pytest.raises(RuntimeError, match="context must include the chunk"):
        kernels.prefill_attention(out, q, k[:3], k[:3], 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernels.prefill_attention(
            out[:, :6], q[:, :6], torch.zeros(8, 4, 64, dtype=bf), k.new_zeros(8, 4, 64), 1.0
        )
    with pytest.raises(RuntimeError, match="no kernel for head_dim 48"):
        q48 = torch.zeros(4, 8, 48, dtype=bf)
        kernels.prefill_attention(
            torch.empty_like(q48), q48, torch.zeros(8, 2, 48, dtype=bf), torch.zeros(8, 2, 48, dtype=bf), 1.0
        )
