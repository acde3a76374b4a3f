"""status.py: conditions, observedGeneration and readiness as pure functions of their inputs."""

from __future__ import annotations

from typing import Any

import pytest

from chunkwise_operator import status
from chunkwise_operator.spec import SpecError, parse
from chunkwise_operator.status import (
    KEEP,
    DeploymentState,
    Failure,
    compute_status,
    deployment_state,
    status_patch,
)

T0 = "2030-01-01T00:00:00Z"
T1 = "2030-01-01T00:01:00Z"
MINIMAL = parse({"model": {"preset": "tiny"}, "image": "i", "replicas": 2})
ROUTED = parse({"model": {"preset": "tiny"}, "image": "i", "replicas": 2, "router": {"enabled": True}})
INVALID = SpecError(
    "InvalidAutoscaling", "spec.autoscaling.minReplicas (5) must not exceed spec.autoscaling.maxReplicas (2)"
)


def deployment(
    replicas: int = 2,
    ready: int = 0,
    updated: int = 0,
    running: int = 0,
    generation: int = 1,
    observed: int = 1,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": running,
            "readyReplicas": ready,
            "updatedReplicas": updated,
        },
    }


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_deployment_state() -> None:
    assert deployment_state(None) == DeploymentState(exists=False)
    assert deployment_state({"spec": {"replicas": 3}}) == DeploymentState(exists=True, desired=3)
    assert deployment_state(deployment(ready=2, updated=2, running=2)) == DeploymentState(
        exists=True, desired=2, replicas=2, ready=2, updated=2, rolled_out=True
    )
    # Counts from before the controller saw the new template are not a finished rollout.
    assert not deployment_state(
        deployment(ready=2, updated=2, running=2, generation=2, observed=1)
    ).rolled_out
    # Old pods still terminating.
    assert not deployment_state(deployment(ready=2, updated=2, running=3)).rolled_out


def test_fresh_service_exactly() -> None:
    status = compute_status(
        name="tiny",
        namespace="default",
        parsed=MINIMAL,
        runtime=None,
        router=None,
        previous={},
        now=T0,
        generation=1,
    )
    assert status == {
        "replicas": 0,
        "readyReplicas": 0,
        "selector": "app.kubernetes.io/component=runtime,serving.chunkwise.dev/inferenceservice=tiny",
        "observedGeneration": 1,
        "url": "http://tiny.default.svc:8000",
        "model": "tiny",
        "autoscaler": {"reason": "Disabled"},
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "NoRuntime",
                "message": "the runtime Deployment does not exist yet",
                "observedGeneration": 1,
                "lastTransitionTime": T0,
            },
            {
                "type": "Progressing",
                "status": "True",
                "reason": "Creating",
                "message": "creating the runtime",
                "observedGeneration": 1,
                "lastTransitionTime": T0,
            },
            {
                "type": "Degraded",
                "status": "False",
                "reason": "AsExpected",
                "message": "the spec is valid and its children are applied",
                "observedGeneration": 1,
                "lastTransitionTime": T0,
            },
        ],
    }


@pytest.mark.parametrize(
    ("spec", "runtime", "router", "expected"),
    [
        (
            MINIMAL,
            deployment(ready=0, updated=2, running=2),
            None,
            {"Ready": ("False", "NoReadyReplicas"), "Progressing": ("True", "RollingOut")},
        ),
        (
            MINIMAL,
            deployment(ready=1, updated=2, running=2),
            None,
            {"Ready": ("True", "Available"), "Progressing": ("True", "RollingOut")},
        ),
        (
            MINIMAL,
            deployment(ready=2, updated=2, running=2),
            None,
            {"Ready": ("True", "Available"), "Progressing": ("False", "Complete")},
        ),
        (
            # The CR asks for 2 but the Deployment has not been patched yet.
            parse({"model": {"preset": "tiny"}, "image": "i", "replicas": 3}),
            deployment(ready=2, updated=2, running=2),
            None,
            {"Ready": ("True", "Available"), "Progressing": ("True", "RollingOut")},
        ),
        (
            ROUTED,
            deployment(ready=2, updated=2, running=2),
            None,
            {"Ready": ("False", "RouterUnavailable"), "Progressing": ("True", "Creating")},
        ),
        (
            ROUTED,
            deployment(ready=2, updated=2, running=2),
            deployment(replicas=1, ready=1, updated=1, running=1),
            {"Ready": ("True", "Available"), "Progressing": ("False", "Complete")},
        ),
        (
            parse({"model": {"preset": "tiny"}, "image": "i", "replicas": 0}),
            deployment(replicas=0),
            None,
            {"Ready": ("False", "ScaledToZero"), "Progressing": ("False", "Complete")},
        ),
    ],
)
def test_readiness_follows_the_deployments(
    spec: Any, runtime: dict[str, Any], router: dict[str, Any] | None, expected: dict[str, tuple[str, str]]
) -> None:
    status = compute_status(
        name="tiny",
        namespace="default",
        parsed=spec,
        runtime=runtime,
        router=router,
        previous={},
        now=T0,
        generation=4,
    )
    assert conditions(status) == {**expected, "Degraded": ("False", "AsExpected")}
    assert status["readyReplicas"] == runtime["status"]["readyReplicas"]
    assert status["replicas"] == runtime["status"]["replicas"]


def test_invalid_spec_is_degraded_and_keeps_the_last_good_view() -> None:
    previous = compute_status(
        name="tiny",
        namespace="default",
        parsed=MINIMAL,
        runtime=deployment(ready=2, updated=2, running=2),
        router=None,
        previous={},
        now=T0,
        generation=1,
    )
    status = compute_status(
        name="tiny",
        namespace="default",
        parsed=INVALID,
        runtime=deployment(ready=2, updated=2, running=2),
        router=None,
        previous=previous,
        now=T1,
        generation=2,
    )
    assert status["observedGeneration"] == 2
    assert status["conditions"][2] == {
        "type": "Degraded",
        "status": "True",
        "reason": "InvalidAutoscaling",
        "message": "spec.autoscaling.minReplicas (5) must not exceed spec.autoscaling.maxReplicas (2)",
        "observedGeneration": 2,
        "lastTransitionTime": T1,
    }
    # The old children keep serving: Ready stays True (and keeps its transition time).
    assert status["conditions"][0]["status"] == "True"
    assert status["conditions"][0]["lastTransitionTime"] == T0
    assert conditions(status)["Progressing"] == ("False", "InvalidSpec")
    assert (status["url"], status["model"], status["autoscaler"]) == (
        previous["url"],
        previous["model"],
        previous["autoscaler"],
    )


def test_reconcile_failure_is_kept_by_the_child_watch_until_a_reconcile_clears_it() -> None:
    common: dict[str, Any] = {
        "name": "tiny",
        "namespace": "default",
        "parsed": MINIMAL,
        "runtime": None,
        "router": None,
        "now": T0,
    }
    failed = compute_status(
        **common, previous={}, generation=3, failure=Failure("Forbidden", "the API server refused a child")
    )
    assert conditions(failed)["Degraded"] == ("True", "Forbidden")
    # The Deployment watch knows nothing of the failure: it keeps it, and keeps observedGeneration.
    watched = compute_status(**common, previous=failed, generation=KEEP, failure=KEEP)
    assert conditions(watched)["Degraded"] == ("True", "Forbidden")
    assert watched["observedGeneration"] == 3
    cleared = compute_status(**common, previous=watched, generation=3, failure=None)
    assert conditions(cleared)["Degraded"] == ("False", "AsExpected")


def test_transition_time_moves_only_when_status_flips() -> None:
    common: dict[str, Any] = {"name": "tiny", "namespace": "default", "parsed": MINIMAL, "router": None}
    first = compute_status(**common, runtime=deployment(ready=0, updated=2, running=2), previous={}, now=T0)
    second = compute_status(
        **common, runtime=deployment(ready=2, updated=2, running=2), previous=first, now=T1
    )
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0}
    assert "observedGeneration" not in second


@pytest.mark.parametrize(
    ("autoscaling", "previous", "expected"),
    [
        ({}, None, {"reason": "Disabled"}),
        ({"enabled": True, "delegated": True}, None, {"desiredReplicas": 2, "reason": "Delegated"}),
        ({"enabled": True}, None, {"desiredReplicas": 2, "reason": "AwaitingMetrics"}),
        (
            {"enabled": True},
            {"desiredReplicas": 5, "reason": "QueueDepth", "lastScaleTime": T0},
            {"desiredReplicas": 5, "reason": "QueueDepth", "lastScaleTime": T0},
        ),
    ],
)
def test_autoscaler_block(autoscaling: dict[str, Any], previous: Any, expected: dict[str, Any]) -> None:
    parsed = parse({"model": {"preset": "tiny"}, "image": "i", "replicas": 2, "autoscaling": autoscaling})
    prior = {} if previous is None else {"autoscaler": previous}
    status = compute_status(
        name="tiny", namespace="default", parsed=parsed, runtime=None, router=None, previous=prior, now=T0
    )
    assert status["autoscaler"] == expected


def test_status_patch() -> None:
    old = {
        "replicas": 1,
        "conditions": [{"type": "Ready"}],
        "autoscaler": {"reason": "AwaitingMetrics", "desiredReplicas": 1},
        "somethingElse": {"kept": True},
    }
    assert (
        status_patch(old, {"replicas": 1, "conditions": [{"type": "Ready"}], "autoscaler": old["autoscaler"]})
        is None
    )
    assert status_patch(
        old, {"replicas": 2, "conditions": [{"type": "Ready"}], "autoscaler": {"reason": "Disabled"}}
    ) == {
        "replicas": 2,
        "autoscaler": {"reason": "Disabled", "desiredReplicas": None},
    }
    # Keys it does not manage are never touched, and managed keys that vanish are removed.
    assert status_patch(old, {"conditions": [{"type": "Ready"}]}) == {"replicas": None, "autoscaler": None}


def _pod(name: str, key: str, container: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {key: [container]}}


def test_pod_failure_names_the_container_and_its_last_words() -> None:
    fetch = _pod(
        "svc-1",
        "initContainerStatuses",
        {
            "name": "fetch-model",
            "restartCount": 1,
            "state": {
                "terminated": {"exitCode": 1, "message": "error: 401 Unauthorized from\nhuggingface.co"}
            },
        },
    )
    assert status.pod_failure([fetch]) == status.Failure(
        "ModelFetchFailed",
        "pod svc-1: container fetch-model exited with code 1 (1 restarts): error: 401 Unauthorized from huggingface.co",
    )
    crash = _pod(
        "svc-2",
        "containerStatuses",
        {
            "name": "engine",
            "restartCount": 2,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        },
    )
    assert status.pod_failure([crash]) == status.Failure(
        "EngineFailing", "pod svc-2: container engine exited with code 137 (2 restarts): OOMKilled"
    )
    long = _pod(
        "svc-3",
        "containerStatuses",
        {"name": "engine", "state": {"terminated": {"exitCode": 2, "message": "x" * 2000}}},
    )
    failure = status.pod_failure([long])
    assert failure is not None and failure.reason == "EngineArgsRejected"
    assert failure.message.endswith("..." + "x" * 512)


def test_pods_that_run_or_finished_cleanly_are_no_failure() -> None:
    recovered = _pod(
        "a",
        "containerStatuses",
        {"name": "engine", "state": {"running": {}}, "lastState": {"terminated": {"exitCode": 1}}},
    )
    fetched = _pod(
        "b", "initContainerStatuses", {"name": "fetch-model", "state": {"terminated": {"exitCode": 0}}}
    )
    assert status.pod_failure([recovered, fetched, {"metadata": {"name": "c"}}]) is None


def test_a_crashing_pod_is_degraded_and_not_ready() -> None:
    parsed = parse({"model": {"preset": "tiny"}})
    crash = _pod(
        "svc-9",
        "containerStatuses",
        {"name": "engine", "state": {"terminated": {"exitCode": 2, "message": "bad flag"}}},
    )
    result = status.compute_status(
        name="svc", namespace="ml", parsed=parsed, runtime=None, router=None, previous={},
        now="2030-01-01T00:00:00Z", generation=1, failure=None, pods=[crash],
    )  # fmt: skip
    by_type = {c["type"]: c for c in result["conditions"]}
    assert (by_type["Degraded"]["status"], by_type["Degraded"]["reason"]) == ("True", "EngineArgsRejected")
    assert (by_type["Ready"]["status"], by_type["Ready"]["reason"]) == ("False", "EngineArgsRejected")
    assert "bad flag" in by_type["Ready"]["message"]
