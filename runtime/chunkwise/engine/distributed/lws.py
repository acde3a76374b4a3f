"""A LeaderWorkerSet's view of a pod (one pod per pipeline stage): the variables LWS sets in every pod of a
group, read once. LWS_LEADER_ADDRESS is the leader pod's address (the group's rank 0 listens there),
LWS_GROUP_SIZE the pods in the group, LWS_WORKER_INDEX this pod's index (0: the leader)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"


@dataclass(frozen=True)
class LWSPlace:
    leader_address: str
    group_size: int
    worker_index: int  # this pod's stage

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> LWSPlace | None:
        """This pod's place in a group of more than one pod (None: not in one)."""
        size = env.get(LWS_GROUP_SIZE, "")
        try:
            group_size = int(size) if size else 1
            index = int(env.get(LWS_WORKER_INDEX, "0") or "0")
        except ValueError as e:
            raise ValueError(f"{LWS_GROUP_SIZE} and {LWS_WORKER_INDEX} must be integers: {e}") from e
        if group_size <= 1:
            return None
        address = env.get(LWS_LEADER_ADDRESS, "")
        if not address:
            raise ValueError(f"{LWS_GROUP_SIZE}={group_size} but {LWS_LEADER_ADDRESS} is not set")
        if not 0 <= index < group_size:
            raise ValueError(f"{LWS_WORKER_INDEX}={index} is not one of {LWS_GROUP_SIZE}={group_size} pods")
        return cls(address, group_size, index)

    def check(self, pipeline_parallel_size: int) -> None:
        """One pod per stage: the group's size is the pipeline's."""
        if self.group_size != pipeline_parallel_size:
            raise ValueError(
                f"a LeaderWorkerSet group of {LWS_GROUP_SIZE}={self.group_size} pods runs one pipeline stage "
                f"per pod: pipeline_parallel_size must be {self.group_size}, not {pipeline_parallel_size}"
            )
