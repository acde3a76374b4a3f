"""status.autoscaler: what an evaluation writes, that it fits the CRD, and that its history round-trips."""

from __future__ import annotations

from typing import Any

from operator_harness import schema_errors

from chunkwise_operator import autoscale as a
from chunkwise_operator.spec import API_VERSION, KIND, parse
from chunkwise_operator.status import (
    autoscaler_block,
    autoscaler_history,
    compute_status,
    iso_time,
    parse_time,
)

NOW = 1_900_000_000.25
OBSERVED = a.Observed(
    {a.QUEUE_DEPTH: 9.0, a.PREEMPTION_RATE: None, a.P99_STEP_TIME: 0.0123456789, a.KV_USAGE: 0.5}, 2
)


def spec(**autoscaling: Any) -> Any:
    return parse(
        {
            "model": {"preset": "tiny"},
            "image": "i",
            "replicas": 2,
            "autoscaling": {"enabled": True, **autoscaling},
        }
    )


def evaluate(parsed: Any, history: tuple[a.Recommendation, ...] = ()) -> a.Decision:
    return a.decide(
        current=parsed.replicas,
        observed=OBSERVED,
        targets=a.per_metric(parsed.autoscaling.targets),
        min_replicas=1,
        max_replicas=8,
        behavior=a.Behavior.from_spec(parsed.autoscaling),
        history=history,
        events=(),
        now=NOW,
    )


def fits_crd(status: dict[str, Any]) -> list[str]:
    obj = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "x"},
        "spec": {"model": {"preset": "tiny"}, "image": "i"},
        "status": status,
    }
    return schema_errors(obj)


def test_block_after_a_scale_up() -> None:
    parsed = spec(targets={"queueDepthPerReplica": 3})
    decision = evaluate(parsed)
    block = autoscaler_block(spec=parsed, decision=decision, observed=OBSERVED, previous=None, now=NOW)
    assert block == {
        "desiredReplicas": 6,
        "recommendedReplicas": 6,
        "reason": "ScaledUp",
        "message": "queueDepthPerReplica asks for 6 (queueDepthPerReplica 9/3, p99StepTimeSeconds 0.0123/0.5, "
        "kvUsageFraction 0.5/0.9)",
        "scrapedReplicas": 2,
        "lastEvaluationTime": "2030-03-17T17:46:40.250Z",
        "lastScaleTime": "2030-03-17T17:46:40.250Z",
        "metrics": {"queueDepthPerReplica": 9.0, "p99StepTimeSeconds": 0.012346, "kvUsageFraction": 0.5},
        "recommendations": [{"time": "2030-03-17T17:46:40.250Z", "replicas": 6}],
        "scaleEvents": [{"time": "2030-03-17T17:46:40.250Z", "from": 2, "to": 6}],
    }
    assert fits_crd({"autoscaler": block}) == []
    # What a restarted operator reads back is what was decided.
    assert autoscaler_history(block) == (decision.history, decision.events)


def test_block_while_delegated_only_reports() -> None:
    parsed = spec(delegated=True, targets={"queueDepthPerReplica": 3})
    block = autoscaler_block(
        spec=parsed, decision=evaluate(parsed), observed=OBSERVED, previous=None, now=NOW
    )
    assert (block["desiredReplicas"], block["recommendedReplicas"], block["reason"]) == (2, 6, "Delegated")
    assert block["message"].startswith(
        "an external scaler owns spec.replicas; chunkwise would run 6 (ScaledUp:"
    )
    assert "scaleEvents" not in block and "lastScaleTime" not in block
    assert fits_crd({"autoscaler": block}) == []
    # The reconcile's own status writes keep the report (and keep spec.replicas as the desired count).
    status = compute_status(
        name="x",
        namespace="d",
        parsed=spec(delegated=True),
        runtime=None,
        router=None,
        previous={"autoscaler": block},
        now="2030-01-01T00:00:00Z",
    )
    assert status["autoscaler"] == block


def test_history_survives_bad_entries_and_times_round_trip() -> None:
    assert parse_time(iso_time(NOW)) == NOW
    assert parse_time("yesterday") is None
    block = {
        "recommendations": [
            {"time": iso_time(NOW), "replicas": 3},
            {"time": "bad", "replicas": 1},
            {"replicas": 2},
            "x",
        ],
        "scaleEvents": [
            {"time": iso_time(NOW - 1), "from": 1, "to": 3},
            {"time": iso_time(NOW), "from": "1", "to": 2},
        ],
    }
    assert autoscaler_history(block) == ((a.Recommendation(NOW, 3),), (a.ScaleEvent(NOW - 1, 1, 3),))
    assert autoscaler_history(None) == ((), ())
