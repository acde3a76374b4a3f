"""The iteration-level scheduler: schedule() composes one step, update_from_output() applies its result.

One rule drives everything: each request's num_computed_tokens catches up with its token count. A prefill
chunk, a prefix-cache hit, a recompute after preemption and a decode are all the same catch-up, so the step
is just "give each running request as many of its missing tokens as the budget allows, then admit".

The scheduler owns request state; the KV cache manager owns block tables; policies decide (policies.py
builds them from the config) and the scheduler never branches on which policy it holds. Two parts of the
class live in files of their own: admission (admit.py) and applying a step's result (apply.py).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable

from chunkwise.cache.kv_cache_manager import KVCacheManager
from chunkwise.config import SchedulerConfig
from chunkwise.request import Request, RequestStatus
from chunkwise.sched.admission import OutputLengthEstimator
from chunkwise.sched.admit import AdmitFromQueues
from chunkwise.sched.apply import ApplyStepResult
from chunkwise.sched.fork import ForkRequests
from chunkwise.sched.output import (
    DecodeStep,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerSnapshot,
    SchedulerStats,
)
from chunkwise.sched.policies import SchedulerPolicies, build_policies
from chunkwise.sched.preemption import PreemptionCostModel
from chunkwise.speculative.adaptive import AdaptiveDraftLength

log = logging.getLogger(__name__)


class Scheduler(AdmitFromQueues, ApplyStepResult, ForkRequests):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policies: SchedulerPolicies) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be resolved before building a Scheduler")
        self.config = config
        self.max_model_len: int = config.max_model_len
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
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()
        # n > 1 (fork.py): parents not yet forked; forked parents' children by the parent's id.
        self._parents: list[Request] = []
        self._families: dict[str, list[Request]] = {}
        # Each request's steady-state decode row, reused step after step while its block table is the same
        # list (_schedule_decodes); kept here, not on the Request, which the scheduler's types sit above.
        self._decode_rows: dict[str, ScheduledRequest] = {}

    @classmethod
    def from_config(
        cls,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost_model: PreemptionCostModel,
        estimator: OutputLengthEstimator | None = None,
        draft_length: AdaptiveDraftLength | None = None,
    ) -> Scheduler:
        """A scheduler with the policies the config names (sched/policies.py), as the engine and the
        simulator build theirs."""
        return cls(config, kv, build_policies(config, kv.block_size, cost_model, estimator, draft_length))

    # -- requests in and out ----------------------------------------------------------------------------
    def prepare(self, req: Request) -> None:
        """Derive what the scheduler keeps on a request as it arrives, and refuse (ValueError) one that no
        amount of waiting could admit: n past the batch, or a reservation past the whole cache, decided by
        the function admission uses. Writes only req and reads the estimator, so the engine calls it on the
        caller's thread before queueing and a refusal is the caller's error, not a stuck queue."""
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
        if req.request_id in self.requests or req.request_id in self._families:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.prepare(req)
        self.stats.last_output_length_estimate = req.output_length_estimate
        if req.fork_hold:
            self._parents.append(req)
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
            elif req is None and rid in self._families:
                # A forked request: every child still going.
                for child in list(self._families[rid]):
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
        self._decode_rows.pop(req.request_id, None)
        self._finished_ids.add(req.request_id)
        if req.fork_hold:
            self._parents.remove(req)  # finished before it forked (aborted)
        elif req.parent_id is not None:
            self._forget_family_member(req)
        if status != RequestStatus.FINISHED_ABORTED:
            self.estimator.observe(req.route, req.num_output_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def snapshot(self, routes: Iterable[str] = ()) -> SchedulerSnapshot:
        num = prefill = decode = 0
        for r in itertools.chain(self.waiting, self.swapped):
            num += 1
            prefill += r.num_tokens - r.num_computed_tokens
            # A parent not yet forked has n outputs to come.
            sequences = r.sampling_params.n if r.fork_hold else 1
            decode += sequences * max(0, r.output_length_estimate - r.num_output_tokens)
        self._update_gauges()
        return SchedulerSnapshot(
            copy.copy(self.stats),
            num,
            prefill,
            decode,
            {route: self.estimator.estimate(route) for route in routes},
        )

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    # -- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # A fork (rare) adds rows whose COW copies this step carries: that step takes the general path.
        copies = self._fork_ready() if self._parents else None
        out = self._schedule_decodes() if copies is None else None
        if out is not None:
            return out
        budget = self.config.max_num_batched_tokens
        num_new: dict[str, int] = {}
        cached_hits: dict[str, int] = {}
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        num_preempted = 0

        # 1. Running requests first. Decode rows before prefill chunks, so a long prompt's chunk takes only
        #    what the decodes leave (B = decode rows + chunk) and never stalls a stream.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (decodes if r.num_tokens - r.num_computed_tokens == 1 else prefills).append(r)
        # Whether a prompt other than the one being chunked could take what it leaves of the step.
        queued = bool(self.swapped or len(self.waiting)) and self.batching.admission_open(len(self.running))
        # Decode rows that may draft once admission has taken its share (_add_drafts).
        drafters: list[Request] = []
        speculate = self.draft_length is not None
        parents = bool(self._parents)  # n > 1 requests not yet forked (rare): only then is fork_hold read
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

        # 2. Admission, only in a step that preempted nothing: a step short of memory must not take more.
        if (
            num_preempted == 0
            and (self.swapped or len(self.waiting))
            and self.batching.admission_open(len(self.running))
        ):
            budget = self._resume_swapped(budget, num_new, swap_in)
            if not self.swapped:
                budget = self._admit_waiting(budget, num_new, cached_hits)

        # 3. Drafts last, from what prefill and admission left: speculation never starves a waiting prompt.
        if speculate:
            budget = self._add_drafts(drafters, num_new, budget)

        out = self._compose(num_new, swap_out, swap_in, num_preempted)
        if copies:
            out.block_copies = copies
        if out.is_empty and not num_preempted and not self.running and (self.swapped or len(self.waiting)):
            out.failed = self._fail_stalled()
        self._update_gauges()
        return out

    def _schedule_decodes(self) -> SchedulerOutput | None:
        """The steady state in one pass: nothing waits, no speculation, and every running request decodes
        one token into room it already has (or gets without pressure). The same outcome as the general
        path; None sends anything else there (what was allocated here stays valid for it)."""
        running = self.running
        if (
            self.draft_length is not None
            or self.swapped
            or len(self.waiting)
            or not running
            or len(running) > self.config.max_num_batched_tokens
        ):
            return None
        kv = self.kv
        capacity = kv.block_size
        tables = kv.block_tables
        rows = self._decode_rows
        scheduled: list[ScheduledRequest] = []
        append = scheduled.append
        # Gathered here, where each request is already in hand, so that the runner need not visit every
        # row again (at hundreds of rows, each visit is a cache miss after the forward).
        ids: list[int] = []
        positions: list[int] = []
        grown: list[int] = []
        num_prefill = 0
        for req in running:
            tokens = req.token_ids
            start = req.num_computed_tokens
            if len(tokens) - start != 1:
                return None
            if start < req.num_prompt_tokens:
                num_prefill += (
                    1  # a prompt's last token (after a prefix-cache hit): prefill, as _compose counts
                )
            table = tables.get(req.request_id)
            if table is None or start >= len(table) * capacity or (start + 1) % capacity == 0:
                # A new block, or one that fills up now (its hash goes to the prefix cache).
                had = len(table) if table is not None else 0
                if not kv.allocate(req, 1):
                    return None
                table = tables[req.request_id]
                if len(table) != had:
                    grown.append(len(scheduled))
            token = tokens[start]
            row = rows.get(req.request_id)
            if row is None or row.block_table is not table:
                params = req.sampling_params
                row = rows[req.request_id] = ScheduledRequest(
                    req.request_id, [token], start, table, True, params, req=req
                )
                if params.has_penalty:
                    row.output_token_ids = req.output_token_ids
            else:
                # The row's own one-token list (no step keeps it past its own): refilled, not reallocated.
                row.token_ids[0] = token
                row.start_pos = start
                if row.output_token_ids is not None:  # penalties read the outputs so far
                    row.output_token_ids = req.output_token_ids
            append(row)
            ids.append(token)
            positions.append(start)
        finished, self._finished_ids = self._finished_ids, set()
        self._update_gauges()
        return SchedulerOutput(
            scheduled,
            len(scheduled),
            finished_req_ids=finished,
            num_prefill_tokens=num_prefill,
            decode_only=True,
            decode=DecodeStep(ids, positions, grown),
            padding_positions=self._padding(len(scheduled)),
        )

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
        if copies is not None:
            swap_out.extend(copies)
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
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

    def _compose(
        self,
        num_new: dict[str, int],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        num_preempted: int,
    ) -> SchedulerOutput:
        scheduled = []
        num_tokens = num_prefill = 0
        score_prompts = False
        for req in self.running:
            n = num_new.get(req.request_id)
            if not n:
                continue
            start = req.num_computed_tokens
            # Past the known tokens means draft positions: the runner fills them in and verifies them.
            num_spec = max(0, start + n - req.num_tokens)
            samples = start + n - num_spec == req.num_tokens
            params = req.sampling_params
            scores = params.prompt_logprobs is not None and start < req.num_prompt_tokens
            score_prompts |= scores
            scheduled.append(
                ScheduledRequest(
                    req_id=req.request_id,
                    token_ids=req.token_ids[start : start + n - num_spec],
                    start_pos=start,
                    block_table=self.kv.block_tables[req.request_id],
                    samples=samples,
                    sampling_params=params,
                    output_token_ids=req.output_token_ids if params.has_penalty and samples else None,
                    num_spec_tokens=num_spec,
                    all_token_ids=req.token_ids if num_spec else None,
                    req=req,
                    prompt_token_ids=req.prompt_token_ids if scores else None,
                )
            )
            num_tokens += n
            if start < req.num_prompt_tokens or n > 1:
                num_prefill += n
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=num_tokens,
            swap_out=swap_out,
            swap_in=swap_in,
            finished_req_ids=finished,
            num_prefill_tokens=num_prefill,
            num_preempted=num_preempted,
            padding_positions=self._padding(len(scheduled)),
            score_prompts=score_prompts,
        )

    def _padding(self, num_rows: int) -> tuple[int, ...]:
        """The step's padding rows (static batching's held slots; none under continuous batching), counted
        with its real rows. A step with no real rows computes no padding either."""
        padding = self.batching.padding_positions() if num_rows else ()
        stats = self.stats
        stats.num_rows += num_rows
        stats.num_padding_rows += len(padding)
        return padding

    @staticmethod
    def _may_speculate(req: Request) -> bool:
        # Penalties and logprobs would need per-draft-position bookkeeping, and a seeded sampled request must
        # consume its random draws identically whatever the (timing-driven) draft length: those decode plainly.
        p = req.sampling_params
        seeded_sampling = p.seed is not None and not p.greedy
        return p.speculative and not p.has_penalty and p.logprobs is None and not seeded_sampling

    def _update_gauges(self) -> None:
        s = self.stats
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting)
        s.num_swapped = len(self.swapped)
        s.kv_usage = self.kv.pool.usage
