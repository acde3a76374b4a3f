"""RBAC against what the operator really sends: every request of a running operator (Kopf's own included)
recorded by kmock over a scenario that reaches every code path, then held against the rules in manifests/,
both ways: each request allowed, and each granted verb used (least privilege)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock as km
import pytest
import yaml
from operator_harness import NAMESPACE, ROOT, TEST_USER_AGENT, Cluster, eventually, running_operator

from chunkwise_operator import manifests
from chunkwise_operator.main import (
    AUTOSCALER_INTERVAL_ENV,
    PEERING_NAME,
    POD_NAMESPACE_ENV,
    STATUS_INTERVAL_ENV,
)

SPEC = {
    "model": {"preset": "tiny"},
    "image": "chunkwise:dev",
    "router": {"enabled": True},
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2},
    "gateway": {"inferencePool": True},
}
VERBS = {
    km.action.LIST: "list",
    km.action.WATCH: "watch",
    km.action.FETCH: "get",
    km.action.CREATE: "create",
    km.action.DELETE: "delete",
}


@dataclass(frozen=True)
class Call:
    group: str
    resource: str  # plural, or plural/subresource
    verb: str
    namespace: str | None


def operator_calls(cluster: Cluster) -> set[Call]:
    calls = set()
    for request in cluster.k:
        if request.resource is None or request.headers.get("User-Agent") == TEST_USER_AGENT:
            continue
        if request.action == km.action.UPDATE:
            verb = "patch" if str(request.method).upper().endswith("PATCH") else "update"
        else:
            verb = VERBS[request.action]
        if request.resource.plural is None:
            continue  # discovery (/api/v1, /apis/GROUP/VERSION): open to every authenticated client
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        calls.add(Call(request.resource.group, resource, verb, request.namespace))
    return calls


def rules(path: Path, kind: str) -> list[Mapping[str, Any]]:
    (role,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind]
    return list(role["rules"])


def allows(rule: Mapping[str, Any], call: Call) -> bool:
    return (
        call.group in rule["apiGroups"]
        and call.resource in rule["resources"]
        and call.verb in rule["verbs"]
        and not rule.get("resourceNames")
    )


def granted(rule_list: Iterable[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rule_list
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


async def exercise(cluster: Cluster) -> None:
    """Create (router, autoscaler, InferencePool), correct a deleted child, remove the router's children and
    the pool, then turn the runtime into a LeaderWorkerSet (pipeline stages), correct it and turn it back."""
    await cluster.create_isvc("chat", SPEC)
    await eventually(lambda: len(cluster.children()) == 8, what="8 children")
    await eventually(lambda: cluster.pool("chat"), what="the InferencePool")
    await eventually(
        lambda: (
            ((cluster.isvc("chat") or {}).get("status") or {}).get("autoscaler", {}).get("reason")
            == "NoMetrics"
        ),
        what="an autoscaler evaluation",
    )
    await cluster.delete(Cluster.SERVICES, "chat")
    await eventually(lambda: cluster.get(Cluster.SERVICES, "chat"), what="service back")
    await cluster.patch_isvc(
        "chat", {"spec": {"router": {"enabled": False}, "gateway": {"inferencePool": False}}}
    )
    await eventually(lambda: len(cluster.children()) == 3, what="router children removed")
    await eventually(lambda: cluster.pool("chat") is None, what="the InferencePool removed")
    # Pipeline stages: the runtime becomes a LeaderWorkerSet (created, corrected, deleted going back).
    await cluster.patch_isvc("chat", {"spec": {"engine": {"pipelineParallelSize": 2}}})
    await eventually(lambda: cluster.get(Cluster.LWS, "chat"), what="the LeaderWorkerSet")
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat") is None, what="the Deployment removed")
    await cluster.patch(Cluster.LWS, "chat", {"spec": {"leaderWorkerTemplate": {"size": 5}}})
    await eventually(
        lambda: (cluster.get(Cluster.LWS, "chat") or {})["spec"]["leaderWorkerTemplate"]["size"] == 2,
        what="the LeaderWorkerSet restored",
    )
    await cluster.patch_isvc("chat", {"spec": {"engine": {"pipelineParallelSize": 1}}})
    await eventually(lambda: cluster.get(Cluster.LWS, "chat") is None, what="the LeaderWorkerSet removed")
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat"), what="the Deployment back")


def check(calls: set[Call], rule_list: list[Mapping[str, Any]], cluster: Cluster) -> None:
    refused = sorted(str(c) for c in calls if not any(allows(r, c) for r in rule_list))
    assert refused == [], f"requests the RBAC rules refuse: {refused}"
    used = {(c.group, c.resource, c.verb) for c in calls}
    # What the operator puts in the Roles it creates is used too, though never sent: Kubernetes refuses to
    # create a Role granting more than its creator holds (RBAC's escalation check, unless it holds the
    # `escalate` verb, which this operator does not).
    for request in cluster.k[km.action.CREATE, Cluster.ROLES]:
        used |= granted((request.data or {}).get("rules") or [])
    unused = sorted(granted(rule_list) - used)
    assert unused == [], f"granted but never used: {unused}"


@pytest.fixture
def fast_daemons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATUS_INTERVAL_ENV, "0.2")
    monkeypatch.setenv(AUTOSCALER_INTERVAL_ENV, "0.2")


async def test_the_cluster_role_is_exactly_what_the_operator_sends(
    fast_daemons: None, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_operator(cluster, caplog, peering_name=PEERING_NAME):
        await exercise(cluster)
    check(operator_calls(cluster), rules(ROOT / "manifests" / "rbac.yaml", "ClusterRole"), cluster)


async def test_the_namespaced_role_is_exactly_what_a_namespaced_operator_sends(
    fast_daemons: None, cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(POD_NAMESPACE_ENV, NAMESPACE)
    options = {"peering_name": PEERING_NAME, "clusterwide": False, "namespaces": [NAMESPACE]}
    async with running_operator(cluster, caplog, **options):
        await exercise(cluster)
    calls = operator_calls(cluster)
    # A Role grants nothing outside its namespace.
    assert sorted(str(c) for c in calls if c.namespace != NAMESPACE) == []
    check(calls, rules(ROOT / "manifests" / "namespaced" / "rbac.yaml", "Role"), cluster)


def test_the_operator_holds_every_permission_it_grants_a_router() -> None:
    """RBAC's escalation check, stated on the files: each rule of a router's Role is within the operator's."""
    role = manifests.router_role("chat", NAMESPACE)
    for path, kind in (
        (ROOT / "manifests" / "rbac.yaml", "ClusterRole"),
        (ROOT / "manifests" / "namespaced" / "rbac.yaml", "Role"),
    ):
        held = granted(rules(path, kind))
        assert granted(role["rules"]) <= held, path
        # ...and it may create the Role and its binding.
        for resource in ("roles", "rolebindings"):
            assert ("rbac.authorization.k8s.io", resource, "create") in held
        # No shortcut around the check: neither `escalate` nor `bind` on roles.
        assert not any(verb in ("escalate", "bind") for _g, r, verb in held if r in ("roles", "clusterroles"))
