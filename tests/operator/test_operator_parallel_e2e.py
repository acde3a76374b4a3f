"""Tensor and pipeline parallelism end to end: the real Kopf operator against kmock.

kmock serves leaderworkersets (leaderworkerset.x-k8s.io/v1) unless a test removes it from its resources,
which is what a cluster without LeaderWorkerSet installed looks like to discovery.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kmock as km
import kubernetes
import pytest
from e2e.local.kube import LEADER_WORKER_SETS
from operator_harness import NAMESPACE, TEST_USER_AGENT, Cluster, eventually, running_operator

from chunkwise_operator import manifests, status
from chunkwise_operator.main import STATUS_INTERVAL_ENV
from chunkwise_operator.spec import parse

TINY: dict[str, Any] = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}
PIPELINE: dict[str, Any] = {
    **TINY,
    "engine": {"pipelineParallelSize": 2},
    "pod": {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
}
OWNER_REF = {
    "apiVersion": "serving.chunkwise.dev/v1alpha1",
    "kind": "InferenceService",
    "name": "chat",
    "uid": "uid-chat",
    "controller": True,
    "blockOwnerDeletion": True,
}


def lws(cluster: Cluster) -> dict[str, Any] | None:
    return cluster.get(Cluster.LWS, "chat")


def lws_spec(cluster: Cluster) -> dict[str, Any]:
    return dict((lws(cluster) or {}).get("spec") or {})


def template_env(cluster: Cluster, role: str) -> list[Any]:
    template = lws_spec(cluster).get("leaderWorkerTemplate", {}).get(role) or {}
    (container,) = template["spec"]["containers"]
    return list(container.get("env") or [])


def condition(cluster: Cluster, ctype: str) -> dict[str, Any] | None:
    for cond in ((cluster.isvc("chat") or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return dict(cond)
    return None


def reason(cluster: Cluster, ctype: str) -> tuple[str, str] | None:
    cond = condition(cluster, ctype)
    return None if cond is None else (cond["status"], cond["reason"])


def events(cluster: Cluster, why: str) -> list[str]:
    return sorted(e["message"] for e in cluster.events() if e.get("reason") == why)


async def patch_lws_status(cluster: Cluster, patch: dict[str, Any]) -> None:
    """What the LWS controller would write once its groups' pods are ready."""

    def call() -> None:
        config = kubernetes.client.Configuration(host=cluster.url)
        with kubernetes.client.ApiClient(config) as c:
            c.user_agent = TEST_USER_AGENT
            kubernetes.client.CustomObjectsApi(c).patch_namespaced_custom_object_status(
                manifests.LWS_GROUP,
                manifests.LWS_VERSION,
                NAMESPACE,
                manifests.LWS_PLURAL,
                "chat",
                {"status": patch},
                _content_type="application/merge-patch+json",
            )

    await asyncio.to_thread(call)


@pytest.fixture
def fast_status(monkeypatch: pytest.MonkeyPatch) -> None:
    # The status refresh is where an LWS API installed later is noticed.
    monkeypatch.setenv(STATUS_INTERVAL_ENV, "0.2")


async def test_gpu_2_is_a_deployment_with_two_tensor_parallel_ranks(cluster: Cluster, operator: Any) -> None:
    await cluster.create_isvc("chat", {**TINY, "resources": {"gpu": 2}})
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat"), what="the Deployment")
    dep = cluster.get(Cluster.DEPLOYMENTS, "chat") or {}
    (engine,) = dep["spec"]["template"]["spec"]["containers"]
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--device") + 1] == "cuda"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    await eventually(lambda: len(cluster.children()) == 3, what="3 children")
    assert lws(cluster) is None
    assert operator.failures() == []


async def test_a_pipeline_group_is_created_scaled_and_reports_its_ready_groups(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create_isvc("chat", PIPELINE)
    await eventually(lambda: lws(cluster), what="the LeaderWorkerSet")
    live = lws(cluster) or {}
    assert live["metadata"]["ownerReferences"] == [OWNER_REF]
    expected = manifests.runtime_leader_worker_set("chat", NAMESPACE, parse(PIPELINE))
    assert live["spec"] == expected["spec"]
    assert live["spec"]["leaderWorkerTemplate"]["size"] == 2
    # The Service and budget as for a Deployment; no Deployment at all.
    await eventually(lambda: len(cluster.children()) == 2, what="the Service and the budget")
    assert cluster.get(Cluster.DEPLOYMENTS, "chat") is None
    watches = cluster.k[km.action.WATCH, Cluster.LWS]
    assert {w.params.get("labelSelector") for w in watches} == {
        "app.kubernetes.io/managed-by=chunkwise-operator"
    }
    await eventually(lambda: reason(cluster, "Ready") == ("False", "NoReadyReplicas"), what="not ready yet")

    # kubectl scale (or an HPA) on the InferenceService: a replica is a group.
    await cluster.scale_isvc("chat", 3)
    await eventually(lambda: lws_spec(cluster).get("replicas") == 3, what="3 groups")

    # The LWS controller reports its groups ready: the service's status follows.
    await patch_lws_status(cluster, {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3})
    await eventually(lambda: reason(cluster, "Ready") == ("True", "Available"), what="Ready")
    st = (cluster.isvc("chat") or {})["status"]
    assert (st["replicas"], st["readyReplicas"]) == (3, 3)
    assert st["selector"] == manifests.selector_string("chat")
    assert reason(cluster, "Progressing") == ("False", "Complete")
    assert reason(cluster, "Degraded") == ("False", "AsExpected")
    assert operator.failures() == []


async def test_a_pipeline_group_is_drift_corrected_and_turns_back_into_a_deployment(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create_isvc("chat", PIPELINE)
    await eventually(lambda: lws(cluster), what="the LeaderWorkerSet")

    # Edited by hand: put back.
    await cluster.patch(Cluster.LWS, "chat", {"spec": {"replicas": 4, "leaderWorkerTemplate": {"size": 5}}})
    await eventually(
        lambda: (
            lws_spec(cluster).get("replicas") == 1 and lws_spec(cluster)["leaderWorkerTemplate"]["size"] == 2
        ),
        what="the group restored",
    )
    # Deleted by hand: recreated.
    await cluster.delete(Cluster.LWS, "chat")
    await eventually(lambda: lws(cluster), what="the group recreated")
    await eventually(
        lambda: (
            events(cluster, "DriftCorrected")
            == [
                "Recreated LeaderWorkerSet chat: it had been deleted",
                "Restored LeaderWorkerSet chat: it had been edited",
            ]
        ),
        what="one event per correction",
    )

    # A field removed from the spec is removed from both templates (server-side apply, not a merge).
    assert [e["name"] for e in template_env(cluster, "workerTemplate")] == ["A", "B"]
    await cluster.patch_isvc("chat", {"spec": {"pod": {"env": [{"name": "A", "value": "1"}]}}})
    for role in ("leaderTemplate", "workerTemplate"):
        await eventually(
            lambda r=role: template_env(cluster, r) == [{"name": "A", "value": "1"}],
            what=f"B gone from {role}",
        )

    # One stage again: the Deployment comes back and the group goes.
    await cluster.patch_isvc("chat", {"spec": {"engine": {"pipelineParallelSize": 1}}})
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat"), what="the Deployment")
    await eventually(lambda: lws(cluster) is None, what="the group deleted")
    await eventually(lambda: "Deleted LeaderWorkerSet chat" in events(cluster, "Deleted"), what="the event")
    assert operator.count("Deleted LeaderWorkerSet chat: the runtime is now a Deployment") == 1
    assert operator.failures() == []


async def test_without_the_lws_crd_the_service_says_what_to_install_and_creates_the_group_once_served(
    fast_status: None, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    # A cluster without LeaderWorkerSet: discovery of leaderworkerset.x-k8s.io/v1 answers 404.
    del cluster.k.resources[LEADER_WORKER_SETS]
    async with running_operator(cluster, caplog) as operator:
        await cluster.create_isvc("chat", PIPELINE)
        await eventually(lambda: len(cluster.children()) == 2, what="the Service and the budget")
        await eventually(
            lambda: reason(cluster, "Degraded") == ("True", status.LWS_NOT_INSTALLED), what="Degraded"
        )
        message = (condition(cluster, "Degraded") or {})["message"]
        assert message == status.lws_not_installed_message(2)
        assert "leaderworkersets.leaderworkerset.x-k8s.io/v1" in message
        assert "kubernetes-sigs/lws/releases/download/" in message
        assert reason(cluster, "Ready") == ("False", status.LWS_NOT_INSTALLED)
        assert reason(cluster, "Progressing") == ("False", status.LWS_NOT_INSTALLED)
        await eventually(lambda: events(cluster, status.LWS_NOT_INSTALLED) == [message], what="the event")
        # Not retried through Kopf, nothing sent to the missing API, no Deployment in its place.
        await eventually(lambda: operator.count("Handler 'reconcile-create' succeeded") == 1, what="handled")
        assert operator.failures() == []
        assert len(cluster.k[km.action.CREATE, Cluster.LWS]) == 0
        assert cluster.get(Cluster.DEPLOYMENTS, "chat") is None
        # Several status refreshes later: the condition stands, one event still.
        refreshes = len(cluster.k[km.action.FETCH, Cluster.ISVCS])
        await eventually(
            lambda: len(cluster.k[km.action.FETCH, Cluster.ISVCS]) > refreshes + 3, what="more refreshes"
        )
        assert reason(cluster, "Degraded") == ("True", status.LWS_NOT_INSTALLED)
        assert len(events(cluster, status.LWS_NOT_INSTALLED)) == 1

        # LeaderWorkerSet installed: the next status refresh creates the group and clears the condition.
        cluster.k.resources[LEADER_WORKER_SETS] = km.ResourceInfo(
            kind="LeaderWorkerSet",
            namespaced=True,
            verbs={"list", "watch", "get", "create", "patch", "delete"},
            subresources={"status", "scale"},
        )
        await eventually(lambda: lws(cluster), what="the group, once the API is served")
        assert (lws(cluster) or {})["metadata"]["ownerReferences"] == [OWNER_REF]
        await eventually(
            lambda: reason(cluster, "Degraded") == ("False", "AsExpected"), what="Degraded cleared"
        )
        await eventually(
            lambda: reason(cluster, "Ready") == ("False", "NoReadyReplicas"), what="Ready's reason"
        )
        await eventually(
            lambda: "Created LeaderWorkerSet chat" in events(cluster, "Created"), what="the event"
        )
        assert operator.failures() == []


async def test_a_stage_worker_that_cannot_start_reaches_the_status(
    fast_status: None, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker pod (no HTTP, not selected by the Service) that crash-loops holds its group unready: the
    status names it, as it would a leader."""
    async with running_operator(cluster, caplog):
        await cluster.create_isvc("chat", PIPELINE)
        await eventually(lambda: lws(cluster), what="the LeaderWorkerSet")
        worker = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "chat-0-1", "labels": manifests.labels("chat", manifests.RUNTIME_WORKER)},
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "engine",
                        "image": "chunkwise:dev",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 4,
                        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m0s"}},
                        "lastState": {
                            "terminated": {
                                "exitCode": 1,
                                "reason": "Error",
                                "message": "rendezvous timed out",
                            }
                        },
                    }
                ],
            },
        }
        await asyncio.to_thread(cluster.create_pod, worker)
        await eventually(lambda: reason(cluster, "Ready") == ("False", "EngineFailing"), what="Ready")
        message = (condition(cluster, "Ready") or {})["message"]
        assert "chat-0-1" in message and "rendezvous timed out" in message
        assert reason(cluster, "Degraded") == ("True", "EngineFailing")
