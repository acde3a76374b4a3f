"""The CPU attention backend: decode rows through chunkwise's C++ paged-attention kernel, prefill chunks
over their gathered context through chunkwise's own kernels where they are measured faster than torch's flash
attention (bench/cpu/prefill_attention.py): on an AVX-512 CPU without AMX, bf16 on AVX512-BF16 and fp32 on
AVX-512 FMA (csrc/prefill_attention.cpp: 2.4-3.2x and 1.5-2.5x torch's on a Zen 4 core); with AMX, bf16 on the
tiles (csrc/prefill_attention_amx.cpp: 1.4-2.2x torch's, which runs on the tiles too) and fp32 on AVX-512 FMA
(1.1-2.3x); torch's flash attention elsewhere.

A decode row reads its context in place, block by block through its block table (kernels/csrc/cpu_ops.cpp):
no gather, no padding to a common length, no mask. On the 57M-parameter benchmark model (8 heads over 2 KV
heads, 32 rows of 64-768 tokens) one layer's decode attention took 3-5 ms against 11-16 ms for the torch
reference's gathers and masked SDPA. A prefill chunk over a context of up to PAGED_PREFILL_MAX_CONTEXT
tokens goes the same way, as one-token queries (each sees its own prefix): there the kernel beat torch's
flash attention over the gathered context, 2x at 150-token prompts, 1.05x at a 1,024-token one, even at a
512-token chunk over 1,024. Longer contexts, where flash attention's reuse of each key across queries wins
(1.15x at 2,048), gather their context once per layer and run SDPA. Measured on AVX2; on an AVX-512 CPU
torch's SDPA has twice the vector width, and every prefill chunk keeps it.

On a CPU without bf16 matrix units (cpu_has_bf16_matmul), half-precision prefill attention is computed in
float32 and rounded back, for the same reason the linear layers are: torch's half-precision matmuls fall
back to scalar code there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chunkwise.engine import kernels
from chunkwise.engine.attention.backend import AttentionMetadata, AttentionPlan
from chunkwise.engine.attention.torch_ref import (
    TorchAttentionBackend,
    context_slots,
    one_token_queries,
    split_short_rows,
)
from chunkwise.engine.hardware import cpu_has_avx512, cpu_has_bf16_matmul, cpu_isa

log = logging.getLogger(__name__)

# The longest context (the chunk and what precedes it) whose prefill rows go through the paged kernel.
PAGED_PREFILL_MAX_CONTEXT = 1024


@dataclass
class PrefillChunk:
    start: int  # first query token in the batch
    num_query: int
    slots: torch.Tensor  # [seq_len] cache slot of every context position
    # Context positions before the chunk (0 for a fresh prompt: plain causal attention).
    prefix: int


@dataclass
class CpuPlan(AttentionPlan):
    # One entry per short-row query token: its request's row, its index in the batch, its context length.
    token_rows: torch.Tensor | None = None
    token_index: torch.Tensor | None = None
    token_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    prefill: list[PrefillChunk] = field(default_factory=list)
    # Shapes the kernel is not built for are planned (and attended) by the torch reference instead.
    fallback: AttentionPlan | None = None


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        kernels.load()  # raises KernelUnavailable with the reason
        self._reference = TorchAttentionBackend()
        self._warned: set[tuple[int, int]] = set()
        # 0..n-1, sliced for each decode step's rows (a view costs less than a new arange every step).
        self._row_ids = torch.arange(0, dtype=torch.int64)
        self.paged_prefill_max_context = 0 if cpu_has_avx512() else PAGED_PREFILL_MAX_CONTEXT
        # Prefill chunks (bench/cpu/prefill_attention.py, one core): on an AVX-512 CPU without AMX, chunkwise's
        # kernel in bf16 (the bf16 dot-product units: 2.4-3.2x torch's flash attention on a Zen 4) and fp32
        # (AVX-512 FMA: 1.5-2.5x). With AMX, torch's bf16 flash attention runs on the tiles and beats the
        # dot-product kernel (0.36-0.44x at 1,024-token chunks on a Xeon), so bf16 goes to the AMX kernel
        # (1.4-2.2x torch's) where this process may use the tiles; fp32 stays on the AVX-512 FMA kernel
        # (1.1-2.3x torch's there). Below AVX-512 neither is built.
        isa = cpu_isa().name
        self.prefill_kernel_dtypes: frozenset[torch.dtype] = frozenset()
        if isa in ("avx512", "amx"):
            self.prefill_kernel_dtypes = frozenset(
                d
                for d in (torch.bfloat16, torch.float32)
                if kernels.prefill_attention_available(torch.empty(1, 1, 64, dtype=d))
                and not (isa == "amx" and d == torch.bfloat16)
            )
        self.prefill_amx = isa == "amx" and kernels.prefill_attention_amx_available(
            torch.empty(1, 1, 64, dtype=torch.bfloat16)
        )
        # Decode rows in bf16 with AMX: the scores on the tiles (csrc/paged_attention_amx.cpp), where the shapes
        # allow; decided once per shape, as a model's shapes never change.
        self._decode_amx: dict[tuple[torch.dtype, int, int, int, int], bool] = {}
        self._amx_level = isa == "amx"

    def plan(self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int) -> CpuPlan:
        plan = CpuPlan(meta, num_heads, num_kv_heads, head_dim)
        if head_dim not in kernels.ATTENTION_HEAD_DIMS or num_heads > kernels.ATTENTION_MAX_HEADS:
            if (num_heads, head_dim) not in self._warned:
                self._warned.add((num_heads, head_dim))
                log.warning(
                    "the CPU attention kernel is built for head_dim in %s and at most %d heads; %d heads of "
                    "%d run on the torch reference path",
                    kernels.ATTENTION_HEAD_DIMS,
                    kernels.ATTENTION_MAX_HEADS,
                    num_heads,
                    head_dim,
                )
            plan.fallback = self._reference.plan(meta, num_heads, num_kv_heads, head_dim)
            return plan
        device = meta.block_tables.device
        if meta.max_query_len == 1:
            # All decode rows (the common step): one query token per row, in row order.
            n = meta.num_reqs
            if self._row_ids.shape[0] < n or self._row_ids.device != device:
                self._row_ids = torch.arange(max(n, 2 * self._row_ids.shape[0]), device=device)
            plan.token_rows = plan.token_index = self._row_ids[:n]
            plan.token_lens = _int64(meta.seq_lens)
            plan.block_tables = _int64(meta.block_tables)
            return plan
        short, long = split_short_rows(meta)
        if long and self.paged_prefill_max_context:
            bound = self.paged_prefill_max_context
            short += [c for c in long if meta.seq_lens_host[c[0]] <= bound]
            long = [c for c in long if meta.seq_lens_host[c[0]] > bound]
        if short:
            rows, index, lens = one_token_queries(meta, short)
            plan.token_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            plan.token_index = torch.tensor(index, dtype=torch.int64, device=device)
            plan.token_lens = torch.tensor(lens, dtype=torch.int64, device=device)
            plan.block_tables = _int64(meta.block_tables)
        for row, start, n in long:
            seq_len = meta.seq_lens_host[row]
            plan.prefill.append(
                PrefillChunk(start, n, context_slots(meta, row, seq_len, meta.block_size), seq_len - n)
            )
        return plan

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # One kernel call for both (a memcpy of each token's KV heads) where the reference runs two
        # index_copy_: the layout the model passes (rows of contiguous heads, the cache's dtype, int64 slots).
        d = key.shape[-1]
        if (
            key.dtype == value.dtype == kv_cache.dtype
            and slot_mapping.dtype == torch.int64
            and key.stride(-1) == value.stride(-1) == 1
            and (key.shape[1] == 1 or key.stride(1) == value.stride(1) == d)
            and kv_cache.is_contiguous()
        ):
            torch.ops.chunkwise.write_kv(kv_cache, key, value, slot_mapping)
            return
        self._reference.write_kv(key, value, kv_cache, slot_mapping)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        if not isinstance(plan, CpuPlan):
            raise TypeError(f"the CPU backend needs its own plan, got {type(plan).__name__}")
        if plan.fallback is not None:
            return self._reference.attend(query, kv_cache, plan.fallback, scale)
        if kv_cache.dtype != query.dtype:
            raise ValueError(f"query is {query.dtype} but the KV cache is {kv_cache.dtype}")
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if plan.token_index is not None:
            decode = (
                torch.ops.chunkwise.paged_attention_amx
                if self._decode_on_amx(query, kv_cache)
                else torch.ops.chunkwise.paged_attention
            )
            decode(
                out,
                query,
                kv_cache,
                plan.block_tables,
                plan.token_rows,
                plan.token_index,
                plan.token_lens,
                scale,
            )
        if plan.prefill:
            self._prefill(query, kv_cache, plan.prefill, scale, out)
        return out

    def _decode_on_amx(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        if not self._amx_level:
            return False
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        key = (query.dtype, query.shape[1], num_kv_heads, head_dim, block_size)
        choice = self._decode_amx.get(key)
        if choice is None:
            choice = self._decode_amx[key] = (
                kernels.paged_attention_amx_available(*key) and kv_cache.is_contiguous()
            )
        return choice

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        chunks: list[PrefillChunk],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        widen = query.dtype != torch.float32 and not cpu_has_bf16_matmul()
        own_kernel = query.dtype in self.prefill_kernel_dtypes and kernels.prefill_attention_available(query)
        # self.prefill_amx already asked whether the tiles are usable; what is left depends on the query.
        amx_kernel = (
            self.prefill_amx
            and query.dtype == torch.bfloat16
            and query.shape[-1] in kernels.AMX_ATTENTION_HEAD_DIMS
        )
        for c in chunks:
            q = query[c.start : c.start + c.num_query]
            k = flat[0].index_select(0, c.slots)
            v = flat[1].index_select(0, c.slots)
            if amx_kernel:
                kernels.prefill_attention_amx(out[c.start : c.start + c.num_query], q, k, v, scale)
                continue
            if own_kernel:
                kernels.prefill_attention(out[c.start : c.start + c.num_query], q, k, v, scale)
                continue
            if widen:
                q, k, v = q.float(), k.float(), v.float()
            qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            if c.prefix == 0:
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
            else:
                o = attend_after_prefix(qh, kh, vh, c.prefix, scale)
            out[c.start : c.start + c.num_query] = o[0].transpose(0, 1).to(out.dtype)


def attend_after_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk whose queries are the last q.shape[2] of the context: q [1, H, n, D],
    k and v [1, KV, prefix + n, D]. SDPA's causal triangle sits top-left, so one call would need an explicit
    mask, which makes flash attention score every (query, key) pair and add the mask. Instead: the prefix,
    which every query sees whole (no mask), and the chunk itself (is_causal, half the square skipped), merged
    by their log-sum-exps in fp32. 1.2-1.5x the masked call at 1,024-token chunks over 1,024-3,000 tokens of
    context on an AVX-512 EPYC (bf16 and fp32)."""
    if _flash_with_lse is None:  # a torch without the op: the masked call
        n, ctx = q.shape[2], k.shape[2]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o_chunk, lse_chunk = _flash_with_lse(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, scale=scale)[
        :2
    ]
    o_prefix, lse_prefix = _flash_with_lse(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale)[:2]
    top = torch.maximum(lse_chunk, lse_prefix)
    w_chunk = (lse_chunk - top).exp_().unsqueeze(-1)
    w_prefix = (lse_prefix - top).exp_().unsqueeze(-1)
    merged = (o_chunk.float() * w_chunk).add_(o_prefix.float() * w_prefix).div_(w_chunk + w_prefix)
    return merged.to(q.dtype)


# Flash attention that also returns each query's log-sum-exp (what merging two partial results needs).
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _int64(t: torch.Tensor) -> torch.Tensor:
    """What the kernel reads: int64 with a contiguous last dimension (a view when it already is)."""
    return t if t.dtype == torch.int64 and t.stride(-1) == 1 else t.to(torch.int64).contiguous()
