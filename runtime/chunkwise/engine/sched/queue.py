"""The waiting queue: FIFO with a cap on concurrent long-prompt prefills (and OrderedQueue: the same rule
over an order by priority, with fair shares between tenants).

The rule: requests are considered in arrival order (preempted ones first, at the head). A prompt of at least
`long_prompt_threshold` tokens is "long"; while `max_long_prefills` long prompts are prefilling, further long
prompts are passed over and keep their place, and shorter requests behind them may be admitted. Long prompts
never overtake each other, and the pass-over only lasts while a long prefill is in flight, so nothing starves:
each long prompt is admitted once the ones ahead of it finish prefilling. When memory, not the cap, stops the
head, the queue stops there (plain FIFO), so small requests cannot starve a large one by taking its blocks.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Iterator
from itertools import islice

from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.sched.fairness import Fairness, NoFairness, tenant_of


class WaitingQueue:
    def __init__(self, long_prompt_threshold: int, max_long_prefills: int, scan_limit: int = 512) -> None:
        self.long_prompt_threshold = long_prompt_threshold
        self.max_long_prefills = max_long_prefills
        # How far past the head admission looks in one step: a deep queue must not make every step slower.
        self.scan_limit = scan_limit
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        """A preempted request goes back to the head: it has waited longest."""
        self._q.appendleft(req)

    def remove(self, req: Request) -> None:
        if self._q and self._q[0] is req:
            self._q.popleft()
        else:
            self._q.remove(req)

    def is_long(self, req: Request) -> bool:
        return req.num_prompt_tokens >= self.long_prompt_threshold

    def candidates(self, num_long_prefilling: int) -> Iterator[Request]:
        """Requests to try, in order, at most scan_limit of them. Iterates over a snapshot of that window so the
        caller may remove what it admits."""
        long_slots = self.max_long_prefills - num_long_prefilling
        for req in list(islice(iter(self), self.scan_limit)):
            if self.is_long(req) and req.is_prefilling:
                if long_slots <= 0:
                    continue
                long_slots -= 1
            yield req


QueueKey = tuple[int, float, str]


def queue_key(req: Request) -> QueueKey:
    """Where a request stands under --scheduling-policy priority: lower priority value first, then earlier
    arrival (its first arrival: a preempted request keeps its place), the id breaking exact ties."""
    return (req.priority, req.arrival_time, req.request_id)


class OrderedQueue(WaitingQueue):
    """The waiting queue under --scheduling-policy priority and/or --fairness vtc.

    Requests stand in queue_key order: by priority, then arrival. A preempted request goes back where its
    key puts it, ahead of everything of its priority that arrived after it, not to the back. With fairness,
    each tenant has its own ordered list and admission is offered, each time, the head of the best priority
    among the tenants' heads, the tenant with the least service counted first (sched/fairness.py); the
    counters are read live, so what admission charges for one admission shapes the next pick in the same
    step. The long-prompt cap and the scan limit work as in WaitingQueue.
    """

    def __init__(
        self,
        long_prompt_threshold: int,
        max_long_prefills: int,
        fairness: Fairness | None = None,
        scan_limit: int = 512,
    ) -> None:
        super().__init__(long_prompt_threshold, max_long_prefills, scan_limit)
        self.fairness: Fairness = fairness or NoFairness()
        # tenant -> its requests in key order (one list, under "", without fairness).
        self._lists: dict[str, list[tuple[QueueKey, Request]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        lists = list(self._lists.values())
        if len(lists) == 1:
            return (r for _, r in lists[0])
        return (r for _, r in heapq.merge(*lists, key=lambda e: e[0]))

    def _tenant(self, req: Request) -> str:
        return tenant_of(req) if self.fairness.enabled else ""

    def push(self, req: Request) -> None:
        t = self._tenant(req)
        entries = self._lists.get(t)
        if entries is None:
            self.fairness.activate(t, self._lists)
            entries = self._lists[t] = []
        bisect.insort(entries, (queue_key(req), req), key=lambda e: e[0])
        self._len += 1

    # A preempted request goes back to its key's place: the same as a push.
    push_front = push

    def remove(self, req: Request) -> None:
        t = self._tenant(req)
        entries = self._lists[t]
        key = queue_key(req)
        i = bisect.bisect_left(entries, key, key=lambda e: e[0])
        if i == len(entries) or entries[i][1] is not req:
            raise ValueError(f"request {req.request_id} is not in the waiting queue")
        del entries[i]
        self._len -= 1
        if not entries:
            del self._lists[t]
            self.fairness.deactivate(t, self._lists)

    def candidates(self, num_long_prefilling: int) -> Iterator[Request]:
        if not self.fairness.enabled or len(self._lists) <= 1:
            yield from super().candidates(num_long_prefilling)
            return
        long_slots = self.max_long_prefills - num_long_prefilling
        service = self.fairness.service
        # The tenants' heads, best first: (priority, service counted, queue key, index, tenant). A tenant's
        # next request goes in once the caller is done with its last (charged, if admitted), and only a tenant
        # taken from gets a snapshot of its first scan_limit requests (the caller may remove what it admits):
        # a pass costs O(tenants + scan_limit log tenants), not tenants x scan_limit.
        heap = [(e[0][0][0], service(t), e[0][0], 0, t) for t, e in self._lists.items()]
        heapq.heapify(heap)
        snapshots: dict[str, list[tuple[QueueKey, Request]]] = {}
        for _ in range(self.scan_limit):
            if not heap:
                return
            *_, i, t = heapq.heappop(heap)
            snap = snapshots.get(t)
            if snap is None:
                snap = snapshots[t] = list(islice(self._lists[t], self.scan_limit))
            req = snap[i][1]
            passed_over = False
            if self.is_long(req) and req.is_prefilling:
                if long_slots <= 0:
                    passed_over = True
                else:
                    long_slots -= 1
            if not passed_over:
                yield req
            if i + 1 < len(snap):
                key = snap[i + 1][0]
                heapq.heappush(heap, (key[0], service(t), key, i + 1, t))


class PrefixPreference:
    """Prefix-aware admission: when memory is tight, prefer requests whose prompt is mostly cached.

    Such a request costs only its uncached suffix, so admitting it ahead of a head that does not fit turns
    cached blocks into throughput. The bound: a head is passed over at most `max_bypass` times, then the queue
    waits for it like plain FIFO.
    """

    def __init__(self, block_size: int, lookahead: int, min_fraction: float, max_bypass: int) -> None:
        self.block_size = block_size
        self.lookahead = lookahead
        self.min_fraction = min_fraction
        self.max_bypass = max_bypass

    def may_bypass(self, head: Request) -> bool:
        return self.lookahead > 0 and head.num_bypassed < self.max_bypass

    def prefers(self, req: Request, num_cached_blocks: int) -> bool:
        return (
            num_cached_blocks > 0
            and num_cached_blocks * self.block_size >= self.min_fraction * req.num_tokens
        )
