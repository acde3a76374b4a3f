"""The Triton attention backend: the mixed batch over the paged KV cache in one or two kernel launches.

Importing this module imports triton (an optional dependency); chunkwise.engine.attention imports it only when the
backend is chosen. The kernels live in triton_kernels.py; this module picks their shapes and launches them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from chunkwise.engine.attention import triton_kernels as K
from chunkwise.engine.attention.backend import AttentionMetadata, AttentionPlan


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


@dataclass
class TritonPlan(AttentionPlan):
    launch: LaunchPlan | None = None


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_splits(seq_len: int, num_splits: int, tile_n: int) -> tuple[int, int]:
    """(splits holding work, KV tiles per split) of a short row of seq_len tokens in a launch of num_splits:
    what the kernels compute from the row's own length (for tests and benchmarks)."""
    num_tiles = _cdiv(max(seq_len, 1), tile_n)
    per_split = _cdiv(num_tiles, num_splits)
    return _cdiv(num_tiles, per_split), per_split


# Splits the merge kernel reads per iteration: a constant, so it compiles once whatever the number of splits.
_MERGE_SPLITS_BLOCK = 16


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        # The interpreter runs one program at a time: splitting only adds work there.
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


class TritonAttentionBackend:
    name = "triton"
    # The kernels read each row's length and block table from device memory: a plan made for the longest
    # context serves any step of its batch size, so a captured CUDA graph can replay it.
    graph_safe = True

    def __init__(self, config: TritonAttentionConfig | None = None) -> None:
        self.config = config or TritonAttentionConfig()
        self.interpreted = K.is_interpreted()
        # Loads are widened to fp32 in the interpreter, whose bf16 is broken; a GPU keeps 16-bit dot
        # operands for the tensor cores. (Tests turn it off to run the GPU's arithmetic in fp16.)
        self.upcast = self.interpreted
        # Per-step scratch (attention output, split partials), kept across steps: see _buffer.
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._outgrown: list[torch.Tensor] = []
        # The query and cache layouts warmup() has compiled every variant for (a draft model sharing the
        # backend has its own).
        self._warm: set[tuple[object, ...]] = set()

    # -- KV cache write -------------------------------------------------------------------------------

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        self._check_device(kv_cache)
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
            raise ValueError(
                f"key/value must be [{num_tokens}, {num_kv_heads}, {head_dim}] to match the cache, got "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        _check_cache(kv_cache)
        key = _last_dim_contiguous(key)
        value = _last_dim_contiguous(value)
        row = num_kv_heads * head_dim
        row_pad = _next_pow2(row)
        # About 4K elements per program on a GPU; the interpreter pays per program, so it takes more.
        block_t = 64 if self.interpreted else max(1, min(64, 4096 // row_pad))
        K.write_kv_kernel[(_cdiv(num_tokens, block_t),)](
            key,
            value,
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
            num_tokens,
            block_size,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            HEAD_DIM=head_dim,
            ROW=row,
            ROW_PAD=row_pad,
            BLOCK_T=block_t,
            UPCAST=self.upcast,
        )

    # -- attention ------------------------------------------------------------------------------------

    def plan(self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int) -> TritonPlan:
        """The step's launch shape, worked out once for every layer (it reads only host-side metadata)."""
        launch = self.launch_plan(meta, num_heads, num_kv_heads, meta.block_tables.device)
        return TritonPlan(meta, num_heads, num_kv_heads, head_dim, launch)

    def launch_plan(
        self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int, device: torch.device
    ) -> LaunchPlan:
        cfg = self.config
        group = num_heads // num_kv_heads
        group_pad = _next_pow2(group)
        short_block_m = max(cfg.short_block_m, group_pad)
        long_block_m = max(cfg.long_block_m, group_pad)
        short_block_q = short_block_m // group_pad
        long_block_q = long_block_m // group_pad
        num_short = sum(1 for n in meta.query_lens_host if 0 < n <= short_block_q)
        run_short = num_short > 0
        run_long = meta.max_query_len > short_block_q

        num_splits = 1
        if run_short:
            total_tiles = _cdiv(max(meta.max_seq_len, 1), cfg.short_tile_n)
            if cfg.num_splits is not None:
                num_splits = cfg.num_splits
            else:
                programs = num_short * num_kv_heads
                target = cfg.splits_target_waves * _sm_count(device)
                if programs < target:
                    num_splits = min(
                        _cdiv(target, programs),
                        max(1, total_tiles // cfg.min_tiles_per_split),
                        cfg.max_splits,
                    )
            # No trailing split that would be empty for every request.
            num_splits = row_splits(meta.max_seq_len, num_splits, cfg.short_tile_n)[0]
        return LaunchPlan(
            group_pad=group_pad,
            short_block_q=short_block_q,
            short_block_m=short_block_m,
            long_block_q=long_block_q,
            long_block_m=long_block_m,
            run_short=run_short,
            run_long=run_long,
            num_splits=num_splits,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
        )

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        """The attention output, [num_tokens, num_heads, head_dim]: a view of this backend's output buffer,
        valid until its next attend (a layer's output projection reads it at once). Output and partials
        live in buffers kept across steps, so a step allocates nothing once they have grown to it."""
        if not isinstance(plan, TritonPlan) or plan.launch is None:
            raise TypeError(f"the Triton backend needs its own plan, got {type(plan).__name__}")
        meta = plan.meta
        num_tokens, num_heads, head_dim = query.shape
        out = self._buffer("out", query.numel(), query.dtype, query.device).view(query.shape)
        if num_tokens == 0:
            return out
        self._check_device(query)
        _check_cache(kv_cache)
        _, _, _, num_kv_heads, cache_head_dim = kv_cache.shape
        if cache_head_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(
                f"query [T, {num_heads}, {head_dim}] does not fit a cache of {num_kv_heads} KV heads "
                f"x {cache_head_dim}"
            )
        query = _last_dim_contiguous(query)
        launch = plan.launch
        if (launch.num_heads, launch.num_kv_heads) != (num_heads, num_kv_heads):
            raise ValueError(
                f"the plan was made for {launch.num_heads} heads over {launch.num_kv_heads} KV heads, "
                f"the query has {num_heads} over a cache of {num_kv_heads}"
            )
        if not self.interpreted and _layout(query, kv_cache) not in self._warm:
            # The first forward (the engine's start-up probe runs one before serving) compiles every
            # variant, with this layer's own query layout: none is left to compile inside a timed step.
            self.warmup(query, kv_cache, launch)
        launches = _Launches(self, query, kv_cache, launch, out, scale, compile_only=False)
        tables = (_last_dim_contiguous(meta.block_tables), meta.seq_lens, meta.query_start_loc)
        if launch.run_short:
            launches.short(meta.num_reqs, tables)
        if launch.run_long:
            launches.long(meta.num_reqs, num_tokens, tables)
        return out

    def warmup(self, query: torch.Tensor, kv_cache: torch.Tensor, launch: LaunchPlan) -> list[str]:
        """Compile, without launching, every kernel variant that attend can reach for queries laid out like
        `query` over `kv_cache` (the short launch with and without KV splits, the merge, the long launch);
        returns their names. The arguments that change from step to step are not specialised on, so these
        are all the variants an engine compiles."""
        device = query.device
        # Stand-ins for the step's index tensors: only their type and alignment reach the compiler.
        index = self._buffer("warmup_index", 2, torch.int64, device)
        tables = (index.view(1, 2), index[:1], index)
        out = self._buffer("out", query.numel(), query.dtype, device).view(query.shape)
        compiled = []
        # Whether a step splits follows its rows and contexts, so both short variants are reachable unless
        # splitting is off. (The number of splits is a grid size and an unspecialised argument: any will do.)
        for num_splits in (1,) if self.config.num_splits == 1 else (1, 2):
            split = replace(launch, num_splits=num_splits)
            compiled += _Launches(self, query, kv_cache, split, out, 1.0, compile_only=True).short(1, tables)
        launches = _Launches(self, query, kv_cache, launch, out, 1.0, compile_only=True)
        compiled += launches.long(1, query.shape[0], tables)
        self._warm.add(_layout(query, kv_cache))
        return compiled

    def _buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least numel elements, kept across steps and layers. It grows (to twice what it
        was, so a few steps reach the largest batch) and never shrinks; an outgrown one stays referenced,
        since a captured CUDA graph may still read and write it."""
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = max(numel, 16)
            if buf is not None:
                self._outgrown.append(buf)
                size = max(size, 2 * buf.numel())
            buf = self._buffers[key] = torch.empty(size, dtype=dtype, device=device)
        return buf[:numel]

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu" and not self.interpreted:
            raise ValueError(
                "the Triton attention backend got CPU tensors but its kernels are compiled for a GPU; on CPU "
                "it runs only in Triton's interpreter (TRITON_INTERPRET=1 set before chunkwise is imported)"
            )


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(4) != 1:
        raise ValueError(
            "the KV cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] with a contiguous last "
            f"dimension, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )


def _layout(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[object, ...]:
    """What fixes the compiled variants besides the backend's config: shapes per token, strides, dtypes."""
    return (
        query.shape[1:],
        query.stride(),
        query.dtype,
        kv_cache.shape[2:],
        kv_cache.stride(),
        kv_cache.dtype,
    )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _Launches:
    """The kernel launches of one attend call, built in one place for attend and warmup alike, so that a
    warmed variant is exactly the one a step would compile: with compile_only, each launch is Triton's
    warmup (compile, do not run) and returns the variant's name."""

    def __init__(
        self,
        backend: TritonAttentionBackend,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        launch: LaunchPlan,
        out: torch.Tensor,
        scale: float,
        *,
        compile_only: bool,
    ) -> None:
        self.backend = backend
        self.config = backend.config
        self.query = query
        self.kv_cache = kv_cache
        self.launch = launch
        self.out = out
        self.compile_only = compile_only
        num_heads, head_dim = query.shape[1], query.shape[2]
        self.num_heads = num_heads
        self.num_kv_heads = kv_cache.shape[3]
        self.head_dim_pad = max(16, _next_pow2(head_dim))
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
            UPCAST=backend.upcast,
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
            part_m = self.backend._buffer("part_m", rows, torch.float32, device)
            part_l = self.backend._buffer("part_l", rows, torch.float32, device)
            part_acc = self.backend._buffer("part_acc", rows * self.head_dim_pad, torch.float32, device).view(
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
