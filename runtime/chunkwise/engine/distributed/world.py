"""One rank's place among tensor_parallel_size * pipeline_parallel_size ranks: the default group every rank
joins (global rank = stage * tp + tp rank), the tensor-parallel group of its stage, and its pipeline stage.

Every rank creates every stage's tensor-parallel subgroup, in stage order (torch.distributed.new_group is
collective over the whole world), and keeps its own. At one stage the tensor-parallel group is the default
group, as before pipeline parallel; at one tensor-parallel rank per stage it is SINGLE_RANK (no collective)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from chunkwise.engine.distributed.group import SINGLE_RANK, ProcessGroupTP, TPGroup, init_tp_group
from chunkwise.engine.distributed.pipeline import PipelineStage


@dataclass(frozen=True)
class RankGroups:
    rank: int  # global
    tp_size: int
    pp_size: int
    tp: TPGroup  # this rank's stage's
    device: torch.device  # this rank's (its collectives' tensors live there under NCCL)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (a collective over the whole world)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def stage(self, num_layers: int) -> PipelineStage:
        """This rank's pipeline stage of a model of `num_layers` layers."""
        return PipelineStage.of(self.rank, self.tp_size, self.pp_size, num_layers)

    def abort(self) -> None:
        """A rank died: this rank's waits in its stage's shared-memory all-reduce end at once."""
        if isinstance(self.tp, ProcessGroupTP):
            self.tp.abort()

    def destroy(self) -> None:
        """Leave the default group (its subgroups go with it)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def join_world(
    rank: int,
    tp_size: int,
    pp_size: int,
    *,
    init_method: str,
    timeout_s: float,
    device: str | torch.device = "cpu",
    backend: str = "auto",
) -> RankGroups:
    """Join the world of tp_size * pp_size ranks as global `rank` (every rank calls this with the same
    `init_method`), with its stage's tensor-parallel group; `device` is this rank's, `backend` the
    engine's distributed_backend."""
    world = init_tp_group(
        rank, tp_size * pp_size, init_method=init_method, device=device, backend=backend, timeout_s=timeout_s
    )
    tp: TPGroup = world
    if pp_size > 1:
        tp = SINGLE_RANK
        if tp_size > 1:
            for stage in range(pp_size):
                ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
                group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
                if rank in ranks:
                    tp = ProcessGroupTP(group, timeout_s)
    return RankGroups(rank, tp_size, pp_size, tp, torch.device(device))
