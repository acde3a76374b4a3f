"""A tiny in-simulator router: which replica gets a request.

- round-robin: in turn, blind to load and to caches;
- least-loaded: fewest requests held (running + waiting + swapped), lowest index on ties;
- predicted-completion: the objective of docs/scheduling.md, the smallest predicted completion time

      T(r, replica) = T_queue + (|p_r| - |p_r ∩ cache|) / prefill_rate + l_r * TPOT

  with T_queue the replica's own predicted queueing delay (queued tokens over its measured service rate, as its
  load shedding computes it), the cached prefix read from the replica's prefix cache, the prefill rate from
  the profile, l_r the client's max_tokens or the replica's output-length estimate, and TPOT the replica's
  recent step time. It prefers cache hits when queues are comparable and leaves them when a replica is
  saturated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from chunkwise.bench.workloads import WorkItem
from chunkwise.sim.replica import SimReplica


class Router(Protocol):
    name: str

    def choose(
        self, replicas: Sequence[SimReplica], item: WorkItem, num_prompt_tokens: int, block_hashes: list[int]
    ) -> int: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, replicas: Sequence[SimReplica], item: WorkItem, num_prompt_tokens: int, block_hashes: list[int]
    ) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


class LeastLoaded:
    name = "least-loaded"

    def choose(
        self, replicas: Sequence[SimReplica], item: WorkItem, num_prompt_tokens: int, block_hashes: list[int]
    ) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].num_requests, i))


class PredictedCompletion:
    name = "predicted-completion"

    def predict_s(
        self, rep: SimReplica, item: WorkItem, num_prompt_tokens: int, block_hashes: list[int]
    ) -> float:
        uncached = num_prompt_tokens - rep.cached_prompt_tokens(block_hashes, num_prompt_tokens)
        prefill_s = uncached / rep.profile.prefill_tokens_per_s
        return rep.queue_delay_s() + prefill_s + rep.output_estimate(item) * rep.tpot_s()

    def choose(
        self, replicas: Sequence[SimReplica], item: WorkItem, num_prompt_tokens: int, block_hashes: list[int]
    ) -> int:
        return min(
            range(len(replicas)),
            key=lambda i: (self.predict_s(replicas[i], item, num_prompt_tokens, block_hashes), i),
        )


ROUTERS: dict[str, type[RoundRobin] | type[LeastLoaded] | type[PredictedCompletion]] = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "predicted-completion": PredictedCompletion,
}


def make_router(name: str) -> Router:
    cls = ROUTERS.get(name)
    if cls is None:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    router: Router = cls()
    return router
