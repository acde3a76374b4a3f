"""Reference attention over the paged KV cache, in plain torch.

Decode rows (one query token each) are most of the rows of a busy step, so they share batched gathers and
masked attention calls; prefill chunks are few and long, so each gets its own SDPA call. Keys and values are
gathered slot by slot, with positions past a request's context clamped onto its last written slot, so no
uninitialised cache memory (possibly NaN) is ever read, and the mask hides the duplicates.

The step's plan holds every index tensor and mask, built once; a layer only gathers and attends. The math
runs in fp32 whatever the cache holds: this backend is what the others are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chunkwise.engine.attention.backend import AttentionMetadata, AttentionPlan

# Upper bound on the elements of one gathered key (or value) tensor for a group of decode rows. On CPU a
# temporary much larger than this comes straight from mmap and costs page faults on every step.
DEFAULT_DECODE_GATHER_ELEMENTS = 1 << 22
# Rows with at most this many query tokens (decodes, speculative verifies) share the batched one-token path.
SHORT_QUERY_TOKENS = 8


@dataclass
class DecodeGroup:
    """One-token queries padded to a common context length."""

    tokens: torch.Tensor  # [m] the queries' rows in the batch
    slots: torch.Tensor  # [m * length] cache slot of each context position (clamped into the context)
    valid: torch.Tensor  # [m, 1, 1, length] which positions are real
    length: int


@dataclass
class PrefillRow:
    start: int  # first query token in the batch
    num_query: int
    slots: torch.Tensor  # [seq_len] cache slot of every context position
    mask: torch.Tensor  # [num_query, seq_len] causal, queries at the context's end


@dataclass
class TorchPlan(AttentionPlan):
    decode: list[DecodeGroup] = field(default_factory=list)
    prefill: list[PrefillRow] = field(default_factory=list)


def split_short_rows(
    meta: AttentionMetadata,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(row, first query token, num_query) of the rows for the one-token path and of the prefill rows."""
    short: list[tuple[int, int, int]] = []
    long: list[tuple[int, int, int]] = []
    start = 0
    for i, n in enumerate(meta.query_lens_host):
        if 1 <= n <= SHORT_QUERY_TOKENS:
            # Decode rows, and the few tokens of a speculative verify: cheaper as n one-token queries in the
            # shared batched call than as a prefill call of their own.
            short.append((i, start, n))
        elif n > SHORT_QUERY_TOKENS:
            long.append((i, start, n))
        start += n
    return short, long


def one_token_queries(
    meta: AttentionMetadata, short: list[tuple[int, int, int]]
) -> tuple[list[int], list[int], list[int]]:
    """The short rows as one-token queries: (row, query token, context length) for each token.

    Query token j of a row with n queries sees the context up to position seq_len - n + j.
    """
    rows: list[int] = []
    tokens: list[int] = []
    lens: list[int] = []
    for row, start, n in short:
        first = meta.seq_lens_host[row] - n + 1
        for j in range(n):
            rows.append(row)
            tokens.append(start + j)
            lens.append(first + j)
    return rows, tokens, lens


def context_slots(meta: AttentionMetadata, row: int, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=meta.block_tables.device)
    return meta.block_tables[row, pos // block_size] * block_size + pos % block_size


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, decode_gather_elements: int = DEFAULT_DECODE_GATHER_ELEMENTS) -> None:
        self.decode_gather_elements = decode_gather_elements

    def plan(self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int) -> TorchPlan:
        plan = TorchPlan(meta, num_heads, num_kv_heads, head_dim)
        if meta.num_reqs == 0:
            return plan
        block_size = meta.block_size
        device = meta.block_tables.device
        short, long = split_short_rows(meta)
        for row, start, n in long:
            seq_len = meta.seq_lens_host[row]
            pos = torch.arange(seq_len, device=device)
            # The chunk is the tail of the context: query j sits at position seq_len - n + j. SDPA's
            # is_causal aligns the triangle top-left, so spell the mask out.
            q_pos = torch.arange(seq_len - n, seq_len, device=device)
            mask = pos[None, :] <= q_pos[:, None]
            plan.prefill.append(PrefillRow(start, n, context_slots(meta, row, seq_len, block_size), mask))
        rows, tokens, lens = one_token_queries(meta, short)
        budget = max(1, self.decode_gather_elements // (num_kv_heads * head_dim))
        for g_rows, g_tokens, g_lens, max_len in _length_groups(rows, tokens, lens, budget):
            row_idx = torch.tensor(g_rows, device=device)
            seq_lens = torch.tensor(g_lens, device=device)
            pos = torch.arange(max_len, device=device)
            clamped = torch.minimum(pos[None, :], seq_lens[:, None] - 1)
            tables = meta.block_tables.index_select(0, row_idx)
            slots = tables.gather(1, clamped // block_size) * block_size + clamped % block_size
            plan.decode.append(
                DecodeGroup(
                    tokens=torch.tensor(g_tokens, device=device),
                    slots=slots.flatten(),
                    valid=(pos[None, :] < seq_lens[:, None])[:, None, None, :],
                    length=max_len,
                )
            )
        return plan

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        flat = _flat_slots(kv_cache)
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        if not isinstance(plan, TorchPlan):
            raise TypeError(f"the torch backend needs its own plan, got {type(plan).__name__}")
        out = torch.empty_like(query)
        flat = _flat_slots(kv_cache)
        for p in plan.prefill:
            k = flat[0].index_select(0, p.slots).float()
            v = flat[1].index_select(0, p.slots).float()
            q = query[p.start : p.start + p.num_query].float()
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=p.mask,
                scale=scale,
                enable_gqa=True,
            )
            out[p.start : p.start + p.num_query] = o[0].transpose(0, 1).to(out.dtype)
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        group = query.shape[1] // num_kv_heads
        for g in plan.decode:
            m = g.tokens.shape[0]
            k = flat[0].index_select(0, g.slots).view(m, g.length, num_kv_heads, head_dim).float()
            v = flat[1].index_select(0, g.slots).view(m, g.length, num_kv_heads, head_dim).float()
            # Fold the query heads that share a KV head into SDPA's query-length axis: GQA without
            # repeating keys and values.
            q = query.index_select(0, g.tokens).float().view(m, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.valid, scale=scale
            )
            out.index_copy_(0, g.tokens, o.reshape(m, -1, head_dim).to(out.dtype))
        return out


def _flat_slots(kv_cache: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, block_size, H, D] -> [2, num_slots, H, D], a view (the cache must be contiguous)."""
    two, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return kv_cache.view(two, num_blocks * block_size, num_kv_heads, head_dim)


def _length_groups(
    rows: list[int], tokens: list[int], lens: list[int], budget: int
) -> list[tuple[list[int], list[int], list[int], int]]:
    """Split one-token queries into groups padded to a common context length.

    Longest first; a group closes when the next query's context is under half its longest (bounding padding
    waste to 2x) or when one more would take the gathered tensor past `budget` positions.
    """
    order = sorted(range(len(rows)), key=lambda j: lens[j], reverse=True)
    groups: list[tuple[list[int], list[int], list[int], int]] = []
    g_rows: list[int] = []
    g_tokens: list[int] = []
    g_lens: list[int] = []
    max_len = 0
    for j in order:
        length = lens[j]
        if g_rows and (2 * length < max_len or (len(g_rows) + 1) * max_len > budget):
            groups.append((g_rows, g_tokens, g_lens, max_len))
            g_rows, g_tokens, g_lens = [], [], []
        if not g_rows:
            max_len = length
        g_rows.append(rows[j])
        g_tokens.append(tokens[j])
        g_lens.append(length)
    if g_rows:
        groups.append((g_rows, g_tokens, g_lens, max_len))
    return groups
