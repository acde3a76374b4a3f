"""The KV cache's tensors: the device blocks the model attends over, the host slots swap moves them to, and
the copies between them (copy-on-write, swap out, swap in). One owner: the runner holds one KVTensors and
asks it to move blocks as the scheduler's output says; nothing else writes these tensors but the model."""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence

import torch

from chunkwise.engine.attention.backend import kv_cache_shape
from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.distributed import TPLayout


def kv_heads_per_rank(config: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """The KV heads each rank's cache holds: its share, or one replicated KV head where the model has fewer
    KV heads than ranks (the same on every rank)."""
    return TPLayout.of(config, 0, tensor_parallel_size).num_kv_heads


def kv_bytes_per_token(
    config: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int = 1, num_layers: int | None = None
) -> int:
    """KV bytes one token takes over a rank's layers (`num_layers`, a pipeline stage's; None: all of them),
    on each rank of a tensor-parallel group (all of them at tensor_parallel_size 1)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    heads = kv_heads_per_rank(config, tensor_parallel_size)
    layers = config.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * heads * config.head_dim * itemsize


class KVTensors:
    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        tensor_parallel_size: int = 1,
        num_layers: int | None = None,
    ) -> None:
        self.device = device
        # A pipeline stage's cache holds its layers only (None: every layer).
        layers = config.num_hidden_layers if num_layers is None else num_layers
        # A rank's cache holds its KV heads only: swap and copy-on-write move its shard of each block.
        heads = kv_heads_per_rank(config, tensor_parallel_size)
        # One block more than the pool hands out: the sink that padding rows write into, those of a bucketed
        # decode step (worker/cuda_graphs.py) and static batching's held slots (SchedulerOutput).
        self.sink_block = num_blocks
        shape = kv_cache_shape(num_blocks + 1, block_size, heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        host_shape = kv_cache_shape(num_host_blocks, block_size, heads, config.head_dim)
        pin = device.type == "cuda"
        # Host slots are always written (swap-out) before they are read (swap-in): leave them untouched, so
        # a large swap space costs no start-up time and no resident memory until used.
        self.host_caches = [torch.empty(host_shape, dtype=dtype, pin_memory=pin) for _ in range(layers)]

    def move(
        self,
        block_copies: Sequence[tuple[int, int]],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        offload: Sequence[tuple[int, int]] = (),
    ) -> None:
        """A step's block movement, before its forward, in this order (on a GPU every copy is queued on one
        stream, so each is made after the ones before it, whatever the host waits for):
        1. the host tier's offloads: the blocks this step's allocations evicted are read as they were, before
           anything below (or the forward) writes a block handed out again in this step;
        2. copy-on-write (a forked request's partial block): a swap-out this step may take the copy;
        3. swap-outs (preemption), then swap-ins (resumed requests, and the host tier's restores, which read
           slots the offloads above may have just written). A step swaps out (it preempted) or resumes and
           admits, never both (the scheduler admits nothing in a step that preempts:
           tests/engine/sched/test_scheduler_stress.py checks it), and the tier's slots are never swap's."""
        if offload:
            self.swap_out(list(offload))
        if block_copies:
            self.copy_blocks(list(block_copies))
        self.swap_out(swap_out)
        self.swap_in(swap_in)

    def _index(self, values: list[int]) -> torch.Tensor:
        """Block ids on the device, copied from pinned memory without blocking (torch.tensor(..., device=)
        copies from pageable memory, which waits)."""
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=pin)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write within the device cache: (source block, new block) pairs."""
        if not pairs:
            return
        s = self._index([p[0] for p in pairs])
        d = self._index([p[1] for p in pairs])
        for layer in self.kv_caches:
            # index_copy_, not `dst[:, d] = ...`: the indexed assignment goes through index_put_, which on
            # a 2-thread CPU took ~8 ms per layer for a few blocks against ~10 us here.
            layer.index_copy_(1, d, layer.index_select(1, s))

    def _swap_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One transfer between a host slot run and the device: both sides contiguous, the host side a view
        of the pinned host cache itself, so on a GPU it is a DMA that the host does not wait for."""
        dst.copy_(src, non_blocking=True)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host slot) pairs: each layer's blocks gathered on the device, then copied run by
        run of consecutive host slots straight into the host cache.

        Nothing waits: the host never reads the host cache itself, and every later use of these device
        blocks (a new owner's writes) or host slots (a swap-in's reads) is queued behind these copies on the
        same stream. The old path's `.to(cpu)` of each layer was a blocking copy into pageable memory:
        a sync per layer."""
        if not pairs:
            return
        pairs = sorted(pairs, key=operator.itemgetter(1))
        blocks = self._index([b for b, _ in pairs])
        runs = _runs([slot for _, slot in pairs])
        for device_layer, host_layer in zip(self.kv_caches, self.host_caches):
            staged = device_layer.index_select(1, blocks)  # [2, n, ...]: contiguous, in slot order
            for j, first, n in runs:
                for plane in range(2):  # keys, values: each run of a plane is one contiguous range
                    self._swap_copy(host_layer[plane, first : first + n], staged[plane, j : j + n])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host slot, device block) pairs: runs of consecutive host slots copied into a device staging
        tensor, then scattered into the blocks on the device (see swap_out for why nothing waits)."""
        if not pairs:
            return
        pairs = sorted(pairs, key=operator.itemgetter(0))
        blocks = self._index([b for _, b in pairs])
        runs = _runs([slot for slot, _ in pairs])
        for device_layer, host_layer in zip(self.kv_caches, self.host_caches):
            staged = torch.empty(
                (2, len(pairs), *device_layer.shape[2:]), dtype=device_layer.dtype, device=device_layer.device
            )
            for j, first, n in runs:
                for plane in range(2):
                    self._swap_copy(staged[plane, j : j + n], host_layer[plane, first : first + n])
            device_layer.index_copy_(1, blocks, staged)

    def measure_host_copy_bandwidth(self, num_blocks: int = 8, repeats: int = 3) -> float:
        """Bytes/s of a device->host->device round trip of `num_blocks` blocks, as swap would move them."""
        n = min(num_blocks, self.kv_caches[0].shape[1], self.host_caches[0].shape[1])
        if n == 0:
            return 1.0
        pairs = [(i, i) for i in range(n)]
        moved = sum(t[:, :n].numel() * t.element_size() for t in self.kv_caches) * 2
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.swap_out(pairs)
            self.swap_in(pairs)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return moved / max(best, 1e-9)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive values in ascending `slots`: (index of the run's first, its value, its length)."""
    runs: list[tuple[int, int, int]] = []
    for j, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((j, slot, 1))
    return runs
