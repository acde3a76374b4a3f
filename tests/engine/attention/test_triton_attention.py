"""The Triton attention backend, run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1), against
the torch reference backend and a float64 dense reference over the same keys and values.

triton is imported unconditionally: CI installs it, and a missing install must fail here, not skip.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  (fails the module loudly where triton is missing)

from chunkwise.engine.attention import get_attention_backend
from chunkwise.engine.attention.backend import AttentionMetadata, kv_cache_shape
from chunkwise.engine.attention.torch_ref import TorchAttentionBackend
from chunkwise.engine.attention.triton_backend import (
    TritonAttentionBackend,
    TritonAttentionConfig,
    row_splits,
)

REPO = Path(__file__).resolve().parents[3]

# Small tiles, so that contexts of a few dozen tokens already span several KV tiles and query blocks.
SMALL_TILES = TritonAttentionConfig(short_tile_n=16, long_block_m=16, long_tile_n=16)


class Batch:
    """A step over a paged cache: requests given as (tokens already cached, tokens in this step)."""

    def __init__(
        self,
        requests: list[tuple[int, int]],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int = 16,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.num_blocks = sum(math.ceil((c + n) / block_size) for c, n in requests) + 5
        # A random permutation: block tables are neither contiguous nor ordered.
        perm = torch.randperm(self.num_blocks, generator=gen).tolist()
        tables: list[list[int]] = []
        ctx_slots: list[torch.Tensor] = []
        step_slots: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for computed, new in requests:
            seq_len = computed + new
            blocks = [perm.pop() for _ in range(math.ceil(seq_len / block_size))]
            tables.append(blocks)
            pos = torch.arange(seq_len)
            slots = torch.tensor(blocks, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
            ctx_slots.append(slots[:computed])
            step_slots.append(slots[computed:])
            self.keys.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
            self.values.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
        query_lens = [n for _, n in requests]
        seq_lens = [c + n for c, n in requests]
        width = max(len(t) for t in tables) + 1  # one column of pure padding
        self.meta = AttentionMetadata(
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
        self.ctx_slots = torch.cat(ctx_slots)
        self.ctx_keys = torch.cat([k[:c] for k, (c, _) in zip(self.keys, requests)])
        self.ctx_values = torch.cat([v[:c] for v, (c, _) in zip(self.values, requests)])
        self.step_keys = torch.cat([k[c:] for k, (c, _) in zip(self.keys, requests)])
        self.step_values = torch.cat([v[c:] for v, (c, _) in zip(self.values, requests)])
        self.query = torch.randn(self.meta.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        self.scale = head_dim**-0.5
        # NaN wherever no request wrote: reading any slot outside a context would poison the output.
        self.cache = torch.full(
            kv_cache_shape(self.num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
        )

    def fill_cache(self, writer: TorchAttentionBackend | TritonAttentionBackend) -> None:
        TorchAttentionBackend().write_kv(self.ctx_keys, self.ctx_values, self.cache, self.ctx_slots)
        writer.write_kv(self.step_keys, self.step_values, self.cache, self.meta.slot_mapping)

    def dense(self) -> torch.Tensor:
        """float64, per request, KV heads repeated, queries at the end of the context."""
        out = []
        start = 0
        num_heads = self.query.shape[1]
        for k, v, n in zip(self.keys, self.values, self.meta.query_lens_host):
            seq_len = k.shape[0]
            group = num_heads // k.shape[1]
            q = self.query[start : start + n].double()
            kk = k.double().repeat_interleave(group, dim=1)
            vv = v.double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, kk) * self.scale
            q_pos = torch.arange(seq_len - n, seq_len)[:, None]
            scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
            start += n
        return torch.cat(out)


def plan_for(backend, batch: Batch):
    _, num_heads, head_dim = batch.query.shape
    return backend.plan(batch.meta, num_heads, batch.cache.shape[3], head_dim)


def run_triton(batch: Batch, config: TritonAttentionConfig | None = None) -> torch.Tensor:
    backend = TritonAttentionBackend(config)
    batch.fill_cache(backend)
    return backend.attend(batch.query, batch.cache, plan_for(backend, batch), batch.scale)


def run_torch(batch: Batch) -> torch.Tensor:
    backend = TorchAttentionBackend()
    return backend.attend(batch.query, batch.cache, plan_for(backend, batch), batch.scale)


# (computed, new): fresh prefills, chunks starting mid-block and crossing blocks, decodes at and just past
# block boundaries, a one-token prompt, a 3-token verify-sized row, decode rows of very different lengths.
MIXED = [(0, 7), (13, 1), (5, 9), (16, 1), (0, 1), (20, 30), (3, 1), (97, 1), (31, 3), (40, 1)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(4, 4), (4, 2), (8, 2), (16, 2)],
    ids=["mha", "gqa2", "gqa4", "gqa8"],
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_fp32(num_heads, num_kv_heads, block_size):
    batch = Batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    out = run_triton(batch)
    assert out.dtype == torch.float32
    assert out.shape == batch.query.shape
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, run_torch(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype,tol",
    [
        # Both backends accumulate in fp32 and round only the output: within about an fp16 ulp.
        (torch.float16, 2e-3),
        # The interpreter truncates fp32 -> bf16 where torch rounds: up to two bf16 ulps apart.
        (torch.bfloat16, 1e-2),
    ],
    ids=["fp16", "bf16"],
)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_mixed_batch_half(dtype, tol, num_heads, num_kv_heads):
    batch = Batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype, seed=1)
    out = run_triton(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), run_torch(batch).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), batch.dense(), atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp16_with_the_gpu_arithmetic(num_splits):
    # The interpreter widens loads to fp32 (its bf16 is broken); a GPU keeps fp16 dot operands and rounds
    # the softmax weights to fp16 before the PV product. fp16 works in the interpreter, so run that path.
    backend = TritonAttentionBackend(TritonAttentionConfig(short_tile_n=16, num_splits=num_splits))
    backend.upcast = False
    batch = Batch(MIXED, num_heads=8, num_kv_heads=2, dtype=torch.float16, seed=9)
    batch.fill_cache(backend)
    out = backend.attend(batch.query, batch.cache, plan_for(backend, batch), batch.scale)
    torch.testing.assert_close(out.float(), run_torch(batch).float(), atol=2e-3, rtol=2e-3)


def test_single_token_decodes_across_block_boundaries():
    decodes = [(c, 1) for c in (0, 1, 14, 15, 16, 31, 32, 63, 64, 200)]
    batch = Batch(decodes, num_heads=4, num_kv_heads=2, seed=2)
    backend = TritonAttentionBackend(SMALL_TILES)
    plan = backend.launch_plan(batch.meta, 4, 2, batch.query.device)
    assert (plan.run_short, plan.run_long) == (True, False)
    out = run_triton(batch, SMALL_TILES)
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-5, rtol=1e-5)


def test_prefill_chunks_across_query_blocks_and_tiles():
    # With 16-row long blocks and a group of 2, a query block holds 8 tokens: these chunks span several
    # blocks, start mid-block and mid-tile, and end in partially filled cache blocks.
    prefills = [(0, 70), (33, 40), (100, 17), (5, 9)]
    batch = Batch(prefills, num_heads=4, num_kv_heads=2, seed=3)
    plan = TritonAttentionBackend(SMALL_TILES).launch_plan(batch.meta, 4, 2, batch.query.device)
    assert (plan.run_short, plan.run_long, plan.long_block_q) == (False, True, 8)
    out = run_triton(batch, SMALL_TILES)
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-5, rtol=1e-5)


def test_short_and_long_launch_boundary():
    # Group 4 pads to 4 rows per token: a short block holds 4 query tokens. Rows of 4 go to the short
    # launch (several queries in one program), rows of 5 to the long one, both in one batch.
    requests = [(10, 4), (10, 5), (0, 4), (0, 5), (50, 1), (17, 16), (18, 17)]
    batch = Batch(requests, num_heads=8, num_kv_heads=2, seed=4)
    plan = TritonAttentionBackend(SMALL_TILES).launch_plan(batch.meta, 8, 2, batch.query.device)
    assert (plan.short_block_q, plan.long_block_q, plan.run_short, plan.run_long) == (4, 4, True, True)
    out = run_triton(batch, SMALL_TILES)
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_decode(num_splits):
    # Flash-decoding: contexts split across programs, partial softmaxes merged. Seven splits of a 220-token
    # context leave the last splits empty for the short rows, which must weigh nothing.
    requests = [(219, 1), (2, 1), (40, 3), (64, 1), (0, 1), (20, 25)]
    batch = Batch(requests, num_heads=8, num_kv_heads=2, block_size=4, seed=5)
    config = TritonAttentionConfig(short_tile_n=16, num_splits=num_splits)
    plan = TritonAttentionBackend(config).launch_plan(batch.meta, 8, 2, batch.query.device)
    assert plan.num_splits == num_splits
    out = run_triton(batch, config)
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-5, rtol=1e-5)


def test_split_heuristic_fills_the_gpu_only_when_rows_are_few():
    backend = TritonAttentionBackend(TritonAttentionConfig(short_tile_n=64))
    few = Batch([(2047, 1)], num_heads=4, num_kv_heads=2, block_size=64).meta
    many = Batch([(15, 1)] * 40, num_heads=4, num_kv_heads=2).meta
    # The interpreter counts as one SM, so split on a pretend 66-SM GPU via a fake CUDA device index.
    from chunkwise.engine.attention import triton_backend

    triton_backend._SM_COUNT[7] = 66
    try:
        cuda = torch.device("cuda", 7)
        one_row = backend.launch_plan(few, 4, 2, cuda)
        # 2 programs (1 row x 2 KV heads) want 4 waves of 66, 132 splits; 32 tiles of 64 allow at most 16
        # of 2 tiles.
        assert one_row.num_splits == 16
        assert row_splits(2048, one_row.num_splits, 64) == (16, 2)
        assert backend.launch_plan(many, 4, 2, cuda).num_splits == 1
    finally:
        del triton_backend._SM_COUNT[7]


def test_graph_plan_splits_each_row_by_its_own_length():
    """A decode graph is planned once for max_model_len; each row must still cut its own context into the
    plan's splits (issue 30: at 131072 a 4k context ran on 8 CTAs). Short and long rows in one batch, run
    with the splits a 66-SM GPU gets for 4 rows at 4096 tokens: every row matches the reference, and the
    partials written (NaN-filled before) are exactly the splits row_splits gives each row's seq_len."""
    from chunkwise.engine.attention import triton_backend

    config = TritonAttentionConfig(short_tile_n=16)
    backend = TritonAttentionBackend(config)
    requests = [(1, 1), (199, 1), (699, 1), (999, 1)]
    batch = Batch(requests, num_heads=4, num_kv_heads=2, block_size=16, seed=14)
    batch.fill_cache(backend)
    capture_meta = dataclasses.replace(batch.meta, seq_lens_host=[4096] * 4, max_seq_len=4096)
    triton_backend._SM_COUNT[7] = 66
    try:
        launch = backend.launch_plan(capture_meta, 4, 2, torch.device("cuda", 7))
    finally:
        del triton_backend._SM_COUNT[7]
    # 8 programs want 4 waves of 66: 33 splits, trimmed to the 32 that 256 tiles of 16 fill (8 tiles each).
    assert (launch.num_splits, launch.run_short, launch.run_long) == (32, True, False)
    rows = 4 * launch.short_block_q * 4 * launch.num_splits
    part_m = backend._buffer("part_m", rows, torch.float32, batch.query.device)
    part_m.fill_(float("nan"))
    plan = triton_backend.TritonPlan(batch.meta, 4, 2, 16, launch)
    out = backend.attend(batch.query, batch.cache, plan, batch.scale)
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-5, rtol=1e-5)

    written = ~part_m.view(4, launch.short_block_q, 4, launch.num_splits)[:, 0].isnan()  # [row, head, split]
    for row, seq_len in enumerate(batch.meta.seq_lens_host):
        splits, _ = row_splits(seq_len, launch.num_splits, 16)
        expected = torch.arange(launch.num_splits) < splits
        assert torch.equal(written[row], expected.expand(4, -1)), (seq_len, written[row])
    # The work follows each row's length: 13 splits of one tile for 200 tokens (a split size fixed by the
    # plan's 4096 would give it 2 splits of 8 tiles), 32 of 2 for 1000, one split for a 2-token row.
    assert [row_splits(n, 32, 16) for n in batch.meta.seq_lens_host] == [(1, 1), (13, 1), (22, 2), (32, 2)]


def test_a_step_allocates_nothing_once_buffers_have_grown(monkeypatch):
    """Issue 30: the backend allocated its output and three partial buffers per layer (128 a step at 32
    layers). Kernels stubbed out (the interpreter allocates for its own copies): once a step of the largest
    batch has run, plan + write_kv + attend over several layers and smaller batches allocate no tensor,
    and the output is the same buffer step after step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from chunkwise.engine.attention import triton_kernels

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    class CountAllocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.allocations: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if any(f in name for f in ("empty", "zeros", "full", "ones", "clone", "_to_copy", "contiguous")):
                self.allocations.append(name)
            return func(*args, **(kwargs or {}))

    backend = TritonAttentionBackend(TritonAttentionConfig(short_tile_n=16, num_splits=4))
    for name in ("paged_attention_kernel", "merge_splits_kernel", "write_kv_kernel"):
        monkeypatch.setattr(triton_kernels, name, Launch())
    largest = Batch([(100, 1)] * 8 + [(0, 20)], num_heads=4, num_kv_heads=2, seed=15)
    steps = [largest] + [
        Batch([(50 + 9 * i, 1)] * n, num_heads=4, num_kv_heads=2, seed=16 + n)
        for i, n in enumerate((1, 5, 8, 3))
    ]

    def step(batch: Batch) -> list[int]:
        plan = plan_for(backend, batch)
        ptrs = []
        for _layer in range(4):
            backend.write_kv(batch.step_keys, batch.step_values, batch.cache, batch.meta.slot_mapping)
            ptrs.append(backend.attend(batch.query, batch.cache, plan, batch.scale).data_ptr())
        return ptrs

    first = step(largest)
    with CountAllocations() as counter:
        later = [ptr for batch in steps for ptr in step(batch)]
    assert counter.allocations == []
    assert set(first + later) == {first[0]}


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(24, 6, 2), (32, 3, 1)])
def test_padded_head_dim_and_group(head_dim, num_heads, num_kv_heads):
    # A head_dim that is not a power of two and a query group of 3 both take the masked padding paths.
    batch = Batch(MIXED[:6], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=6)
    out = run_triton(batch, SMALL_TILES)
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-5, rtol=1e-5)


def test_zero_length_query_rows_are_skipped():
    requests = [(5, 3), (9, 0), (12, 1), (7, 0)]
    batch = Batch(requests, num_heads=4, num_kv_heads=2, block_size=4, seed=7)
    out = run_triton(batch, SMALL_TILES)
    assert out.shape[0] == 4
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-5, rtol=1e-5)


def test_empty_batch():
    backend = TritonAttentionBackend()
    cache = torch.zeros(kv_cache_shape(4, 4, 2, 16))
    meta = AttentionMetadata(
        query_start_loc=torch.zeros(1, dtype=torch.long),
        seq_lens=torch.zeros(0, dtype=torch.long),
        block_tables=torch.zeros(0, 1, dtype=torch.long),
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_lens_host=[],
        seq_lens_host=[],
        max_query_len=0,
        max_seq_len=0,
        block_size=4,
    )
    out = backend.attend(torch.zeros(0, 4, 16), cache, backend.plan(meta, 4, 2, 16), 0.25)
    assert out.shape == (0, 4, 16)
    backend.write_kv(torch.zeros(0, 2, 16), torch.zeros(0, 2, 16), cache, meta.slot_mapping)
    assert torch.count_nonzero(cache) == 0


@pytest.mark.parametrize(
    "src_dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
def test_write_kv_places_each_token_in_its_slot(src_dtype, cache_dtype):
    block_size, num_kv_heads, head_dim, num_blocks = 4, 3, 24, 6
    gen = torch.Generator().manual_seed(8)
    cache = torch.zeros(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=cache_dtype)
    expected = cache.clone()
    slots = torch.tensor([21, 3, 8, 9, 0, -1, 17])
    # A key that is a strided view (every other token of a bigger tensor), as a fused projection gives.
    key = torch.randn(14, num_kv_heads, head_dim, generator=gen).to(src_dtype)[::2]
    value = torch.randn(7, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    TritonAttentionBackend().write_kv(key, value, cache, slots)
    keep = slots >= 0  # a negative slot is a padding token and is not written
    TorchAttentionBackend().write_kv(key[keep], value[keep], expected, slots[keep])
    assert torch.equal(cache, expected)
    assert torch.count_nonzero(cache.view(2, -1, num_kv_heads * head_dim).abs().sum(-1)) == 2 * 6


def test_triton_write_then_attend_in_a_tiny_model():
    """The tiny preset's forward pass over a mixed batch, Triton vs torch backend (writes and attention)."""
    from chunkwise.engine.model.loader import load_model
    from chunkwise.engine.model.presets import PRESETS

    config = PRESETS["tiny"]
    requests = [(0, 12), (9, 1), (30, 1), (0, 5)]
    hidden = {}
    for name, backend in (
        ("torch", TorchAttentionBackend()),
        ("triton", TritonAttentionBackend(SMALL_TILES)),
    ):
        model = load_model("tiny", dtype=torch.float32, device="cpu", backend=backend).model
        batch = Batch(
            requests,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            block_size=8,
            seed=12,
        )
        caches = [batch.cache.clone() for _ in range(config.num_hidden_layers)]
        for cache in caches:
            # Earlier steps' keys and values, as the torch backend would have left them.
            TorchAttentionBackend().write_kv(batch.ctx_keys, batch.ctx_values, cache, batch.ctx_slots)
        positions = torch.cat([torch.arange(c, c + n) for c, n in requests])
        ids = torch.randint(
            0, config.vocab_size, (len(positions),), generator=torch.Generator().manual_seed(13)
        )
        with torch.no_grad():
            hidden[name] = model(ids, positions, caches, batch.meta)
    torch.testing.assert_close(hidden["triton"], hidden["torch"], atol=1e-4, rtol=1e-4)


def test_engine_greedy_output_matches_the_torch_backend():
    """The whole engine, chunked prefill (16-token steps) mixing chunks with decode rows over 4-token
    blocks: Triton attention must not change a single greedy token."""
    from chunkwise import LLM, SamplingParams

    prompts = ["Hello there, how are", "The quick brown fox jumps over the lazy dog again and again", "a"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    tokens = {}
    for name in ("torch", "triton"):
        llm = LLM(
            model="tiny", dtype="float32", attention_backend=name, max_num_batched_tokens=16, block_size=4
        )
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [len(t) for t in tokens["triton"]] == [8, 8, 8]
    assert tokens["triton"] == tokens["torch"]


# -- selection -----------------------------------------------------------------------------------------


def test_get_attention_backend_selection(monkeypatch):
    assert get_attention_backend("torch", "cpu").name == "torch"
    assert get_attention_backend("torch", "cuda").name == "torch"
    # On CPU, auto is chunkwise's C++ kernels (test_kernels.py covers their fallback), never Triton.
    assert get_attention_backend("auto", "cpu").name == "cpu"
    # conftest runs the kernels in the interpreter, so "triton" works on CPU here.
    assert get_attention_backend("triton", "cpu").name == "triton"
    assert get_attention_backend("triton", "cuda:0").name == "triton"
    # Interpreted kernels would run on host copies of GPU memory: "auto" keeps the reference then.
    assert get_attention_backend("auto", "cuda").name == "torch"
    with pytest.raises(ValueError, match="runs on CUDA"):
        get_attention_backend("triton", "mps")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="only in Triton's interpreter: set TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu")


def _python(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime"), **env_extra}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def test_selection_without_triton_installed_and_lazy_import():
    code = """
import sys
sys.modules["triton"] = None  # as if triton were not installed
import chunkwise.engine.attention as A
print(A.get_attention_backend("auto", "cuda").name)
try:
    A.get_attention_backend("triton", "cuda")
except ValueError as e:
    print(e)
"""
    result = _python(code, {"TRITON_INTERPRET": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "torch",
        "the Triton attention backend needs the triton package (pip install triton)",
    ]
    lazy = _python(
        "import sys, chunkwise.engine.attention as A\nA.get_attention_backend('auto', 'cpu')\n"
        "print('triton' in sys.modules)",
        {},
    )
    assert lazy.returncode == 0, lazy.stderr
    assert lazy.stdout.strip() == "False"


def test_compiled_kernels_refuse_cpu_tensors():
    code = """
import torch
from chunkwise.engine.attention.triton_backend import TritonAttentionBackend
b = TritonAttentionBackend()
try:
    b.write_kv(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(2, 1, 4, 1, 16), torch.zeros(1, dtype=torch.long))
except ValueError as e:
    print(e)
"""
    result = _python(code, {"TRITON_INTERPRET": "0"})
    assert result.returncode == 0, result.stderr
    assert "runs only in Triton's interpreter" in result.stdout


def test_kernels_compile_for_nvidia_gpus(tmp_path):
    """What the interpreter cannot catch: the backend's launches compile to cubins for sm_90 and sm_80."""
    result = _python(
        f"import runpy; runpy.run_path({str(REPO / 'tests/engine/triton_compile_check.py')!r}, run_name='__main__')",
        {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # One line per distinct variant: 4 jobs x (write_kv, short, short+split, merge, long), less the second
    # job's short kernels, which are the first job's.
    assert len(lines) == 16 and all(": ok (" in line for line in lines), result.stdout
    # The backend's warmup compiled every attention variant before a launch needed it.
    assert all(line.endswith("[launch]") == line.startswith("write_kv") for line in lines), result.stdout
    # Prefill tiles of 64+ rows get Hopper's warpgroup MMA; decode's 16-row tiles the classic one.
    assert sum(line.startswith("paged_attention_kernel long sm_90: ok (wgmma") for line in lines) == 3
    short = [line for line in lines if line.startswith("paged_attention_kernel short")]
    assert sum("sm_90" in line for line in short) == 4
    # Decode is multi-buffered: two K/V buffers at least, and the loop leaves copies in flight (a wait with
    # num > 0) instead of waiting for every copy each iteration.
    for line in short:
        match = re.search(r"(\d+) K/V buffers, async_wait num<=(\d+)", line)
        assert match and int(match[1]) >= 2 and int(match[2]) > 0, line


def test_serving_compiles_no_variant_after_the_first_forward():
    """Issue 30: while serving, Triton compiled a variant (1-3 s each) whenever the block table's width hit a
    new "== 1" / "multiple of 16" class and for every power of two of KV splits the merge saw. Steps with
    varying batch sizes, table widths, contexts and splits, after the first forward, must meet only the
    variants that forward compiled: short, short+split and long attention, one merge, one KV write."""
    script = REPO / "tests/engine/triton_compile_check.py"
    result = _python(
        f"import runpy, sys; sys.argv = [{str(script)!r}, '--variants', '300']; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')",
        {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    counts = json.loads(result.stdout.splitlines()[-1])
    assert counts == {
        "write_kv_kernel": {"first_forward": 1, "serving": 1, "new_in_serving": 0},
        "paged_attention_kernel": {"first_forward": 3, "serving": 3, "new_in_serving": 0},
        "merge_splits_kernel": {"first_forward": 1, "serving": 1, "new_in_serving": 0},
    }


# -- the GPU benchmark's smoke mode ------------------------------------------------------------------------


def test_gpu_bench_smoke_mode(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "run_attention_bench", REPO / "bench/gpu/run_attention_bench.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules.
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "attention_bench.json").read_text())
    assert report["smoke"] is True
    assert report["correctness"] and all(c["ok"] for c in report["correctness"])
    assert {"decode", "prefill", "mixed", "e2e_decode"} <= set(report)
    table = (tmp_path / "attention_bench.md").read_text()
    assert "smoke run" in table
