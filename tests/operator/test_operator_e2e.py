"""The real Kopf operator (its handlers from chunkwise_operator.main) against kmock's Kubernetes emulator."""

from __future__ import annotations

import asyncio
from typing import Any

import kmock as km
import pytest
from operator_harness import Cluster, Operator, eventually, running_operator

from chunkwise_operator import manifests
from chunkwise_operator.main import STATUS_INTERVAL_ENV
from chunkwise_operator.spec import parse

TINY = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}
ROUTED = {**TINY, "replicas": 2, "router": {"enabled": True, "policy": "round-robin"}}


def condition(cluster: Cluster, name: str, ctype: str) -> dict[str, Any] | None:
    for cond in ((cluster.isvc(name) or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return dict(cond)
    return None


def args(cluster: Cluster, name: str) -> list[str] | None:
    dep = cluster.get(Cluster.DEPLOYMENTS, name)
    if dep is None:
        return None
    container = dep["spec"]["template"]["spec"]["containers"][0]
    return [*container.get("command", []), *container.get("args", [])]


def assert_every_child_owned(cluster: Cluster, name: str) -> None:
    """kmock has no garbage collector: deletion is safe only if every child points at its owner."""
    children = cluster.children()
    assert children, "no children at all"
    for child in children:
        refs = child["metadata"].get("ownerReferences")
        assert refs == [
            {
                "apiVersion": "serving.chunkwise.dev/v1alpha1",
                "kind": "InferenceService",
                "name": name,
                "uid": f"uid-{name}",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], (child["kind"], child["metadata"]["name"])


async def handled(operator: Operator, handler: str, times: int = 1) -> None:
    """Wait until Kopf has logged the handler's outcome: `times` successes, or any failure."""
    await eventually(
        lambda: operator.count(f"Handler '{handler}' succeeded") >= times or operator.failures(),
        what=f"{handler} handled",
    )


async def test_create_makes_owned_children_with_engine_arguments(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create_isvc("chat", ROUTED)
    await eventually(lambda: len(cluster.children()) == 9, what="9 children")
    kinds = sorted((c["kind"], c["metadata"]["name"]) for c in cluster.children())
    assert kinds == [
        ("Deployment", "chat"),
        ("Deployment", "chat-router"),
        ("PodDisruptionBudget", "chat"),
        ("PodDisruptionBudget", "chat-router"),
        ("Role", "chat-router"),
        ("RoleBinding", "chat-router"),
        ("Service", "chat"),
        ("Service", "chat-router"),
        ("ServiceAccount", "chat-router"),
    ]
    assert_every_child_owned(cluster, "chat")
    assert args(cluster, "chat") == [
        "chunkwise", "serve", "--model", "tiny", "--served-model-name", "tiny",
        "--host", "0.0.0.0", "--port", "8000", "--device", "cpu", "--dtype", "auto",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "1024", "--block-size", "16",
        "--preemption-mode", "auto", "--enable-prefix-caching",
        "--queue-delay-slo-seconds", "30.0", "--drain-timeout-seconds", "30",
    ]  # fmt: skip
    assert args(cluster, "chat-router") == [
        "chunkwise", "router", "--host", "0.0.0.0", "--port", "8080",
        "--policy", "round-robin", "--kube-service", "chat", "--namespace", "default",
        "--tokenizer", "byte", "--block-size", "16",
    ]  # fmt: skip
    dep = cluster.get(Cluster.DEPLOYMENTS, "chat")
    assert dep is not None and dep["spec"]["replicas"] == 2

    await eventually(lambda: condition(cluster, "chat", "Degraded"), what="status")
    status = (cluster.isvc("chat") or {})["status"]
    assert status["observedGeneration"] == 1
    assert (
        status["selector"]
        == "app.kubernetes.io/component=runtime,serving.chunkwise.dev/inferenceservice=chat"
    )
    assert status["url"] == "http://chat-router.default.svc:8080"
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Ready", "False", "NoReadyReplicas"),
        ("Progressing", "True", "RollingOut"),
        ("Degraded", "False", "AsExpected"),
    ]
    await handled(operator, "reconcile-create")
    assert operator.count("Handler 'reconcile-create' is invoked") == 1
    assert operator.count("Handler 'reconcile-create' succeeded") == 1
    assert operator.failures() == []


async def test_spec_change_updates_children(cluster: Cluster, operator: Operator) -> None:
    await cluster.create_isvc("chat", ROUTED)
    await eventually(lambda: len(cluster.children()) == 9, what="9 children")

    await cluster.patch_isvc(
        "chat",
        {"spec": {"engine": {"maxNumSeqs": 64, "preemptionMode": "recompute"}, "router": {"enabled": False}}},
    )
    changed = parse({**TINY, "replicas": 2, "engine": {"maxNumSeqs": 64, "preemptionMode": "recompute"}})
    await eventually(
        lambda: args(cluster, "chat") == manifests.engine_command(changed), what="new engine args"
    )
    # The router is gone with its account and binding; the runtime stays.
    await eventually(lambda: len(cluster.children()) == 3, what="router children deleted")
    assert sorted(c["kind"] for c in cluster.children()) == ["Deployment", "PodDisruptionBudget", "Service"]
    await eventually(
        lambda: ((cluster.isvc("chat") or {}).get("status") or {}).get("observedGeneration") == 2,
        what="observedGeneration 2",
    )
    assert (cluster.isvc("chat") or {})["status"]["url"] == "http://chat.default.svc:8000"
    assert_every_child_owned(cluster, "chat")
    await handled(operator, "reconcile-update/spec")
    assert operator.count("Handler 'reconcile-update/spec' is invoked") == 1


async def test_scale_subresource_is_honoured(cluster: Cluster, operator: Operator) -> None:
    spec = {**TINY, "autoscaling": {"enabled": True, "delegated": True, "minReplicas": 1, "maxReplicas": 8}}
    await cluster.create_isvc("chat", spec)
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat"), what="deployment")

    await cluster.scale_isvc("chat", 5)
    await eventually(
        lambda: (cluster.get(Cluster.DEPLOYMENTS, "chat") or {})["spec"]["replicas"] == 5, what="5 replicas"
    )
    await eventually(
        lambda: (
            ((cluster.isvc("chat") or {}).get("status") or {}).get("autoscaler")
            == {"desiredReplicas": 5, "reason": "Delegated"}
        ),
        what="autoscaler status",
    )

    # A later, unrelated spec change keeps the scaled count: spec.replicas is the only source.
    await cluster.patch_isvc("chat", {"spec": {"engine": {"blockSize": 32}}})
    await eventually(lambda: "32" in (args(cluster, "chat") or []), what="new block size")
    dep = cluster.get(Cluster.DEPLOYMENTS, "chat")
    assert dep is not None and dep["spec"]["replicas"] == 5


async def test_invalid_spec_is_degraded_once_without_a_retry_loop(
    cluster: Cluster, operator: Operator
) -> None:
    bad = {**TINY, "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}
    await cluster.create_isvc("chat", bad)
    degraded = await eventually(lambda: condition(cluster, "chat", "Degraded"), what="Degraded")
    assert degraded["status"] == "True"
    assert degraded["reason"] == "InvalidAutoscaling"
    assert (
        degraded["message"]
        == "spec.autoscaling.minReplicas (5) must not exceed spec.autoscaling.maxReplicas (2)"
    )
    assert degraded["observedGeneration"] == 1
    assert cluster.children() == []

    warning = await eventually(
        lambda: [e for e in cluster.events() if e["reason"] == "InvalidAutoscaling"], what="Warning event"
    )
    assert warning[0]["type"] == "Warning"
    assert warning[0]["involvedObject"]["name"] == "chat"
    assert warning[0]["message"] == degraded["message"]

    await handled(operator, "reconcile-create")
    assert operator.count("Handler 'reconcile-create' is invoked") == 1
    assert operator.count("Handler 'reconcile-create' succeeded") == 1
    assert operator.failures() == []
    assert operator.failures() == []

    # Fixing the spec recovers without any operator restart.
    await cluster.patch_isvc("chat", {"spec": {"autoscaling": {"maxReplicas": 8}}})
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat"), what="deployment after the fix")
    await eventually(
        lambda: (condition(cluster, "chat", "Degraded") or {}).get("reason") == "AsExpected", what="recovered"
    )
    assert_every_child_owned(cluster, "chat")


async def test_a_bad_value_past_the_schema_leaves_running_children_alone(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create_isvc("chat", TINY)
    await eventually(lambda: args(cluster, "chat"), what="deployment")
    before = args(cluster, "chat")

    await cluster.patch_isvc("chat", {"spec": {"engine": {"preemptionMode": "lru"}}})
    await eventually(
        lambda: (condition(cluster, "chat", "Degraded") or {}).get("reason") == "InvalidEngine",
        what="Degraded",
    )
    assert args(cluster, "chat") == before
    await handled(operator, "reconcile-update/spec")
    assert operator.count("Handler 'reconcile-update/spec' is invoked") == 1
    assert operator.failures() == []


async def test_an_object_someone_else_owns_is_never_taken_over(cluster: Cluster, operator: Operator) -> None:
    await cluster.create_service("chat")
    await cluster.create_isvc("chat", TINY)
    degraded = await eventually(
        lambda: (
            (condition(cluster, "chat", "Degraded") or {}).get("reason") == "ChildConflict"
            and condition(cluster, "chat", "Degraded")
        ),
        what="Degraded ChildConflict",
    )
    assert degraded["status"] == "True"
    assert degraded["message"] == "Service default/chat exists and is not owned by this InferenceService"
    service = cluster.get(Cluster.SERVICES, "chat")
    assert service is not None and "ownerReferences" not in service["metadata"]
    await eventually(lambda: [e for e in cluster.events() if e["reason"] == "ChildConflict"], what="event")
    # Retried later (the owner may delete the Service), not in a tight loop.
    await eventually(operator.failures, what="the handler's outcome")
    assert operator.failures() == [
        "Handler 'reconcile-create' failed temporarily: "
        "Service default/chat exists and is not owned by this InferenceService"
    ]
    assert operator.count("Handler 'reconcile-create' is invoked") == 1


async def test_a_child_the_api_server_rejects_fails_permanently(cluster: Cluster, operator: Operator) -> None:
    status = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422}
    cluster.k[km.action.CREATE, Cluster.PDBS] << 422 << {**status, "message": "spec.maxUnavailable: Invalid"}
    await cluster.create_isvc("chat", TINY)
    degraded = await eventually(
        lambda: (
            (condition(cluster, "chat", "Degraded") or {}).get("reason") == "ChildRejected"
            and condition(cluster, "chat", "Degraded")
        ),
        what="Degraded ChildRejected",
    )
    assert degraded["message"] == (
        "the API server refused a child: 422 Unprocessable Entity: spec.maxUnavailable: Invalid"
    )
    await eventually(operator.failures, what="the handler's outcome")
    assert operator.failures() == [f"Handler 'reconcile-create' failed permanently: {degraded['message']}"]
    assert operator.count("Handler 'reconcile-create' is invoked") == 1


async def test_readiness_comes_from_the_deployment_status(cluster: Cluster, operator: Operator) -> None:
    await cluster.create_isvc("chat", TINY)
    await eventually(lambda: condition(cluster, "chat", "Ready"), what="status")
    assert (condition(cluster, "chat", "Ready") or {})["status"] == "False"

    # What the Deployment controller would report once the pod passes its readiness probe.
    await cluster.patch_deployment(
        "chat",
        {"status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}},
        status=True,
    )
    await eventually(
        lambda: (condition(cluster, "chat", "Ready") or {}).get("status") == "True", what="Ready"
    )
    status = (cluster.isvc("chat") or {})["status"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Ready", "True", "Available"),
        ("Progressing", "False", "Complete"),
        ("Degraded", "False", "AsExpected"),
    ]


async def test_drift_and_deletion_of_the_deployment_are_undone(cluster: Cluster, operator: Operator) -> None:
    await cluster.create_isvc("chat", TINY)
    await eventually(lambda: args(cluster, "chat"), what="deployment")
    expected = manifests.engine_command(parse(TINY))

    # Someone edits the Deployment by hand: scaled, and the engine flags changed.
    await cluster.patch_deployment(
        "chat",
        {
            "spec": {
                "replicas": 4,
                "template": {"spec": {"containers": [{"name": "engine", "args": ["serve", "--model", "x"]}]}},
            }
        },
    )
    await eventually(lambda: args(cluster, "chat") == expected, what="args restored")
    await eventually(
        lambda: (cluster.get(Cluster.DEPLOYMENTS, "chat") or {})["spec"]["replicas"] == 1, what="1"
    )

    await cluster.delete_deployment("chat")
    await eventually(lambda: args(cluster, "chat") == expected, what="deployment recreated")
    assert_every_child_owned(cluster, "chat")


def child_writes(cluster: Cluster) -> int:
    actions = (km.action.CREATE, km.action.UPDATE, km.action.DELETE)
    return sum(1 for action in actions for r in cluster.k[action] if r.resource in Cluster.CHILD_RESOURCES)


async def test_restart_resumes_without_rewriting_anything(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_operator(cluster, caplog):
        await cluster.create_isvc("chat", ROUTED)
        await eventually(lambda: len(cluster.children()) == 9, what="9 children")
        await eventually(lambda: condition(cluster, "chat", "Degraded"), what="status")
    writes = child_writes(cluster)
    caplog.clear()

    async with running_operator(cluster, caplog) as operator:
        await handled(operator, "reconcile-resume")
        # The watch on Deployments also looks at both existing ones, and finds nothing to correct.
        await handled(operator, "child-deployment", times=2)
        assert operator.count("Handler 'reconcile-resume' is invoked") == 1
        assert operator.count("Handler 'reconcile-create' is invoked") == 0
        assert operator.count("Created ") == operator.count("Updated ") == 0
        # Only Kopf's own bookkeeping on the CR may be written; no child is touched.
        assert child_writes(cluster) == writes


@pytest.fixture
def fast_status(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by the operator's start-up handler: the fixture must come before `operator` in a test's arguments.
    monkeypatch.setenv(STATUS_INTERVAL_ENV, "0.2")


async def test_an_engine_that_refuses_its_arguments_is_reported(
    fast_status: None, cluster: Cluster, operator: Operator
) -> None:
    """The runtime judges engine.extraArgs; its refusal reaches the status, not just a CrashLoopBackOff."""
    await cluster.create_isvc("chat", {**TINY, "engine": {"extraArgs": ["--max-model-lenn", "8192"]}})
    await eventually(lambda: args(cluster, "chat"), what="runtime Deployment")
    assert (args(cluster, "chat") or [])[-2:] == ["--max-model-lenn", "8192"]
    said = "chunkwise serve: error: unrecognized arguments: --max-model-lenn 8192"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "chat-7d9-x",
            "namespace": "default",
            "labels": manifests.labels("chat", "runtime"),
        },
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "engine",
                    "image": "chunkwise:dev",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": said + "\n"}},
                }
            ],
        },
    }
    await asyncio.to_thread(cluster.create_pod, pod)
    degraded = await eventually(
        lambda: (c := condition(cluster, "chat", "Degraded")) and c["reason"] == "EngineArgsRejected" and c,
        what="Degraded EngineArgsRejected",
    )
    assert degraded["message"] == (
        f"pod chat-7d9-x: container engine exited with code 2 (3 restarts): {said}"
    )
    ready = condition(cluster, "chat", "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "EngineArgsRejected")
