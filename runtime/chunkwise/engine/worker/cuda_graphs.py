"""Decode steps at a few fixed batch sizes through static buffers, replayed from CUDA graphs on a GPU.

A decode-only step (every row one token, all sampling) of n rows runs as the smallest bucket B >= n: its
inputs are copied into the bucket's static buffers and rows n..B-1 are padding. A padding row reads token 0
at position 0 and writes its key and value into the sink block, a cache block the block pool never hands
out, so it can neither disturb a real request nor read uninitialised memory; its outputs are dropped.

On CUDA each bucket's forward is captured once at start-up (attention planned for the longest context the
engine allows, so the same launch serves every step; the kernels read each row's real length from the
static seq_lens, and the Triton backend cuts each row's own context into the bucket's KV splits, so a short
context still spreads over all of them) and a step is a few copies and one replay: no Python per layer, no
launch overhead. With
capture off (a CPU, or tests) the same padded static buffers run eagerly, which is how the CPU suite checks
that padding changes no token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch

from chunkwise.engine.attention.backend import AttentionBackend, AttentionMetadata, AttentionPlan
from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (vLLM's default capture sizes)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


class DecodeGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        sizes: Sequence[int],
        block_size: int,
        max_model_len: int,
        sink_block: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.config = config
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        max_blocks = -(-max_model_len // block_size)
        b = self.max_batch

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        # One set of static buffers shared by every bucket (a bucket uses its leading rows): what the
        # captured graphs read and write.
        self.input_ids = zeros(b)
        self.positions = zeros(b)
        self.slot_mapping = torch.full((b,), sink_block * block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int64, device=device)
        self.block_tables = torch.full((b, max_blocks), sink_block, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int64, device=device)
        self.sink_slot = sink_block * block_size
        self.sink_block = sink_block
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, n: int) -> int | None:
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def _meta(self, size: int, seq_lens_host: list[int], max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            query_lens_host=[1] * size,
            seq_lens_host=seq_lens_host,
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
        )

    def _plan(self, meta: AttentionMetadata) -> AttentionPlan:
        heads = self.model.layout  # this rank's heads (all of them at world size 1)
        return self.backend.plan(meta, heads.num_heads, heads.num_kv_heads, self.config.head_dim)

    def _forward(self, size: int, meta: AttentionMetadata, plan: AttentionPlan) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta, plan)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per bucket, largest first (later, smaller ones reuse its memory pool)."""
        pool = None
        for size in reversed(self.sizes):
            # Planned for the longest context: one launch shape (the grid, the number of KV splits) serves
            # every step of this bucket; how much of a row each split takes is decided at run time from the
            # row's seq_len, so a 4k context at a 128k max_model_len is not left on a few programs.
            meta = self._meta(size, [self.max_model_len] * size, self.max_model_len)
            plan = self._plan(meta)
            self._reset_padding(0, size)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy initialisation and autotuning happen outside capture
                    self._forward(size, meta, plan)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size, meta, plan)
            pool = graph.pool()
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batches of %s rows", self.sizes)

    def _reset_padding(self, n: int, size: int) -> None:
        """Rows n..size-1 read token 0 at position 0 and write into the sink block."""
        if n < size:
            self.input_ids[n:size] = 0
            self.positions[n:size] = 0
            self.slot_mapping[n:size] = self.sink_slot
            self.seq_lens[n:size] = 1
            self.block_tables[n:size, 0] = self.sink_block

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a decode-only step, or None when no bucket holds it."""
        n = meta.num_reqs
        size = self.bucket(n)
        if size is None:
            return None
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self._reset_padding(n, size)
        graph = self._graphs.get(size)
        if graph is not None:
            graph[0].replay()
            return graph[1][:n]
        # Eager over the same padded static buffers: the CPU's way, and the tests' check of the padding.
        padded = replace(
            self._meta(size, [*meta.seq_lens_host, *[1] * (size - n)], meta.max_seq_len),
            block_tables=self.block_tables[:size, :width],
        )
        return self._forward(size, padded, self._plan(padded))[:n]
