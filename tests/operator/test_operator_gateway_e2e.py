"""spec.gateway.inferencePool end to end: the real Kopf operator against kmock, with and without GAIE's CRD.

kmock serves inferencepools (GAIE v1.0.0's inference.networking.k8s.io/v1) unless a test removes it from
its resources, which is what a cluster without GAIE's CRDs looks like to discovery.
"""

from __future__ import annotations

from typing import Any

import kmock as km
import pytest
from e2e.local.kube import INFERENCE_POOLS
from operator_harness import Cluster, Operator, eventually, running_operator

from chunkwise_operator import gateway, manifests
from chunkwise_operator.main import STATUS_INTERVAL_ENV

POOLED = {
    "model": {"preset": "tiny"},
    "image": "chunkwise:dev",
    "router": {"enabled": True},
    "gateway": {"inferencePool": True},
}
OWNER_REF = {
    "apiVersion": "serving.chunkwise.dev/v1alpha1",
    "kind": "InferenceService",
    "name": "chat",
    "uid": "uid-chat",
    "controller": True,
    "blockOwnerDeletion": True,
}


def condition(cluster: Cluster, name: str, ctype: str) -> dict[str, Any] | None:
    for cond in ((cluster.isvc(name) or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return dict(cond)
    return None


def pool_condition(cluster: Cluster) -> tuple[str, str] | None:
    cond = condition(cluster, "chat", gateway.CONDITION)
    return None if cond is None else (cond["status"], cond["reason"])


def router(cluster: Cluster) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """The router's args, its container's ports and its Service's ports."""
    dep = cluster.get(Cluster.DEPLOYMENTS, "chat-router") or {}
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    service = cluster.get(Cluster.SERVICES, "chat-router") or {}
    return container["args"], container["ports"], service["spec"]["ports"]


def events(cluster: Cluster, reason: str) -> list[str]:
    return sorted(e["message"] for e in cluster.events() if e.get("reason") == reason)


@pytest.fixture
def fast_status(monkeypatch: pytest.MonkeyPatch) -> None:
    # The status refresh is where a CRD installed later is noticed.
    monkeypatch.setenv(STATUS_INTERVAL_ENV, "0.2")


async def test_the_pool_follows_the_field_and_the_router_serves_the_epp(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create_isvc("chat", POOLED)
    await eventually(lambda: cluster.pool("chat"), what="the InferencePool")
    pool = cluster.pool("chat") or {}
    assert pool["metadata"]["ownerReferences"] == [OWNER_REF]
    assert pool["spec"] == manifests.inference_pool("chat", "default")["spec"]
    assert (
        pool["spec"]["selector"]["matchLabels"]
        == (cluster.get(Cluster.SERVICES, "chat") or {})["spec"]["selector"]
    )
    await eventually(lambda: len(cluster.children()) == 9, what="the other 9 children")
    args, container_ports, service_ports = router(cluster)
    assert args[-2:] == ["--epp-port", "9002"]
    assert {"name": "grpc-epp", "containerPort": 9002, "protocol": "TCP"} in container_ports
    assert {
        "name": "grpc-epp",
        "port": 9002,
        "targetPort": "grpc-epp",
        "protocol": "TCP",
        "appProtocol": "kubernetes.io/h2c",
    } in service_ports
    await eventually(lambda: pool_condition(cluster) == ("True", "Applied"), what="InferencePoolReady")
    assert (condition(cluster, "chat", gateway.CONDITION) or {})["message"] == (
        "InferencePool chat selects the runtime pods on port 8000; its endpoint picker is Service "
        "chat-router port 9002"
    )
    watches = cluster.k[km.action.WATCH, Cluster.POOLS]
    assert {w.params.get("labelSelector") for w in watches} == {
        "app.kubernetes.io/managed-by=chunkwise-operator"
    }

    await cluster.patch_isvc("chat", {"spec": {"gateway": {"inferencePool": False}}})
    await eventually(lambda: cluster.pool("chat") is None, what="the pool deleted")
    await eventually(lambda: "--epp-port" not in router(cluster)[0], what="the router without --epp-port")
    args, container_ports, service_ports = router(cluster)
    assert [p["name"] for p in container_ports] == ["http"]
    assert [p["name"] for p in service_ports] == ["http"]
    await eventually(lambda: pool_condition(cluster) is None, what="the condition gone")
    # Kopf posts events from a queue: they may land after the status.
    await eventually(lambda: events(cluster, "Deleted") == ["Deleted InferencePool chat"], what="the event")
    assert operator.count("Deleted InferencePool chat: spec.gateway.inferencePool is off") == 1
    assert len(cluster.children()) == 9
    assert operator.failures() == []


async def test_a_deleted_or_edited_pool_is_put_back(cluster: Cluster, operator: Operator) -> None:
    await cluster.create_isvc("chat", POOLED)
    await eventually(lambda: cluster.pool("chat"), what="the InferencePool")
    await cluster.delete(Cluster.POOLS, "chat")
    await eventually(lambda: cluster.pool("chat"), what="the pool back")
    assert (cluster.pool("chat") or {})["metadata"]["ownerReferences"] == [OWNER_REF]
    await cluster.patch(Cluster.POOLS, "chat", {"spec": {"targetPorts": [{"number": 9999}]}})
    await eventually(
        lambda: (cluster.pool("chat") or {}).get("spec", {}).get("targetPorts") == [{"number": 8000}],
        what="the port restored",
    )
    await eventually(
        lambda: (
            events(cluster, "DriftCorrected")
            == [
                "Recreated InferencePool chat: it had been deleted",
                "Restored InferencePool chat: it had been edited",
            ]
        ),
        what="one event per correction",
    )


async def test_without_the_crd_the_rest_is_created_and_the_pool_waits_for_it(
    fast_status: None, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    # A cluster without GAIE: discovery of inference.networking.k8s.io/v1 answers 404.
    del cluster.k.resources[INFERENCE_POOLS]
    async with running_operator(cluster, caplog) as operator:
        await cluster.create_isvc("chat", POOLED)
        await eventually(lambda: len(cluster.children()) == 9, what="the other 9 children")
        await eventually(
            lambda: pool_condition(cluster) == ("False", "CRDNotInstalled"), what="the condition"
        )
        message = (condition(cluster, "chat", gateway.CONDITION) or {})["message"]
        assert "inferencepools.inference.networking.k8s.io/v1" in message
        assert "releases/download/v1.0.0/manifests.yaml" in message
        await eventually(lambda: events(cluster, "CRDNotInstalled") == [message], what="the Warning event")
        assert "--epp-port" in router(cluster)[0]  # the router is ready for the pool, whenever it comes
        assert (condition(cluster, "chat", "Degraded") or {})["status"] == "False"
        # Not retried through Kopf, and nothing was written to the missing API.
        await eventually(lambda: operator.count("Handler 'reconcile-create' succeeded") == 1, what="handled")
        assert operator.failures() == []
        assert len(cluster.k[km.action.CREATE, Cluster.POOLS]) == 0
        # Several status refreshes later: still one event, not one per refresh.
        refreshes = len(cluster.k[km.action.FETCH, Cluster.ISVCS])
        await eventually(
            lambda: len(cluster.k[km.action.FETCH, Cluster.ISVCS]) > refreshes + 3, what="more refreshes"
        )
        assert len(events(cluster, "CRDNotInstalled")) == 1

        # GAIE's CRDs installed: the next status refresh creates the pool.
        cluster.k.resources[INFERENCE_POOLS] = km.ResourceInfo(
            kind="InferencePool", namespaced=True, verbs={"list", "watch", "get", "create", "patch", "delete"}
        )
        await eventually(lambda: cluster.pool("chat"), what="the pool, once the CRD is served")
        assert (cluster.pool("chat") or {})["spec"] == manifests.inference_pool("chat", "default")["spec"]
        await eventually(lambda: pool_condition(cluster) == ("True", "Applied"), what="InferencePoolReady")
        await eventually(lambda: "Created InferencePool chat" in events(cluster, "Created"), what="the event")
        assert operator.failures() == []
