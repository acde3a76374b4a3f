"""Fair shares between tenants: the Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large
Language Models", OSDI'24).

Each tenant has a counter of the service it has received: prefill tokens weighted 1 and decode tokens
weighted 2 (a decode token costs a step's row for one token, a prefill token a share of a chunk: the paper's
weights). Admission takes the waiting tenant with the smallest counter (sched/queue.py, OrderedQueue), so a
tenant that bursts runs ahead only until its counter passes the others'. A tenant that had nothing waiting
and comes back is lifted to the smallest counter among the tenants waiting: idle time is not credit to spend
later in a burst.

`NoFairness` is the seed's behaviour (every request is one tenant's). Counters are charged when tokens are
scheduled (Scheduler._schedule_running, Admitter.admit_waiting), so two admissions in one step already see
each other's charge.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from chunkwise.engine.datatypes.request import Request

PREFILL_WEIGHT = 1.0
DECODE_WEIGHT = 2.0


def tenant_of(req: Request) -> str:
    """The key a request is counted under: its tenant, or "" for requests that name none."""
    return req.tenant or ""


class Fairness(Protocol):
    # Whether the queue orders tenants by their counters (False: one tenant, arrival order).
    enabled: bool

    def service(self, tenant: str) -> float: ...

    def charge(self, req: Request, num_tokens: int, prefill: bool) -> None: ...

    def activate(self, tenant: str, waiting: Iterable[str]) -> None: ...

    def deactivate(self, tenant: str, waiting: Iterable[str]) -> None: ...


class NoFairness:
    enabled = False

    def service(self, tenant: str) -> float:
        return 0.0

    def charge(self, req: Request, num_tokens: int, prefill: bool) -> None:
        return None

    def activate(self, tenant: str, waiting: Iterable[str]) -> None:
        return None

    def deactivate(self, tenant: str, waiting: Iterable[str]) -> None:
        return None


class VirtualTokenCounter:
    enabled = True

    def __init__(self, prefill_weight: float = PREFILL_WEIGHT, decode_weight: float = DECODE_WEIGHT) -> None:
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.counters: dict[str, float] = {}

    def service(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def charge(self, req: Request, num_tokens: int, prefill: bool) -> None:
        w = self.prefill_weight if prefill else self.decode_weight
        t = tenant_of(req)
        self.counters[t] = self.counters.get(t, 0.0) + w * num_tokens

    def activate(self, tenant: str, waiting: Iterable[str]) -> None:
        """`tenant` has a request waiting again, while `waiting` (the others) already had: lift it to their
        smallest counter, so time spent idle is not banked."""
        floor = min((self.service(t) for t in waiting if t != tenant), default=None)
        if floor is not None and self.service(tenant) < floor:
            self.counters[tenant] = floor

    def deactivate(self, tenant: str, waiting: Iterable[str]) -> None:
        """`tenant` has nothing waiting now. Its counter is dropped when it is at or below the smallest of
        the tenants still waiting: it would be lifted to at least that on return, so forgetting it changes
        nothing and the table stays as small as the tenants ahead of the pack."""
        floor = min((self.service(t) for t in waiting if t != tenant), default=None)
        if floor is not None and self.service(tenant) <= floor:
            self.counters.pop(tenant, None)
