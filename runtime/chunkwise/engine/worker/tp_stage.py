"""Tensor and pipeline parallel's per-step stage of ModelRunner.execute. Rank 0 (the engine's scheduler,
sampler and proposers) sends each step's StepMessage to the other ranks before its own forward; a worker rank
runs the same step from it (ModelRunner.follow): the same finished requests forgotten, the same KV block
copies and swaps over its own shard of its stage's layers, the same inputs, forward and (on the last stage)
LM head gathers, and nothing sampled (the next step's message carries the tokens rank 0 sampled). At world
size 1 the runner has no RankDriver and none of this runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from chunkwise.engine.sched.output import SchedulerOutput


@dataclass(frozen=True)
class StepMessage:
    """One step as rank 0 prepared it: its scheduler output (what only rank 0 reads left out) and the
    draft tokens its proposer chose (after any grammar cut)."""

    so: SchedulerOutput
    drafts: dict[str, list[int]]

    @classmethod
    def of(cls, so: SchedulerOutput, drafts: dict[str, list[int]]) -> StepMessage:
        rows = [
            dataclasses.replace(sr, req=None, output_token_ids=None, all_token_ids=None)
            for sr in so.scheduled
        ]
        return cls(dataclasses.replace(so, scheduled=rows, failed=[]), drafts)


class RankFailure(RuntimeError):
    """The engine's other ranks are gone (one died, or a failed step stopped them all): this engine cannot
    step again. The server treats it as fatal, where a failed step on one rank is recovered from."""


class RankDriver(Protocol):
    """Rank 0's hold on the other ranks (loop/tp_ranks.py)."""

    @property
    def world_size(self) -> int: ...

    def check(self) -> None:
        """Raise RankFailure, naming the rank, if a rank has died or the ranks were stopped."""
        ...

    def send(self, message: StepMessage) -> None:
        """The step's message to every other rank."""
        ...

    def stop_after(self, error: BaseException) -> None:
        """A step failed with `error`: stop every other rank (they are out of step with rank 0) and raise
        RankFailure from it, naming a rank that died if one did."""
        ...

    def close(self) -> None:
        """Stop every other rank (idempotent)."""
        ...
