"""Per-request state. The scheduler is its only writer; policies read it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from chunkwise.engine.datatypes.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks dropped; waits to re-prefill prompt + output (recompute)
    SWAPPED = "swapped"  # blocks copied to host memory; waits to be copied back (swap)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # The engine could not serve it (the scheduler's watchdog); stop_reason says why. vLLM's name.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    # Resolved output cap: max_tokens, or what is left of max_model_len when the client gave none.
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    # Key under which output lengths are observed for admission's estimate (model + endpoint by default).
    route: str = ""
    cache_salt: str | None = None
    # The LoRA adapter it runs: its name (what metrics show), and its key, which the engine runs, caches and
    # counts slots by (lora/store.py: the name, or "name#k" for a name loaded again with other weights).
    lora_name: str | None = None
    lora_key: str | None = None
    # Who it is served for (--fairness vtc shares the engine between tenants); None: the default tenant.
    tenant: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    # All tokens, prompt then output, grown in place: the step loop never concatenates.
    token_ids: list[int] = field(init=False)
    # len(prompt_token_ids), which never changes: a field, so the step loop's per-row checks read the
    # request alone, not the prompt list too.
    num_prompt_tokens: int = field(init=False)
    # sampling_params.priority, read by the queue and the victim rule (lower is served first).
    priority: int = field(init=False)
    # The one number the step loop drives: computed KV catches up with len(token_ids). A prefill chunk,
    # a prefix-cache hit, a recompute after preemption and a speculative verify all move it forward.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    preempt_count: int = 0
    # Times admission passed over this request to prefer another (bounded: see sched/queue.py).
    num_bypassed: int = 0
    # Blocks admission reserved for prompt + estimated output (sched/admission.py).
    reserved_blocks: int = 0
    output_length_estimate: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    # n > 1 (sched/fork.py): a request with n completions is a parent until its prompt but the last token is
    # computed, then forks into n children that share those blocks. fork_hold is 1 for a parent not yet
    # forked (the one prompt token it leaves to its children: subtracted from what it may compute), else 0.
    fork_hold: int = 0
    # A child's parent (the request id the outside knows) and its completion's index 0..n-1; None for others.
    parent_id: str | None = None
    index: int = 0

    # Set by the scheduler when the request arrives: the length at which it ends (max_tokens generated, or
    # max_model_len), and the ids that may end it sooner (EOS, stop_token_ids). The step loop's per-token
    # check is then one compare and one set lookup; which one ended it is worked out only then.
    length_limit: int = field(init=False, default=0)
    stop_check_ids: frozenset[int] = field(init=False, default=frozenset())

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.priority = self.sampling_params.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        """True while the prompt's KV is not yet all computed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The request's output cap: max_tokens, or what max_model_len leaves after the prompt when the client
    gave none. Raises ValueError when the prompt leaves no room or max_tokens overruns max_model_len (the
    engine's check and the simulator's, so a replay refuses what a server refuses)."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt is {num_prompt_tokens} tokens; max_model_len is {max_model_len}, "
            "which must leave room for at least one generated token"
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"max_model_len ({max_model_len})"
        )
    return max_tokens if max_tokens is not None else room
