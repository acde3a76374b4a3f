"""The simulator's autoscalers (issue 36): the operator's decision and the KEDA and HPA baselines, each fed
hand-built fleet signals on a virtual clock, evaluation by evaluation."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import pytest

from chunkwise.sim.autoscaling import (
    DEFAULT_MAX_REPLICAS,
    DEFAULT_MIN_REPLICAS,
    STEP_DURATION_BUCKETS,
    ChunkwiseAutoscaler,
    FleetSignals,
    HpaKvUsage,
    KedaQueueDepth,
    ReplicaSignals,
    make_autoscaler,
)
from chunkwise_operator.autoscale import STARTUP_GRACE_S, Behavior
from chunkwise_operator.spec import AutoscalingSpec

WINDOW = 15.0


def ready(
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.1,
    preemptions: int = 0,
    steps: Sequence[float] = (),
    requests: int | None = None,
) -> ReplicaSignals:
    seen = waiting + running if requests is None else requests
    return ReplicaSignals(True, None, waiting, running, kv, preemptions, tuple(steps), seen)


def starting(since: float) -> ReplicaSignals:
    return ReplicaSignals(False, since, 0, 0, 0.0, 0, (), 0)


def fleet(now: float, replicas: Sequence[ReplicaSignals], held: int = 0) -> FleetSignals:
    return FleetSignals(now, WINDOW, tuple(replicas), held)


def idle(n: int) -> list[ReplicaSignals]:
    return [ready(kv=0.05) for _ in range(n)]


# -- the contract: names, defaults, errors -------------------------------------------------------------------


def test_factory_builds_each_by_name_and_refuses_unknown_names_and_bad_params() -> None:
    for name, cls in (
        ("chunkwise", ChunkwiseAutoscaler),
        ("keda-queue", KedaQueueDepth),
        ("hpa-kv", HpaKvUsage),
    ):
        scaler = make_autoscaler(name, min_replicas=1, max_replicas=3, cold_start_s=30.0)
        assert isinstance(scaler, cls) and scaler.name == name
    with pytest.raises(ValueError, match=r"unknown autoscaler 'knative'.*chunkwise, keda-queue, hpa-kv"):
        make_autoscaler("knative")
    with pytest.raises(ValueError, match="takes no bogus"):
        make_autoscaler("keda-queue", bogus=1)
    with pytest.raises(ValueError, match=r"min_replicas .3. must not exceed max_replicas .2."):
        make_autoscaler("chunkwise", min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_per_replica must be a finite number > 0"):
        make_autoscaler("keda-queue", target_per_replica=0)
    with pytest.raises(ValueError, match="HPA cannot scale to zero"):
        make_autoscaler("hpa-kv", min_replicas=0)
    with pytest.raises(ValueError, match="unknown target"):
        make_autoscaler("chunkwise", targets={"queueDepth": 4.0})
    with pytest.raises(ValueError, match="must be an integer"):
        make_autoscaler("hpa-kv", max_replicas=2.5)
    with pytest.raises(ValueError, match="window_s must be > 0"):
        FleetSignals(0.0, 0.0, ())


def test_defaults_are_the_operator_s_and_the_engine_s() -> None:
    from chunkwise.engine.loop.metrics import STEP_DURATION_BUCKETS as ENGINE_BUCKETS

    spec = AutoscalingSpec()
    assert (spec.min_replicas, spec.max_replicas) == (DEFAULT_MIN_REPLICAS, DEFAULT_MAX_REPLICAS)
    assert STEP_DURATION_BUCKETS == ENGINE_BUCKETS
    c = ChunkwiseAutoscaler()
    assert c.behavior == Behavior.from_spec(spec)
    assert c.targets["queueDepthPerReplica"] == spec.targets.queue_depth_per_replica
    assert c.grace_s == STARTUP_GRACE_S
    assert ChunkwiseAutoscaler(cold_start_s=45.0).grace_s == 45.0
    assert ChunkwiseAutoscaler(cold_start_s=45.0, grace_s=90.0).grace_s == 90.0


def test_chunkwise_without_the_operator_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "chunkwise_operator", None)
    with pytest.raises(ImportError, match=r"chunkwise\[operator\]"):
        make_autoscaler("chunkwise")
    assert make_autoscaler("keda-queue").name == "keda-queue"  # the baselines need no operator


# -- chunkwise: the operator's decision -----------------------------------------------------------------------


def test_chunkwise_scales_up_once_the_scale_up_window_agrees() -> None:
    # Queue target 8 per replica, scale-up window 30 s (the spec's): 24 waiting on one replica asks for 3,
    # but the 4 waiting at t=0 asked for 1, and that recommendation stays in the window through t=30.
    s = ChunkwiseAutoscaler(min_replicas=1, max_replicas=8)
    assert s.evaluate(fleet(0.0, [ready(waiting=4)])) == 1
    assert s.evaluate(fleet(15.0, [ready(waiting=24)])) == 1
    assert s.last_reason == "ScaleUpStabilized"
    assert s.evaluate(fleet(30.0, [ready(waiting=24)])) == 1
    assert s.evaluate(fleet(45.0, [ready(waiting=24)])) == 3
    assert s.last_reason == "ScaledUp"
    # The queue keeps growing on the 3 (48 over 3 = 16 a replica, asking for 6): again once the window agrees.
    assert s.evaluate(fleet(60.0, [ready(waiting=16) for _ in range(3)], held=0)) == 3
    assert s.evaluate(fleet(75.0, [ready(waiting=16) for _ in range(3)])) == 3
    assert s.evaluate(fleet(90.0, [ready(waiting=16) for _ in range(3)])) == 6


def test_chunkwise_holds_within_tolerance() -> None:
    behavior = _behavior(scale_up_stabilization_s=0.0)
    s = ChunkwiseAutoscaler(min_replicas=1, max_replicas=8, behavior=behavior)
    # 3 replicas, 26 waiting: 8.67 a replica, 8% above the target of 8, within the 10% tolerance.
    assert s.evaluate(fleet(0.0, [ready(waiting=9), ready(waiting=9), ready(waiting=8)])) == 3
    assert s.last_reason == "WithinTolerance"
    # 27 waiting: 9 a replica, 12.5% above: ceil(3 × 1.125) = 4.
    assert s.evaluate(fleet(15.0, [ready(waiting=9) for _ in range(3)])) == 4


def test_chunkwise_scales_down_only_after_the_scale_down_window() -> None:
    s = ChunkwiseAutoscaler(min_replicas=1, max_replicas=8)
    busy = [ready(waiting=8, kv=0.5) for _ in range(3)]
    assert s.evaluate(fleet(0.0, busy)) == 3  # 8 a replica: exactly the target
    for now in range(15, 301, 15):  # idle from t=15: it asks for 1, but the 3 of t=0 is in the window
        assert s.evaluate(fleet(float(now), idle(3))) == 3, now
    assert s.last_reason == "ScaleDownStabilized"
    assert s.evaluate(fleet(315.0, idle(3))) == 1
    assert s.last_reason == "ScaledDown"


def test_chunkwise_preemption_rate_is_per_second_over_the_window() -> None:
    # 30 preemptions in a 15 s window on one replica: 2 a second against a target of 1: ceil(1 × 2) = 2.
    s = ChunkwiseAutoscaler(min_replicas=1, max_replicas=8, behavior=_behavior(scale_up_stabilization_s=0.0))
    assert s.evaluate(fleet(0.0, [ready(running=4, preemptions=30)])) == 2
    assert s.last_decision is not None and s.last_decision.driver == "preemptionRatePerSecond"


def test_chunkwise_slow_steps_hold_a_scale_down() -> None:
    # p99 step time is a ceiling: 0.6 s steps (above 0.5 s) keep an idle-queued fleet from scaling down,
    # and 0.3 s steps let it.
    quick = _behavior(scale_down_stabilization_s=0.0)
    slow = ChunkwiseAutoscaler(behavior=quick)
    assert slow.evaluate(fleet(0.0, [ready(steps=[0.6] * 100) for _ in range(3)])) == 3
    assert slow.last_reason == "ScaleDownHeld"
    fast = ChunkwiseAutoscaler(behavior=quick)
    assert fast.evaluate(fleet(0.0, [ready(steps=[0.3] * 100) for _ in range(3)])) == 1


def test_chunkwise_scales_to_zero_after_idle_and_back_up_on_held_requests() -> None:
    s = ChunkwiseAutoscaler(min_replicas=0, max_replicas=8, scale_to_zero_after_s=300.0)
    assert s.evaluate(fleet(0.0, [ready(running=2)])) == 1
    assert s.evaluate(fleet(100.0, [ready(requests=1)])) == 1  # a request in the window: active at 100
    for now in (115.0, 250.0, 385.0):
        assert s.evaluate(fleet(now, idle(1))) == 1, now
    assert s.evaluate(fleet(400.0, idle(1))) == 0  # 300 s without a request
    assert s.last_reason == "ScaledToZero"
    assert s.evaluate(fleet(415.0, [])) == 0  # nothing held: stays at 0
    # 20 requests held at the router with no replica: straight to ceil(20 / 8) = 3, not 0 -> 1.
    assert s.evaluate(fleet(430.0, [], held=20)) == 3
    assert s.last_reason == "ScaledUp"


def test_chunkwise_holds_a_scale_down_while_a_replica_starts_within_grace() -> None:
    # No scale-down window, so that only the startup hold keeps the count: 2 idle ready replicas and one
    # starting since t=100, with a 60 s cold start.
    s = ChunkwiseAutoscaler(cold_start_s=60.0, behavior=_behavior(scale_down_stabilization_s=0.0))
    for now in (110.0, 140.0, 155.0):
        assert s.evaluate(fleet(now, [*idle(2), starting(100.0)])) == 3, now
        assert s.last_reason == "ScaleDownHeld"
    # Past the grace the ready ones decide.
    assert s.evaluate(fleet(170.0, [*idle(2), starting(100.0)])) == 1


def test_chunkwise_does_not_wait_forever_on_a_replica_that_never_becomes_ready() -> None:
    # One ready idle replica and one never ready (no GPU node): held while it may still be starting, then the
    # ready one decides and the count comes down.
    s = ChunkwiseAutoscaler(cold_start_s=60.0)
    counts = [s.evaluate(fleet(float(now), [*idle(1), starting(0.0)])) for now in range(0, 121, 15)]
    assert counts[:4] == [2, 2, 2, 2]  # t = 0..45: within the grace
    assert counts[-1] == 1, counts


# -- keda-queue --------------------------------------------------------------------------------------------------


def test_keda_scales_up_on_a_growing_queue_within_hpa_s_rate_limit() -> None:
    s = KedaQueueDepth(min_replicas=1, max_replicas=10)
    assert s.evaluate(fleet(0.0, [ready(waiting=12)])) == 3  # ceil(12 / 5)
    # 60 waiting asks for 12 (max 10), but a period adds at most max(4 pods, 100%): 3 -> 7.
    assert s.evaluate(fleet(15.0, [ready(waiting=20) for _ in range(3)])) == 7
    assert s.evaluate(fleet(30.0, [ready(waiting=10) for _ in range(7)])) == 10


def test_keda_holds_within_tolerance() -> None:
    s = KedaQueueDepth(min_replicas=1, max_replicas=10)
    # 16 waiting on 3 replicas against 5 each: 16/15 = 1.067, within HPA's 10%; ceil(16/5) would be 4.
    assert s.evaluate(fleet(0.0, [ready(waiting=6), ready(waiting=5), ready(waiting=5)])) == 3
    # 17: 1.133, out of it.
    assert s.evaluate(fleet(15.0, [ready(waiting=6), ready(waiting=6), ready(waiting=5)])) == 4


def test_keda_scales_down_only_after_hpa_s_stabilization_window() -> None:
    s = KedaQueueDepth(min_replicas=1, max_replicas=10)
    assert s.evaluate(fleet(0.0, [ready(waiting=5, running=4) for _ in range(3)])) == 3
    serving = [ready(running=4) for _ in range(3)]  # nothing waiting: it asks for 1
    for now in range(15, 300, 15):
        assert s.evaluate(fleet(float(now), serving)) == 3, now
        assert s.last_reason == "ScaleDownStabilized"
    assert s.evaluate(fleet(300.0, serving)) == 1  # the t=0 sample is 300 s old: out of the window
    assert s.last_reason == "ScaledDown"


def test_keda_scales_to_zero_after_its_cooldown_and_activates_on_held_requests() -> None:
    s = KedaQueueDepth(min_replicas=0, max_replicas=10)
    assert s.evaluate(fleet(0.0, [ready(running=1)])) == 1
    assert s.evaluate(fleet(15.0, idle(1))) == 1
    assert s.evaluate(fleet(300.0, idle(1))) == 1  # inactive since 0 for 300 s: not longer than the cooldown
    assert s.evaluate(fleet(315.0, idle(1))) == 0
    assert s.evaluate(fleet(330.0, [])) == 0
    # Held requests activate it: KEDA goes to 1, then HPA takes over.
    assert s.evaluate(fleet(345.0, [], held=20)) == 1
    assert s.evaluate(fleet(360.0, [starting(345.0)], held=20)) == 4
    # With min_replicas 1 it never goes to 0.
    keep = KedaQueueDepth(min_replicas=1)
    assert [keep.evaluate(fleet(float(t), idle(1))) for t in range(0, 901, 300)] == [1, 1, 1, 1]


# -- hpa-kv -------------------------------------------------------------------------------------------------------


def test_hpa_kv_scales_up_on_kv_usage() -> None:
    s = HpaKvUsage(min_replicas=1, max_replicas=10)
    # Mean 0.9 against 0.7 on 2 replicas: ceil(2 × 1.286) = 3.
    assert s.evaluate(fleet(0.0, [ready(kv=0.9), ready(kv=0.9)])) == 3
    assert s.evaluate(fleet(15.0, [ready(kv=0.95) for _ in range(3)])) == 5


def test_hpa_kv_holds_within_tolerance() -> None:
    s = HpaKvUsage(min_replicas=1, max_replicas=10)
    assert s.evaluate(fleet(0.0, [ready(kv=0.75), ready(kv=0.75)])) == 2  # 1.071: within 10%
    assert s.last_reason == "WithinTolerance"
    assert s.evaluate(fleet(15.0, [ready(kv=0.8), ready(kv=0.8)])) == 3  # 1.143: ceil(2.29)


def test_hpa_kv_scales_down_only_after_the_stabilization_window() -> None:
    s = HpaKvUsage(min_replicas=1, max_replicas=10)
    assert s.evaluate(fleet(0.0, [ready(kv=0.7) for _ in range(4)])) == 4
    for now in range(15, 300, 15):
        assert s.evaluate(fleet(float(now), idle(4))) == 4, now
    assert s.evaluate(fleet(300.0, idle(4))) == 1  # ceil(4 × 0.05/0.7) = 1


def test_hpa_kv_counts_starting_replicas_as_empty_for_a_scale_up_and_ignores_them_for_a_scale_down() -> None:
    # 3 ready at 1.0 and one starting: over the ready ones ceil(3 × 1.43) = 5, but with the starting one at
    # 0 the mean is 3/4 = 0.75, within tolerance of 0.7: HPA holds at 4.
    up = HpaKvUsage(max_replicas=10)
    assert up.evaluate(fleet(0.0, [ready(kv=1.0) for _ in range(3)] + [starting(0.0)])) == 4
    # 2 ready nearly empty and 2 starting: the starting ones hold no scale down.
    down = HpaKvUsage(max_replicas=10)
    assert down.evaluate(fleet(0.0, [*idle(2), starting(0.0), starting(0.0)])) == 1
    # None ready: no metrics, no change.
    assert HpaKvUsage().evaluate(fleet(0.0, [starting(0.0), starting(0.0)])) == 2


def _behavior(**overrides: float) -> Behavior:
    """The spec's default behavior with some windows changed."""
    return dataclasses.replace(Behavior.from_spec(AutoscalingSpec()), **overrides)  # type: ignore[arg-type]
