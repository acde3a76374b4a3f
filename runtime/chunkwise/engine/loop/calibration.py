"""Start-up measurements on this machine: the constants the cost models begin from (the preemption cost
model's swap and recompute rates, the adaptive draft length's step cost) and the KV cache's size.

Each runs through the real runner while every block is free, so what it writes is overwritten later.

On CUDA the KV cache is sized as vLLM sizes it (`gpu_memory_utilization`): this engine may use a fraction of
the device's total memory; the weights, the activation peak of the largest step the engine can run (one
profiled forward and sample) and the memory outside torch's allocator come off it, and the KV cache gets the
rest. The decision (`kv_blocks_for_utilization`) is pure; the readings come through `MemoryStats`, torch.cuda's
in `CudaMemoryStats`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import EngineConfig
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.sched.output import ScheduledRequest, SchedulerOutput
from chunkwise.engine.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

# KV memory on CPU when neither blocks nor bytes are given: modest, since it comes out of the host's RAM.
DEFAULT_CPU_KV_BYTES = 1 << 30
_GIB = float(1 << 30)

# The profiled step samples as the costliest request does, short of prompt log-probs: top-k and top-p (a sort
# of every row's logits), a penalty and log-probs (each a [rows, vocab] float32 copy). 20 is vLLM's default
# cap on log-probs.
_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, presence_penalty=0.5, logprobs=20)


@dataclass(frozen=True)
class MemoryReading:
    """One look at the device's memory, in bytes."""

    total: int  # the device's memory
    used: int  # in use on the device by anyone: the driver's total - free
    allocated: int  # in torch tensors now
    peak_allocated: int  # the most in torch tensors since the peak was last reset
    reserved: int  # held by torch's caching allocator: its tensors and its cache of freed blocks


class MemoryStats(Protocol):
    def reset_peak(self) -> None:
        """Wait for the device, give torch's cached free blocks back, and restart the peak."""
        ...

    def read(self) -> MemoryReading:
        """Wait for the device, then read its memory."""
        ...


class CudaMemoryStats:
    """MemoryStats of one CUDA device, from torch.cuda."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryReading:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryReading(
            total=total,
            used=total - free,
            allocated=torch.cuda.memory_allocated(self.device),
            peak_allocated=torch.cuda.max_memory_allocated(self.device),
            reserved=torch.cuda.memory_reserved(self.device),
        )


@dataclass(frozen=True)
class ProfileStep:
    num_rows: int  # rows the step sampled
    num_tokens: int
    # The step's own KV blocks, which the real cache replaces (not the runner's sink block: the real runner
    # has one too, so it stays in the peak).
    kv_bytes: int


@dataclass(frozen=True)
class MemoryProfile:
    """Where the device's memory goes before the KV cache, in bytes."""

    total: int
    weights: int  # torch's allocations before the profiled step: the weights and what loading left resident
    # torch's peak during the profiled step, its own small KV cache excepted: the weights, the runner's
    # persistent buffers and the largest step's activations.
    peak: int
    # In use outside torch's allocator: the CUDA context, cuBLAS and Triton's workspaces, and any other
    # process on the device (which vLLM counts the same way).
    non_torch: int
    step: ProfileStep  # the step profiled

    @property
    def activations(self) -> int:
        return self.peak - self.weights


def profile_memory(stats: MemoryStats, run_step: Callable[[], ProfileStep]) -> MemoryProfile:
    """Run `run_step` between two readings of `stats`: its peak, and what the device uses outside torch."""
    stats.reset_peak()
    before = stats.read()
    step = run_step()
    after = stats.read()
    return MemoryProfile(
        total=after.total,
        weights=before.allocated,
        peak=after.peak_allocated - step.kv_bytes,
        # What torch reserved (cached blocks included) is in `used` too; what is left is someone else's.
        non_torch=max(after.used - after.reserved, 0),
        step=step,
    )


def run_profile_step(
    make_runner: Callable[[int], ModelRunner],
    *,
    num_tokens: int,
    num_rows: int,
    block_size: int,
    max_model_len: int,
) -> ProfileStep:
    """One step as large as the scheduler can compose, through a runner from `make_runner(num_blocks)` with
    just the blocks it needs: num_tokens (the step budget) spread over num_rows rows (max_num_seqs; no row
    longer than max_model_len), every row sampled. A fresh prompt chunk per row, as vLLM's profile run."""
    rows = min(num_rows, num_tokens)
    tokens = min(num_tokens, rows * max_model_len)
    lengths = [tokens // rows + (i < tokens % rows) for i in range(rows)]
    scheduled, next_block = [], 0
    for i, n in enumerate(lengths):
        blocks = -(-n // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append(
            ScheduledRequest(
                f"__profile_{i}__", [0] * n, 0, table, samples=True, sampling_params=_PROFILE_SAMPLING
            )
        )
    runner = make_runner(next_block)
    out = runner.execute(SchedulerOutput(scheduled=scheduled, num_batched_tokens=tokens))
    # Per layer [2, blocks + 1 (the sink), ...] (attention/backend.py): bytes per block times the step's blocks.
    kv_bytes = sum(t.numel() * t.element_size() // t.shape[1] for t in runner.kv_caches) * next_block
    return ProfileStep(num_rows=len(out.sampled), num_tokens=tokens, kv_bytes=kv_bytes)


def _gib(n: int) -> str:
    if abs(n) < _GIB:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / _GIB:.2f} GiB"


def kv_blocks_for_utilization(
    *,
    total: int,
    peak: int,
    non_torch: int,
    utilization: float,
    block_bytes: int,
    block_size: int,
    max_model_len: int | None,
) -> int:
    """KV blocks in what `utilization` of `total` leaves after `peak` (weights + activations) and `non_torch`.

    Raises ValueError, naming the flags that would fix it, when that is less than one request of max_model_len
    tokens (None: not set, the engine cuts it to what the cache holds; then less than one block)."""
    allowed = int(total * utilization)
    budget = allowed - peak - non_torch
    blocks = max(budget, 0) // block_bytes
    min_blocks = -(-max_model_len // block_size) if max_model_len is not None else 1
    if blocks >= min_blocks:
        return blocks
    need = peak + non_torch + min_blocks * block_bytes
    wanted = (
        f"one request of max_model_len {max_model_len} tokens needs {min_blocks} ({_gib(min_blocks * block_bytes)})"
        if max_model_len is not None
        else f"one block needs {_gib(block_bytes)}"
    )
    fixes = []
    if need <= total:
        fixes.append(f"raise --gpu-memory-utilization to {-(-need * 100 // total) / 100:.2f} or more")
    if max_model_len is not None and blocks > 0:
        fixes.append(f"lower --max-model-len to {blocks * block_size} or less")
    fixes.append("lower --max-num-batched-tokens or --max-num-seqs (a smaller activation peak)")
    if need > total:
        fixes.append("use a smaller model or a device with more memory")
    raise ValueError(
        f"no room for the KV cache: --gpu-memory-utilization {utilization} lets this engine use "
        f"{_gib(allowed)} of the device's {_gib(total)}; the weights and the largest step's activation peak "
        f"take {_gib(peak)} and memory outside torch {_gib(non_torch)}, which leaves {_gib(budget)}, "
        f"{blocks} blocks of {block_size} tokens, where {wanted}. To fix: {'; '.join(fixes)}"
    )


def kv_blocks_on_device(
    make_runner: Callable[[int], ModelRunner],
    stats: MemoryStats,
    *,
    utilization: float,
    block_bytes: int,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int | None,
    profile_len: int,
) -> int:
    """KV blocks for a CUDA device: profile the largest step (rows no longer than profile_len: max_model_len,
    or the model's positions when that is not set), decide, and log where the memory goes."""

    def step() -> ProfileStep:
        return run_profile_step(
            make_runner,
            num_tokens=max_num_batched_tokens,
            num_rows=max_num_seqs,
            block_size=block_size,
            max_model_len=profile_len,
        )

    p = profile_memory(stats, step)
    blocks = kv_blocks_for_utilization(
        total=p.total,
        peak=p.peak,
        non_torch=p.non_torch,
        utilization=utilization,
        block_bytes=block_bytes,
        block_size=block_size,
        max_model_len=max_model_len,
    )
    log.info(
        "GPU memory: %s total x --gpu-memory-utilization %.2f = %s for this engine: weights %s, activation "
        "peak %s (%d tokens in %d rows, sampled), outside torch %s, KV cache %s (%d blocks, %d tokens)",
        _gib(p.total),
        utilization,
        _gib(int(p.total * utilization)),
        _gib(p.weights),
        _gib(p.activations),
        p.step.num_tokens,
        p.step.num_rows,
        _gib(p.non_torch),
        _gib(blocks * block_bytes),
        blocks,
        blocks * block_size,
    )
    return blocks


@dataclass(frozen=True)
class KVProfileRequest:
    """Rank 0's word to the other tensor-parallel ranks on CUDA: profile your own device as I profile mine
    (the profile step's collectives need every rank), then agree on the smallest block count."""

    block_bytes: int  # a worker's bytes per block (rank 0 adds a draft model's, which only it holds)
    profile_len: int


def profile_kv_blocks(
    make_runner: Callable[[int], ModelRunner],
    device: torch.device,
    config: EngineConfig,
    block_bytes: int,
    profile_len: int,
) -> int:
    """kv_blocks_on_device with the engine's settings, on `device`."""
    sched = config.scheduler
    return kv_blocks_on_device(
        make_runner,
        CudaMemoryStats(device),
        utilization=config.cache.gpu_memory_utilization,
        block_bytes=block_bytes,
        block_size=config.cache.block_size,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        max_model_len=sched.max_model_len,
        profile_len=profile_len,
    )


class StartupProbe:
    """Timed forwards and swap round trips through `runner`, over the blocks of `kv`."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_model_len: int) -> None:
        self.runner = runner
        self.kv = kv
        self.max_model_len = max_model_len

    def _sync(self) -> None:
        """Wait for the device's queued work (a no-op on CPU, where work is done when the call returns)."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def time_forward(self, num_tokens: int) -> float:
        """Seconds of one warm prefill of num_tokens tokens through the first blocks.

        Used at start-up only, while every block is free; what it writes there is overwritten later."""
        n = min(num_tokens, self.max_model_len, self.kv.block_size * self.kv.pool.num_blocks)
        table = list(range(-(-n // self.kv.block_size)))
        sr = ScheduledRequest(
            "__warmup__", [0] * n, 0, table, samples=False, sampling_params=SamplingParams()
        )
        so = SchedulerOutput(scheduled=[sr], num_batched_tokens=n)
        self.runner.execute(so)  # warm-up
        # A step that samples nothing never waits for the device: without these the time would be the
        # enqueueing, and the recompute rate the preemption cost model starts from would be the host's.
        self._sync()
        t0 = time.perf_counter()
        self.runner.execute(so)
        self._sync()
        elapsed = time.perf_counter() - t0
        # The runner keeps per-request state (a block-table row) until told the request is gone.
        self.runner.execute(SchedulerOutput(scheduled=[], num_batched_tokens=0, finished_req_ids={sr.req_id}))
        return elapsed

    def step_cost(self) -> tuple[float, float]:
        """(fixed seconds per step, seconds per token) from two timed forwards, to seed the adaptive draft length."""
        large = min(64, self.max_model_len)
        t_small, t_large = self.time_forward(1), self.time_forward(large)
        per_token = max((t_large - t_small) / max(large - 1, 1), 1e-9)
        return max(t_small - per_token, 1e-6), per_token

    def swap_cost(
        self,
        num_blocks: int,
        num_host_blocks: int,
        block_bytes: int,
        max_blocks: int = 16,
        repeats: int = 5,
        budget_s: float = 0.15,
    ) -> tuple[float, float]:
        """(fixed seconds per transfer, bytes/s) of swap's copies, the preemption cost model's swap constants.

        Times device->host->device round trips of 1, a quarter of max_blocks and max_blocks blocks through
        the runner's own swap path (a step with only swap_out, then one with only swap_in), the best of up to
        `repeats` passes (fewer when a pass would overrun budget_s), and fits round trip = 2 * (fixed + bytes
        / bandwidth) by least squares. At start-up only, while nothing is swapped: the host slots' contents
        do not matter and the device blocks get their own bytes back."""
        n_max = min(max_blocks, num_blocks, num_host_blocks)
        if n_max == 0:
            return 0.0, 1.0  # no swap space: swap never happens, recompute is the only choice
        sizes = sorted({1, max(1, n_max // 4), n_max})
        sync = self._sync

        def round_trip(n: int) -> float:
            pairs = [(i, i) for i in range(n)]
            out = SchedulerOutput(scheduled=[], num_batched_tokens=0, swap_out=pairs)
            back = SchedulerOutput(scheduled=[], num_batched_tokens=0, swap_in=pairs)
            sync()
            t0 = time.perf_counter()
            self.runner.execute(out)
            self.runner.execute(back)
            sync()
            return time.perf_counter() - t0

        deadline = time.perf_counter() + budget_s
        round_trip(1)  # warm-up: first-call overheads
        best = dict.fromkeys(sizes, float("inf"))
        for _ in range(repeats):
            t0 = time.perf_counter()
            for n in sizes:
                best[n] = min(best[n], round_trip(n))
            now = time.perf_counter()
            if now + (now - t0) > deadline:
                break
        xs = [float(n * block_bytes) for n in sizes]
        ys = [best[n] / 2 for n in sizes]  # one transfer
        if len(sizes) == 1:
            return 0.0, xs[0] / max(ys[0], 1e-9)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 1e-15)  # seconds per byte: no faster than 1 PB/s, whatever the noise says
        return max(my - slope * mx, 0.0), 1 / slope

    def prefill_rate(self, num_tokens: int = 128) -> float:
        """Tokens/s of one prefill, the starting point of the preemption cost model's recompute rate."""
        n = min(num_tokens, self.max_model_len)
        return n / max(self.time_forward(n), 1e-9)
