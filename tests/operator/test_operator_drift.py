"""Drift on every child kind: the real Kopf operator against kmock, children deleted and edited by hand."""

from __future__ import annotations

import asyncio
from typing import Any

import kmock as km
from operator_harness import TEST_USER_AGENT, Cluster, Operator, eventually

from chunkwise_operator.manifests import LABEL_MANAGED_BY, MANAGER

TINY = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}
ROUTED = {**TINY, "router": {"enabled": True}}


def corrections(cluster: Cluster) -> list[str]:
    return sorted(e["message"] for e in cluster.events() if e.get("reason") == "DriftCorrected")


async def test_every_child_kind_is_watched_through_a_server_side_selector(
    cluster: Cluster, operator: Operator
) -> None:
    for resource in Cluster.CHILD_RESOURCES:
        watches = cluster.k[km.action.WATCH, resource]
        assert watches, resource
        assert {w.params.get("labelSelector") for w in watches} == {f"{LABEL_MANAGED_BY}={MANAGER}"}, resource


async def test_a_deleted_child_of_any_kind_comes_back_with_one_line_and_one_event(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create_isvc("chat", ROUTED)
    await eventually(lambda: len(cluster.children()) == 8, what="8 children")
    deleted = [
        (Cluster.SERVICES, "Service", "chat"),
        (Cluster.PDBS, "PodDisruptionBudget", "chat"),
        (Cluster.SERVICE_ACCOUNTS, "ServiceAccount", "chat-router"),
        (Cluster.ROLE_BINDINGS, "RoleBinding", "chat-router"),
        (Cluster.ROLES, "Role", "chat-router"),
        (Cluster.SERVICES, "Service", "chat-router"),
    ]
    for resource, _kind, name in deleted:
        await cluster.delete(resource, name)
    for resource, _kind, name in deleted:
        await eventually(lambda r=resource, n=name: cluster.get(r, n), what=f"{resource.plural} {name} back")
        child = cluster.get(resource, name)
        assert child is not None
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
    expected = sorted(f"Recreated {kind} {name}: it had been deleted" for _r, kind, name in deleted)
    await eventually(lambda: corrections(cluster) == expected, what="one event per correction")
    for message in expected:
        assert operator.count(message) == 1, message


async def test_an_edited_service_is_restored(cluster: Cluster, operator: Operator) -> None:
    await cluster.create_isvc("chat", ROUTED)
    await eventually(lambda: cluster.get(Cluster.SERVICES, "chat"), what="service")

    await cluster.patch(Cluster.SERVICES, "chat", {"spec": {"ports": [{"name": "http", "port": 9999}]}})
    await eventually(
        lambda: (cluster.get(Cluster.SERVICES, "chat") or {})["spec"]["ports"][0]["port"] == 8000,
        what="port restored",
    )
    await eventually(
        lambda: corrections(cluster) == ["Restored Service chat: it had been edited"],
        what="one correction event",
    )


POD = {
    "nodeSelector": {"pool": "gpu", "zone": "a"},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
    "annotations": {"team": "search"},
    "priorityClassName": "inference",
}


def runtime_pod(cluster: Cluster) -> dict[str, Any]:
    deployment = cluster.get(Cluster.DEPLOYMENTS, "chat") or {}
    return dict((deployment.get("spec") or {}).get("template") or {})


def env_names(pod: dict[str, Any]) -> list[str]:
    (runtime,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return [e["name"] for e in runtime.get("env") or []]


async def test_fields_removed_from_the_spec_leave_the_deployment(
    cluster: Cluster, operator: Operator
) -> None:
    """Issue 31, point 1: server-side apply removes what the operator stops sending (the harness enforces
    the API server's apply semantics; a subset check judged the old fields "unchanged" and wrote nothing)."""
    await cluster.create_isvc("chat", {**TINY, "imagePullPolicy": "Always", "pod": POD})
    await eventually(lambda: runtime_pod(cluster).get("spec", {}).get("nodeSelector"), what="deployment")
    pod = runtime_pod(cluster)
    assert pod["spec"]["priorityClassName"] == "inference"
    assert {"A", "B"} <= set(env_names(pod))
    assert pod["metadata"]["annotations"]["team"] == "search"

    await cluster.patch_isvc(
        "chat",
        {
            "spec": {
                "imagePullPolicy": None,
                "pod": {
                    "nodeSelector": {"zone": None},
                    "tolerations": None,
                    "env": None,
                    "annotations": None,
                    "priorityClassName": None,
                },
            }
        },
    )
    # Only removals: no list the operator sends changes, so a check of the sent fields alone sees nothing.
    await eventually(lambda: not env_names(runtime_pod(cluster)), what="env removed")
    pod = runtime_pod(cluster)
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert "tolerations" not in pod["spec"]
    assert "priorityClassName" not in pod["spec"]
    assert "team" not in (pod["metadata"].get("annotations") or {})
    assert all("imagePullPolicy" not in c for c in pod["spec"]["containers"])


async def test_quantities_in_canonical_form_are_no_drift(cluster: Cluster, operator: Operator) -> None:
    """Issue 31, point 1: the API server stores cpu "0.5" as "500m" and "1.5Gi" as "1536Mi" (so does the
    harness); a status change of the Deployment then is no drift: no write, no DriftCorrected event."""
    await cluster.create_isvc("chat", {**TINY, "resources": {"cpu": "0.5", "memory": "1.5Gi"}})
    await eventually(lambda: runtime_pod(cluster).get("spec"), what="deployment")
    (engine,) = [c for c in runtime_pod(cluster)["spec"]["containers"] if c["name"] == "engine"]
    assert engine["resources"]["requests"]["cpu"] == "500m"
    assert engine["resources"]["limits"]["memory"] == "1536Mi"
    writes = len(cluster.k[km.action.UPDATE, Cluster.DEPLOYMENTS])

    for ready in (1, 0, 1):
        await cluster.patch_deployment("chat", {"status": {"readyReplicas": ready}}, status=True)
        # The refresh after each status change reads it into the CR: the change was handled by then.
        await eventually(
            lambda r=ready: (cluster.isvc("chat") or {}).get("status", {}).get("readyReplicas", 0) == r,
            what=f"readyReplicas {ready} in status",
        )
    operator_writes = [
        r.params
        for r in list(cluster.k[km.action.UPDATE, Cluster.DEPLOYMENTS])[writes:]
        if r.headers.get("User-Agent") != TEST_USER_AGENT
    ]
    assert operator_writes == []
    assert operator.count("Restored Deployment chat") == 0
    await asyncio.sleep(0.5)  # Kopf posts events in batches
    assert corrections(cluster) == []
