"""Tensor parallelism's two parts below the model: the group of ranks one model is sharded over, with its
collectives (group.py), and what each rank holds of a model's heads, MLP columns and vocabulary (layout.py).

At world size 1 (SINGLE_RANK) nothing here calls torch.distributed: the engine as it always was."""

from __future__ import annotations

from chunkwise.engine.distributed.group import (
    SINGLE_RANK,
    ProcessGroupTP,
    SingleRank,
    TPGroup,
    backend_for,
    init_tp_group,
)
from chunkwise.engine.distributed.layout import TPLayout

__all__ = [
    "SINGLE_RANK",
    "ProcessGroupTP",
    "SingleRank",
    "TPGroup",
    "TPLayout",
    "backend_for",
    "init_tp_group",
]
