"""The iteration-level scheduler: schedule() composes one step, update_from_output() applies its result.

One rule drives everything: each request's num_computed_tokens catches up with its token count. A prefill
chunk, a prefix-cache hit, a recompute after preemption and a decode are all the same catch-up, so the step
is just "give each running request as many of its missing tokens as the budget allows, then admit".

The scheduler owns request state; the KV cache manager owns block tables; policies decide (policies.py
builds them from the config) and the scheduler never branches on which policy it holds. It owns four
collaborators, each with its own state and file: Forks (fork.py: n > 1 parents and families), Admitter
(admit.py: admission from the swapped and waiting queues), StepComposer (compose.py: the step's rows, the
steady-state decode step, the ids the runner drops) and StepApplier (apply.py: a step's result applied).
Only the scheduler and these write request state.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable

from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.sched.admit import Admitter
from chunkwise.engine.sched.apply import StepApplier
from chunkwise.engine.sched.compose import StepComposer
from chunkwise.engine.sched.draft_length import AdaptiveDraftLength
from chunkwise.engine.sched.fork import Forks
from chunkwise.engine.sched.output import (
    QueuedWork,
    SchedulerOutput,
    SchedulerSnapshot,
    SchedulerStats,
    work_ahead_of,
)
from chunkwise.engine.sched.policies import SchedulerPolicies, build_policies
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.reservation import OutputLengthEstimator
from chunkwise.engine.sched.shedding import LoadSnapshot

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policies: SchedulerPolicies) -> None:
        self.config = config
        self.max_model_len = config.resolved_max_model_len()
        self.kv = kv
        self.block_size = kv.block_size
        self.policies = policies
        self.cost_model = policies.cost_model
        self.estimator = policies.estimator
        self.draft_length = policies.draft_length
        self.admission = policies.admission
        self.budget = policies.budget
        self.batching = policies.batching
        self.preemption = policies.preemption
        self.victims = policies.victims
        self.waiting = policies.waiting
        self.reuse = policies.reuse
        self.ranking = policies.ranking
        self.fairness = policies.fairness
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.forks = Forks(kv, policies.admission)
        self.admitter = Admitter(config, kv, policies, self.forks, self.stats, self.running, self.swapped)
        self.composer = StepComposer(
            kv, policies.batching, self.stats, config.max_num_batched_tokens, self.draft_length is not None
        )
        # Given finish per call, not kept: a bound method of the Scheduler held by its own collaborator would
        # make a reference cycle, and an engine in one is freed only by the garbage collector's full passes.
        self.applier = StepApplier(self.stats, self.cost_model, self.draft_length, self.max_model_len)

    @classmethod
    def from_config(
        cls,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost_model: PreemptionCostModel,
        estimator: OutputLengthEstimator | None = None,
        draft_length: AdaptiveDraftLength | None = None,
        max_loras: int | None = None,
    ) -> Scheduler:
        """A scheduler with the policies the config names (sched/policies.py), as the engine and the
        simulator build theirs; `max_loras` when the engine serves LoRA adapters."""
        return cls(
            config, kv, build_policies(config, kv.block_size, cost_model, estimator, draft_length, max_loras)
        )

    # -- requests in and out ----------------------------------------------------------------------------
    def prepare(self, req: Request) -> None:
        """Derive what the scheduler keeps on a request as it arrives, and refuse (ValueError) one that no
        amount of waiting could admit: n past the batch, or a reservation past the whole cache, decided by
        the function admission uses. Writes only req and reads the estimator, so the engine calls it on the
        caller's thread before queueing and a refusal is the caller's error, not a stuck queue."""
        if req.priority and self.config.scheduling_policy != "priority":
            # vLLM's rule: a priority that nothing would honour is the caller's mistake, not a silent no-op.
            raise ValueError(
                f"priority {req.priority} needs --scheduling-policy priority (this engine runs "
                f"{self.config.scheduling_policy}); send priority 0 or none"
            )
        n = req.sampling_params.n
        if n > self.config.max_num_seqs:
            # Its n sequences run side by side once forked (fork.py): they must fit in one batch.
            raise ValueError(f"n ({n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        req.length_limit = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        req.stop_check_ids = frozenset(req.eos_token_ids) | frozenset(req.sampling_params.stop_token_ids)
        req.fork_hold = 1 if n > 1 else 0
        req.output_length_estimate = self.admission.output_estimate(req)
        self.admission.check_fits(req, self.kv.pool.num_blocks)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests or req.request_id in self.forks.families:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.prepare(req)
        self.stats.last_output_length_estimate = req.output_length_estimate
        if req.fork_hold:
            self.forks.hold(req)
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
            elif req is None and rid in self.forks.families:
                # A forked request: every child still going.
                for child in list(self.forks.families[rid]):
                    if not child.is_finished:
                        self.finish(child, RequestStatus.FINISHED_ABORTED)
                        aborted.append(child)
        return aborted

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Release a request at once: its blocks are free for the next step's admission."""
        prev = req.status
        req.status = status
        req.finish_reason = status.value
        req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        if prev == RequestStatus.RUNNING:
            self.running.remove(req)
            # Static batching holds the slot (padding rows) until the batch's longest request completes.
            self.batching.release(req, len(self.running))
        elif prev == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        elif prev in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.kv.forget(req)
        self.requests.pop(req.request_id, None)
        self.composer.forget(req.request_id)
        if req.fork_hold or req.parent_id is not None:
            self.forks.forget(req)  # a parent finished before it forked (aborted), or a child
        if status != RequestStatus.FINISHED_ABORTED:
            self.estimator.observe(req.route, req.num_output_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def queued_work(self) -> tuple[int, int, int]:
        """The requests queued (waiting or swapped), their uncomputed tokens and their estimated outputs still
        to come: the work ahead of a newcomer, as the engine's load shedding and the simulator count it."""
        w = QueuedWork()
        for band in self.queued_bands().values():
            w = w.plus(band.num, band.prefill_tokens, band.decode_tokens)
        return w.num, w.prefill_tokens, w.decode_tokens

    def queued_bands(self) -> dict[int, QueuedWork]:
        """queued_work per priority band (one band, 0, under fcfs)."""
        bands: dict[int, list[int]] = {}
        for r in itertools.chain(self.waiting, self.swapped):
            b = bands.get(r.priority)
            if b is None:
                b = bands[r.priority] = [0, 0, 0]
            b[0] += 1
            b[1] += r.num_tokens - r.num_computed_tokens
            # A parent not yet forked has n outputs to come.
            sequences = r.sampling_params.n if r.fork_hold else 1
            b[2] += sequences * max(0, r.output_length_estimate - r.num_output_tokens)
        return {p: QueuedWork(*b) for p, b in bands.items()}

    def load(self, service_tokens_per_s: float, priority: int = 0) -> LoadSnapshot:
        """The queue as load shedding sees it at a measured service rate, for a newcomer of `priority` (its
        predicted_delay_s is the queueing delay that newcomer would see: the bands served before or with
        it)."""
        w = work_ahead_of(self.queued_bands(), priority)
        return LoadSnapshot(w.num, w.prefill_tokens, w.decode_tokens, service_tokens_per_s)

    def gauges(self) -> SchedulerStats:
        """The stats as of now (what /metrics reads), without the queued-work count `snapshot` adds: the
        simulator scrapes hundreds of replicas, some with thousands queued."""
        self._update_gauges()
        return copy.copy(self.stats)

    def snapshot(self, routes: Iterable[str] = ()) -> SchedulerSnapshot:
        bands = self.queued_bands()
        w = QueuedWork()
        for band in bands.values():
            w = w.plus(band.num, band.prefill_tokens, band.decode_tokens)
        self._update_gauges()
        return SchedulerSnapshot(
            copy.copy(self.stats),
            w.num,
            w.prefill_tokens,
            w.decode_tokens,
            {route: self.estimator.estimate(route) for route in routes},
            bands,
        )

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    @property
    def num_requests(self) -> int:
        """Requests held: running, waiting or swapped."""
        return len(self.running) + len(self.waiting) + len(self.swapped)

    # -- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Compose one step: fork the parents that are ready, give the running requests their tokens
        (preempting when memory is short), admit from the queues with what is left, add drafts last."""
        # A fork (rare) adds rows whose COW copies this step carries: that step takes the general path.
        copies = self._fork_ready() if self.forks.parents else None
        if copies is None and not (self.swapped or len(self.waiting)):
            out = self.composer.decode_step(self.running)
            if out is not None:
                if self.fairness.enabled:
                    for row in out.scheduled:
                        assert row.req is not None
                        self.fairness.charge(row.req, 1, prefill=False)
                if self.kv.tier is not None:
                    self._take_tier_copies(out)
                self._update_gauges()
                return out
        num_new: dict[str, int] = {}
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        # 0. A waiting request that outranks running ones (--scheduling-policy priority) and cannot be
        # admitted makes them give way, lowest first; it is admitted next step, as after any preemption.
        # (Only where requests differ in rank: under fcfs no one outranks anyone, and the head is not sought.)
        ranks = self.ranking.ranks
        head = self.admitter.head() if ranks and len(self.waiting) and self.running else None
        num_preempted = self._preempt_for(head, swap_out) if head is not None else 0

        # 1. Running requests first (preempting victims when the cache is short).
        budget, preempted, drafters = self._schedule_running(num_new, swap_out)
        num_preempted += preempted
        if self.fairness.enabled:
            for rid, n in num_new.items():
                req = self.requests[rid]
                self.fairness.charge(req, n, prefill=req.num_tokens - req.num_computed_tokens > 1)

        # 2. Admission, only in a step that preempted nothing: a step short of memory must not take more.
        if (
            num_preempted == 0
            and (self.swapped or len(self.waiting))
            and self.batching.admission_open(len(self.running))
        ):
            head = self.admitter.head() if ranks and len(self.waiting) else None
            budget = self.admitter.resume_swapped(budget, num_new, swap_in, head)
            if not self.swapped or (head is not None and self.ranking.outranks(head, self.swapped[0])):
                budget = self.admitter.admit_waiting(budget, num_new)

        # 3. Drafts last, from what prefill and admission left: speculation never starves a waiting prompt.
        if self.draft_length is not None:
            budget = self._add_drafts(drafters, num_new, budget)

        out = self.composer.compose(self.running, num_new, swap_out, swap_in, num_preempted)
        if copies:
            out.block_copies = copies
        if self.kv.tier is not None:
            self._take_tier_copies(out)
        if out.is_empty and not num_preempted and not self.running and (self.swapped or len(self.waiting)):
            out.failed = self._fail_stalled()
        self._update_gauges()
        return out

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        drafted: dict[str, int] | None = None,
        row_tokens: list[int] | None = None,
        forward_seconds: float | None = None,
        step_seconds: float | None = None,
    ) -> list[Request]:
        """Apply the step's result (StepApplier.apply, whose docstring says how). Returns requests with new
        tokens (finished ones included, already released)."""
        return self.applier.apply(
            out, sampled, drafted, row_tokens, forward_seconds, step_seconds, finish=self.finish
        )

    def _schedule_running(
        self, num_new: dict[str, int], swap_out: list[tuple[int, int]]
    ) -> tuple[int, int, list[Request]]:
        """Each running request as many of its missing tokens as the budget allows, decode rows before
        prefill chunks, so a long prompt's chunk takes only what the decodes leave (B = decode rows + chunk)
        and never stalls a stream. Returns the budget left, the number of victims preempted, and the decode
        rows that may draft once admission has taken its share (_add_drafts)."""
        budget = self.config.max_num_batched_tokens
        num_preempted = 0
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (decodes if r.num_tokens - r.num_computed_tokens == 1 else prefills).append(r)
        # Whether a prompt other than the one being chunked could take what it leaves of the step.
        queued = bool(self.swapped or len(self.waiting)) and self.batching.admission_open(len(self.running))
        drafters: list[Request] = []
        speculate = self.draft_length is not None
        parents = bool(
            self.forks.parents
        )  # n > 1 requests not yet forked (rare): only then is fork_hold read
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            want = req.num_tokens - req.num_computed_tokens
            if parents:
                # A parent not yet forked leaves its prompt's last token to its children (fork.py).
                want -= req.fork_hold
            own_prefill = req.num_tokens - req.num_computed_tokens > 1
            n = self.budget.chunk(req, want, budget, queued or len(prefills) > own_prefill)
            if n == 0:
                continue
            while not self.kv.allocate(req, n):
                victim = self.victims.victim(self.running)
                budget += num_new.pop(victim.request_id, 0)
                self._preempt(victim, swap_out)
                num_preempted += 1
                if victim is req:
                    break
            else:
                num_new[req.request_id] = n
                budget -= n
                if speculate and not own_prefill and self._may_speculate(req):
                    drafters.append(req)
        if budget <= 0 and len(num_new) < len(self.running):
            # More rows than the budget (max_num_seqs above max_num_batched_tokens): the ones left out go
            # first next step, or the same rows at the front would take every step.
            self.running.sort(key=lambda r: r.request_id in num_new)
        return budget, num_preempted, drafters

    def _fork_ready(self) -> list[tuple[int, int]] | None:
        """Fork every running parent whose prompt but the last token is computed. Returns the block copies
        the runner must make before this step's forward, or None when no parent forked."""
        ready = self.forks.ready()
        if not ready:
            return None
        copies: list[tuple[int, int]] = []
        for parent in ready:
            copies.extend(self._fork(parent))
        return copies

    def _fork(self, parent: Request) -> list[tuple[int, int]]:
        """One parent's n children take its place in the running list and in requests (fork.py)."""
        children, copies = self.forks.fork(parent)
        pos = self.running.index(parent)
        self.running[pos : pos + 1] = children
        pid = parent.request_id
        del self.requests[pid]
        for child in children:
            self.requests[child.request_id] = child
        # The runner drops whatever it kept for the parent (its table row).
        self.composer.forget(pid)
        return copies

    def _add_drafts(self, drafters: list[Request], num_new: dict[str, int], budget: int) -> int:
        """Speculative draft positions for this step's decode rows, from the budget the step has left: the
        draft length policy picks k for that share (budget // rows at most), each row drafts up to k but never
        past max_tokens or max_model_len (the verify may accept every draft). A row whose table cannot grow
        for its drafts decodes plainly: drafts never preempt anyone."""
        assert self.draft_length is not None
        # Preempted after it was given its token (a later row's victim): no longer in this step.
        rows = [r for r in drafters if r.request_id in num_new]
        # Each row already holds its one token: choose() caps k at budget // rows - 1 of what it is given.
        k = self.draft_length.choose(len(rows), budget + len(rows))
        self.stats.spec_draft_length = k
        if not k:
            return budget
        for req in rows:
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            d = min(k, room, budget)
            if d > 0 and self.kv.allocate(req, 1 + d):
                num_new[req.request_id] = 1 + d
                budget -= d
        return budget

    def _preempt_for(self, head: Request, swap_out: list[tuple[int, int]]) -> int:
        """Preempt running requests that `head` outranks (the ranking's choice, lowest first) until it
        could be admitted; nothing when it fits already or could not fit even with all of them gone.
        Returns how many were preempted."""
        victim = self.ranking.victim_for(head, self.running)
        if victim is None or self.admitter.fits(head):
            return 0
        outranked = [r for r in self.running if self.ranking.outranks(head, r)]
        if not self.admitter.fits(head, without=outranked):
            return 0
        n = 0
        while victim is not None and not self.admitter.fits(head):
            self._preempt(victim, swap_out)
            self.stats.num_priority_preemptions += 1
            n += 1
            victim = self.ranking.victim_for(head, self.running)
        return n

    def _fail_stalled(self) -> list[Request]:
        """The watchdog: a step with work waiting, nothing running and nothing admitted would repeat forever
        (admission and feasibility at arrival should make this unreachable; a leaked block, say, would not).
        The request at the head, which nothing admits, fails with an error instead; the next step tries the
        rest. Returns it, for the step's outputs."""
        req = self.swapped[0] if self.swapped else next(iter(self.waiting))
        free, total = self.kv.num_free_blocks, self.kv.pool.num_blocks
        reason = (
            f"no progress: nothing is running and request {req.request_id} cannot be admitted "
            f"({free} of {total} KV blocks free for its {req.num_tokens} tokens); it was failed rather than "
            "left waiting"
        )
        log.error("scheduler watchdog: %s", reason)
        self.stats.num_stalled_requests += 1
        self.finish(req, RequestStatus.FINISHED_ERROR, reason)
        return [req]

    def _preempt(self, req: Request, swap_out: list[tuple[int, int]]) -> None:
        self.running.remove(req)
        req.preempt_count += 1
        mode = self.preemption.mode(req)
        copies = self.kv.swap_out(req) if mode == "swap" else None
        self.stats.count_preemption(req.priority)
        if copies is not None:
            swap_out.extend(copies)
            req.status = RequestStatus.SWAPPED
            self.ranking.requeue_swapped(self.swapped, req)
            self.stats.num_preemptions_swap += 1
        else:
            if mode == "swap":
                # Swap was the choice but the host swap space cannot take the blocks: recompute instead.
                self.stats.num_preemption_fallbacks += 1
                if self.stats.num_preemption_fallbacks == 1:
                    self.cost_model.warn_swap_space_full(
                        req,
                        needed=len(self.kv.block_tables.get(req.request_id, ())),
                        free=self.kv.swap_space.num_free,
                        capacity=self.kv.swap_space.num_host_blocks,
                    )
            # Recompute (chosen, or swap space is full): drop the KV; prompt + output re-prefill on resume,
            # often partly from the prefix cache, since the freed blocks keep their hashes.
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.waiting.push_front(req)
            self.stats.num_preemptions_recompute += 1

    @staticmethod
    def _may_speculate(req: Request) -> bool:
        # Penalties and logprobs would need per-draft-position bookkeeping, and a seeded sampled request must
        # consume its random draws identically whatever the (timing-driven) draft length: those decode plainly.
        p = req.sampling_params
        seeded_sampling = p.seed is not None and not p.greedy
        return p.speculative and not p.has_penalty and p.logprobs is None and not seeded_sampling

    def _take_tier_copies(self, out: SchedulerOutput) -> None:
        """The host tier's copies of this step into its output: offloads of the blocks this step's
        allocations evicted, restores of the host hits it admitted (cache/host_tier.py)."""
        offload, restore = self.kv.take_tier_copies()
        out.offload = offload
        if restore:
            out.swap_in = out.swap_in + restore if out.swap_in else restore

    def _update_gauges(self) -> None:
        s = self.stats
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting)
        s.num_swapped = len(self.swapped)
        s.kv_usage = self.kv.pool.usage
        tier = self.kv.tier
        if tier is not None:
            s.host_cache_restores = tier.num_restores
            s.host_cache_offloads = tier.num_offloads
            s.host_cache_evictions = tier.num_evictions
            s.host_cache_usage = tier.usage
        if self.ranking.ranks:
            s.running_by_priority = _count_by_priority(self.running)
            s.queued_by_priority = _count_by_priority(itertools.chain(self.waiting, self.swapped))
        if self.policies.adapters is not None:
            self.policies.adapters.publish(s, self.running, (*self.waiting, *self.swapped))


def _count_by_priority(requests: Iterable[Request]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in requests:
        counts[r.priority] = counts.get(r.priority, 0) + 1
    return counts
