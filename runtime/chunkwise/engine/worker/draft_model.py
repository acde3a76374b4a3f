"""Draft-model proposals: a small model with the target's vocabulary guesses k tokens ahead.

The draft keeps its own KV cache laid out exactly like the target's and indexed by the *target's* block tables,
so it needs no allocator of its own: the scheduler has already allocated slots for the k draft positions. For
each request it remembers how many tokens of draft KV are valid; each step it catches up on the tokens committed
since (one flat prefill-like forward for every speculating request), then decodes k - 1 more tokens one at a
time. Drafts are greedy: a deterministic proposal is a valid draft distribution for rejection sampling, so the
target distribution is preserved for sampled requests too.
"""

from __future__ import annotations

import torch

from chunkwise.engine.attention.backend import kv_cache_shape
from chunkwise.engine.kernels import argmax
from chunkwise.engine.model.llama import LlamaForCausalLM
from chunkwise.engine.worker.inputs import Row, build_batch
from chunkwise.engine.worker.step import DraftRequest


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = kv_cache_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]
        # req_id -> (tokens whose draft KV is valid, the block ids that KV lives in).
        self._valid: dict[str, tuple[int, tuple[int, ...]]] = {}

    def forget(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._valid.pop(rid, None)

    def _valid_prefix(self, r: DraftRequest) -> int:
        n, blocks = self._valid.get(r.req_id, (0, ()))
        # After a preemption the request's KV may live in other blocks: then start over.
        if tuple(r.block_table[: len(blocks)]) != blocks:
            return 0
        return min(n, len(r.token_ids) - 1)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        reqs = [r for r in requests if r.k > 0]
        if not reqs:
            return {}
        # Catch up on everything committed since the last proposal; the last row yields the first draft.
        rows = []
        for r in reqs:
            start = self._valid_prefix(r)
            rows.append(Row(r.token_ids[start:], start, r.block_table))
        drafts: dict[str, list[int]] = {r.req_id: [] for r in reqs}
        last = self._forward(rows)
        for r, t in zip(reqs, last):
            drafts[r.req_id].append(t)
        for j in range(1, max(r.k for r in reqs)):
            active = [r for r in reqs if r.k > j]
            rows = [Row([drafts[r.req_id][-1]], len(r.token_ids) + j - 1, r.block_table) for r in active]
            for r, t in zip(active, self._forward(rows)):
                drafts[r.req_id].append(t)
        for r in reqs:
            n_blocks = -(-len(r.token_ids) // self.block_size)
            self._valid[r.req_id] = (len(r.token_ids), tuple(r.block_table[:n_blocks]))
        return drafts

    def _forward(self, rows: list[Row]) -> list[int]:
        input_ids, positions, meta = build_batch(rows, self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
        return argmax(logits).tolist()
