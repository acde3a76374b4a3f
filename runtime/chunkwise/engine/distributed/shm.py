"""Tensor parallel's all-reduce on CPU through shared memory (kernels/csrc/shm_all_reduce.cpp): the ranks of
a group on one machine map one segment, and each sum is two copies and a spin on a counter instead of gloo's
round trip through loopback TCP (0.5-0.7 ms for 64-128 KB, twice per layer per step).

Set up once per group, collectively (every rank calls `ShmAllReduce.create` at the same point): rank 0
creates the segment in /dev/shm and broadcasts its path; every rank maps it and says whether it could; the
segment is used only if every rank could (ranks on other machines, or a machine without the kernels, keep
gloo, and the reason is logged). The file is unlinked once mapped: nothing is left behind when the ranks
exit, however they exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

COUNTER_BYTES = 64  # csrc/shm_all_reduce.cpp: one cache line per rank's counter
# Per rank and bank: a step's hidden states of up to 8 MiB (e.g. 1,024 tokens x 4,096 fp16/bf16 values x 2);
# larger tensors go through gloo.
SLOT_BYTES = 8 << 20


def _segment_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class ShmAllReduce:
    """The sum over a group's ranks of a contiguous CPU tensor, in place, every rank the same bits."""

    def __init__(
        self, segment: torch.Tensor, rank: int, world_size: int, timeout_s: float, path: str = ""
    ) -> None:
        self.segment = segment
        self.path = path  # where it was created (unlinked once every rank had mapped it)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.header = header = (world_size + 1) * COUNTER_BYTES
        self.slot_bytes = (segment.numel() - header) // (2 * world_size) // 64 * 64
        # The abort word (csrc/shm_all_reduce.cpp): non-zero ends every rank's wait with an error.
        self._abort = segment[world_size * COUNTER_BYTES : world_size * COUNTER_BYTES + 8].view(torch.int64)
        self._seq = 0
        self._barrier_arg = torch.empty(0)  # an all-reduce of nothing: publish, then wait for every rank

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.numel() * x.element_size() <= self.slot_bytes
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` contiguous and `fits`; every rank calls this for the same collective in the same order."""
        self._seq += 1
        torch.ops.chunkwise.shm_all_reduce(
            x, self.segment, self.rank, self.world_size, self._seq, self.timeout_s
        )
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` (each the same shape, `fits`) concatenated along `dim` in rank order: each rank
        writes its slot of the call's bank, then the op's publish-and-wait with nothing to sum is the barrier
        after which every slot is read. The same two-bank rule as the sum's makes reuse safe."""
        self._seq += 1
        bank = self.header + (self._seq % 2) * self.world_size * self.slot_bytes
        nbytes = x.numel() * x.element_size()
        with torch.inference_mode():  # the segment may have been mapped inside a forward's inference mode

            def slot(r: int) -> torch.Tensor:
                start = bank + r * self.slot_bytes
                return self.segment[start : start + nbytes].view(x.dtype).view(x.shape)

            slot(self.rank).copy_(x)
            torch.ops.chunkwise.shm_all_reduce(
                self._barrier_arg, self.segment, self.rank, self.world_size, self._seq, self.timeout_s
            )
            return torch.cat([slot(r) for r in range(self.world_size)], dim=dim)

    def abort(self) -> None:
        """End every rank's current and future waits with an error: a rank died, and those waiting for it
        would otherwise spin until the timeout. Safe from any thread."""
        with torch.inference_mode():  # the segment was mapped inside a forward's inference mode
            self._abort.fill_(1)

    @classmethod
    def create(
        cls, group: dist.ProcessGroup | None, timeout_s: float, slot_bytes: int = SLOT_BYTES
    ) -> ShmAllReduce | None:
        """Collective over `group`: the segment every rank mapped, or None (gloo stays) with the reason logged."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        nbytes = (world + 1) * COUNTER_BYTES + 2 * world * slot_bytes
        path = [str(_segment_dir() / f"chunkwise-tp-{uuid.uuid4().hex}") if rank == 0 else ""]
        why = ""
        if rank == 0:
            try:
                with open(path[0], "wb") as f:
                    f.truncate(nbytes)  # zero-filled: every counter starts at 0
            except OSError as e:
                why = f"cannot create {path[0]}: {e}"
                path[0] = ""
        dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        segment: torch.Tensor | None = None
        if path[0]:
            try:
                from chunkwise.engine import kernels

                kernels.load()
                if not hasattr(torch.ops.chunkwise, "shm_all_reduce"):
                    raise kernels.KernelUnavailable("this kernel build has no shm_all_reduce")
                segment = torch.from_file(path[0], shared=True, size=nbytes, dtype=torch.uint8)
            except (OSError, RuntimeError) as e:  # KernelUnavailable is a RuntimeError
                why = why or f"rank {rank}: {e}"
        elif not why:
            why = "rank 0 could not create the segment"
        ok = torch.tensor([1 if segment is not None else 0], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # through gloo: every rank decides alike
        if rank == 0 and path[0]:
            with contextlib.suppress(OSError):
                os.unlink(path[0])  # every rank has mapped it (or given up): the mappings keep it alive
        if int(ok.item()) == 0:
            log.warning(
                "tensor parallel: gloo all-reduce (no shared-memory segment: %s)", why or "a rank failed"
            )
            return None
        assert segment is not None
        log.info(
            "tensor parallel: shared-memory all-reduce over %d ranks (slots of %d MiB)",
            world,
            slot_bytes >> 20,
        )
        return cls(segment, rank, world, timeout_s, path[0])
