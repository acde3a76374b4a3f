"""The waiting queue: FIFO with a cap on concurrent long-prompt prefills.

The rule: requests are considered in arrival order (preempted ones first, at the head). A prompt of at least
`long_prompt_threshold` tokens is "long"; while `max_long_prefills` long prompts are prefilling, further long
prompts are passed over and keep their place, and shorter requests behind them may be admitted. Long prompts
never overtake each other, and the pass-over only lasts while a long prefill is in flight, so nothing starves:
each long prompt is admitted once the ones ahead of it finish prefilling. When memory, not the cap, stops the
head, the queue stops there (plain FIFO), so small requests cannot starve a large one by taking its blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice

from chunkwise.engine.datatypes.request import Request


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
        for req in list(islice(self._q, self.scan_limit)):
            if self.is_long(req) and req.is_prefilling:
                if long_slots <= 0:
                    continue
                long_slots -= 1
            yield req


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
