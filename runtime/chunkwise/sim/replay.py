"""Replay a workload on simulated replicas: discrete events on a virtual clock, one report like `bench serve`'s.

Events are arrivals (routed at once by the live router's policy, sim/fleet.py, to a replica, which holds them
until its next step, as the engine's loop drains its inbox between steps), step ends (the step's tokens are
emitted, then the replica schedules its next step), the router's scrapes of every replica, and, with an
autoscaler, its evaluations and the replicas it starts becoming ready. At equal times arrivals go first, so
a request arriving as a step ends joins the next one, as in the engine. Nothing sleeps: thousands of
requests across many replicas replay in seconds.

With an autoscaler (sim/autoscaling.py) the fleet changes size: a new replica is listed for routing
`cold_start_s` after it is asked for (pulling the image and loading the model), a removed one stops taking
requests at once and goes when it has finished what it holds, and while no replica is listed the router holds
arriving requests (scale from zero) and routes them when one is. Replica-seconds count every replica from
the moment it is asked for to the moment it goes: what the fleet costs in GPU time.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkwise.bench.metrics import RequestRecord
from chunkwise.bench.results import COUNTERS, RunResult, StepRecord
from chunkwise.bench.workloads import Encoder, WorkItem
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.sched.output import SchedulerOutput
from chunkwise.router.core import Pick
from chunkwise.sim.fleet import RouterSpec, SimRouter
from chunkwise.sim.profile import Profile
from chunkwise.sim.replica import SimReplica, prompt_block_hashes

if TYPE_CHECKING:
    from chunkwise.sim.autoscaling import Autoscaler

# Event kinds, in the order they run at equal times.
_ARRIVAL, _READY, _STEP_END, _START, _SCRAPE, _AUTOSCALE = range(6)


def scheduler_config(profile: Profile, **overrides: Any) -> SchedulerConfig:
    """The engine's SchedulerConfig defaults, with max_model_len resolved from the profile."""
    overrides.setdefault("max_model_len", profile.max_model_len)
    return SchedulerConfig(**overrides)


# From asking for a replica to its first request, when the user does not say: an 8B model on a GPU node
# pulls its image, reads 16 GB of weights and captures CUDA graphs (llm-d's users report 2-8 minutes to
# Ready); a CPU replica of the built-in models starts in seconds.
GPU_COLD_START_S = 120.0
CPU_COLD_START_S = 20.0


def default_cold_start_s(profile: Profile) -> float:
    return GPU_COLD_START_S if profile.kind == "roofline" else CPU_COLD_START_S


@dataclass(frozen=True)
class Scaling:
    """An autoscaler in the loop: how often it decides, and what a new replica costs before it serves."""

    autoscaler: Autoscaler
    interval_s: float = 15.0  # the operator's (and HPA's) evaluation period
    cold_start_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"the autoscaling interval must be positive, got {self.interval_s}")
        if not self.cold_start_s >= 0:
            raise ValueError(f"cold_start_s must be >= 0, got {self.cold_start_s}")


@dataclass
class _Life:
    """One replica's life in the fleet, on the virtual clock."""

    created_s: float
    ready_s: float
    draining: bool = False
    gone_s: float | None = None
    # Since the last autoscaler evaluation.
    step_times: list[float] = field(default_factory=list)
    preemptions_at_eval: int = 0
    requests_seen: set[str] = field(default_factory=set)


def replay(
    items: Sequence[WorkItem],
    profile: Profile,
    config: SchedulerConfig,
    *,
    num_replicas: int = 1,
    router: str | RouterSpec = "round-robin",
    num_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    num_host_blocks: int | None = None,
    num_tier_blocks: int = 0,
    encode: Encoder | None = None,
    name: str = "replay",
    keep_steps: bool = True,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
    scaling: Scaling | None = None,
) -> RunResult:
    """Replay items; `on_step(replica, scheduler_output)` sees every step as it is scheduled. With `scaling`,
    `num_replicas` is the fleet's size at the start (0 allowed: scale from zero)."""
    if num_replicas < (0 if scaling is not None else 1):
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    spec = router if isinstance(router, RouterSpec) else RouterSpec(policy=router)
    rt = SimRouter(spec, profile.block_size)
    exact = spec.prefix_index == "exact"
    replicas: list[SimReplica] = []
    lives: list[_Life] = []

    def new_replica(t: float, ready_s: float) -> int:
        r = len(replicas)
        replicas.append(
            SimReplica(
                r,
                profile,
                config,
                num_blocks=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
                num_host_blocks=num_host_blocks,
                kv_events=exact,
                num_tier_blocks=num_tier_blocks,
            )
        )
        lives.append(_Life(created_s=t, ready_s=ready_s))
        step_start.append(0.0)
        routed.append(0)
        return r

    records = [RequestRecord(prompt_len=0) for _ in items]
    where: dict[str, int] = {}
    picks: dict[str, Pick] = {}
    last_emit: dict[str, float] = {}
    steps: list[StepRecord] = []
    step_start: list[float] = []
    routed: list[int] = []
    held: list[int] = []
    last_desired: int | None = None  # the autoscaler's last answer
    scale_log: list[tuple[float, int]] = []
    events: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(t: float, kind: int, x: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, kind, seq, x))
        seq += 1

    for _ in range(num_replicas):
        new_replica(0.0, 0.0)

    def listed() -> list[SimReplica]:
        """What discovery lists: ready replicas not being removed."""
        return [
            rep
            for rep, life in zip(replicas, lives)
            if life.gone_s is None and not life.draining and life.ready_s <= now
        ]

    now = 0.0
    rt.set_replicas(listed())
    rt.scrape(0.0, listed())  # the router probes every replica before it serves (Router.probe_all)
    for i, it in enumerate(items):
        events.append((it.arrival_s, _ARRIVAL, seq, i))
        seq += 1
    heapq.heapify(events)
    pending_arrivals = len(items)
    if items:
        push(spec.interval_s, _SCRAPE, 0)
        if scaling is not None:
            push(scaling.interval_s, _AUTOSCALE, 0)
    wall0 = time.perf_counter()
    end = 0.0

    def start(r: int, t: float) -> None:
        rep = replicas[r]
        step_start[r] = t
        dt = rep.start_step()
        if on_step is not None and rep.last_output is not None:
            on_step(r, rep.last_output)
        push(t + dt, _STEP_END, r)

    def admit(x: int, t: float) -> None:
        """Route item x now, or hold it while no replica is listed."""
        it = items[x]
        rec = records[x]
        try:
            ids = it.token_ids(encode)
        except ValueError as e:
            rec.success, rec.error = False, str(e)
            return
        rec.prompt_len = len(ids)
        hashes = prompt_block_hashes(ids, profile.block_size) if enable_prefix_caching else []
        chosen = rt.route(t, len(ids), hashes, it.max_tokens)
        if chosen is None:
            held.append(x)
            return
        r, pick = chosen
        rid = f"{name}-{x}"
        rep = replicas[r]
        try:
            rep.add(rep.make_request(rid, it, ids, t), it.target_len if it.max_tokens is None else None)
        except ValueError as e:
            rt.finish(t, pick)
            rec.success, rec.error = False, str(e)
            return
        where[rid] = x
        picks[rid] = pick
        routed[r] += 1
        if scaling is not None:
            lives[r].requests_seen.add(rid)
        if not rep.busy:
            rep.busy = True  # a start is queued: later arrivals at this instant join the same step
            push(t, _START, r)

    def fleet_changed(t: float) -> None:
        rt.set_replicas(listed())
        rt.scrape(t, [replicas[i] for i in range(len(replicas)) if lives[i].ready_s == t])
        while held and listed():
            admit(held.pop(0), t)

    def retire_idle(t: float) -> None:
        for r, life in enumerate(lives):
            if life.gone_s is None and life.draining and not replicas[r].has_work():
                life.gone_s = t

    def autoscale(t: float) -> None:
        from chunkwise.sim.autoscaling import FleetSignals, ReplicaSignals

        assert scaling is not None
        alive = [r for r, life in enumerate(lives) if life.gone_s is None and not life.draining]
        signals = []
        for r in alive:
            life, rep = lives[r], replicas[r]
            s = rep.gauges()
            ready = life.ready_s <= t
            signals.append(
                ReplicaSignals(
                    ready=ready,
                    not_ready_since=None if ready else life.created_s,
                    waiting=s.num_waiting + s.num_swapped,
                    running=s.num_running,
                    kv_usage=s.kv_usage,
                    preemptions=preempted(rep) - life.preemptions_at_eval,
                    step_times_s=tuple(life.step_times),
                    requests=len(life.requests_seen) + rep.num_requests,
                )
            )
            life.step_times = []
            life.preemptions_at_eval = preempted(rep)
            life.requests_seen = set()
        nonlocal last_desired
        desired = scaling.autoscaler.evaluate(
            FleetSignals(now=t, window_s=scaling.interval_s, replicas=tuple(signals), held=len(held))
        )
        last_desired = desired
        if desired > len(alive):
            for _ in range(desired - len(alive)):
                r = new_replica(t, t + scaling.cold_start_s)
                push(t + scaling.cold_start_s, _READY, r)
        elif desired < len(alive):
            # Starting replicas go first (nothing to drain), then the least busy.
            order = sorted(alive, key=lambda r: (lives[r].ready_s <= t, replicas[r].num_requests, -r))
            for r in order[: len(alive) - desired]:
                lives[r].draining = True
            rt.set_replicas(listed())
            retire_idle(t)
        if desired != len(alive):
            scale_log.append((t, desired))

    def more_to_come() -> bool:
        """Whether the clock must keep ticking: requests to arrive or in flight, or held ones that a replica
        (alive, or one the autoscaler has not yet declined to start) could serve. An autoscaler that stays
        at zero (HPA does nothing at 0) would otherwise leave held requests ticking forever."""
        if pending_arrivals or where:
            return True
        if not held:
            return False
        if any(life.gone_s is None and not life.draining for life in lives):
            return True
        return scaling is not None and last_desired != 0

    while events:
        now, kind, _, x = heapq.heappop(events)
        t = now
        if kind == _ARRIVAL:
            pending_arrivals -= 1
            records[x].start_s = items[x].arrival_s
            admit(x, t)
        elif kind == _START:
            start(x, t)
        elif kind == _READY:
            if lives[x].gone_s is None and not lives[x].draining:
                fleet_changed(t)
        elif kind == _SCRAPE:
            rt.scrape(t, listed())
            if more_to_come():
                push(t + spec.interval_s, _SCRAPE, 0)
        elif kind == _AUTOSCALE:
            autoscale(t)
            if more_to_come():
                push(t + scaling.interval_s, _AUTOSCALE, 0)  # type: ignore[union-attr]
        else:
            rep = replicas[x]
            so, emitted = rep.finish_step()
            if scaling is not None and so.scheduled:
                lives[x].step_times.append(t - step_start[x])
            for em in emitted:
                i = where[em.request_id]
                rec = records[i]
                if em.num_tokens:
                    if rec.output_len == 0:
                        rec.ttft = t - rec.start_s
                        rt.first_token(t, picks[em.request_id])
                    else:
                        gap = t - last_emit[em.request_id]
                        rec.itl.append(gap)
                        rep.counters.itl_seconds += gap
                        rep.counters.itl_count += 1
                    last_emit[em.request_id] = t
                    rec.output_len += em.num_tokens
                if em.finished:
                    rec.latency = t - rec.start_s
                    rec.num_preemptions = em.num_preemptions
                    del where[em.request_id]
                    rt.finish(t, picks.pop(em.request_id))
                    last_emit.pop(em.request_id, None)
                    end = max(end, t)
            if keep_steps:
                # Gauges as of the step's schedule(), as the engine's stats report them.
                s = rep.scheduler.stats
                steps.append(
                    StepRecord(
                        t=t,
                        step_s=t - step_start[x],
                        schedule_s=rep.schedule_cpu_s[-1],
                        num_batched_tokens=so.num_batched_tokens,
                        num_prefill_tokens=so.num_prefill_tokens,
                        num_decode_rows=sum(1 for sr in so.scheduled if len(sr.token_ids) == 1),
                        num_running=s.num_running,
                        num_waiting=s.num_waiting + s.num_swapped,
                        kv_usage=s.kv_usage,
                        forward_s=t - step_start[x],
                        replica=x,
                    )
                )
            if rep.has_work():
                rep.busy = True
                push(t, _START, x)
            elif lives[x].draining and lives[x].gone_s is None:
                lives[x].gone_s = t
    for x in held:
        records[x].success, records[x].error = False, "held: no replica was ever ready"
    for rid, i in where.items():
        records[i].success, records[i].error = False, f"{rid} never finished"
    counters = {k: sum(getattr(rep.scheduler.stats, k) for rep in replicas) for k in COUNTERS}
    sched = [s for rep in replicas for s in rep.schedule_cpu_s]
    finish = max(end, max((it.arrival_s for it in items), default=0.0))
    replica_s = sum((life.gone_s if life.gone_s is not None else finish) - life.created_s for life in lives)
    extra: dict[str, Any] = {
        "profile": profile.name,
        "profile_source": profile.source,
        "num_replicas": num_replicas,
        "router": spec.policy,
        "prefix_index": spec.index_name,
        "scrape_interval_s": spec.interval_s,
        "simulated": True,
        "wall_seconds": time.perf_counter() - wall0,
        "median_schedule_cpu_ms": statistics.median(sched) * 1000 if sched else 0.0,
        "requests_per_replica": routed,
        "replica_seconds": replica_s,
    }
    if scaling is not None:
        extra["autoscaler"] = scaling.autoscaler.name
        extra["cold_start_s"] = scaling.cold_start_s
        extra["scale_events"] = scale_log
        extra["max_replicas"] = max([num_replicas, *(n for _, n in scale_log)])
    return RunResult(name, records, steps, max(end, 1e-9), counters, extra, clock="virtual")


def preempted(rep: SimReplica) -> int:
    s = rep.scheduler.stats
    return s.num_preemptions_swap + s.num_preemptions_recompute


def with_config(config: SchedulerConfig, **changes: Any) -> SchedulerConfig:
    return dataclasses.replace(config, **changes)


def capacity_rps(items: Sequence[WorkItem], profile: Profile, config: SchedulerConfig, **kw: Any) -> float:
    """Requests per second one replica completes when every item arrives at once: its capacity for this
    mix of requests (what a load of 70% or 90% of a fleet's capacity is measured against)."""
    burst = [dataclasses.replace(it, arrival_s=0.0) for it in items]
    res = replay(burst, profile, config, num_replicas=1, keep_steps=False, **kw)
    done = sum(1 for r in res.records if r.success)
    return done / res.duration_s if res.duration_s > 0 and math.isfinite(res.duration_s) else 0.0
