"""The Triton attention backend: the mixed batch over the paged KV cache in one or two kernel launches.

Importing this module imports triton (an optional dependency); chunkwise.engine.attention imports it only when the
backend is chosen. The kernels live in triton_kernels.py and their launches in triton_launch.py; this module
picks each step's launch shape and keeps the buffers the launches write.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from chunkwise.engine.attention import triton_kernels as K
from chunkwise.engine.attention.backend import AttentionMetadata, AttentionPlan
from chunkwise.engine.attention.triton_launch import Launches, LaunchPlan, TritonAttentionConfig, next_pow2


@dataclass
class TritonPlan(AttentionPlan):
    launch: LaunchPlan | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_splits(seq_len: int, num_splits: int, tile_n: int) -> tuple[int, int]:
    """(splits holding work, KV tiles per split) of a short row of seq_len tokens in a launch of num_splits:
    what the kernels compute from the row's own length (for tests and benchmarks)."""
    num_tiles = _cdiv(max(seq_len, 1), tile_n)
    per_split = _cdiv(num_tiles, num_splits)
    return _cdiv(num_tiles, per_split), per_split


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
        row_pad = next_pow2(row)
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
        group_pad = next_pow2(group)
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
        launches = Launches(
            self.config, self.upcast, self._buffer, query, kv_cache, launch, out, scale, compile_only=False
        )
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
            compiled += Launches(
                self.config, self.upcast, self._buffer, query, kv_cache, split, out, 1.0, compile_only=True
            ).short(1, tables)
        launches = Launches(
            self.config, self.upcast, self._buffer, query, kv_cache, launch, out, 1.0, compile_only=True
        )
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
