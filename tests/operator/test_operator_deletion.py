"""Deletion: no finalizer on an InferenceService, so deleting one never waits for the operator.

kmock honours finalizers as an API server does (a DELETE only marks an object that has one), so these tests
see the hang a finalizer would cause when the operator is gone.
"""

from __future__ import annotations

import asyncio

import pytest
from operator_harness import Cluster, Operator, eventually, running_operator

from chunkwise_operator.main import AUTOSCALER_INTERVAL_ENV, STATUS_INTERVAL_ENV

# Both daemons (status refresh, autoscaler) run for this one: the handlers that made Kopf add a finalizer.
AUTOSCALED = {
    "model": {"preset": "tiny"},
    "image": "chunkwise:dev",
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2},
}
KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


@pytest.fixture
def fast_daemons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATUS_INTERVAL_ENV, "0.2")
    monkeypatch.setenv(AUTOSCALER_INTERVAL_ENV, "0.2")


def daemons_started(operator: Operator) -> bool:
    return all(operator.count(f"Daemon '{d}' is invoked") for d in ("status-refresh", "autoscaler"))


async def test_deleting_with_the_operator_gone_completes(
    fast_daemons: None, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_operator(cluster, caplog) as operator:
        await cluster.create_isvc("chat", AUTOSCALED)
        await eventually(lambda: daemons_started(operator), what="both daemons running")
        await eventually(lambda: (cluster.isvc("chat") or {}).get("status"), what="status written")
        await asyncio.sleep(0.5)  # several daemon rounds, and Kopf's own patches of the object
        assert (cluster.isvc("chat") or {})["metadata"].get("finalizers") in (None, [])

    await cluster.delete(Cluster.ISVCS, "chat")
    assert cluster.isvc("chat") is None, "the delete waits on a finalizer nobody will remove"


async def test_the_daemons_end_with_their_object(
    fast_daemons: None, cluster: Cluster, operator: Operator
) -> None:
    await cluster.create_isvc("chat", AUTOSCALED)
    await eventually(lambda: daemons_started(operator), what="both daemons running")
    await cluster.delete(Cluster.ISVCS, "chat")
    assert cluster.isvc("chat") is None
    for daemon in ("status-refresh", "autoscaler"):
        await eventually(lambda d=daemon: operator.count(f"Daemon '{d}' succeeded"), what=f"{daemon} ended")
    assert operator.failures() == []


async def test_a_finalizer_left_by_an_older_operator_is_released(
    fast_daemons: None, cluster: Cluster, operator: Operator
) -> None:
    await cluster.create_isvc("chat", AUTOSCALED, finalizers=[KOPF_FINALIZER])
    await eventually(
        lambda: (cluster.isvc("chat") or {})["metadata"].get("finalizers") in (None, []), what="released"
    )
    await cluster.delete(Cluster.ISVCS, "chat")
    assert cluster.isvc("chat") is None
