"""Start-up measurements on this machine: the constants the cost models begin from (the preemption cost
model's swap and recompute rates, the adaptive draft length's step cost) and the default KV memory.

Each runs through the real runner while every block is free, so what it writes is overwritten later."""

from __future__ import annotations

import time

import torch

from chunkwise.cache.kv_cache_manager import KVCacheManager
from chunkwise.sampling_params import SamplingParams
from chunkwise.sched.output import ScheduledRequest, SchedulerOutput
from chunkwise.worker.model_runner import ModelRunner

# KV memory when neither blocks nor bytes are given: modest on CPU, most of a GPU's free memory on CUDA.
_DEFAULT_CPU_KV_BYTES = 1 << 30
_DEFAULT_GPU_KV_FRACTION = 0.8


def default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _DEFAULT_GPU_KV_FRACTION)
    return _DEFAULT_CPU_KV_BYTES


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
