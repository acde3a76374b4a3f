"""Why runtime pods do not start, as the running operator reports it: pods and Deployment status on kmock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_harness import Cluster, Operator, eventually

from chunkwise_operator import manifests
from chunkwise_operator.main import STATUS_INTERVAL_ENV

SCHEDULER = (
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: "
    "3 No preemption victims found for incoming pod."
)
TINY = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}
QUOTA = (
    'pods "chat-6c9d8f7b5-hq2lt" is forbidden: exceeded quota: gpu-quota, requested: '
    "requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=4"
)


def condition(cluster: Cluster, name: str, ctype: str) -> dict[str, Any] | None:
    for cond in ((cluster.isvc(name) or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return dict(cond)
    return None


@pytest.fixture
def fast_status(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by the operator's start-up handler: the fixture must come before `operator` in a test's arguments.
    monkeypatch.setenv(STATUS_INTERVAL_ENV, "0.2")


async def test_an_unschedulable_pod_then_a_refused_one_reach_the_status(
    fast_status: None, cluster: Cluster, operator: Operator
) -> None:
    """The status timer reads the pods; the Deployment watch reads the controller's ReplicaFailure."""
    await cluster.create_isvc("chat", TINY)
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat"), what="runtime Deployment")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "chat-6c9d8f7b5-x2x7q", "labels": manifests.labels("chat", "runtime")},
        "status": {
            "phase": "Pending",
            "qosClass": "Burstable",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "lastProbeTime": None,
                    "lastTransitionTime": "2030-01-01T00:00:00Z",
                    "reason": "Unschedulable",
                    "message": SCHEDULER,
                }
            ],
        },
    }
    await asyncio.to_thread(cluster.create_pod, pod)
    pending = f"pod chat-6c9d8f7b5-x2x7q cannot be scheduled: {SCHEDULER}"
    ready = await eventually(
        lambda: (c := condition(cluster, "chat", "Ready")) and c["reason"] == "Unschedulable" and c,
        what="Ready Unschedulable",
    )
    assert (ready["status"], ready["message"]) == ("False", pending)
    degraded = condition(cluster, "chat", "Degraded")
    assert degraded is not None and (degraded["status"], degraded["message"]) == ("True", pending)

    # The next ReplicaSet's pods are refused by a quota: the Deployment controller says so in a condition.
    generation = (cluster.get(Cluster.DEPLOYMENTS, "chat") or {})["metadata"]["generation"]
    failed = {
        "type": "ReplicaFailure",
        "status": "True",
        "lastUpdateTime": "2030-01-01T00:00:00Z",
        "lastTransitionTime": "2030-01-01T00:00:00Z",
        "reason": "FailedCreate",
        "message": QUOTA,
    }
    await cluster.patch_deployment(
        "chat",
        {"status": {"observedGeneration": generation, "replicas": 1, "conditions": [failed]}},
        status=True,
    )
    degraded = await eventually(
        lambda: (c := condition(cluster, "chat", "Degraded")) and c["reason"] == "FailedCreate" and c,
        what="Degraded FailedCreate",
    )
    assert (degraded["status"], degraded["message"]) == ("True", f"Deployment chat: {QUOTA}")
    ready = condition(cluster, "chat", "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "FailedCreate")
