"""The scheduler's policies as objects, and the one factory that builds them from a SchedulerConfig.

The scheduler calls each policy and never asks which one it holds; only `build_policies` reads the config's
mode strings. The engine and the simulator both build their schedulers through `Scheduler.from_config`,
which uses this factory, so a replay runs the policies a server runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.sched.batching import ContinuousBatching, StaticBatching
from chunkwise.engine.sched.budget import TokenBudget
from chunkwise.engine.sched.draft_length import AdaptiveDraftLength
from chunkwise.engine.sched.fairness import Fairness, NoFairness, VirtualTokenCounter
from chunkwise.engine.sched.output import SchedulerStats
from chunkwise.engine.sched.preemption import Mode, PreemptionCostModel, PriorityVictims, VictimPolicy
from chunkwise.engine.sched.queue import OrderedQueue, PrefixPreference, WaitingQueue, queue_key
from chunkwise.engine.sched.reservation import OutputLengthEstimator, ReservationAdmission


class Batching(Protocol):
    # Whether admission may go on once the step's token budget is spent (a static batch forms whole).
    admits_without_budget: bool

    def admission_open(self, num_running: int) -> bool: ...

    def release(self, req: Request, num_running: int) -> None: ...

    def padding_positions(self) -> tuple[int, ...]: ...


class Preemption(Protocol):
    """Whether a victim is swapped to host memory or dropped and recomputed later."""

    def mode(self, req: Request) -> Mode: ...


class AlwaysSwap:
    def mode(self, req: Request) -> Mode:
        return "swap"


class AlwaysRecompute:
    def mode(self, req: Request) -> Mode:
        return "recompute"


class CostChosen:
    """Swap or recompute, whichever the measured cost model says is cheaper for this victim's context."""

    def __init__(self, cost_model: PreemptionCostModel) -> None:
        self.cost_model = cost_model

    def mode(self, req: Request) -> Mode:
        return self.cost_model.mode(req)


class Victims(Protocol):
    def victim(self, running: list[Request]) -> Request: ...


class Ranking(Protocol):
    """Whether a waiting request may take a running one's place (--scheduling-policy)."""

    # Whether requests differ in rank at all (the per-band gauges are kept only then).
    ranks: bool

    def outranks(self, a: Request, b: Request) -> bool:
        """Whether `a` is served before `b` even at `b`'s expense: preempting it, or resuming ahead of it."""
        ...

    def victim_for(self, head: Request, running: list[Request]) -> Request | None:
        """The running request to preempt so that `head`, which cannot be admitted, can be; None if none
        may give way to it."""
        ...

    def requeue_swapped(self, swapped: deque[Request], req: Request) -> None:
        """Put a request just swapped out into the swapped queue, in the order resumption takes them."""
        ...


class ArrivalOrder:
    """fcfs: no request takes another's place; the swapped resume oldest first (in the order swapped)."""

    ranks = False

    def outranks(self, a: Request, b: Request) -> bool:
        return False

    def victim_for(self, head: Request, running: list[Request]) -> Request | None:
        return None

    def requeue_swapped(self, swapped: deque[Request], req: Request) -> None:
        swapped.append(req)


class StrictPriority:
    """priority: a request with a lower priority value preempts running requests of strictly higher value
    (the lowest first: PriorityVictims.lowest) and resumes ahead of them; the swapped stand in queue order."""

    ranks = True

    def __init__(self, victims: PriorityVictims) -> None:
        self.victims = victims

    def outranks(self, a: Request, b: Request) -> bool:
        return a.priority < b.priority

    def victim_for(self, head: Request, running: list[Request]) -> Request | None:
        lower = [r for r in running if r.priority > head.priority]
        return self.victims.lowest(lower) if lower else None

    def requeue_swapped(self, swapped: deque[Request], req: Request) -> None:
        key = queue_key(req)
        i = next((i for i, r in enumerate(swapped) if queue_key(r) > key), len(swapped))
        swapped.insert(i, req)


@dataclass
class SchedulerPolicies:
    batching: Batching
    estimator: OutputLengthEstimator
    admission: ReservationAdmission
    budget: TokenBudget
    preemption: Preemption
    victims: Victims
    waiting: WaitingQueue
    # Who may take whose place (--scheduling-policy), and the tenants' shares (--fairness).
    ranking: Ranking
    fairness: Fairness
    reuse: PrefixPreference
    # Learns the recompute rate from prefill-heavy steps; the preemption policy may read it.
    cost_model: PreemptionCostModel
    # Speculative decoding's draft length (None: no speculation).
    draft_length: AdaptiveDraftLength | None = None
    # LoRA: how many distinct adapters may run at once (None: the engine serves no adapters).
    adapters: AdapterLimit | None = None


class AdapterLimit:
    """At most `max_loras` distinct LoRA adapters among the running requests: the device's adapter slots.
    A request whose adapter would be one too many waits, and the requests behind it in the queue go ahead
    (vLLM's rule): the base model's and the running adapters' requests are never stalled by it."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def admits(self, running: set[str], req: Request) -> bool:
        return req.lora_key is None or req.lora_key in running or len(running) < self.max_loras

    @staticmethod
    def running(requests: Iterable[Request]) -> set[str]:
        return {r.lora_key for r in requests if r.lora_key is not None}

    def publish(self, stats: SchedulerStats, running: Iterable[Request], queued: Iterable[Request]) -> None:
        """The gauges of vLLM's vllm:lora_requests_info."""
        stats.max_lora = self.max_loras
        stats.running_lora_adapters = tuple(sorted({r.lora_name for r in running if r.lora_name is not None}))
        stats.waiting_lora_adapters = tuple(sorted({r.lora_name for r in queued if r.lora_name is not None}))


def preemption_policy(config: SchedulerConfig, cost_model: PreemptionCostModel) -> Preemption:
    if config.preemption_mode == "swap":
        return AlwaysSwap()
    if config.preemption_mode == "recompute":
        return AlwaysRecompute()
    return CostChosen(cost_model)


def build_policies(
    config: SchedulerConfig,
    block_size: int,
    cost_model: PreemptionCostModel,
    estimator: OutputLengthEstimator | None = None,
    draft_length: AdaptiveDraftLength | None = None,
    max_loras: int | None = None,
) -> SchedulerPolicies:
    max_model_len = config.resolved_max_model_len()
    estimator = estimator or OutputLengthEstimator(
        config.output_length_quantile,
        config.cold_start_output_tokens,
        kind=config.output_length_estimator,
    )
    # Speculation grows a sequence by up to k tokens in a step: admission reserves for that too.
    spec_tokens = draft_length.max_k if draft_length is not None else 0
    batching: Batching = (
        StaticBatching(max_model_len) if config.batching == "static" else ContinuousBatching()
    )
    fairness: Fairness = VirtualTokenCounter() if config.fairness == "vtc" else NoFairness()
    victims: Victims
    ranking: Ranking
    waiting: WaitingQueue
    if config.scheduling_policy == "priority":
        priority_victims = PriorityVictims()
        victims, ranking = priority_victims, StrictPriority(priority_victims)
    else:
        victims, ranking = VictimPolicy(), ArrivalOrder()
    if config.scheduling_policy == "priority" or fairness.enabled:
        waiting = OrderedQueue(config.long_prompt_threshold, config.max_long_prefills, fairness)
    else:
        waiting = WaitingQueue(config.long_prompt_threshold, config.max_long_prefills)
    return SchedulerPolicies(
        batching=batching,
        estimator=estimator,
        admission=ReservationAdmission(block_size, estimator, spec_tokens),
        budget=TokenBudget(
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.long_prompt_threshold,
            config.max_long_prefill_chunk,
        ),
        preemption=preemption_policy(config, cost_model),
        victims=victims,
        waiting=waiting,
        ranking=ranking,
        fairness=fairness,
        reuse=PrefixPreference(
            block_size, config.prefix_lookahead, config.prefix_reuse_min_fraction, config.max_prefix_bypass
        ),
        cost_model=cost_model,
        draft_length=draft_length,
        adapters=AdapterLimit(max_loras) if max_loras is not None else None,
    )
