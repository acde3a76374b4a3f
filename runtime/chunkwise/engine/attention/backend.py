"""The attention backend interface: what the model sees of a mixed batch over the paged KV cache.

A step's tokens form one flat batch. Request i owns tokens [query_start_loc[i], query_start_loc[i+1]) of it;
they sit at the *end* of its context, which is seq_lens[i] tokens long once this step's keys and values are
written. A decode row is a request with one query token; a prefill chunk has several. Both are the same thing
to attention: each query at context position p attends to positions 0..p of its own request.

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0: keys,
1: values). Token t of the batch writes its key and value to flat slot slot_mapping[t], that is block
slot // block_size, offset slot % block_size. Block tables are padded with 0; entries past a request's
last block are never read.

A step is planned once: `plan(meta, num_heads, num_kv_heads, head_dim)` does the host-side work (which rows take
which path, their index tensors, a kernel's launch shape) and every layer's `attend` reuses the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int64, context length including this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Host copies of the same facts, so the reference path can loop without device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    # Tokens per cache block (the cache's shape[2]), so a step can be planned before any layer runs.
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass
class AttentionPlan:
    """What a backend worked out for one step; each backend's plan extends this with its own fields."""

    meta: AttentionMetadata
    num_heads: int
    num_kv_heads: int
    head_dim: int


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class AttentionBackend(Protocol):
    name: str

    def plan(
        self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> AttentionPlan:
        """The step's plan: called once per forward, before the first layer."""
        ...

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store key/value [num_tokens, num_kv_heads, head_dim] into the cache slots."""
        ...

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] -> output of the same shape (keys/values already written).

        The output may be a view of a buffer the backend reuses (the Triton backend's, which a CUDA graph
        replays into): it is valid until the backend's next attend, so use it (the output projection) first."""
        ...
