"""Scraping: which pods, what their /metrics say, and the per-replica signals over a window."""

from __future__ import annotations

from typing import Any

import pytest

from chunkwise.engine.loop.metrics import EngineMetrics
from chunkwise.engine.sched.output import SchedulerStats
from chunkwise_operator import autoscale as a
from chunkwise_operator.scrape import PodSample, parse, quantile, signals, targets


def pod(name: str, ip: str | None, ready: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "annotations": {"prometheus.io/port": "8000", "prometheus.io/path": "/metrics"},
            **extra,
        },
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_targets_are_the_ready_pods_at_their_annotated_port() -> None:
    pods = [
        pod("b", "10.0.0.3"),
        pod("a", "10.0.0.2"),
        pod("starting", "10.0.0.4", ready=False),
        pod("pending", None),
        pod("leaving", "10.0.0.5", deletionTimestamp="2030-01-01T00:00:00Z"),
        {
            "metadata": {"name": "plain", "uid": "u"},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 9000}]}]},
            "status": {"podIP": "fd00::1", "conditions": [{"type": "Ready", "status": "True"}]},
        },
    ]
    assert [(t.name, t.key, t.url) for t in targets(pods)] == [
        ("a", "uid-a", "http://10.0.0.2:8000/metrics"),
        ("b", "uid-b", "http://10.0.0.3:8000/metrics"),
        ("plain", "u", "http://[fd00::1]:9000/metrics"),
    ]


def test_parse_reads_the_engines_exposition() -> None:
    stats = SchedulerStats(num_waiting=7, kv_usage=0.5, num_preemptions_swap=2, num_preemptions_recompute=3)
    m = EngineMetrics("tiny", stats_source=lambda: stats)
    for seconds in (0.004, 0.004, 0.02, 0.3):
        m.step_duration.observe(seconds)
    sample = parse(m.exposition().decode(), key="k", now=5.0)
    assert (sample.waiting, sample.kv_usage, sample.preemptions, sample.steps) == (7.0, 0.5, 5.0, 4.0)
    buckets = dict(sample.step_buckets)
    assert (buckets[0.004], buckets[0.02], buckets[0.25], buckets[0.3], buckets[float("inf")]) == (
        2.0,
        3.0,
        3.0,
        4.0,
        4.0,
    )


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 50.0), (0.2, 90.0), (0.5, 100.0), (float("inf"), 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.7, buckets) == pytest.approx(0.15)
    assert quantile(0.99, buckets) == pytest.approx(0.2 + 0.3 * 0.9)
    # Ranks in the +Inf bucket: the highest finite bound is all one can say.
    assert quantile(0.99, [(0.1, 1.0), (float("inf"), 100.0)]) == 0.1
    assert quantile(0.99, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def sample(
    key: str,
    t: float,
    waiting: float = 0,
    kv: float = 0,
    preempt: float = 0,
    fast: float = 0,
    slow: float = 0,
) -> PodSample:
    # fast steps fall at or under 10 ms, slow ones between 0.5 and 1 s
    return PodSample(
        key,
        t,
        waiting,
        kv,
        preempt,
        ((0.01, fast), (0.5, fast), (1.0, fast + slow), (float("inf"), fast + slow)),
    )


def test_signals_over_a_window() -> None:
    before = {"p1": sample("p1", 0.0, preempt=10, fast=100), "p2": sample("p2", 0.0, preempt=0, fast=0)}
    now = [
        sample("p1", 10.0, waiting=6, kv=0.5, preempt=30, fast=197, slow=3),
        sample("p2", 10.0, waiting=2, kv=0.3, preempt=0, fast=100),
    ]
    observed = signals(now, before, replicas=2)
    assert observed.ready_replicas == 2
    assert observed.values[a.QUEUE_DEPTH] == 4.0
    assert observed.values[a.KV_USAGE] == pytest.approx(0.4)
    assert observed.values[a.PREEMPTION_RATE] == pytest.approx(20 / 10 / 2)
    # 200 steps in the window, 3 of them slow: the p99 (rank 198) is a third into the (0.5, 1] bucket.
    assert observed.values[a.P99_STEP_TIME] == pytest.approx(0.5 + 0.5 / 3)


def test_signals_count_pods_not_ready_as_idle_and_skip_restarted_counters() -> None:
    before = {"p1": sample("p1", 0.0, preempt=50, fast=500)}
    now = [sample("p1", 10.0, waiting=9, preempt=1, fast=3)]  # counters went back: a restart
    observed = signals(now, before, replicas=3)
    assert observed.values[a.QUEUE_DEPTH] == 3.0  # 9 waiting over the 3 replicas asked for
    assert observed.values[a.PREEMPTION_RATE] is None
    assert observed.values[a.P99_STEP_TIME] is None
    assert signals([], {}, replicas=2).values[a.QUEUE_DEPTH] is None


def test_requests_count_running_waiting_and_the_finished_since_the_last_scrape() -> None:
    def text(waiting: float, running: float, finished: float) -> str:
        return (
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {waiting}\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {running}\n"
            f"# TYPE vllm:request_success counter\nvllm:request_success_total {finished}\n"
        )

    before = parse(text(0, 0, 7), "a", 10.0)
    idle = parse(text(0, 0, 7), "a", 11.0)
    short = parse(text(0, 0, 9), "a", 11.0)  # two requests came and went between scrapes
    busy = parse(text(1, 2, 7), "a", 11.0)
    assert signals([idle], {"a": before}, 1).requests == 0.0
    assert signals([short], {"a": before}, 1).requests == 2.0
    assert signals([busy], {"a": before}, 1).requests == 3.0
    assert signals([], {}, 1).requests is None  # no replica ready, no router reading: no data
    # No replica ready and the router holds nothing: an idle fleet (a replica stuck unready is not activity).
    assert signals([], {}, 1, held=0.0).requests == 0.0


def test_requests_held_at_the_router_are_queued_demand() -> None:
    # Issue 31: the router holds requests while no replica is ready; they wait as a replica's queue does.
    nothing_ready = signals([], {}, replicas=0, held=5.0)
    assert nothing_ready.values[a.QUEUE_DEPTH] == 5.0  # over one replica, not zero
    assert nothing_ready.requests == 5.0 and nothing_ready.ready_replicas == 0
    assert signals([], {}, replicas=2, held=6.0).values[a.QUEUE_DEPTH] == 3.0
    one = [sample("p1", 10.0, waiting=2)]
    assert signals(one, {}, replicas=2, held=4.0).values[a.QUEUE_DEPTH] == 3.0
    assert signals([], {}, replicas=1, held=0.0).values[a.QUEUE_DEPTH] is None
