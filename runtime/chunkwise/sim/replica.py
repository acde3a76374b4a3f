"""One simulated replica: chunkwise's own Scheduler and KVCacheManager, unchanged, with a cost model in place of
the model runner and a virtual clock in place of time.

A step is scheduled at virtual time t; the profile says how long it takes; its result is applied at t + dt,
which is when its tokens are emitted. The stand-in model samples a filler token, or EOS when a request whose
length the client did not give reaches its hidden target, so admission sees output lengths only as the real
engine does: by observing finished requests.

The scheduler stamps a few wall-clock times on requests (finished_time, first_scheduled_time); nothing here
reads them: every time a report uses is virtual and kept by the simulator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from chunkwise.bench.workloads import WorkItem
from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.cache.hashing import hash_prefix_blocks
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request, resolve_max_tokens
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.sched.output import SchedulerOutput, SchedulerStats
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler
from chunkwise.sim.profile import Profile

# The stand-in model's vocabulary: EOS where a hidden target ends a request, fillers otherwise. Fillers vary
# with position so that generated blocks hash differently, as real output would.
SIM_EOS = -1
_NUM_FILLERS = 251
# A scheduler that returns empty steps this many times in a row while holding requests cannot progress.
_MAX_EMPTY_STEPS = 1000


def filler_token(position: int) -> int:
    return 1 + position % _NUM_FILLERS


@dataclass
class Counters:
    """The replica's cumulative counters, as its /metrics exports them (what a router learns speed from)."""

    steps: int = 0
    step_seconds: float = 0.0
    scheduled_tokens: int = 0
    itl_seconds: float = 0.0
    itl_count: int = 0


@dataclass
class Emission:
    """What a step emitted for one request."""

    request_id: str
    num_tokens: int
    finished: bool
    num_preemptions: int


class SimReplica:
    def __init__(
        self,
        index: int,
        profile: Profile,
        config: SchedulerConfig,
        *,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        num_host_blocks: int | None = None,
        kv_events: bool = False,
        num_tier_blocks: int = 0,
    ) -> None:
        """`kv_events`: keep the engine's KV event log (a router reading the exact prefix index needs it);
        `num_tier_blocks`: the prefix cache's host tier (--kv-offloading-size), in blocks."""
        self.index = index
        self.profile = profile
        self.config = config
        self.max_model_len = config.resolved_max_model_len()
        blocks = num_blocks if num_blocks is not None else profile.num_blocks
        # Host swap space as the engine sizes it by default: 1 GiB.
        host = num_host_blocks
        if host is None:
            host = (1 << 30) // (profile.kv_bytes_per_token * profile.block_size)
        self.num_blocks = blocks
        self.kv_events = KVEventLog() if kv_events else None
        self.kv = KVCacheManager(
            blocks, profile.block_size, enable_prefix_caching, host, self.kv_events, num_tier_blocks
        )
        self.cost_model = PreemptionCostModel(
            kv_bytes_per_token=profile.kv_bytes_per_token,
            host_copy_bytes_per_s=profile.host_copy_bytes_per_s,
            prefill_tokens_per_s=profile.prefill_tokens_per_s,
        )
        self.scheduler = Scheduler.from_config(config, self.kv, self.cost_model)
        self.targets: dict[str, int] = {}
        self.counters = Counters()
        self.busy = False
        self._in_flight: tuple[SchedulerOutput, dict[str, list[int]]] | None = None
        self.last_output: SchedulerOutput | None = None
        self._empty_steps = 0
        self.schedule_cpu_s: list[float] = []

    # -- requests -------------------------------------------------------------------------------------------
    def make_request(self, rid: str, item: WorkItem, ids: list[int], arrival_s: float) -> Request:
        """The engine's validation (make_request) on virtual time. Raises ValueError as the engine does."""
        max_tokens = resolve_max_tokens(len(ids), item.max_tokens, self.max_model_len)
        params = SamplingParams(
            max_tokens=item.max_tokens, temperature=0.0, ignore_eos=item.max_tokens is not None
        )
        return Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=arrival_s,
            max_tokens=max_tokens,
            eos_token_ids=(SIM_EOS,),
        )

    def add(self, req: Request, target_len: int | None) -> None:
        self.scheduler.add_request(req)
        if target_len is not None:
            self.targets[req.request_id] = target_len

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return self.scheduler.num_requests

    def gauges(self) -> SchedulerStats:
        """The scheduler's stats as the engine publishes them after each step (its /metrics reads these):
        current, not as of the last schedule()."""
        return self.scheduler.gauges()

    # -- steps ----------------------------------------------------------------------------------------------
    def start_step(self) -> float:
        """Schedule one step; returns its duration. Its result is applied by finish_step."""
        # CPU time of this thread: the scheduler's own cost, whatever else the machine is doing.
        t0 = time.thread_time()
        so = self.scheduler.schedule()
        self.schedule_cpu_s.append(time.thread_time() - t0)
        if so.is_empty:
            self._empty_steps += 1
            if self._empty_steps > _MAX_EMPTY_STEPS:
                raise RuntimeError(
                    f"replica {self.index}: the scheduler made no progress in {_MAX_EMPTY_STEPS} steps with "
                    f"{self.num_requests} requests held"
                )
        else:
            self._empty_steps = 0
        sampled: dict[str, list[int]] = {}
        for sr in so.scheduled:
            if not sr.samples:
                continue
            req = self.scheduler.requests[sr.req_id]
            n = req.num_output_tokens
            target = self.targets.get(sr.req_id)
            sampled[sr.req_id] = [SIM_EOS if target is not None and n + 1 >= target else filler_token(n)]
        self._in_flight = (so, sampled)
        self.last_output = so
        self.busy = True
        dt = self.profile.step_seconds(so)
        if so.scheduled:
            c = self.counters
            c.steps += 1
            c.step_seconds += dt
            c.scheduled_tokens += so.num_batched_tokens
        return dt

    def finish_step(self) -> tuple[SchedulerOutput, list[Emission]]:
        assert self._in_flight is not None
        so, sampled = self._in_flight
        self._in_flight = None
        self.busy = False
        emitted = []
        for req in self.scheduler.update_from_output(so, sampled):
            emitted.append(
                Emission(
                    req.request_id, len(sampled.get(req.request_id, ())), req.is_finished, req.preempt_count
                )
            )
            if req.is_finished:
                self.targets.pop(req.request_id, None)
        if self.kv_events is not None:
            self.kv_events.flush()  # the engine closes each step's cache changes into one event
        return so, emitted


def prompt_block_hashes(ids: list[int], block_size: int) -> list[int]:
    """The chained hashes the replicas' prefix caches use (no salt), for the router's cache lookups."""
    return hash_prefix_blocks(ids, block_size)
