"""Each router's rights name its own InferenceService (issue 31, point 9): the real Kopf operator on kmock."""

from __future__ import annotations

import kmock as km
from operator_harness import TEST_USER_AGENT, Cluster, Operator, eventually

from chunkwise_operator.manifests import LEGACY_ROUTER_CLUSTER_ROLE

ROUTED = {"model": {"preset": "tiny"}, "image": "chunkwise:dev", "router": {"enabled": True}}
LEGACY_REF = {
    "apiGroup": "rbac.authorization.k8s.io",
    "kind": "ClusterRole",
    "name": LEGACY_ROUTER_CLUSTER_ROLE,
}
OWN_REF = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "chat-router"}


async def test_two_routers_can_each_scale_only_their_own_service(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create_isvc("chat", ROUTED)
    await cluster.create_isvc("code", ROUTED)
    for name in ("chat", "code"):
        await eventually(
            lambda n=name: cluster.get(Cluster.ROLE_BINDINGS, f"{n}-router"), what=f"{name} binding"
        )
        role = cluster.get(Cluster.ROLES, f"{name}-router")
        assert role is not None
        (scale,) = [r for r in role["rules"] if "inferenceservices/scale" in r["resources"]]
        assert scale["resourceNames"] == [name]
        binding = cluster.get(Cluster.ROLE_BINDINGS, f"{name}-router")
        assert binding is not None
        assert binding["roleRef"] == {**OWN_REF, "name": f"{name}-router"}
        assert binding["subjects"][0]["name"] == f"{name}-router"


async def test_a_binding_left_by_an_older_operator_is_replaced(cluster: Cluster, operator: Operator) -> None:
    """roleRef cannot be patched on a real API server (kmock would let it): the operator deletes and recreates."""
    await cluster.create_isvc("chat", ROUTED)
    await eventually(lambda: cluster.get(Cluster.ROLE_BINDINGS, "chat-router"), what="the binding")
    # What the previous release built: a binding to the shared ClusterRole.
    await cluster.patch(Cluster.ROLE_BINDINGS, "chat-router", {"roleRef": LEGACY_REF})
    await eventually(
        lambda: (cluster.get(Cluster.ROLE_BINDINGS, "chat-router") or {}).get("roleRef") == OWN_REF,
        what="the binding to the router's own Role",
    )
    deletes = [
        r
        for r in cluster.k[km.action.DELETE, Cluster.ROLE_BINDINGS]
        if r.headers.get("User-Agent") != TEST_USER_AGENT
    ]
    assert [r.name for r in deletes] == ["chat-router"]
