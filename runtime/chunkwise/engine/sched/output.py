"""The scheduler's output record: everything the model runner needs for one step, and nothing of policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.datatypes.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    req_id: str
    # Tokens whose KV this step computes: positions start_pos .. start_pos + len(token_ids) - 1.
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    # True when this step reaches the end of the request's known tokens, so its last row is sampled.
    samples: bool
    sampling_params: SamplingParams
    # Generated tokens so far (a live reference; read only when a penalty needs the counts).
    output_token_ids: list[int] | None = None
    # Speculative decoding: the runner may append up to this many draft tokens after token_ids and verify
    # them in this same forward (the scheduler has budgeted and allocated for them).
    num_spec_tokens: int = 0
    # The request's whole token history (live reference), for proposers that look back over it.
    all_token_ids: list[int] | None = None
    # The scheduler's own request, so that applying the step needs no lookup (the runner never reads it).
    req: Request | None = None
    # The prompt (live reference), while a request that asked for its prompt's log-probs prefills it: the
    # tokens each position's logits are scored against.
    prompt_token_ids: list[int] | None = None
    # The LoRA adapter its rows run, by key (lora/store.py; None: the base model).
    lora: str | None = None


@dataclass(slots=True)
class DecodeStep:
    """A decode-only step at a glance, gathered while it was composed: each row's one token and position
    (the same as its row's, in row order), and the rows whose block table grew this step. The runner fills
    its inputs from these lists instead of reading every row again."""

    token_ids: list[int]
    positions: list[int]
    grown: list[int]  # indices into scheduled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # KV copies to run before the forward pass: first out (device block, host slot), then in (host slot, block).
    # swap_in also carries the host tier's restores (cache/host_tier.py).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The host tier's offloads, (device block, host slot): evicted cached blocks copied to host memory, made
    # first of all, before any of the step's copies or its forward writes a device block.
    offload: list[tuple[int, int]] = field(default_factory=list)
    # Copy-on-write copies (source block, new block) on device, made before the swaps and the forward: a
    # forked request's partial last block, one copy per child but the first (sched/fork.py).
    block_copies: Sequence[tuple[int, int]] = ()
    # Requests that left since the last step, so the runner drops their per-request state.
    finished_req_ids: set[str] = field(default_factory=set)
    num_prefill_tokens: int = 0
    num_preempted: int = 0
    # Set by the steady-state path: every row is one token of a decode that samples (none speculating).
    decode_only: bool = False
    # The steady-state path's summary of its rows (None on the general path).
    decode: DecodeStep | None = None
    # Static batching's padding rows, one per finished request whose slot the batch still holds: the position
    # of each. The runner computes each as a one-token decode row into its sink block (a block no request
    # owns) and discards its logits; they belong to no request and produce nothing.
    padding_positions: tuple[int, ...] = ()
    # Some row carries a prompt to score (SamplingParams.prompt_logprobs): the runner looks only then.
    score_prompts: bool = False
    # Requests the scheduler's watchdog failed this step (Scheduler._fail_stalled): finished, with no row.
    failed: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return (
            not self.scheduled
            and not self.swap_out
            and not self.swap_in
            and not self.block_copies
            and not self.offload
        )


@dataclass
class SchedulerStats:
    """Counters since start plus gauges as of the last step; metrics.py exports them."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    # Of the recomputes: swap chosen but the host swap space was full (counted in recompute too).
    num_preemption_fallbacks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found cached
    num_prefill_tokens: int = 0  # tokens computed as prefill (recompute included)
    num_decode_tokens: int = 0
    last_output_length_estimate: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_draft_length: int = 0  # k chosen for the last step
    num_long_prefilling: int = 0
    num_rows: int = 0  # real rows computed (one per scheduled request per step)
    num_padding_rows: int = 0  # static batching's padding rows computed, on top of those
    # Requests the watchdog failed: a step with work waiting, nothing running and nothing admitted.
    num_stalled_requests: int = 0
    # LoRA (vLLM's vllm:lora_requests_info): the adapters of the running and of the waiting requests, each
    # name once, and the slots (0: the engine serves no adapters).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # Filled by EngineCore.snapshot (the runner owns the slots): the adapters served, those resident on the
    # device, and the slot fills so far with their time (what a router weighs against a resident adapter).
    served_lora_adapters: tuple[str, ...] = ()
    resident_lora_adapters: tuple[str, ...] = ()
    lora_loads: int = 0
    lora_load_seconds: float = 0.0
    # The prefix cache's host tier (--kv-offloading-size; all 0 without one): prompt tokens found there at
    # first admission (of prefix_cache_hits), blocks copied back, blocks copied in, blocks dropped from its
    # LRU, and the fraction of its slots in use.
    host_cache_hits: int = 0
    host_cache_restores: int = 0
    host_cache_offloads: int = 0
    host_cache_evictions: int = 0
    host_cache_usage: float = 0.0
    # --scheduling-policy priority: preemptions of running requests for a waiting one that outranks them
    # (counted in the swap/recompute counters too), and per priority band: preemptions so far, and the
    # requests running and queued (waiting or swapped) now. Replaced, never mutated: copies share them.
    num_priority_preemptions: int = 0
    preemptions_by_priority: dict[int, int] = field(default_factory=dict)
    running_by_priority: dict[int, int] = field(default_factory=dict)
    queued_by_priority: dict[int, int] = field(default_factory=dict)

    def count_preemption(self, priority: int) -> None:
        counts = dict(self.preemptions_by_priority)
        counts[priority] = counts.get(priority, 0) + 1
        self.preemptions_by_priority = counts


@dataclass
class SchedulerSnapshot:
    """What the scheduler's state means to whoever publishes it (load shedding, metrics), as of one moment:
    a copy of the stats with the gauges refreshed, the load queued behind the running requests, and the
    output-length estimate of each route asked for."""

    stats: SchedulerStats
    num_queued: int  # waiting + swapped
    queued_prefill_tokens: int  # their tokens not yet computed
    queued_decode_tokens: int  # their estimated outputs still to generate
    estimates: dict[str, int]
    # The same three per priority band (all in band 0 under fcfs): load shedding counts, for a newcomer,
    # only the bands served before or with it.
    bands: dict[int, QueuedWork] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class QueuedWork:
    num: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def plus(self, num: int, prefill_tokens: int, decode_tokens: int) -> QueuedWork:
        return QueuedWork(
            self.num + num, self.prefill_tokens + prefill_tokens, self.decode_tokens + decode_tokens
        )


def work_ahead_of(bands: dict[int, QueuedWork], priority: int) -> QueuedWork:
    """The work a newcomer of `priority` waits behind: the bands of its priority and better (lower)."""
    total = QueuedWork()
    for p, w in bands.items():
        if p <= priority:
            total = total.plus(w.num, w.prefill_tokens, w.decode_tokens)
    return total
