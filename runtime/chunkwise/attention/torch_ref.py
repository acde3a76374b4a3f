"""Reference attention over the paged KV cache, in plain torch.

Decode rows (one query token each) are most of the rows of a busy step, so they share batched gathers and
masked attention calls; prefill chunks are few and long, so each gets its own SDPA call. Keys and values are
gathered slot by slot, with positions past a request's context clamped onto its last written slot, so no
uninitialised cache memory (possibly NaN) is ever read, and the mask hides the duplicates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chunkwise.attention.backend import AttentionMetadata

# Upper bound on the elements of one gathered key (or value) tensor for a group of decode rows. On CPU a
# temporary much larger than this comes straight from mmap and costs page faults on every step.
DEFAULT_DECODE_GATHER_ELEMENTS = 1 << 22
# Rows with at most this many query tokens (decodes, speculative verifies) share the batched one-token path.
SHORT_QUERY_TOKENS = 8


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, decode_gather_elements: int = DEFAULT_DECODE_GATHER_ELEMENTS) -> None:
        self.decode_gather_elements = decode_gather_elements

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        flat = _flat_slots(kv_cache)
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        # Query tokens that go through the batched path: each attends to its context up to its own position.
        decode_rows: list[int] = []
        decode_tokens: list[int] = []
        decode_lens: list[int] = []
        start = 0
        for i, n in enumerate(meta.query_lens_host):
            if 1 <= n <= SHORT_QUERY_TOKENS:
                # Decode rows, and the few tokens of a speculative verify: cheaper as n one-token queries in the
                # shared batched call than as a prefill call of their own.
                first = meta.seq_lens_host[i] - n + 1
                for j in range(n):
                    decode_rows.append(i)
                    decode_tokens.append(start + j)
                    decode_lens.append(first + j)
            elif n > SHORT_QUERY_TOKENS:
                self._prefill(query, kv_cache, meta, i, start, n, scale, out)
            start += n
        if decode_rows:
            self._decode(query, kv_cache, meta, decode_rows, decode_tokens, decode_lens, scale, out)
        return out

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        row: int,
        start: int,
        num_query: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        seq_len = meta.seq_lens_host[row]
        block_size = kv_cache.shape[2]
        device = query.device
        pos = torch.arange(seq_len, device=device)
        slots = meta.block_tables[row, pos // block_size] * block_size + pos % block_size
        flat = _flat_slots(kv_cache)
        k = flat[0].index_select(0, slots).float()
        v = flat[1].index_select(0, slots).float()
        q = query[start : start + num_query].float()
        # The chunk is the tail of the context: query j sits at position seq_len - num_query + j. SDPA's
        # is_causal aligns the triangle top-left, so spell the mask out.
        q_pos = torch.arange(seq_len - num_query, seq_len, device=device)
        mask = pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + num_query] = o[0].transpose(0, 1).to(out.dtype)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: list[int],
        tokens: list[int],
        lens: list[int],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        device = query.device
        flat = _flat_slots(kv_cache)
        budget = max(1, self.decode_gather_elements // (num_kv_heads * head_dim))
        for g_rows, g_tokens, g_lens, max_len in _length_groups(rows, tokens, lens, budget):
            m = len(g_rows)
            row_idx = torch.tensor(g_rows, device=device)
            tok_idx = torch.tensor(g_tokens, device=device)
            seq_lens = torch.tensor(g_lens, device=device)
            pos = torch.arange(max_len, device=device)
            valid = pos[None, :] < seq_lens[:, None]
            clamped = torch.minimum(pos[None, :], seq_lens[:, None] - 1)
            tables = meta.block_tables.index_select(0, row_idx)
            slots = tables.gather(1, clamped // block_size) * block_size + clamped % block_size
            k = flat[0].index_select(0, slots.flatten()).view(m, max_len, num_kv_heads, head_dim).float()
            v = flat[1].index_select(0, slots.flatten()).view(m, max_len, num_kv_heads, head_dim).float()
            # Fold the query heads that share a KV head into SDPA's query-length axis: GQA without
            # repeating keys and values.
            q = query.index_select(0, tok_idx).float().view(m, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=valid[:, None, None, :],
                scale=scale,
            )
            out.index_copy_(0, tok_idx, o.reshape(m, num_heads, head_dim).to(out.dtype))


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
