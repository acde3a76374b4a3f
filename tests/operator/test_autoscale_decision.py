"""The autoscaler's pure decision, table-tested, plus a property: no flapping within a window."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkwise_operator import autoscale as a
from chunkwise_operator.autoscale import Behavior, Observed, Recommendation, ScaleEvent, decide

NOW = 10_000.0
TARGETS = {a.QUEUE_DEPTH: 4.0, a.PREEMPTION_RATE: 1.0, a.P99_STEP_TIME: 0.5, a.KV_USAGE: 0.8}
BEHAVIOR = Behavior(scale_up_stabilization_s=0.0, scale_down_stabilization_s=60.0)


def seen(ready: int = 99, **values: float | None) -> Observed:
    names = {"queue": a.QUEUE_DEPTH, "preempt": a.PREEMPTION_RATE, "p99": a.P99_STEP_TIME, "kv": a.KV_USAGE}
    return Observed({names[k]: v for k, v in values.items()}, ready)


def run(current: int, observed: Observed, **kw: Any) -> a.Decision:
    args: dict[str, Any] = {
        "current": current,
        "observed": observed,
        "targets": TARGETS,
        "min_replicas": 1,
        "max_replicas": 10,
        "behavior": BEHAVIOR,
        "history": (),
        "events": (),
        "now": NOW,
    }
    args.update(kw)
    return decide(**args)


CASES = [
    # (name, current, observed, extra args, desired, reason, driver)
    ("within tolerance", 2, seen(queue=4.3), {}, 2, a.WITHIN_TOLERANCE, a.QUEUE_DEPTH),
    ("queue depth scales up", 2, seen(queue=10.0), {}, 5, a.SCALED_UP, a.QUEUE_DEPTH),
    ("the neediest metric wins", 2, seen(queue=6.0, kv=1.6), {}, 4, a.SCALED_UP, a.KV_USAGE),
    # A ceiling (issue 31): above its target p99 holds the count, never multiplies it.
    ("p99 step time holds", 3, seen(queue=0.0, p99=1.0), {}, 3, a.SCALE_DOWN_HELD, a.P99_STEP_TIME),
    ("preemption rate", 1, seen(preempt=3.0), {}, 3, a.SCALED_UP, a.PREEMPTION_RATE),
    # 2 -> 10 asked; one period allows max(2 + 4 pods, 2 x 200%) = 6.
    ("rate limited up", 2, seen(queue=100.0), {}, 6, a.SCALED_UP, a.QUEUE_DEPTH),
    ("at max", 10, seen(queue=100.0), {}, 10, a.AT_MAX, a.QUEUE_DEPTH),
    ("at min", 1, seen(queue=0.0, kv=0.0), {}, 1, a.AT_MIN, a.QUEUE_DEPTH),
    (
        "scale down waits for its window",
        4,
        seen(queue=0.0),
        {"history": (Recommendation(NOW - 30, 4),)},
        4,
        a.SCALE_DOWN_STABILIZED,
        a.QUEUE_DEPTH,
    ),
    (
        "scale down once the window agrees",
        4,
        seen(queue=2.0),
        {"history": (Recommendation(NOW - 61, 4), Recommendation(NOW - 30, 3))},
        3,
        a.SCALED_DOWN,
        a.QUEUE_DEPTH,
    ),
    (
        "scale up waits for its window",
        2,
        seen(queue=10.0),
        {
            "behavior": replace(BEHAVIOR, scale_up_stabilization_s=30.0),
            "history": (Recommendation(NOW - 10, 2),),
        },
        2,
        a.SCALE_UP_STABILIZED,
        a.QUEUE_DEPTH,
    ),
    (
        "scale up to the window's minimum",
        2,
        seen(queue=10.0),
        {
            "behavior": replace(BEHAVIOR, scale_up_stabilization_s=30.0),
            "history": (Recommendation(NOW - 40, 2), Recommendation(NOW - 10, 3)),
        },
        3,
        a.SCALED_UP,
        a.QUEUE_DEPTH,
    ),
    (
        "this period's scale up is spent",
        6,
        seen(queue=40.0),
        {"max_replicas": 30, "events": (ScaleEvent(NOW - 5, 2, 6),)},
        6,
        a.SCALE_UP_LIMITED,
        a.QUEUE_DEPTH,
    ),
    (
        "a scale down removes at most its percent a period",
        8,
        seen(queue=0.0),
        {"behavior": replace(BEHAVIOR, scale_down_stabilization_s=0.0, scale_down_percent=50.0)},
        4,
        a.SCALED_DOWN,
        a.QUEUE_DEPTH,
    ),
    ("no metrics", 3, seen(), {}, 3, a.NO_METRICS, None),
    (
        "scale down held while pods start",
        3,
        seen(ready=1, queue=0.0),
        {},
        3,
        a.SCALE_DOWN_HELD,
        a.QUEUE_DEPTH,
    ),
    ("below min", 0, seen(), {}, 1, a.BELOW_MIN, None),
    ("above max", 12, seen(queue=50.0), {}, 10, a.ABOVE_MAX, None),
]


@pytest.mark.parametrize(
    ("current", "observed", "extra", "desired", "reason", "driver"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decision_table(
    current: int, observed: Observed, extra: dict[str, Any], desired: int, reason: str, driver: str | None
) -> None:
    d = run(current, observed, **extra)
    assert (d.desired, d.reason, d.driver) == (desired, reason, driver), d.message


def test_decision_records_history_and_events_and_prunes_them() -> None:
    history = (Recommendation(NOW - 500, 9), Recommendation(NOW - 20, 2))
    events = (ScaleEvent(NOW - 100, 1, 2), ScaleEvent(NOW - 3, 2, 2))
    d = run(2, seen(queue=10.0), history=history, events=events)
    assert d.history == (Recommendation(NOW - 20, 2), Recommendation(NOW, 5))
    assert d.events == (ScaleEvent(NOW - 3, 2, 2), ScaleEvent(NOW, 2, 5))
    assert d.recommendation == 5
    assert d.proposals == {a.QUEUE_DEPTH: 5}
    assert d.message == "queueDepthPerReplica asks for 5 (queueDepthPerReplica 10/4)"


def test_tolerance_is_relative_to_each_target() -> None:
    # preemptions 1.08 / 1.0: within 10%; the queue at 4.3 / 4 too (a different absolute band).
    d = run(2, seen(queue=4.3, preempt=1.08))
    assert d.proposals == {a.QUEUE_DEPTH: 2, a.PREEMPTION_RATE: 2}
    assert (d.desired, d.reason) == (2, a.WITHIN_TOLERANCE)
    assert run(2, seen(queue=4.5)).proposals == {a.QUEUE_DEPTH: 3}


def test_each_metric_has_its_own_tolerance() -> None:
    # queue 4.6 / 4 = 1.15: outside the default 10%, inside a 20% band set for the queue alone.
    wide = replace(BEHAVIOR, tolerances={**BEHAVIOR.tolerances, a.QUEUE_DEPTH: 0.2})
    assert run(2, seen(queue=4.6)).proposals == {a.QUEUE_DEPTH: 3}
    assert run(2, seen(queue=4.6), behavior=wide).proposals == {a.QUEUE_DEPTH: 2}
    assert run(2, seen(preempt=1.15), behavior=wide).proposals == {a.PREEMPTION_RATE: 3}


def test_kv_usage_is_a_threshold_that_acts_before_saturation() -> None:
    # Target 0.8: at 0.82 (within a symmetric 10% band) it already asks for more; at 0.75 it holds.
    assert run(2, seen(kv=0.82)).proposals == {a.KV_USAGE: 3}
    assert run(2, seen(kv=0.75)).proposals == {a.KV_USAGE: 2}
    assert run(2, seen(kv=0.5)).proposals == {a.KV_USAGE: 2}  # ceil(2 x 0.625): down, ratio-wise
    assert run(4, seen(kv=0.5)).proposals == {a.KV_USAGE: 3}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=40.0), min_size=5, max_size=60),
    st.integers(min_value=0, max_value=30),
    st.integers(min_value=5, max_value=60),
    st.integers(min_value=1, max_value=10),
)
def test_no_flapping_within_a_window(
    queues: list[float], up_window: int, down_window: int, step: int
) -> None:
    """A scale down never follows a scale up within the down window, nor an up a down within the up window."""
    behavior = Behavior(scale_up_stabilization_s=up_window, scale_down_stabilization_s=down_window)
    current, history, events = 1, (), ()
    moves: list[tuple[float, int]] = []
    for i, queue in enumerate(queues):
        now = NOW + i * step
        d = run(current, seen(queue=queue), behavior=behavior, history=history, events=events, now=now)
        if d.desired != current:
            moves.append((now, 1 if d.desired > current else -1))
        current, history, events = d.desired, d.history, d.events
        assert 1 <= current <= 10
    for (t0, dir0), (t1, dir1) in itertools.pairwise(moves):
        if dir0 > 0 and dir1 < 0:
            assert t1 - t0 >= down_window
        if dir0 < 0 and dir1 > 0 and up_window > 0:
            assert t1 - t0 >= up_window


def test_another_scaler_on_the_same_service_holds_the_count() -> None:
    hpa = a.ExternalScaler("HorizontalPodAutoscaler", "chat")
    d = run(2, seen(queue=100.0), external=(hpa,))
    assert (d.desired, d.reason) == (2, a.SCALER_CONFLICT)
    assert d.message.startswith("HorizontalPodAutoscaler chat also scales this InferenceService")
    # Even out of bounds: the other scaler owns the count, and would be fought over it.
    assert run(0, seen(queue=0.0), external=(hpa,)).desired == 0


def test_external_scalers_are_those_aimed_at_this_service() -> None:
    def obj(kind: str, name: str, ref: dict[str, Any]) -> dict[str, Any]:
        return {"kind": kind, "metadata": {"name": name}, "spec": {"scaleTargetRef": ref}}

    mine = {"apiVersion": "serving.chunkwise.dev/v1alpha1", "kind": "InferenceService", "name": "chat"}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat"}
    objects = [
        obj("ScaledObject", "keda", {"kind": "InferenceService", "name": "chat"}),  # KEDA may omit apiVersion
        obj("HorizontalPodAutoscaler", "hpa", mine),
        obj("HorizontalPodAutoscaler", "other", {**mine, "name": "other"}),
        obj("HorizontalPodAutoscaler", "deployment", deployment),
        obj("HorizontalPodAutoscaler", "elsewhere", {**mine, "apiVersion": "serving.kserve.io/v1beta1"}),
        {"kind": "HorizontalPodAutoscaler", "metadata": {"name": "empty"}},
    ]
    assert a.external_scalers("chat", objects) == (
        a.ExternalScaler("HorizontalPodAutoscaler", "hpa"),
        a.ExternalScaler("ScaledObject", "keda"),
    )


def test_scale_to_zero_needs_the_whole_idle_time_and_the_metrics_alone_never_go_there() -> None:
    zero = {"min_replicas": 0, "scale_to_zero_after_s": 60.0}
    # An idle queue with min 0: the metrics ask for 0, but their floor is 1 while a replica runs.
    d = run(2, seen(queue=0.0), behavior=replace(BEHAVIOR, scale_down_stabilization_s=0.0), **zero)
    assert (d.desired, d.reason) == (1, a.SCALED_DOWN)
    assert run(1, seen(queue=0.0), idle_s=59.0, **zero).desired == 1
    d = run(1, seen(queue=0.0), idle_s=60.0, **zero)
    assert (d.desired, d.reason) == (0, a.SCALED_TO_ZERO)
    assert d.message == "no request for 60 s (scaleToZeroAfterSeconds 60)"
    # At 0 it stays until the router raises /scale; with min 1 idleness changes nothing.
    assert (run(0, seen(), **zero).desired, run(0, seen(), **zero).reason) == (0, a.SCALED_TO_ZERO)
    assert run(1, seen(queue=0.0), idle_s=600.0, scale_to_zero_after_s=60.0).desired == 1


# -- issue 31, point 3 -------------------------------------------------------------------------------------
def test_a_replica_unready_past_the_startup_budget_stops_holding_a_scale_down() -> None:
    # 5 of 8 ready, no load: 3 pods Pending (no GPU node). Within the startup budget they may yet take load.
    young = (NOW - 100.0,) * 3
    d = run(8, seen(ready=5, queue=0.0), unready_since=young)
    assert (d.desired, d.reason) == (8, a.SCALE_DOWN_HELD), d.message
    # Past it they hold nothing: the ready replicas' load decides, as HPA does for not-yet-ready pods.
    old = (NOW - a.STARTUP_GRACE_S - 1.0,) * 3
    for later in (0.0, 600.0, 3600.0):
        d = run(8, seen(ready=5, queue=0.0), unready_since=old, now=NOW + later)
        assert (d.desired, d.reason) == (1, a.SCALED_DOWN), d.message
    # One of the three still young holds it again.
    d = run(8, seen(ready=5, queue=0.0), unready_since=(*old[:2], NOW - 10.0))
    assert (d.desired, d.reason) == (8, a.SCALE_DOWN_HELD), d.message
    # A replica with no pod at all yet (just scaled up) is starting.
    d = run(8, seen(ready=5, queue=0.0), unready_since=old[:2])
    assert (d.desired, d.reason) == (8, a.SCALE_DOWN_HELD), d.message


def test_the_startup_budget_is_the_startup_probes() -> None:
    """The default grace is a CPU service's startup probe budget; the reconcile passes each spec's own."""
    from chunkwise_operator import manifests
    from chunkwise_operator.spec import parse

    cpu = manifests.runtime_deployment("s", "ns", parse({"model": {"preset": "tiny"}}))
    probe = cpu["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert a.STARTUP_GRACE_S == probe["periodSeconds"] * probe["failureThreshold"] == 600


def test_not_ready_since_reads_the_ready_condition_then_the_creation() -> None:
    def pod(name: str, ready: str | None, transition: str | None = None, **meta: str) -> dict[str, Any]:
        conditions = [] if ready is None else [{"type": "Ready", "status": ready}]
        if transition is not None:
            conditions[0]["lastTransitionTime"] = transition
        return {"metadata": {"name": name, **meta}, "status": {"conditions": conditions}}

    pods = [
        pod("ready", "True", "2026-12-03T10:00:00Z"),
        pod("crashed", "False", "2026-12-03T10:00:00Z", creationTimestamp="2026-12-01T00:00:00Z"),
        pod("pending", None, creationTimestamp="2026-12-03T09:00:00Z"),
        pod("unknown", "False"),
        pod("leaving", "False", "2026-12-03T08:00:00Z", deletionTimestamp="2026-12-03T10:00:00Z"),
    ]
    now = 1_796_300_000.0  # 2026-12-03T11:33:20Z
    assert a.not_ready_since(pods, now) == (1_796_288_400.0, 1_796_292_000.0, now)


def test_p99_step_time_is_a_ceiling_not_a_load() -> None:
    # Steps 3x slower than the target with a short queue: a step is capped by its token budget, so more
    # replicas do not make it proportionally shorter. Fed back over many evaluations, the count stays.
    current, history, events = 2, (), ()
    counts = []
    for i in range(20):
        d = run(current, seen(queue=1.0, p99=1.5), history=history, events=events, now=NOW + 15.0 * i)
        current, history, events = d.desired, d.history, d.events
        counts.append(current)
    assert counts == [2] * 20, counts
    assert d.reason == a.SCALE_DOWN_HELD and d.driver == a.P99_STEP_TIME, d.message
    # Above its target it holds what runs (no scale down while steps are slow); below it, it has no say.
    assert run(4, seen(queue=0.0, p99=1.5)).proposals == {a.QUEUE_DEPTH: 0, a.P99_STEP_TIME: 4}
    assert run(4, seen(queue=0.0, p99=1.5)).desired == 4
    assert run(4, seen(queue=0.0, p99=0.3)).proposals == {a.QUEUE_DEPTH: 0}
    assert run(4, seen(queue=0.0, p99=0.3)).desired == 1
    # The queue still scales up past it.
    assert run(2, seen(queue=10.0, p99=1.5)).desired == 5


def test_from_zero_the_held_requests_decide_how_many() -> None:
    # Issue 31: 7 requests held at the router (the queue over one replica), target 4: straight to 2.
    d = run(0, seen(ready=0, queue=7.0), min_replicas=0)
    assert (d.desired, d.reason, d.driver) == (2, a.SCALED_UP, a.QUEUE_DEPTH), d.message
    # 100 held ask for maxReplicas 10; one period's scale up from 0 adds at most 4 pods.
    d = run(0, seen(ready=0, queue=100.0), min_replicas=0)
    assert (d.desired, d.recommendation) == (4, 10), d.message
    assert d.message.endswith("limited to +4 this period")
    # Nothing held: at 0 until a request arrives.
    assert run(0, seen(ready=0), min_replicas=0).reason == a.SCALED_TO_ZERO
    # The router woke 1 replica, still starting: the held requests ask for the rest.
    d = run(1, seen(ready=0, queue=7.0), min_replicas=0)
    assert (d.desired, d.reason) == (2, a.SCALED_UP), d.message


def test_only_a_replica_that_may_still_start_is_activity_for_scale_to_zero() -> None:
    # Issue 31: 1 of 2 ready and idle, the other Pending. Within the startup budget it is activity (the
    # request that woke it may not have arrived); past it, it is not, and the idle clock runs on.
    before = NOW - 50.0
    young = a.starting(2, 1, (NOW - 100.0,), NOW, a.STARTUP_GRACE_S)
    stuck = a.starting(2, 1, (NOW - a.STARTUP_GRACE_S - 1.0,), NOW, a.STARTUP_GRACE_S)
    assert (young, stuck) == (1, 0)
    assert a.last_activity(before, 0.0, young, NOW) == NOW
    assert a.last_activity(before, 0.0, stuck, NOW) == before
    # A replica with no pod yet (just woken from zero) is starting; requests, or no data, are activity.
    assert a.starting(1, 0, (), NOW, a.STARTUP_GRACE_S) == 1
    assert a.last_activity(before, 2.0, 0, NOW) == NOW
    assert a.last_activity(before, None, 0, NOW) == NOW
    assert a.last_activity(None, 0.0, 0, NOW) == NOW


def test_replicas_whose_pods_the_controller_cannot_create_hold_no_scale_down() -> None:
    # Issue 31, point 3: 3 replicas, 1 ready and idle, no pod at all for the other two. While they may still be
    # created they are starting, and a scale down waits; once the Deployment reports ReplicaFailure (a quota
    # refuses them) they are not coming, and the ready replica's load decides.
    coming = run(3, seen(ready=1, queue=0.0))
    refused = run(3, seen(ready=1, queue=0.0), creation_failing=True)
    assert coming.reason == a.SCALE_DOWN_HELD, coming.message
    assert refused.reason != a.SCALE_DOWN_HELD and refused.recommendation == 1, refused.message
    assert a.starting(3, 1, (), NOW, a.STARTUP_GRACE_S) == 2
    assert a.starting(3, 1, (), NOW, a.STARTUP_GRACE_S, creation_failing=True) == 0
    # A Pending pod that exists is judged by its age, refused siblings or not.
    assert a.starting(3, 1, (NOW - 10.0,), NOW, a.STARTUP_GRACE_S, creation_failing=True) == 1
