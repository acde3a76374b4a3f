"""Drift on every child kind: the real Kopf operator against kmock, children deleted and edited by hand."""

from __future__ import annotations

import kmock as km
from operator_harness import Cluster, Operator, eventually

from chunkwise_operator.manifests import LABEL_MANAGED_BY, MANAGER

ROUTED = {"model": {"preset": "tiny"}, "image": "chunkwise:dev", "router": {"enabled": True}}


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
