"""The CPU attention backends (the torch reference and chunkwise's C++ kernel) against a dense per-request
reference over the same keys and values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from chunkwise.engine.attention import get_attention_backend
from chunkwise.engine.attention.backend import AttentionMetadata, kv_cache_shape
from chunkwise.engine.attention.cpu_backend import PAGED_PREFILL_MAX_CONTEXT, CpuAttentionBackend
from chunkwise.engine.attention.torch_ref import TorchAttentionBackend

# Its expectations depend on the CPU's choices: `make test` runs it again under each CHUNKWISE_CPU_ISA.
pytestmark = pytest.mark.isa


def build_batch(
    requests: list[tuple[int, int]],
    *,
    block_size: int,
    num_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[
    AttentionMetadata, list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor
]:
    """requests: (tokens already in the cache, tokens in this step). Returns the metadata, each request's
    full context keys/values [seq_len, H, D], and the slots of every context position (all requests)
    with the keys/values to write there."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    all_slots: list[torch.Tensor] = []
    step_slots: list[torch.Tensor] = []
    for computed, new in requests:
        seq_len = computed + new
        blocks = [perm.pop() for _ in range(math.ceil(seq_len / block_size))]
        tables.append(blocks)
        pos = torch.arange(seq_len)
        slots = torch.tensor(blocks, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        all_slots.append(slots)
        step_slots.append(slots[computed:])
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
    width = max(len(t) for t in tables)
    query_lens = [new for _, new in requests]
    seq_lens = [c + n for c, n in requests]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
        slot_mapping=torch.cat(step_slots),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return meta, keys, values, torch.cat(all_slots), torch.cat(keys), torch.cat(values)


def attend(backend, query, cache, meta, scale):
    """Plan the step, then attend (what the model does once per forward, then once per layer)."""
    plan = backend.plan(meta, query.shape[1], cache.shape[3], query.shape[2])
    return backend.attend(query, cache, plan, scale)


def dense_reference(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Per request, in float64: repeat KV heads, full causal mask with the queries at the context's end."""
    out = []
    start = 0
    num_heads = query.shape[1]
    for k, v, n in zip(keys, values, query_lens):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        q = query[start : start + n].double()
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        q_pos = torch.arange(seq_len - n, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
        start += n
    return torch.cat(out)


# (computed, new): fresh prefills, chunks starting mid-block and crossing blocks, decodes at and just
# past block boundaries, a one-token prompt, and decode rows of very different lengths.
MIXED = [(0, 7), (13, 1), (5, 9), (16, 1), (0, 1), (20, 12), (3, 1), (97, 1), (31, 1), (40, 1)]


BACKENDS = ["torch", "cpu"]


def run_case(requests, *, num_heads, num_kv_heads, block_size, dtype, backend=None, seed=0, head_dim=16):
    gen = torch.Generator().manual_seed(seed)
    backend = backend or TorchAttentionBackend()
    if isinstance(backend, str):
        backend = get_attention_backend(backend, "cpu")
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in requests) + 7
    meta, keys, values, slots, k_all, v_all = build_batch(
        requests,
        block_size=block_size,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        gen=gen,
    )
    # NaN everywhere no request wrote: reading any slot past a context would poison the output.
    cache = torch.full(
        kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    backend.write_kv(k_all, v_all, cache, slots)
    query = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = attend(backend, query, cache, meta, scale)
    ref = dense_reference(query, keys, values, meta.query_lens_host, scale)
    return out, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_fp32(backend, num_heads, num_kv_heads, block_size):
    out, ref = run_case(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=torch.float32,
        backend=backend,
    )
    assert out.dtype == torch.float32
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_batch_half(backend, dtype):
    out, ref = run_case(
        MIXED, num_heads=8, num_kv_heads=2, block_size=16, dtype=dtype, seed=1, backend=backend
    )
    assert out.dtype == dtype
    # The backend accumulates in fp32; what is left is the rounding of the output itself.
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_only_and_prefill_only_batches(backend):
    decodes = [(c, 1) for c in (0, 1, 15, 16, 17, 63, 64, 200)]
    out, ref = run_case(
        decodes, num_heads=4, num_kv_heads=2, block_size=16, dtype=torch.float32, seed=2, backend=backend
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    prefills = [(0, 33), (17, 16), (48, 2)]
    out, ref = run_case(
        prefills, num_heads=4, num_kv_heads=2, block_size=16, dtype=torch.float32, seed=3, backend=backend
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bound", [0, 16, PAGED_PREFILL_MAX_CONTEXT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_sends_prefill_to_the_kernel_or_to_sdpa_by_context(bound, dtype):
    """Prefill chunks whose context is at most the bound are one-token queries of the paged kernel, the rest
    run SDPA over their gathered context; both compute the reference, in one batch together."""
    backend = CpuAttentionBackend()
    backend.paged_prefill_max_context = bound
    gen = torch.Generator().manual_seed(5)
    meta = build_batch(
        MIXED, block_size=4, num_blocks=128, num_kv_heads=2, head_dim=16, dtype=dtype, gen=gen
    )[0]
    plan = backend.plan(meta, 8, 2, 16)
    on_sdpa = sorted(
        meta.seq_lens_host[i]
        for i, n in enumerate(meta.query_lens_host)
        if n > 8 and meta.seq_lens_host[i] > bound
    )
    assert sorted(c.slots.shape[0] for c in plan.prefill) == on_sdpa
    out, ref = run_case(
        MIXED, num_heads=8, num_kv_heads=2, block_size=4, dtype=dtype, backend=backend, seed=5
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_decode_rows_split_into_many_groups():
    # A tiny gather budget forces one group per row, and the mixed lengths force length groups anyway.
    for budget in (1, 16 * 2 * 50):
        backend = TorchAttentionBackend(decode_gather_elements=budget)
        out, ref = run_case(
            MIXED, num_heads=4, num_kv_heads=2, block_size=4, dtype=torch.float32, backend=backend, seed=4
        )
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_head_dims(head_dim, dtype):
    # Every head size the C++ kernel is built for, GQA groups of 1, 3 and 4, decodes and verify rows.
    for num_heads, num_kv_heads in ((2, 2), (6, 2), (8, 2)):
        requests = [(0, 1), (37, 1), (16, 3), (100, 1), (5, 9)]
        out, ref = run_case(
            requests,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            block_size=16,
            dtype=dtype,
            seed=head_dim,
            backend="cpu",
            head_dim=head_dim,
        )
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_cpu_backend_plans_other_head_dims_on_the_reference_path(caplog):
    # head_dim 24 is not built into the kernel: the backend says so once and still attends correctly.
    backend = get_attention_backend("cpu", "cpu")
    with caplog.at_level("WARNING"):
        for seed in (0, 1):
            out, ref = run_case(
                MIXED,
                num_heads=4,
                num_kv_heads=2,
                block_size=4,
                dtype=torch.float32,
                seed=seed,
                backend=backend,
                head_dim=24,
            )
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert sum("torch reference path" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_length_query_rows_are_skipped(backend):
    # A request scheduled for no tokens this step contributes no rows and must not disturb the others.
    requests = [(5, 3), (9, 0), (12, 1)]
    gen = torch.Generator().manual_seed(5)
    meta, keys, values, slots, k_all, v_all = build_batch(
        requests, block_size=4, num_blocks=16, num_kv_heads=2, head_dim=16, dtype=torch.float32, gen=gen
    )
    cache = torch.zeros(kv_cache_shape(16, 4, 2, 16))
    backend = get_attention_backend(backend, "cpu")
    backend.write_kv(k_all, v_all, cache, slots)
    query = torch.randn(meta.num_tokens, 4, 16, generator=gen)
    out = attend(backend, query, cache, meta, 0.25)
    keep = [0, 2]
    ref = dense_reference(query, [keys[i] for i in keep], [values[i] for i in keep], [3, 1], 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("backend", "source", "dtype"),
    [
        ("torch", torch.float32, torch.float16),
        ("cpu", torch.float32, torch.float16),  # a dtype to convert: the reference's index_copy_
        ("cpu", torch.float32, torch.float32),  # the model's layouts: chunkwise's write_kv kernel
        ("cpu", torch.bfloat16, torch.bfloat16),
    ],
)
def test_write_kv_places_each_token_in_its_slot(backend, source, dtype):
    backend = TorchAttentionBackend() if backend == "torch" else CpuAttentionBackend()
    block_size, num_kv_heads, head_dim = 4, 2, 8
    cache = torch.zeros(kv_cache_shape(6, block_size, num_kv_heads, head_dim), dtype=dtype)
    slots = torch.tensor([21, 3, 8, 9, 0])
    # Views into one fused [tokens, q + k + v heads, D] output, as the model passes its keys and values.
    qkv = torch.randn(5, 4 + 2 * num_kv_heads, head_dim).to(source)
    key, value = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    backend.write_kv(key, value, cache, slots)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(cache[0, block, offset], key[t].to(dtype))
        assert torch.equal(cache[1, block, offset], value[t].to(dtype))
    written = torch.zeros(6 * block_size, dtype=torch.bool)
    written[slots] = True
    untouched = cache.view(2, 6 * block_size, -1)[:, ~written]
    assert torch.count_nonzero(untouched) == 0


def test_get_attention_backend():
    assert get_attention_backend("torch", "cpu").name == "torch"
    # The C++ kernels build wherever the tests run (g++ is part of the test environment).
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("cpu", "cpu").name == "cpu"
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_attention_backend("cpu", "cuda")
    # Selecting Triton is tested in test_triton_attention.py.
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "prefix", "n"), [(8, 2, 1, 7), (4, 4, 300, 100), (6, 2, 64, 513)]
)
def test_a_chunk_after_its_prefix_is_the_masked_attention(dtype, heads, kv_heads, prefix, n):
    """The prefix and the chunk's own triangle, merged by log-sum-exp, against one masked SDPA call."""
    from chunkwise.engine.attention.cpu_backend import attend_after_prefix

    gen = torch.Generator().manual_seed(prefix + n)
    q = torch.randn(1, n, heads, 64, generator=gen).to(dtype).transpose(1, 2)  # strided, as the backend's
    k = torch.randn(1, prefix + n, kv_heads, 64, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(1, prefix + n, kv_heads, 64, generator=gen).to(dtype).transpose(1, 2)
    ctx = prefix + n
    mask = torch.arange(ctx)[None, :] <= torch.arange(prefix, ctx)[:, None]
    want = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125, enable_gqa=True
    )
    got = attend_after_prefix(q, k, v, prefix, 0.125)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [16, 64])  # 16: a head size the AMX kernel has no tiles for
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_runs_prefill_on_the_kernel_measured_fastest_at_its_level(monkeypatch, dtype, head_dim):
    """Prefill chunks: at the avx512 level (bf16 dot products, no AMX) bf16 and fp32 go to chunkwise's AVX-512
    kernel; at the amx level fp32 goes there too, bf16 to the AMX kernel where this process may use the tiles
    and the head size is one it has (else torch's flash attention, which runs on the tiles); below AVX-512,
    torch's. `make isa` runs this under every level."""
    from chunkwise.engine import kernels
    from chunkwise.engine.hardware import cpu_isa

    calls: dict[str, list[tuple[int, ...]]] = {"avx512": [], "amx": []}
    real, real_amx = kernels.prefill_attention, kernels.prefill_attention_amx
    monkeypatch.setattr(
        kernels, "prefill_attention", lambda *a: (calls["avx512"].append(tuple(a[1].shape)), real(*a))[1]
    )
    monkeypatch.setattr(
        kernels, "prefill_attention_amx", lambda *a: (calls["amx"].append(tuple(a[1].shape)), real_amx(*a))[1]
    )
    backend = CpuAttentionBackend()
    out, ref = run_case(
        [(0, 40), (30, 20), (50, 1)],
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        dtype=dtype,
        seed=9,
        backend=backend,
        head_dim=head_dim,
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    isa = cpu_isa().name
    probe = torch.empty(1, 1, head_dim, dtype=dtype)
    if isa == "amx" and dtype == torch.bfloat16:
        expect = "amx" if kernels.prefill_attention_amx_available(probe) else None
    elif isa in ("avx512", "amx"):
        expect = "avx512" if kernels.prefill_attention_available(probe) else None
    else:
        expect = None
    chunks = [(40, 8, head_dim), (20, 8, head_dim)]
    assert calls == {k: chunks if k == expect else [] for k in calls}


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (8, 1), (6, 6), (32, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_decode_rows_at_every_length(head_dim, num_heads, num_kv_heads, block_size, dtype):
    """Decode and verify rows through the CPU backend at lengths around the kernels' boundaries (bf16 on
    AVX512-BF16: paged_attention_bf16.cpp, scores 16 keys at a time and values 2 at a time; a group of 32
    heads, fp32 and other CPUs: the generic kernel, 8 keys at a time), against the reference."""
    requests = [(c, 1) for c in (0, 1, 14, 15, 16, 30, 31, 32, 199)] + [(20, 3), (47, 2)]
    out, ref = run_case(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=head_dim + num_heads,
        backend="cpu",
        head_dim=head_dim,
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "block_size"),
    [
        (torch.bfloat16, 8, 2, 64, 16),
        (torch.bfloat16, 8, 2, 64, 4),  # blocks smaller than a 16-key tile
        (torch.bfloat16, 8, 2, 16, 16),  # a head size without whole 32-dim tiles
        (torch.float32, 8, 2, 64, 16),
    ],
)
def test_cpu_backend_runs_decode_scores_on_amx_only_at_the_amx_level_and_its_shapes(
    dtype, heads, kv_heads, head_dim, block_size
):
    """bf16 decode rows go to the AMX op where the level is amx, the tiles are usable and the shapes are the
    kernel's; everything else to the AVX-512/AVX2 kernel. `make isa` runs this under every level."""
    from chunkwise.engine import kernels
    from chunkwise.engine.hardware import cpu_isa

    backend = CpuAttentionBackend()
    q = torch.zeros(3, heads, head_dim, dtype=dtype)
    cache = torch.zeros(kv_cache_shape(4, block_size, kv_heads, head_dim), dtype=dtype)
    want = (
        cpu_isa().name == "amx"
        and dtype == torch.bfloat16
        and head_dim in kernels.AMX_ATTENTION_HEAD_DIMS
        and block_size % 16 == 0
        and bool(torch.ops.chunkwise.has_paged_attention_amx())
    )
    assert backend._decode_on_amx(q, cache) is want
    out, ref = run_case(
        [(37, 1), (5, 1)],
        num_heads=heads,
        num_kv_heads=kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=3,
        backend=backend,
        head_dim=head_dim,
    )
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
