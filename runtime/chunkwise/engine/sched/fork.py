"""n > 1: one request, n completions, the prompt's KV computed once. Forks, a collaborator the Scheduler owns.

A request with n > 1 enters the scheduler as a parent. It is an ordinary request in every policy's eyes
(queued, admitted, chunked, preempted by recompute or swap) except that it computes its prompt but the last
token (`Request.fork_hold`): it never samples. Once that much is computed and it is running, the step that
follows forks it (at the start of schedule(), before anything else is composed): n children replace it in the
running list, each an ordinary request (prompt tokens, its own sampling stream), each with the prompt's last
token still to compute. So each child computes that token itself and samples its own first token from its
own logits, exactly as an n=1 request's last prefill row does: a greedy child is the n=1 greedy output, and
a seeded child's draws are its own generator's alone.

The KV cache manager hands the parent's blocks over (KVCacheManager.fork): the full blocks are shared by
reference count, the partial last block is copied on write for every child but the first. The copies ride
in this step's SchedulerOutput (block_copies) and the model runner makes them before the forward.

Why the parent stops one token short rather than sampling n tokens from its last row: the children's first
rows are then ordinary prefill rows, so the runner, the sampler, the seeded generators, speculative decoding
and the output side need no per-row notion of "one row, n samples"; the price is n - 1 extra tokens of compute
per request, once.

After the fork the parent is gone from the scheduler; its id names the family (`Forks.families`), so that an
abort by that id aborts every child. Children are the only requests the step loop sees; nothing in the steady
decode path knows about families.
"""

from __future__ import annotations

import dataclasses

from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.datatypes.sampling_params import SamplingParams, child_seed
from chunkwise.engine.sched.reservation import ReservationAdmission

# Between a parent's id and its child's index in the child's (internal) request id.
CHILD_ID_SEP = "\x1f"


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}{CHILD_ID_SEP}{index}"


class Forks:
    """The n > 1 requests' state, owned here: parents not yet forked (whatever their status) and each forked
    parent's children, by the parent's id. Builds the children and hands them the parent's blocks; the
    Scheduler puts them in its queues (fork returns them)."""

    def __init__(self, kv: KVCacheManager, admission: ReservationAdmission) -> None:
        self.kv = kv
        self.admission = admission
        self.parents: list[Request] = []
        self.families: dict[str, list[Request]] = {}

    def hold(self, parent: Request) -> None:
        """A parent arrives (fork_hold set): it forks once its prompt but the last token is computed."""
        self.parents.append(parent)

    def ready(self) -> list[Request]:
        """The running parents whose prompt but the last token is computed: this step forks them."""
        return [
            p
            for p in self.parents
            if p.status is RequestStatus.RUNNING and p.num_computed_tokens >= p.num_prompt_tokens - 1
        ]

    def fork(self, parent: Request) -> tuple[list[Request], list[tuple[int, int]]]:
        """Fork one parent: its n children (running, with the parent's blocks and as many computed tokens as
        their tables hold) and the block copies the runner must make before this step's forward."""
        params = parent.sampling_params
        child_params = [
            # The parent scored the prompt (prompt_logprobs): a child has nothing of it to report.
            dataclasses.replace(
                params,
                n=1,
                seed=None if params.seed is None else child_seed(params.seed, i),
                prompt_logprobs=None,
            )
            for i in range(params.n)
        ]
        children = [self._child(parent, i, p) for i, p in enumerate(child_params)]
        copies, held = self.kv.fork(parent, children)
        for child, computed in zip(children, held):
            child.num_computed_tokens = computed
        self.parents.remove(parent)
        self.families[parent.request_id] = children
        return children, copies

    def _child(self, parent: Request, index: int, params: SamplingParams) -> Request:
        assert parent.parent_id is None
        child = Request(
            request_id=child_request_id(parent.request_id, index),
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=params,
            arrival_time=parent.arrival_time,
            max_tokens=parent.max_tokens,
            eos_token_ids=parent.eos_token_ids,
            route=parent.route,
            cache_salt=parent.cache_salt,
            lora_name=parent.lora_name,
            lora_key=parent.lora_key,
            tenant=parent.tenant,
        )
        child.parent_id = parent.request_id
        child.index = index
        child.status = RequestStatus.RUNNING
        child.num_cached_tokens = parent.num_cached_tokens
        child.preempt_count = parent.preempt_count
        child.length_limit = parent.length_limit
        child.stop_check_ids = parent.stop_check_ids
        child.output_length_estimate = parent.output_length_estimate
        # What its table will reach: the prompt (shared blocks included) and its estimated output.
        child.reserved_blocks = self.admission.child_blocks(child)
        child.first_scheduled_time = parent.first_scheduled_time
        return child

    def seats(self) -> int:
        """Rows the running parents will add when they fork (n - 1 each): admission counts them as taken, so
        a fork never takes the batch past max_num_seqs."""
        return sum(p.sampling_params.n - 1 for p in self.parents if p.status is RequestStatus.RUNNING)

    def forget(self, req: Request) -> None:
        """A request finished: a parent that never forked (aborted) leaves the parents; a child's family ends
        with its last child."""
        if req.fork_hold:
            self.parents.remove(req)
            return
        pid = req.parent_id
        if pid is None:
            return
        family = self.families.get(pid)
        if family is not None and all(c.is_finished for c in family):
            del self.families[pid]
