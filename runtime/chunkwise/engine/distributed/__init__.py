"""Parallelism below the model: the group of ranks one model is sharded over, with its collectives
(group.py), what each rank holds of a model's heads, MLP columns and vocabulary (layout.py), which layers a
pipeline stage holds and its point-to-point traffic (pipeline.py), and a rank's place among them all
(world.py).

At world size 1 (SINGLE_RANK) nothing here calls torch.distributed: the engine as it always was."""

from __future__ import annotations

from chunkwise.engine.distributed.group import (
    SINGLE_RANK,
    ProcessGroupTP,
    SingleRank,
    TPGroup,
    backend_for,
    init_tp_group,
    rank_device,
)
from chunkwise.engine.distributed.layout import TPLayout
from chunkwise.engine.distributed.pipeline import PipelineStage, single_stage, stage_layers
from chunkwise.engine.distributed.world import RankGroups, join_world

__all__ = [
    "SINGLE_RANK",
    "PipelineStage",
    "ProcessGroupTP",
    "RankGroups",
    "SingleRank",
    "TPGroup",
    "TPLayout",
    "backend_for",
    "init_tp_group",
    "join_world",
    "rank_device",
    "single_stage",
    "stage_layers",
]
