"""The kernel launches of one attend call of the Triton attention backend, and the shapes they are given
(TritonAttentionConfig, LaunchPlan; triton_backend.py re-exports both).

Launches is given the backend's config, upcast flag and buffer allocator rather than the backend itself, so this
module sits below triton_backend.py and imports only the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from chunkwise.engine.attention import triton_kernels as K

# A flat scratch buffer of at least numel elements, kept across steps: (name, numel, dtype, device) -> tensor.
BufferFn = Callable[[str, int, torch.dtype, torch.device], torch.Tensor]


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile shapes and launch parameters. The defaults are a reasoned starting point for Hopper; they are
    not tuned (bench/gpu/run_attention_bench.py sweeps alternatives on a GPU)."""

    # Short launch (decode rows, speculative verifies): 16 rows is the smallest tensor-core M, filled by
    # the query group and, for small groups, by several query tokens of the same request.
    short_block_m: int = 16
    short_tile_n: int = 64
    short_num_warps: int = 4
    # 3 stages: two K/V buffers, so the copies of tile i+1 are in flight while tile i computes (with 2 the
    # sm_90 TTGIR had one buffer and waited for every copy each iteration); ~70 KB of shared memory at
    # head_dim 128, three programs per SM.
    short_num_stages: int = 3
    # Long launch (prefill chunks).
    long_block_m: int = 64
    long_tile_n: int = 64
    long_num_warps: int = 4
    long_num_stages: int = 2
    # KV splits for the short launch: None picks them so the launch has about splits_target_waves programs
    # per SM (decode is bandwidth-bound: more programs in flight hide more latency); 1 never splits.
    num_splits: int | None = None
    max_splits: int = 64
    min_tiles_per_split: int = 2
    splits_target_waves: int = 4

    def __post_init__(self) -> None:
        for name in ("short_block_m", "short_tile_n", "long_block_m", "long_tile_n"):
            value = getattr(self, name)
            # tl.dot needs every dimension >= 16 on NVIDIA, and tl.arange needs powers of two.
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_splits is not None and not 1 <= self.num_splits <= self.max_splits:
            raise ValueError(f"num_splits must be in 1..{self.max_splits}, got {self.num_splits}")


@dataclass(frozen=True)
class LaunchPlan:
    """What attend() launches for one batch shape (exposed for tests and benchmarks)."""

    group_pad: int
    short_block_q: int
    short_block_m: int
    long_block_q: int
    long_block_m: int
    run_short: bool
    run_long: bool
    # KV splits of the short launch: the grid's third axis. Each row cuts its own context into this many
    # pieces at run time (row_splits), so the plan holds no split size.
    num_splits: int
    num_heads: int
    num_kv_heads: int


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# Splits the merge kernel reads per iteration: a constant, so it compiles once whatever the number of splits.
_MERGE_SPLITS_BLOCK = 16


class Launches:
    """The kernel launches of one attend call, built in one place for attend and warmup alike, so that a
    warmed variant is exactly the one a step would compile: with compile_only, each launch is Triton's
    warmup (compile, do not run) and returns the variant's name."""

    def __init__(
        self,
        config: TritonAttentionConfig,
        upcast: bool,
        buffer: BufferFn,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        launch: LaunchPlan,
        out: torch.Tensor,
        scale: float,
        *,
        compile_only: bool,
    ) -> None:
        self.config = config
        self.buffer = buffer
        self.query = query
        self.kv_cache = kv_cache
        self.launch = launch
        self.out = out
        self.compile_only = compile_only
        num_heads, head_dim = query.shape[1], query.shape[2]
        self.num_heads = num_heads
        self.num_kv_heads = kv_cache.shape[3]
        self.head_dim_pad = max(16, next_pow2(head_dim))
        self.common: dict[str, object] = dict(
            num_heads=num_heads,
            qk_scale=scale * K.LOG2E,
            stride_qt=query.stride(0),
            stride_qh=query.stride(1),
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            stride_kb=kv_cache.stride(1),
            stride_ko=kv_cache.stride(2),
            stride_kh=kv_cache.stride(3),
            # The page size is fixed for an engine's life: a constant turns // and % into shifts.
            PAGE=kv_cache.shape[2],
            GROUP=num_heads // self.num_kv_heads,
            GROUP_PAD=launch.group_pad,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=self.head_dim_pad,
            UPCAST=upcast,
            # Real fp32 matmuls for fp32 caches; on GPU tl.dot would otherwise round inputs to tf32.
            IEEE_DOT=kv_cache.dtype == torch.float32,
            SEARCH=128,
        )

    def _run(self, kernel: Any, grid: tuple[int, ...], name: str, *args: Any, **kwargs: Any) -> list[str]:
        if self.compile_only:
            kernel.warmup(*args, grid=grid, **kwargs)
            return [name]
        kernel[grid](*args, **kwargs)
        return []

    def short(self, num_reqs: int, tables: tuple[torch.Tensor, ...]) -> list[str]:
        launch, cfg, device = self.launch, self.config, self.query.device
        block_tables, seq_lens, query_start_loc = tables
        split = launch.num_splits > 1
        if split:
            rows = num_reqs * launch.short_block_q * self.num_heads * launch.num_splits
            part_m = self.buffer("part_m", rows, torch.float32, device)
            part_l = self.buffer("part_l", rows, torch.float32, device)
            part_acc = self.buffer("part_acc", rows * self.head_dim_pad, torch.float32, device).view(
                rows, self.head_dim_pad
            )
        else:
            # Unused when SPLIT is off; any tensor will do for the pointer arguments.
            part_m = part_l = part_acc = self.out
        compiled = self._run(
            K.paged_attention_kernel,
            (num_reqs, self.num_kv_heads, launch.num_splits),
            "short+split" if split else "short",
            self.out,
            self.query,
            self.kv_cache[0],
            self.kv_cache[1],
            block_tables,
            seq_lens,
            query_start_loc,
            part_acc,
            part_m,
            part_l,
            num_reqs=num_reqs,
            short_max_q=0,
            stride_bt=block_tables.stride(0),
            BLOCK_Q=launch.short_block_q,
            BLOCK_M=launch.short_block_m,
            TILE_N=cfg.short_tile_n,
            LONG=False,
            SPLIT=split,
            num_warps=cfg.short_num_warps,
            num_stages=cfg.short_num_stages,
            **self.common,
        )
        if split:
            compiled += self._run(
                K.merge_splits_kernel,
                (num_reqs, launch.short_block_q, self.num_heads),
                "merge",
                self.out,
                part_acc,
                part_m,
                part_l,
                query_start_loc,
                seq_lens,
                self.num_heads,
                launch.num_splits,
                self.out.stride(0),
                self.out.stride(1),
                HEAD_DIM=self.common["HEAD_DIM"],
                HEAD_DIM_PAD=self.head_dim_pad,
                BLOCK_Q=launch.short_block_q,
                TILE_N=cfg.short_tile_n,
                SPLITS_BLOCK=_MERGE_SPLITS_BLOCK,
            )
        return compiled

    def long(self, num_reqs: int, num_tokens: int, tables: tuple[torch.Tensor, ...]) -> list[str]:
        launch, cfg = self.launch, self.config
        block_tables, seq_lens, query_start_loc = tables
        return self._run(
            K.paged_attention_kernel,
            (num_tokens // launch.long_block_q + num_reqs, self.num_kv_heads, 1),
            "long",
            self.out,
            self.query,
            self.kv_cache[0],
            self.kv_cache[1],
            block_tables,
            seq_lens,
            query_start_loc,
            self.out,
            self.out,
            self.out,
            num_reqs=num_reqs,
            # Requests the short launch already took; 0 when it did not run, so the long one takes all.
            short_max_q=launch.short_block_q if launch.run_short else 0,
            stride_bt=block_tables.stride(0),
            BLOCK_Q=launch.long_block_q,
            BLOCK_M=launch.long_block_m,
            TILE_N=cfg.long_tile_n,
            LONG=True,
            SPLIT=False,
            num_warps=cfg.long_num_warps,
            num_stages=cfg.long_num_stages,
            **self.common,
        )
