"""Replay a workload on simulated replicas: discrete events on a virtual clock, one report like `bench serve`'s.

Events are arrivals (routed at once to a replica, which holds them until its next step, as the engine's loop
drains its inbox between steps) and step ends (the step's tokens are emitted, then the replica schedules its
next step). At equal times arrivals go first, so a request arriving as a step ends joins the next one, as in
the engine. Nothing sleeps: thousands of requests across many replicas replay in seconds.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from chunkwise.bench.metrics import RequestRecord
from chunkwise.bench.results import COUNTERS, RunResult, StepRecord
from chunkwise.bench.workloads import Encoder, WorkItem
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.sched.output import SchedulerOutput
from chunkwise.sim.profile import Profile
from chunkwise.sim.replica import SimReplica, prompt_block_hashes
from chunkwise.sim.router import Router, make_router

_ARRIVAL, _STEP_END, _START = 0, 1, 2


def scheduler_config(profile: Profile, **overrides: Any) -> SchedulerConfig:
    """The engine's SchedulerConfig defaults, with max_model_len resolved from the profile."""
    overrides.setdefault("max_model_len", profile.max_model_len)
    return SchedulerConfig(**overrides)


def replay(
    items: Sequence[WorkItem],
    profile: Profile,
    config: SchedulerConfig,
    *,
    num_replicas: int = 1,
    router: str | Router = "round-robin",
    num_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    num_host_blocks: int | None = None,
    encode: Encoder | None = None,
    name: str = "replay",
    keep_steps: bool = True,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
) -> RunResult:
    """Replay items; `on_step(replica, scheduler_output)` sees every step as it is scheduled."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    rt = make_router(router) if isinstance(router, str) else router
    replicas = [
        SimReplica(
            i,
            profile,
            config,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
        )
        for i in range(num_replicas)
    ]
    records = [RequestRecord(prompt_len=0) for _ in items]
    where: dict[str, int] = {}
    last_emit: dict[str, float] = {}
    steps: list[StepRecord] = []
    events: list[tuple[float, int, int, int]] = []
    seq = 0
    for i, it in enumerate(items):
        events.append((it.arrival_s, _ARRIVAL, seq, i))
        seq += 1
    heapq.heapify(events)
    step_start = [0.0] * num_replicas
    routed = [0] * num_replicas
    wall0 = time.perf_counter()
    end = 0.0

    def start(r: int, t: float) -> None:
        nonlocal seq
        rep = replicas[r]
        step_start[r] = t
        dt = rep.start_step()
        if on_step is not None and rep.last_output is not None:
            on_step(r, rep.last_output)
        heapq.heappush(events, (t + dt, _STEP_END, seq, r))
        seq += 1

    while events:
        t, kind, _, x = heapq.heappop(events)
        if kind == _ARRIVAL:
            it = items[x]
            rec = records[x]
            rec.start_s = it.arrival_s
            try:
                ids = it.token_ids(encode)
                rec.prompt_len = len(ids)
                hashes = prompt_block_hashes(ids, profile.block_size) if enable_prefix_caching else []
                r = rt.choose(replicas, it, len(ids), hashes)
                rid = f"{name}-{x}"
                rep = replicas[r]
                rep.add(rep.make_request(rid, it, ids, t), it.target_len if it.max_tokens is None else None)
            except ValueError as e:
                rec.success, rec.error = False, str(e)
                continue
            where[rid] = x
            routed[r] += 1
            if not rep.busy:
                rep.busy = True  # a start is queued: later arrivals at this instant join the same step
                heapq.heappush(events, (t, _START, seq, r))
                seq += 1
        elif kind == _START:
            start(x, t)
        else:
            rep = replicas[x]
            so, emitted = rep.finish_step()
            for em in emitted:
                i = where[em.request_id]
                rec = records[i]
                if em.num_tokens:
                    if rec.output_len == 0:
                        rec.ttft = t - rec.start_s
                    else:
                        rec.itl.append(t - last_emit[em.request_id])
                    last_emit[em.request_id] = t
                    rec.output_len += em.num_tokens
                if em.finished:
                    rec.latency = t - rec.start_s
                    rec.num_preemptions = em.num_preemptions
                    del where[em.request_id]
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
                heapq.heappush(events, (t, _START, seq, x))
                seq += 1
    for rid, i in where.items():
        records[i].success, records[i].error = False, f"{rid} never finished"
    counters = {k: sum(getattr(rep.scheduler.stats, k) for rep in replicas) for k in COUNTERS}
    sched = [s for rep in replicas for s in rep.schedule_cpu_s]
    extra = {
        "profile": profile.name,
        "profile_source": profile.source,
        "num_replicas": num_replicas,
        "router": rt.name,
        "simulated": True,
        "wall_seconds": time.perf_counter() - wall0,
        "median_schedule_cpu_ms": statistics.median(sched) * 1000 if sched else 0.0,
        "requests_per_replica": routed,
    }
    return RunResult(name, records, steps, max(end, 1e-9), counters, extra, clock="virtual")


def with_config(config: SchedulerConfig, **changes: Any) -> SchedulerConfig:
    return dataclasses.replace(config, **changes)
