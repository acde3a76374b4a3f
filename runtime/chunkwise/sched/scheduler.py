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
        self.spec = policies.draft_length
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
        self.last_schedule_seconds = 0.0
        # n > 1 (fork.py): parents not yet forked; forked parents' children by the parent's id.
        self._parents: list[Request] = []
        self._families: dict[str, list[Request]] = {}

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
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests or req.request_id in self._families:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        n = req.sampling_params.n
        if n > self.config.max_num_seqs:
            raise ValueError(f"n ({n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        need = self.kv.num_blocks(req.num_prompt_tokens + req.max_tokens)
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks for its prompt and max_tokens, "
                f"but the cache holds {self.kv.pool.num_blocks}"
            )
        req.length_limit = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        req.stop_check_ids = frozenset(req.eos_token_ids) | frozenset(req.sampling_params.stop_token_ids)
        req.output_length_estimate = self.admission.output_estimate(req)
        self.stats.last_output_length_estimate = req.output_length_estimate
        if n > 1:
            req.fork_hold = 1
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
        req.decode_row = None
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
        t0 = time.perf_counter()
        # A fork (rare) adds rows whose COW copies this step carries: that step takes the general path.
        copies = self._fork_ready() if self._parents else None
        out = self._schedule_decodes() if copies is None else None
        if out is not None:
            self.last_schedule_seconds = time.perf_counter() - t0
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
        k_step = 0
        if self.spec is not None:
            k_step = self.spec.choose(sum(1 for r in decodes if self._may_speculate(r)), budget)
            self.stats.spec_draft_length = k_step
        parents = bool(self._parents)  # n > 1 requests not yet forked (rare): only then is fork_hold read
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            want = req.num_tokens - req.num_computed_tokens
            if k_step and want == 1 and self._may_speculate(req):
                # Never draft past max_tokens or max_model_len: the verify step may accept every draft.
                room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
                want += max(0, min(k_step, room))
            if parents:
                # A parent not yet forked leaves its prompt's last token to its children (fork.py); its raw
                # want is at least 2 here (it forks at 1), so it never speculated above.
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

        # 2. Admission, only in a step that preempted nothing: a step short of memory must not take more.
        if (
            num_preempted == 0
            and (self.swapped or len(self.waiting))
            and self.batching.admission_open(len(self.running))
        ):
            budget = self._resume_swapped(budget, num_new, swap_in)
            if not self.swapped:
                budget = self._admit_waiting(budget, num_new, cached_hits)

        out = self._compose(num_new, swap_out, swap_in, num_preempted)
        if copies:
            out.block_copies = copies
        self._update_gauges()
        self.last_schedule_seconds = time.perf_counter() - t0
        return out

    def _schedule_decodes(self) -> SchedulerOutput | None:
        """The steady state in one pass: nothing waits, no speculation, and every running request decodes
        one token into room it already has (or gets without pressure). The same outcome as the general
        path; None sends anything else there (what was allocated here stays valid for it)."""
        running = self.running
        if (
            self.spec is not None
            or self.swapped
            or len(self.waiting)
            or not running
            or len(running) > self.config.max_num_batched_tokens
        ):
            return None
        kv = self.kv
        capacity = kv.block_size
        tables = kv.block_tables
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
            row = req.decode_row
            if row is None or row.block_table is not table:
                params = req.sampling_params
                row = req.decode_row = ScheduledRequest(
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
