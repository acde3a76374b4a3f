"""The ranks a model is sharded over, and the two collectives its layers need: a sum (the row-parallel
projections and the vocabulary-parallel embedding) and a gather along a dimension (the LM head's logits).

SINGLE_RANK is world size 1: its collectives return their input and nothing touches torch.distributed, so
the engine built without a group runs exactly as before. ProcessGroupTP runs them over torch.distributed:
gloo on CPU, NCCL on CUDA (backend_for)."""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from chunkwise.engine.distributed.shm import ShmAllReduce


class TPGroup(Protocol):
    """What a sharded layer sees of its ranks."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, every rank the same bits; may be `x` itself, summed in place."""
        ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Each rank's `x` concatenated along `dim`, in rank order (every rank's of the same shape)."""
        ...


class SingleRank:
    """World size 1: the collectives are the identity, and no process group exists."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


SINGLE_RANK = SingleRank()


def backend_for(device: torch.device, choice: str = "auto") -> str:
    """The torch.distributed backend for tensors on `device`: `choice`, or for "auto" NCCL on CUDA and gloo
    elsewhere."""
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str | torch.device, backend: str, local_rank: int) -> torch.device:
    """The device of the `local_rank`-th rank of this machine, `device` being rank 0's: under NCCL each rank
    has a GPU of its own, the next ones after rank 0's; under gloo every rank shares rank 0's (on CUDA: several
    ranks on one GPU, which NCCL refuses)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + (local_rank if backend == "nccl" else 0))


class ProcessGroupTP:
    """The collectives over a torch.distributed process group (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 300.0) -> None:
        self.group = group
        self.timeout_s = timeout_s
        # CPU: the shared-memory all-reduce, set up by the first all-reduce (a collective, so every rank sets
        # it up at the same point); None: gloo's (or NCCL's), False: not yet asked.
        self._shm: ShmAllReduce | bool | None = False
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # Every rank has the same shape, so every rank skips an empty tensor (a step whose last layer keeps
        # no rows) together.
        if x.numel() == 0:
            return x
        if not x.is_contiguous():
            x = x.contiguous()
        if self._shm is False:
            self._shm = ShmAllReduce.create(self.group, self.timeout_s) if x.device.type == "cpu" else None
        # Every rank has the same shape and dtype, so every rank takes the same path.
        if isinstance(self._shm, ShmAllReduce) and self._shm.fits(x):
            return self._shm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        if x.numel() and isinstance(self._shm, ShmAllReduce) and self._shm.fits(x):
            return self._shm.all_gather(x, dim)  # the LM head's logits: megabytes a step, gloo's slowest call
        parts = [torch.empty_like(x) for _ in range(self._world_size)]
        if x.numel():
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def abort(self) -> None:
        """A rank died: every rank waiting in (or later entering) a shared-memory all-reduce raises at once
        rather than at the timeout. gloo's collectives fail on their own once the peer's socket closes."""
        if isinstance(self._shm, ShmAllReduce):
            self._shm.abort()

    def destroy(self) -> None:
        """Leave the group (the default one: the process's torch.distributed state with it)."""
        dist.destroy_process_group(self.group)


def init_tp_group(
    rank: int,
    world_size: int,
    *,
    init_method: str,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    timeout_s: float = 120.0,
) -> ProcessGroupTP:
    """Join the default process group as `rank` of `world_size` (every rank calls this with the same
    `init_method`, e.g. "tcp://127.0.0.1:PORT" or "file:///tmp/rendezvous"). A collective that waits longer
    than `timeout_s` for a peer (one that died) raises rather than hangs."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device, backend),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return ProcessGroupTP(timeout_s=timeout_s)
