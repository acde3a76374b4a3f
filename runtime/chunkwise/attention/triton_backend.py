"""The Triton attention backend: the mixed batch over the paged KV cache in one or two kernel launches.

Importing this module imports triton (an optional dependency); chunkwise.attention imports it only when the
backend is chosen. The kernels live in triton_kernels.py; this module picks their shapes and launches them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkwise.attention import triton_kernels as K
from chunkwise.attention.backend import AttentionMetadata, AttentionPlan


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile shapes and launch parameters. The defaults are a reasoned starting point for Hopper; they are
    not tuned (bench/gpu/run_attention_bench.py sweeps alternatives on a GPU)."""

    # Short launch (decode rows, speculative verifies): 16 rows is the smallest tensor-core M, filled by
    # the query group and, for small groups, by several query tokens of the same request.
    short_block_m: int = 16
    short_tile_n: int = 64
    short_num_warps: int = 4
    short_num_stages: int = 2
    # Long launch (prefill chunks).
    long_block_m: int = 64
    long_tile_n: int = 64
    long_num_warps: int = 4
    long_num_stages: int = 2
    # KV splits for the short launch: None picks them so the launch has about splits_target_waves programs
    # per SM; 1 never splits.
    num_splits: int | None = None
    max_splits: int = 64
    min_tiles_per_split: int = 2
    splits_target_waves: int = 2

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
    num_splits: int
    tiles_per_split: int
    num_heads: int
    num_kv_heads: int


@dataclass
class TritonPlan(AttentionPlan):
    launch: LaunchPlan | None = None


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
            tiles_per_split = _cdiv(total_tiles, num_splits)
            # No trailing split that would be empty for every request.
            num_splits = _cdiv(total_tiles, tiles_per_split)
        else:
            tiles_per_split = 0
        if num_splits == 1:
            # One split covers every tile of any request; the bound only has to be large enough.
            tiles_per_split = 1 << 30
        return LaunchPlan(
            group_pad=group_pad,
            short_block_q=short_block_q,
            short_block_m=short_block_m,
            long_block_q=long_block_q,
            long_block_m=long_block_m,
            run_short=run_short,
            run_long=run_long,
            num_splits=num_splits,
            tiles_per_split=tiles_per_split,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
        )

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        if not isinstance(plan, TritonPlan) or plan.launch is None:
            raise TypeError(f"the Triton backend needs its own plan, got {type(plan).__name__}")
        meta = plan.meta
        out = torch.empty_like(query)
        num_tokens, num_heads, head_dim = query.shape
        if num_tokens == 0:
            return out
        self._check_device(query)
        _check_cache(kv_cache)
        _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
        if cache_head_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(
                f"query [T, {num_heads}, {head_dim}] does not fit a cache of {num_kv_heads} KV heads "
                f"x {cache_head_dim}"
            )
        query = _last_dim_contiguous(query)
        block_tables = _last_dim_contiguous(meta.block_tables)
        launch = plan.launch
        if (launch.num_heads, launch.num_kv_heads) != (num_heads, num_kv_heads):
            raise ValueError(
                f"the plan was made for {launch.num_heads} heads over {launch.num_kv_heads} KV heads, "
                f"the query has {num_heads} over a cache of {num_kv_heads}"
            )
        cfg = self.config
        num_reqs = meta.num_reqs
        head_dim_pad = max(16, _next_pow2(head_dim))
        group = num_heads // num_kv_heads

        common = dict(
            num_reqs=num_reqs,
            num_heads=num_heads,
            qk_scale=scale * K.LOG2E,
            stride_qt=query.stride(0),
            stride_qh=query.stride(1),
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            stride_kb=kv_cache.stride(1),
            stride_ko=kv_cache.stride(2),
            stride_kh=kv_cache.stride(3),
            stride_bt=block_tables.stride(0),
            # The page size is fixed for an engine's life: a constant turns // and % into shifts.
            PAGE=block_size,
            GROUP=group,
            GROUP_PAD=launch.group_pad,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            UPCAST=self.upcast,
            # Real fp32 matmuls for fp32 caches; on GPU tl.dot would otherwise round inputs to tf32.
            IEEE_DOT=kv_cache.dtype == torch.float32,
            SEARCH=128,
        )
        tensors = (query, kv_cache[0], kv_cache[1], block_tables, meta.seq_lens, meta.query_start_loc)

        if launch.run_short:
            split = launch.num_splits > 1
            if split:
                rows = num_reqs * launch.short_block_q * num_heads * launch.num_splits
                part_m = torch.empty(rows, dtype=torch.float32, device=query.device)
                part_l = torch.empty_like(part_m)
                part_acc = torch.empty(rows, head_dim_pad, dtype=torch.float32, device=query.device)
            else:
                # Unused when SPLIT is off; any tensor will do for the pointer arguments.
                part_m = part_l = part_acc = out
            K.paged_attention_kernel[(num_reqs, num_kv_heads, launch.num_splits)](
                out,
                *tensors,
                part_acc,
                part_m,
                part_l,
                short_max_q=0,
                tiles_per_split=launch.tiles_per_split,
                BLOCK_Q=launch.short_block_q,
                BLOCK_M=launch.short_block_m,
                TILE_N=cfg.short_tile_n,
                LONG=False,
                SPLIT=split,
                num_warps=cfg.short_num_warps,
                num_stages=cfg.short_num_stages,
                **common,
            )
            if split:
                K.merge_splits_kernel[(num_reqs, launch.short_block_q, num_heads)](
                    out,
                    part_acc,
                    part_m,
                    part_l,
                    meta.query_start_loc,
                    num_heads,
                    launch.num_splits,
                    out.stride(0),
                    out.stride(1),
                    HEAD_DIM=head_dim,
                    HEAD_DIM_PAD=head_dim_pad,
                    BLOCK_Q=launch.short_block_q,
                    SPLITS_PAD=max(2, _next_pow2(launch.num_splits)),
                )
        if launch.run_long:
            grid = (num_tokens // launch.long_block_q + num_reqs, num_kv_heads, 1)
            K.paged_attention_kernel[grid](
                out,
                *tensors,
                out,
                out,
                out,
                # Requests the short launch already took; 0 when it did not run, so the long one takes all.
                short_max_q=launch.short_block_q if launch.run_short else 0,
                tiles_per_split=1 << 30,
                BLOCK_Q=launch.long_block_q,
                BLOCK_M=launch.long_block_m,
                TILE_N=cfg.long_tile_n,
                LONG=True,
                SPLIT=False,
                num_warps=cfg.long_num_warps,
                num_stages=cfg.long_num_stages,
                **common,
            )
        return out

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


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
