"""status.py: conditions, observedGeneration and readiness as pure functions of their inputs."""

from __future__ import annotations

import re
from pathlib import Path
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


# -- why pods do not start: live objects as the API server returns them ---------------------------------------

LLAMA = parse({"model": {"preset": "tiny"}, "image": "ghcr.io/acme/chunkwise:cuda", "replicas": 2})
POD = "llama-6c9d8f7b5-x2x7q"
NOT_READY = [
    {"type": "PodReadyToStartContainers", "status": "True", "lastProbeTime": None},
    {"type": "Initialized", "status": "True", "lastProbeTime": None},
    {
        "type": "Ready",
        "status": "False",
        "lastProbeTime": None,
        "reason": "ContainersNotReady",
        "message": "containers with unready status: [engine]",
    },
    {
        "type": "ContainersReady",
        "status": "False",
        "lastProbeTime": None,
        "reason": "ContainersNotReady",
        "message": "containers with unready status: [engine]",
    },
    {"type": "PodScheduled", "status": "True", "lastProbeTime": None},
]


def live_pod(
    name: str = POD,
    phase: str = "Pending",
    pod_conditions: list[dict[str, Any]] | None = None,
    engine: dict[str, Any] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    """A runtime pod as `kubectl get pod -o json` shows it; `engine` is the engine's containerStatuses entry."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ml",
        "generateName": "llama-6c9d8f7b5-",
        "labels": {
            "serving.chunkwise.dev/inferenceservice": "llama",
            "app.kubernetes.io/component": "runtime",
        },
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llama-6c9d8f7b5"}],
    }
    if deleting:
        meta["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    result: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "engine", "image": "ghcr.io/acme/chunkwise:cuda"}]},
        "status": {"phase": phase, "qosClass": "Burstable"},
    }
    if pod_conditions is not None:
        result["status"]["conditions"] = pod_conditions
    if engine is not None:
        result["status"].update(hostIP="10.0.3.7", podIP="10.244.2.9", startTime="2030-01-01T00:00:00Z")
        result["status"]["containerStatuses"] = [
            {
                "name": "engine",
                "image": "ghcr.io/acme/chunkwise:cuda",
                "imageID": "",
                "lastState": {},
                "ready": False,
                "restartCount": 0,
                "started": False,
                **engine,
            }
        ]
    return result


def unschedulable(name: str = POD, message: str | None = None) -> dict[str, Any]:
    said = message or (
        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: "
        "3 No preemption victims found for incoming pod."
    )
    scheduled = {
        "type": "PodScheduled",
        "status": "False",
        "lastProbeTime": None,
        "lastTransitionTime": "2030-01-01T00:00:00Z",
        "reason": "Unschedulable",
        "message": said,
    }
    return live_pod(name, pod_conditions=[scheduled])


def waiting(reason: str, message: str, name: str = POD) -> dict[str, Any]:
    return live_pod(
        name, pod_conditions=NOT_READY, engine={"state": {"waiting": {"reason": reason, "message": message}}}
    )


def live_deployment(
    *conditions: dict[str, Any], ready: int = 0, running: int = 0, generation: int = 1, observed: int = 1
) -> dict[str, Any]:
    """The runtime Deployment, 2 replicas wanted, with the Deployment controller's conditions."""
    result = deployment(
        ready=ready, updated=running, running=running, generation=generation, observed=observed
    )
    result["metadata"].update(name="llama", namespace="ml")
    stamp = {"lastUpdateTime": "2030-01-01T00:00:00Z", "lastTransitionTime": "2030-01-01T00:00:00Z"}
    result["status"]["conditions"] = [
        {
            **stamp,
            "type": "Available",
            "status": "False",
            "reason": "MinimumReplicasUnavailable",
            "message": "Deployment does not have minimum availability.",
        },
        *({**stamp, **c} for c in conditions),
    ]
    if ready < 2:
        result["status"]["unavailableReplicas"] = 2 - ready
    return result


ROLLING = {
    "type": "Progressing",
    "status": "True",
    "reason": "ReplicaSetUpdated",
    "message": 'ReplicaSet "llama-6c9d8f7b5" is progressing.',
}
TIMED_OUT = {
    "type": "Progressing",
    "status": "False",
    "reason": "ProgressDeadlineExceeded",
    "message": 'ReplicaSet "llama-6c9d8f7b5" has timed out progressing.',
}


def llama_status(
    pods: list[dict[str, Any]], runtime: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    result = compute_status(
        name="llama",
        namespace="ml",
        parsed=LLAMA,
        runtime=runtime or live_deployment(ROLLING, running=len(pods)),
        router=None,
        previous={},
        now=T0,
        generation=1,
        failure=None,
        pods=pods,
    )
    return {c["type"]: c for c in result["conditions"]}


def said(cond: dict[str, Any]) -> tuple[str, str, str]:
    return cond["status"], cond["reason"], cond["message"]


def test_a_pod_no_node_can_take_is_unschedulable_with_the_schedulers_words() -> None:
    by_type = llama_status([unschedulable()])
    message = (
        f"pod {POD} cannot be scheduled: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu. "
        "preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod."
    )
    assert said(by_type["Ready"]) == ("False", "Unschedulable", message)
    assert said(by_type["Degraded"]) == ("True", "Unschedulable", message)
    # Still rolling out: the Deployment has not given up, and a cluster autoscaler may yet add a node.
    assert by_type["Progressing"]["status"] == "True"


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("ImagePullBackOff", 'Back-off pulling image "ghcr.io/acme/chunkwise:cuda"'),
        (
            "ErrImagePull",
            'rpc error: code = NotFound desc = failed to pull and unpack image "ghcr.io/acme/chunkwise:cuda": '
            'failed to resolve reference "ghcr.io/acme/chunkwise:cuda": ghcr.io/acme/chunkwise:cuda: not found',
        ),
        ("CreateContainerConfigError", 'secret "hf-token" not found'),
    ],
)
def test_a_container_the_kubelet_cannot_start_names_its_reason(reason: str, message: str) -> None:
    by_type = llama_status([waiting(reason, message)])
    expected = f"pod {POD}: container engine: {message}"
    assert said(by_type["Ready"]) == ("False", reason, expected)
    assert said(by_type["Degraded"]) == ("True", reason, expected)


def test_a_crash_loop_after_a_clean_exit_is_still_a_failing_engine() -> None:
    """CrashLoopBackOff whose last run ended with code 0: the engine returned, which it must never do."""
    pod = live_pod(
        phase="Running",
        pod_conditions=NOT_READY,
        engine={
            "restartCount": 5,
            "state": {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off 2m40s restarting failed container=engine pod={POD}_ml(4f0c-uid)",
                }
            },
            "lastState": {
                "terminated": {
                    "exitCode": 0,
                    "reason": "Completed",
                    "startedAt": "2030-01-01T00:00:00Z",
                    "finishedAt": "2030-01-01T00:00:09Z",
                    "containerID": "containerd://0a1b",
                }
            },
        },
    )
    by_type = llama_status([pod])
    expected = f"pod {POD}: container engine exited with code 0 (5 restarts): Completed"
    assert said(by_type["Ready"]) == ("False", "EngineFailing", expected)
    assert said(by_type["Degraded"]) == ("True", "EngineFailing", expected)


@pytest.mark.parametrize(
    "message",
    [
        'pods "llama-6c9d8f7b5-hq2lt" is forbidden: exceeded quota: gpu-quota, requested: '
        "requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=4",
        'pods "llama-6c9d8f7b5-hq2lt" is forbidden: violates PodSecurity "restricted:latest": seccompProfile '
        '(pod or container "engine" must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")',
    ],
)
def test_pods_the_api_server_refuses_to_create_are_failed_create(message: str) -> None:
    failed = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": message}
    by_type = llama_status([], live_deployment(ROLLING, failed))
    expected = f"Deployment llama: {message}"
    assert said(by_type["Ready"]) == ("False", "FailedCreate", expected)
    assert said(by_type["Degraded"]) == ("True", "FailedCreate", expected)


def test_a_rollout_past_its_deadline_stops_progressing_and_says_why() -> None:
    crash = live_pod(
        phase="Running",
        pod_conditions=NOT_READY,
        engine={
            "restartCount": 7,
            "state": {
                "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed"}
            },
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "CUDA out of memory"}},
        },
    )
    by_type = llama_status([crash], live_deployment(TIMED_OUT, running=1))
    crashed = f"pod {POD}: container engine exited with code 1 (7 restarts): CUDA out of memory"
    assert said(by_type["Progressing"]) == (
        "False",
        "ProgressDeadlineExceeded",
        f'Deployment llama: ReplicaSet "llama-6c9d8f7b5" has timed out progressing.; {crashed}',
    )
    # Degraded names the cause, which is what to fix.
    assert said(by_type["Degraded"]) == ("True", "EngineFailing", crashed)
    # With no pod to blame (a model slower to load than the deadline), the deadline itself is the reason.
    slow = live_pod(phase="Running", pod_conditions=NOT_READY, engine={"state": {"running": {}}})
    by_type = llama_status([slow], live_deployment(TIMED_OUT, running=1))
    deadline = 'Deployment llama: ReplicaSet "llama-6c9d8f7b5" has timed out progressing.'
    assert said(by_type["Progressing"]) == ("False", "ProgressDeadlineExceeded", deadline)
    assert said(by_type["Degraded"]) == ("True", "ProgressDeadlineExceeded", deadline)
    assert said(by_type["Ready"]) == ("False", "ProgressDeadlineExceeded", deadline)


def test_deployment_conditions_from_an_older_template_are_not_judged() -> None:
    """A new template restarts the deadline: until the controller has seen it, its old verdict is stale."""
    stale = live_deployment(TIMED_OUT, running=1, generation=3, observed=2)
    slow = live_pod(phase="Running", pod_conditions=NOT_READY, engine={"state": {"running": {}}})
    by_type = llama_status([slow], stale)
    assert (by_type["Progressing"]["status"], by_type["Progressing"]["reason"]) == ("True", "RollingOut")
    assert (by_type["Degraded"]["status"], by_type["Degraded"]["reason"]) == ("False", "AsExpected")


def test_the_most_actionable_reason_wins_and_the_others_are_counted() -> None:
    pull = waiting("ErrImagePull", "not found", name="llama-6c9d8f7b5-b")
    backoff = waiting("ImagePullBackOff", "Back-off pulling image", name="llama-6c9d8f7b5-a")
    secret = waiting("CreateContainerConfigError", 'secret "hf-token" not found', name="llama-6c9d8f7b5-z")
    pending = unschedulable("llama-6c9d8f7b5-0")
    by_type = llama_status([pending, backoff, pull, secret])
    assert said(by_type["Degraded"]) == (
        "True",
        "CreateContainerConfigError",
        'pod llama-6c9d8f7b5-z: container engine: secret "hf-token" not found '
        "[4 pods: 1 CreateContainerConfigError, 1 ErrImagePull, 1 ImagePullBackOff, 1 Unschedulable]",
    )
    # The registry's answer (ErrImagePull) before the kubelet's back-off, which only repeats the image name.
    by_type = llama_status([pending, backoff, pull])
    assert by_type["Degraded"]["reason"] == "ErrImagePull"
    assert by_type["Degraded"]["message"].startswith("pod llama-6c9d8f7b5-b: container engine: not found [")
    # A pod that cannot even be created outranks every pod that exists.
    failed = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "quota"}
    by_type = llama_status([pending, backoff], live_deployment(ROLLING, failed, running=2))
    assert said(by_type["Degraded"]) == ("True", "FailedCreate", "Deployment llama: quota")


def test_starting_and_terminating_pods_are_no_failure() -> None:
    creating = waiting("ContainerCreating", "", name="llama-6c9d8f7b5-a")
    initializing = waiting("PodInitializing", "", name="llama-6c9d8f7b5-b")
    gone = waiting("ImagePullBackOff", "Back-off pulling image", name="llama-6c9d8f7b5-c")
    gone["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    by_type = llama_status([creating, initializing, gone])
    assert said(by_type["Ready"]) == ("False", "NoReadyReplicas", "0 of 2 replicas are ready")
    assert by_type["Degraded"]["reason"] == "AsExpected"


def test_long_messages_keep_their_head_and_stay_bounded() -> None:
    words = ", ".join(f"1 node(s) had untolerated taint {{pool-{i}: gpu}}" for i in range(200))
    by_type = llama_status([unschedulable(message=f"0/200 nodes are available: {words}.")])
    message = by_type["Degraded"]["message"]
    assert message.startswith(f"pod {POD} cannot be scheduled: 0/200 nodes are available: 1 node(s) had")
    assert message.endswith("...") and len(message) <= 600


def test_a_missing_credentials_secret_stops_the_fetcher_and_says_which() -> None:
    """model.credentialsSecret is the fetch-model init container's envFrom: the kubelet cannot create it."""
    pod = waiting("PodInitializing", "")
    pod["status"]["phase"] = "Pending"
    pod["status"]["initContainerStatuses"] = [
        {
            "name": "fetch-model",
            "image": "ghcr.io/acme/chunkwise:cuda",
            "imageID": "",
            "lastState": {},
            "ready": False,
            "restartCount": 0,
            "started": False,
            "state": {
                "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}
            },
        }
    ]
    by_type = llama_status([pod])
    expected = f'pod {POD}: container fetch-model: secret "hf-token" not found'
    assert said(by_type["Ready"]) == ("False", "CreateContainerConfigError", expected)
    assert said(by_type["Degraded"]) == ("True", "CreateContainerConfigError", expected)


def test_the_documented_order_is_the_order_used() -> None:
    """docs/operator.md's Failure modes section lists status.ORDER as it is."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operator.md").read_text()
    section = docs.split("### Failure modes", 1)[1].split("\n## ", 1)[0]
    paragraph = " ".join(section.split("in this order:", 1)[1].split(";", 1)[0].split())
    named = re.findall(r"`(\w+)`|(other kubelet reasons)", paragraph)
    assert [code or status.OTHER for code, _ in named] == list(status.ORDER)
    for reason in status.ORDER:
        if reason != status.OTHER:
            assert f"`{reason}`" in section.split("When pods differ", 1)[0] or reason == status.CRASH_LOOP
