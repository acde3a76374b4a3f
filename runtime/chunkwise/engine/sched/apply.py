"""The second half of a step: the runner's result applied to the scheduler's requests (Scheduler's
update_from_output delegates here), and the learning policies fed from it. StepApplier, a collaborator the
Scheduler owns."""

from __future__ import annotations

import time
from collections.abc import Callable

from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.sched.draft_length import AdaptiveDraftLength
from chunkwise.engine.sched.output import SchedulerOutput, SchedulerStats
from chunkwise.engine.sched.preemption import PreemptionCostModel

# Scheduler.finish: releases a request that the step's tokens ended.
Finish = Callable[[Request, RequestStatus, "int | str | None"], None]


class StepApplier:
    """Advances each scheduled request by what its row computed and sampled, ends those that stop (through
    `finish`, the scheduler's), counts the step into `stats` and feeds the learning policies. It keeps no
    state of its own."""

    def __init__(
        self,
        stats: SchedulerStats,
        cost_model: PreemptionCostModel,
        draft_length: AdaptiveDraftLength | None,
        max_model_len: int,
    ) -> None:
        self.stats = stats
        self.cost_model = cost_model
        self.draft_length = draft_length
        self.max_model_len = max_model_len

    def apply(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        drafted: dict[str, int] | None = None,
        row_tokens: list[int] | None = None,
        forward_seconds: float | None = None,
        step_seconds: float | None = None,
        *,
        finish: Finish,
    ) -> list[Request]:
        """Advance each scheduled request and append what it sampled. Returns requests with new tokens
        (finished ones included, already released).

        With speculation, sampled holds the accepted drafts and then one token from the target: the KV of the
        accepted drafts is valid and counts as computed; the rejected drafts' KV is rolled back simply by not
        counting it (those slots are overwritten by the next tokens).

        Every scheduled row's request is still running here: aborts and stop strings reach the scheduler
        between steps (the engine applies them before the next schedule()), and a victim preempted while the
        step was composed has no row. The watchdog's failed requests (out.failed) come first in the result.

        forward_seconds is the step's forward, step_seconds the whole step's (host work included): the
        learning policies read them (_learn)."""
        now = time.monotonic()
        if forward_seconds is not None or step_seconds is not None:
            self._learn(out, sampled, drafted or {}, forward_seconds, step_seconds)
        updated = out.failed[:] if out.failed else []
        self.stats.num_prefill_tokens += out.num_prefill_tokens
        self.stats.num_decode_tokens += out.num_batched_tokens - out.num_prefill_tokens
        if drafted:
            self.stats.spec_num_draft_tokens += sum(drafted.values())
        if out.decode_only and not drafted:
            if row_tokens is None:
                row_tokens = [sampled[sr.req_id][0] for sr in out.scheduled]
            return self._update_decodes(out, row_tokens, now, finish)
        for sr in out.scheduled:
            req = sr.req
            assert req is not None  # the scheduler's own rows carry their request
            tokens = sampled.get(sr.req_id)
            if not tokens:
                req.num_computed_tokens += len(sr.token_ids)
                continue
            accepted = len(tokens) - 1 if sr.num_spec_tokens else 0
            req.num_computed_tokens += len(sr.token_ids) + accepted
            self.stats.spec_num_accepted_tokens += accepted
            if req.first_token_time is None:
                req.first_token_time = now
            token_ids = req.token_ids
            limit = req.length_limit
            stop_ids = req.stop_check_ids
            for t in tokens:
                token_ids.append(t)
                if len(token_ids) >= limit or t in stop_ids:
                    status, reason = self._check_stop(req, t)  # which one it is (EOS may be ignored)
                    if status is not None:
                        finish(req, status, reason)
                        break
            updated.append(req)
        return updated

    def _learn(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        drafted: dict[str, int],
        forward_seconds: float | None,
        step_seconds: float | None,
    ) -> None:
        """The policies that learn from measured steps learn here, where they live: the draft length from
        every step's whole time, shape and acceptance, the preemption cost model's recompute rate from
        prefill-heavy steps (whose forward is mostly prefill)."""
        prefill = out.num_prefill_tokens
        draft = self.draft_length
        if draft is not None and out.scheduled:
            asked = slots = 0
            if draft.last_k:  # this step's k (schedule chose it): only then may a row verify drafts
                for sr in out.scheduled:
                    if sr.num_spec_tokens:
                        asked += 1
                        slots += sr.num_spec_tokens
            # A row verifying drafts computes several tokens, so the output counts it as prefill: it is not.
            prefill -= asked + slots
            if step_seconds is not None:
                accepted = cut = 0
                for rid, n in drafted.items():
                    got = len(sampled[rid]) - 1
                    accepted += got
                    cut += got < n  # a rejection ended this draft (the geometric rate's failures)
                rows = len(out.scheduled)
                draft.observe_step(
                    step_seconds,
                    rows,
                    prompt_tokens=out.num_batched_tokens - slots - rows,
                    asked=asked,
                    drafted=sum(drafted.values()),
                    drafted_rows=len(drafted),
                    accepted=accepted,
                    cut=cut,
                )
        if forward_seconds is not None and prefill > 0 and prefill >= out.num_batched_tokens // 2:
            self.cost_model.observe_prefill(out.num_batched_tokens, forward_seconds)

    def _update_decodes(
        self, out: SchedulerOutput, tokens: list[int], now: float, finish: Finish
    ) -> list[Request]:
        """update_from_output for the steady state: every row computed one token and sampled one (`tokens`,
        in row order)."""
        updated: list[Request] = []
        append = updated.append
        for sr, t in zip(out.scheduled, tokens):
            req = sr.req
            assert req is not None  # the scheduler's own rows carry their request
            req.num_computed_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            token_ids = req.token_ids
            token_ids.append(t)
            if len(token_ids) >= req.length_limit or t in req.stop_check_ids:
                status, reason = self._check_stop(req, t)
                if status is not None:
                    finish(req, status, reason)
            append(req)
        return updated

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = req.sampling_params
        # A grammar allows EOS only where it is complete, and only EOS once it is: that EOS always ends it.
        if (not params.ignore_eos or params.structured is not None) and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
