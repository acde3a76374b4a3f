"""Triton kernels for the mixed batch over the paged KV cache, and the KV-cache write.

Importing this module imports triton; chunkwise.engine.attention only does so when the Triton backend is chosen.
Whether the kernels run compiled (CUDA) or in Triton's CPU interpreter is fixed when this module is first
imported: `triton.jit` reads TRITON_INTERPRET at decoration time.

Attention is one kernel launched in up to two shapes:

- "short" programs take a whole request whose query fits one small block (decode rows, speculative verifies):
  one program per (request, KV head[, KV split]). The query heads sharing a KV head are stacked into the rows
  of the score tile (padded to a power of two) and, for small groups, so are several query tokens, to fill
  the 16 rows tl.dot needs for a tensor-core shape. Decode is bandwidth-bound, so when there are too few
  (request, KV head) pairs to fill the GPU the context is split across programs (flash-decoding) and a
  second kernel merges the partial softmaxes. The number of splits is the launch's (grid axis 2, fixed for
  a captured CUDA graph); each row cuts its *own* context into that many pieces, so a short row in a graph
  planned for the longest context still spreads over every split, and splits past its last tile idle.
- "long" programs take BLOCK_Q query tokens x the query group of one KV head of a prefill chunk, with a
  larger tile for tensor-core throughput. Each program finds its (request, query block) from
  query_start_loc inside the kernel, so the launch needs no per-step host tensors (and can sit in a CUDA
  graph).

Both use an online softmax in fp32 (scores in the log2 domain: exp2 is the fast instruction).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A running maximum that starts finite: rows with nothing to attend to yet (padding rows, empty KV splits)
# then give exp2(-inf - NEG_BIG) = 0 and exp2(NEG_BIG - NEG_BIG) = 1 instead of NaN. (A kernel may read
# a global only if it is a tl.constexpr.)
NEG_BIG = tl.constexpr(-1.0e30)


# Triton compiles a variant per "equals 1" / "multiple of 16" of each int argument; these change from step
# to step (stride_bt is the block table's width, a function of the step's longest context), and a compile in
# the middle of serving costs seconds. The strides left specialised are fixed for an engine's life, and their
# divisibility is what lets the KV loads vectorise.
@triton.jit(do_not_specialize=["num_reqs", "short_max_q", "stride_bt"])
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    num_reqs,
    num_heads,
    qk_scale,
    short_max_q,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_bt,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    LONG: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SEARCH: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if LONG:
        # Request i's query blocks are numbered from query_start_loc[i] // BLOCK_Q + i: the +i makes room
        # for the extra block a request gets when its tokens straddle a BLOCK_Q boundary, so numbers never
        # overlap and the grid needs only num_tokens // BLOCK_Q + num_reqs programs. First-block numbers
        # strictly increase, so this program's request is the count of those <= pid, minus one: a few
        # independent wide loads, where a binary search is a chain of dependent scalar ones. (Inline, not
        # a helper: the interpreter pays milliseconds per nested jit call.)
        count = 0
        for start in range(0, num_reqs, SEARCH):
            offs = start + tl.arange(0, SEARCH)
            valid = offs < num_reqs
            first_block = tl.load(query_start_loc_ptr + offs, mask=valid, other=0) // BLOCK_Q + offs
            count += tl.sum(((first_block <= pid) & valid).to(tl.int32), 0)
        req = count - 1
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        q_block = pid - (q_start // BLOCK_Q + req)
    else:
        req = pid
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        q_block = 0
    # Each request belongs to exactly one of the two launches; grid slots past a request's blocks idle.
    if LONG:
        if q_len <= short_max_q:
            return
    else:
        if q_len > BLOCK_Q:
            return
    if q_block * BLOCK_Q >= q_len:
        return

    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    q_pos = ctx_start + q_idx
    token = (q_start + q_idx).to(tl.int64)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # Keys past the last query of this block are causally invisible to all of its rows.
    kv_len = ctx_start + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    # This row's own split size: the work per program follows its context, not the launch's longest one.
    tiles_per_split = tl.cdiv(num_tiles, tl.num_programs(2))
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(num_tiles, tile_lo + tiles_per_split)
    # (Nested, not `and`: the constexpr test leaves the unsplit variants without the runtime one.)
    if SPLIT:  # noqa: SIM102
        # Past this row's last tile: nothing to compute, and nothing to store (the merge reads only the
        # splits that hold work).
        if tile_lo >= num_tiles:
            return

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + req * stride_bt
    head_off = kv_head * stride_kh

    # The first tile's block ids; each iteration fetches the next tile's at its end. Carried across the loop,
    # the ids are no longer a load feeding a load inside one iteration, which Triton's pipeliner handles only
    # by splitting its stages between the two (num_stages=3 then gave one K/V buffer and a wait for every
    # copy); carried, the K/V copies of tile i+1 are in flight while tile i computes.
    # Table entries past the context are padding (0): masked out, so such blocks are never read.
    offs_first = tile_lo * TILE_N + tl.arange(0, TILE_N)
    blk = tl.load(table_row + offs_first // PAGE, mask=offs_first < kv_len, other=0).to(tl.int64)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_len
        slot_off = blk * stride_kb + (offs_n % PAGE) * stride_ko + head_off

        k = tl.load(
            k_cache_ptr + slot_off[None, :] + offs_d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]

        v = tl.load(
            v_cache_ptr + slot_off[:, None] + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE_DOT:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
        offs_next = offs_n + TILE_N
        blk = tl.load(table_row + offs_next // PAGE, mask=offs_next < kv_len, other=0).to(tl.int64)

    if SPLIT:
        # Partials are indexed by (request, query within the short block, head, split): bounded by the
        # split heuristic, unlike an index by token.
        num_splits = tl.num_programs(2)
        part_row = ((req * BLOCK_Q + q_idx) * num_heads + head).to(tl.int64) * num_splits + split
        tl.store(part_m_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_l_ptr + part_row, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + part_row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
    else:
        # Padding rows saw no key (l = 0); keep them finite, they are not stored anyway.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )


# One compiled variant whatever the number of splits: they are read SPLITS_BLOCK at a time (a constexpr that
# followed the number of splits compiled a variant per power of two, inside timed steps).
@triton.jit(do_not_specialize=["num_splits"])
def merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLITS_BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    q_idx = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_len > BLOCK_Q:
        return
    if q_idx >= q_len:
        return
    # The splits that hold this row's work, as the attention kernel cut it (a short row's keys end at its
    # seq_len); those past it stored nothing.
    num_tiles = tl.cdiv(tl.load(seq_lens_ptr + req), TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    row_splits = tl.cdiv(num_tiles, tiles_per_split)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    base = ((req * BLOCK_Q + q_idx) * num_heads + head).to(tl.int64) * num_splits
    # An online merge over blocks of splits: running maximum, weight and weighted sum. Split 0 always holds
    # position 0, which every query sees, so the total weight is positive.
    m_run = tl.full([], NEG_BIG, dtype=tl.float32)
    l_run = tl.zeros([], dtype=tl.float32)
    acc_run = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for first in range(0, row_splits, SPLITS_BLOCK):
        offs_s = first + tl.arange(0, SPLITS_BLOCK)
        s_valid = offs_s < row_splits
        m = tl.load(part_m_ptr + base + offs_s, mask=s_valid, other=NEG_BIG)
        l_part = tl.load(part_l_ptr + base + offs_s, mask=s_valid, other=0.0)
        acc = tl.load(
            part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            mask=s_valid[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.math.exp2(m_run - m_new)
        w = tl.math.exp2(m - m_new)
        l_run = l_run * alpha + tl.sum(l_part * w, 0)
        acc_run = acc_run * alpha + tl.sum(acc * w[:, None], 0)
        m_run = m_new
    o = acc_run / l_run
    token = (q_start + q_idx).to(tl.int64)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit(do_not_specialize=["num_tokens"])
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One row per token: its KV heads x head_dim values, flattened, written to its slot.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_valid = offs_t < num_tokens
    slot = tl.load(slot_mapping_ptr + offs_t, mask=t_valid, other=-1).to(tl.int64)
    # A negative slot marks a padding token (vLLM's convention): nothing to store.
    t_valid = t_valid & (slot >= 0)
    offs_c = tl.arange(0, ROW_PAD)
    head = offs_c // HEAD_DIM
    d = offs_c % HEAD_DIM
    mask = t_valid[:, None] & (offs_c < ROW)[None, :]
    tok = offs_t.to(tl.int64)[:, None]
    dst = ((slot // block_size) * stride_cb + (slot % block_size) * stride_co)[:, None] + (
        head * stride_ch + d
    )[None, :]

    k = tl.load(key_ptr + tok * stride_kt + (head * stride_kh + d)[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + (head * stride_vh + d)[None, :], mask=mask)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def is_interpreted() -> bool:
    """True when these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(paged_attention_kernel).__name__ == "InterpretedFunction"
