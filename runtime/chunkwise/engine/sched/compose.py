"""Composing a step's SchedulerOutput from what the scheduler decided: the general path's rows (compose) and
the steady state's decode step in one pass (decode_step). StepComposer, a collaborator the Scheduler owns."""

from __future__ import annotations

from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.sched.output import DecodeStep, ScheduledRequest, SchedulerOutput, SchedulerStats
from chunkwise.engine.sched.policies import Batching


class StepComposer:
    """Owns what the runner is told between steps: the ids of requests gone since the last step (finished,
    or forked parents: the runner drops what it kept for them) and each request's steady-state decode row,
    reused step after step while its block table is the same list (decode_step); kept here, not on the
    Request, which the scheduler's types sit above."""

    def __init__(
        self,
        kv: KVCacheManager,
        batching: Batching,
        stats: SchedulerStats,
        max_num_batched_tokens: int,
        speculate: bool,
    ) -> None:
        self.kv = kv
        self.batching = batching
        self.stats = stats
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speculate = speculate
        self.finished_ids: set[str] = set()
        self.decode_rows: dict[str, ScheduledRequest] = {}

    def forget(self, request_id: str) -> None:
        """A request left the batch for good (finished, or a parent forked): its id goes to the runner with
        the next step, and its decode row is dropped."""
        self.decode_rows.pop(request_id, None)
        self.finished_ids.add(request_id)

    def compose(
        self,
        running: list[Request],
        num_new: dict[str, int],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        num_preempted: int,
    ) -> SchedulerOutput:
        """The step's rows: each running request given tokens (num_new), in the running list's order."""
        scheduled = []
        num_tokens = num_prefill = 0
        score_prompts = False
        for req in running:
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
                    lora=req.lora_key,
                )
            )
            num_tokens += n
            if start < req.num_prompt_tokens or n > 1:
                num_prefill += n
        finished, self.finished_ids = self.finished_ids, set()
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

    def decode_step(self, running: list[Request]) -> SchedulerOutput | None:
        """The steady state in one pass (the caller has checked that nothing waits): no speculation, and
        every running request decodes one token into room it already has (or gets without pressure). The
        same outcome as the general path; None sends anything else there (what was allocated here stays
        valid for it)."""
        if self.speculate or not running or len(running) > self.max_num_batched_tokens:
            return None
        kv = self.kv
        capacity = kv.block_size
        tables = kv.block_tables
        rows = self.decode_rows
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
                    1  # a prompt's last token (after a prefix-cache hit): prefill, as compose counts
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
                    req.request_id, [token], start, table, True, params, req=req, lora=req.lora_key
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
        finished, self.finished_ids = self.finished_ids, set()
        return SchedulerOutput(
            scheduled,
            len(scheduled),
            finished_req_ids=finished,
            num_prefill_tokens=num_prefill,
            decode_only=True,
            decode=DecodeStep(ids, positions, grown),
            padding_positions=self._padding(len(scheduled)),
        )
