"""Routing policies: small objects with one method, `choose(request, candidates, now)`.

The router never branches on a policy's name. Every policy sees the same cost model, so the router can
record the predicted TTFT of the replica a policy chose, whichever policy it was.

The cost model they share is router/cost.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from chunkwise.router.cost import CostModel
from chunkwise.router.llmd import LlmD
from chunkwise.router.prompt import RoutedRequest
from chunkwise.router.replica import Replica


class Policy(Protocol):
    name: str

    def choose(self, request: RoutedRequest, candidates: Sequence[Replica], now: float) -> Replica:
        """One of `candidates` (never empty; in a stable order)."""
        ...


class _Rotation:
    """Ties go to each replica in turn, so that equal replicas share a burst."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def offsets(self, n: int) -> Callable[[int], int]:
        start = next(self._turn) % n
        return lambda i: (i - start) % n


class RoundRobin:
    name = "round-robin"

    def __init__(self, cost: CostModel) -> None:
        self._turn = itertools.count()

    def choose(self, request: RoutedRequest, candidates: Sequence[Replica], now: float) -> Replica:
        return candidates[next(self._turn) % len(candidates)]


class LeastLoaded:
    """Fewest requests in flight: the router's own now, plus other routers' as the last scrape showed."""

    name = "least-loaded"

    def __init__(self, cost: CostModel) -> None:
        self._rotation = _Rotation()

    def choose(self, request: RoutedRequest, candidates: Sequence[Replica], now: float) -> Replica:
        tie = self._rotation.offsets(len(candidates))

        def key(i: int) -> tuple[float, int]:
            waiting, running = candidates[i].others()
            return len(candidates[i].inflight) + waiting + running, tie(i)

        return candidates[min(range(len(candidates)), key=key)]


class PrefixAffinity:
    """The longest cached prefix wins, whatever the load; ties go to the least loaded."""

    name = "prefix-affinity"

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._rotation = _Rotation()

    def choose(self, request: RoutedRequest, candidates: Sequence[Replica], now: float) -> Replica:
        tie = self._rotation.offsets(len(candidates))

        def key(i: int) -> tuple[int, int, int]:
            r = candidates[i]
            return -self.cost.cached_tokens(r, request), len(r.inflight), tie(i)

        return candidates[min(range(len(candidates)), key=key)]


class PredictedCompletion:
    """The minimum of the predicted completion time, plus what the request's prefill delays the requests
    already at the replica: cache hits win while queues are comparable.

    The second term is the sum of completion times the pick adds, not only its own: an uncached prefill at
    a busy replica stalls every request there for as long as it runs, while the same prompt at the replica
    that caches it costs them almost nothing. Without it, a fleet whose caches are small spreads a
    tenant's requests wherever its own queue is shortest, each spread request displaces other prefixes,
    and the hit ratio and then the tail fall (docs/router-bench.md, "At fleet scale").
    """

    name = "predicted-completion"

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._rotation = _Rotation()

    def choose(self, request: RoutedRequest, candidates: Sequence[Replica], now: float) -> Replica:
        tie = self._rotation.offsets(len(candidates))
        predictions = self.cost.predict_all(candidates, request, now)

        def key(i: int) -> tuple[float, int, int]:
            p = predictions[i]
            return p.completion + p.delay_to_others_s, len(candidates[i].inflight), tie(i)

        return candidates[min(range(len(candidates)), key=key)]


POLICIES: dict[str, Callable[[CostModel], Policy]] = {
    p.name: p for p in (PredictedCompletion, RoundRobin, LeastLoaded, PrefixAffinity)
}
# Other routers' policies, reproduced as baselines (router/llmd.py). The router runs them like any other;
# `chunkwise router --policy` offers POLICIES (router/args.py), and the benchmark starts the router with
# these as well (bench/routing/router.py).
BASELINES: dict[str, Callable[[CostModel], Policy]] = {LlmD.name: LlmD}


def make_policy(name: str, cost: CostModel) -> Policy:
    factory = POLICIES.get(name) or BASELINES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join([*POLICIES, *BASELINES])}")
    return factory(cost)
