"""Admission, the last part of composing a step: swapped requests resumed first, then waiting ones in the
queue's order, each only with blocks for its prompt and estimated output. Admitter, a collaborator the
Scheduler owns."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection

from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.sched.fork import Forks
from chunkwise.engine.sched.output import SchedulerStats
from chunkwise.engine.sched.policies import AdapterLimit, SchedulerPolicies


class Admitter:
    """Moves requests from the Scheduler's swapped and waiting queues into its running list (the queues are
    the Scheduler's, given here to move requests between), with their first chunk's blocks, as the policies
    allow. Each method takes the step's budget left and returns what it leaves, recording the tokens it
    scheduled in num_new. It keeps no state of its own; the parents' seats it reads from `forks`."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        policies: SchedulerPolicies,
        forks: Forks,
        stats: SchedulerStats,
        running: list[Request],
        swapped: deque[Request],
    ) -> None:
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.waiting = policies.waiting
        self.budget = policies.budget
        self.batching = policies.batching
        self.admission = policies.admission
        self.reuse = policies.reuse
        self.adapters = policies.adapters
        self.ranking = policies.ranking
        self.fairness = policies.fairness
        self.forks = forks
        self.stats = stats
        self.running = running
        self.swapped = swapped

    def head(self) -> Request | None:
        """The waiting request admission would try first now (the long-prompt cap applied), if any."""
        num_long = sum(1 for r in self.running if r.is_prefilling and self.waiting.is_long(r))
        return next(self.waiting.candidates(num_long), None)

    def _outstanding(self, without: Collection[Request] = ()) -> int:
        """Blocks promised to running requests (all but `without`) and not yet allocated: off-limits to
        newcomers."""
        tables = self.kv.block_tables
        return sum(
            max(0, r.reserved_blocks - len(tables.get(r.request_id, ())))
            for r in self.running
            if r not in without
        )

    def fits(self, req: Request, without: Collection[Request] = ()) -> bool:
        """Whether admission could take waiting `req` now: a seat and its reservation's blocks. With
        `without`, as if those running requests had given theirs back (an upper bound: a block they share
        with others is counted as freed)."""
        seats = self.forks.seats() if self.forks.parents else 0
        rows = req.sampling_params.n if req.fork_hold else 1
        if len(self.running) - len(without) + seats + rows > self.config.max_num_seqs:
            return False
        cached = self.kv.lookup_prefix(req)
        need = self.admission.blocks_needed(req, len(cached)) + self.kv.num_idle(cached)
        freed = sum(len(self.kv.block_tables.get(r.request_id, ())) for r in without)
        return need <= self.kv.num_free_blocks + freed - self._outstanding(without)

    def resume_swapped(
        self,
        budget: int,
        num_new: dict[str, int],
        swap_in: list[tuple[int, int]],
        head: Request | None = None,
    ) -> int:
        """Swapped requests back in, in their queue's order, recording their blocks' copies in swap_in; never
        one that the waiting `head` outranks (it goes first)."""
        # A parent not yet forked (n > 1) takes a seat for each of the children it will fork into.
        seats = self.forks.seats()
        adapters = AdapterLimit.running(self.running) if self.adapters is not None else set()
        while self.swapped and len(self.running) + seats < self.config.max_num_seqs:
            req = self.swapped[0]
            if head is not None and self.ranking.outranks(head, req):
                break
            if not self.kv.can_swap_in(req):
                break
            if self.adapters is not None:
                if not self.adapters.admits(adapters, req):
                    break  # oldest first: the swapped wait for a slot in their order
                if req.lora_key is not None:
                    adapters.add(req.lora_key)
            if req.fork_hold:
                if len(self.running) + seats + req.sampling_params.n > self.config.max_num_seqs:
                    break
                seats += req.sampling_params.n - 1
            self.swapped.popleft()
            swap_in.extend(self.kv.swap_in(req))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            contended = bool(self.swapped or len(self.waiting)) or any(
                r.is_prefilling for r in self.running if r is not req
            )
            n = self.budget.chunk(
                req, req.num_tokens - req.num_computed_tokens - req.fork_hold, budget, contended
            )
            if n and self.kv.allocate(req, n):
                num_new[req.request_id] = n
                budget -= n
                self.fairness.charge(req, n, prefill=n > 1)
        return budget

    def admit_waiting(self, budget: int, num_new: dict[str, int]) -> int:
        """Waiting requests in, in the queue's order, each with its prefix-cache hits."""
        # Blocks promised to running requests but not yet allocated stay off-limits to newcomers.
        outstanding = self._outstanding()
        num_long = sum(1 for r in self.running if r.is_prefilling and self.waiting.is_long(r))
        num_prefilling = sum(1 for r in self.running if r.is_prefilling)
        blocked: Request | None = None  # the head that did not fit, while reuse-heavy requests pass it
        scanned = 0
        # Seats the running parents' children will take when they fork (n > 1): counted as taken.
        seats = self.forks.seats() if self.forks.parents else 0
        adapters = AdapterLimit.running(self.running) if self.adapters is not None else set()
        for req in self.waiting.candidates(num_long):
            if self.adapters is not None and not self.adapters.admits(adapters, req):
                continue  # its adapter would be one too many this step: those behind it go ahead
            if len(self.running) + seats >= self.config.max_num_seqs:
                break
            if req.fork_hold and len(self.running) + seats + req.sampling_params.n > self.config.max_num_seqs:
                break
            if budget <= 0 and not self.batching.admits_without_budget:
                break
            if blocked is not None:
                scanned += 1
                if scanned > self.reuse.lookahead:
                    break
            if req.status == RequestStatus.WAITING and req.sampling_params.max_tokens is None:
                # Estimated at admission, not arrival: a burst that queued before the route had history
                # gets the quantile learned since, not the cold-start value.
                req.output_length_estimate = self.admission.output_estimate(req)
            cached = self.kv.lookup_prefix(req)
            if blocked is not None and not self.reuse.prefers(req, len(cached)):
                continue
            need = self.admission.blocks_needed(req, len(cached))
            # Hits on free cached blocks leave the free list when taken: they are not there for `need`.
            # With nothing running the head goes in whatever its reservation says (an estimate that may have
            # grown since it arrived): it alone holds the cache, waiting would free nothing, and the victim
            # rule backs the estimate up as it does for everyone.
            if self.running and need + self.kv.num_idle(cached) > self.kv.num_free_blocks - outstanding:
                if blocked is None and self.reuse.may_bypass(req):
                    blocked = req
                    continue
                break
            if blocked is not None:
                blocked.num_bypassed += 1
            num_cached_tokens = len(cached) * self.block_size
            contended = num_prefilling > 0 or len(self.waiting) > 1
            n = self.budget.chunk(req, req.num_tokens - num_cached_tokens - req.fork_hold, budget, contended)
            if not self.kv.allocate(req, n, cached):
                break
            if req.fork_hold:
                seats += req.sampling_params.n - 1
            self.waiting.remove(req)
            if req.status == RequestStatus.WAITING:
                # First admission: count prefix-cache lookups once per request, as vLLM does.
                req.num_cached_tokens = num_cached_tokens
                self.stats.prefix_cache_queries += req.num_prompt_tokens
                self.stats.prefix_cache_hits += num_cached_tokens
                self.stats.host_cache_hits += len(cached.host) * self.block_size
                req.first_scheduled_time = time.monotonic()
            req.num_computed_tokens = num_cached_tokens
            req.status = RequestStatus.RUNNING
            req.reserved_blocks = need + len(cached)
            outstanding += max(0, req.reserved_blocks - len(self.kv.block_tables[req.request_id]))
            self.running.append(req)
            if req.lora_key is not None:
                adapters.add(req.lora_key)
            if req.is_prefilling:
                num_prefilling += 1
                if self.waiting.is_long(req):
                    num_long += 1
            if n:
                num_new[req.request_id] = n
                budget -= n
                # Charged now, so the next pick in this same pass already sees it (sched/fairness.py).
                self.fairness.charge(req, n, prefill=True)
        return budget
