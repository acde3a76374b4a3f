"""The autoscaler in the real Kopf operator against kmock, with pods whose /metrics a test controls.

Each "pod" is a Pod object in the emulator (ready, with podIP 127.0.0.1 and its Prometheus port annotation)
backed by a small HTTP server on that port serving the metrics text the test sets.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable, Iterator
from typing import Any

import kmock as km
import kubernetes
import pytest
from operator_harness import MERGE, NAMESPACE, VERBS, Cluster, HttpStub, eventually, running_operator

from chunkwise_operator import manifests
from chunkwise_operator.main import AUTOSCALER_INTERVAL_ENV
from chunkwise_operator.spec import DEFAULT_STARTUP_TIMEOUT_SECONDS, GROUP, PLURAL, VERSION

PODS = km.resource("v1/pods")
# The startup probe's budget (a CPU service's default): a pod not ready for longer has failed to start,
# not yet to start.
STARTUP_BUDGET_S = DEFAULT_STARTUP_TIMEOUT_SECONDS


class MetricsServer(HttpStub):
    """A replica's /metrics: vllm:num_requests_waiting as the test sets it, and nothing else."""

    def __init__(self) -> None:
        self.waiting = 0.0
        self.scrapes = 0
        # Runs inside a scrape, before it answers: something the operator meets between its read and its write.
        self.during_scrape: Callable[[], None] | None = None
        super().__init__(self._metrics)

    def _metrics(self, path: str) -> tuple[int, str, bytes]:
        self.scrapes += 1
        if self.during_scrape is not None:
            hook, self.during_scrape = self.during_scrape, None
            hook()
        body = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="tiny"}} {self.waiting}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="tiny"} 0.0\n'
        ).encode()
        return 200, "text/plain; version=0.0.4", body


@pytest.fixture
def fast_autoscaler(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by the operator's start-up handler: the fixture must come before `operator` in a test's arguments.
    monkeypatch.setenv(AUTOSCALER_INTERVAL_ENV, "0.2")


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[list[MetricsServer]]:
    cluster.k.resources["v1/pods"] = km.ResourceInfo(kind="Pod", namespaced=True, verbs=VERBS)
    servers: list[MetricsServer] = []
    yield servers
    for s in servers:
        s.close()


async def create_pod(cluster: Cluster, body: dict[str, Any]) -> None:
    """A pod as the kubelet would report it (kmock has no kubelet: the test writes its status)."""

    def create() -> None:
        with kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url)) as c:
            kubernetes.client.CoreV1Api(c).create_namespaced_pod(NAMESPACE, body)

    await asyncio.to_thread(create)


async def add_pod(
    cluster: Cluster, servers: list[MetricsServer], owner: str, waiting: float
) -> MetricsServer:
    server = MetricsServer()
    server.waiting = waiting
    servers.append(server)
    name = f"{owner}-pod-{len(servers)}"
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": manifests.labels(owner, manifests.RUNTIME),
            "annotations": {"prometheus.io/port": str(server.port), "prometheus.io/path": "/metrics"},
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }

    await create_pod(cluster, body)
    return server


def autoscaler_status(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict(((cluster.isvc(name) or {}).get("status") or {}).get("autoscaler") or {})


def replicas(cluster: Cluster, name: str) -> int | None:
    return ((cluster.isvc(name) or {}).get("spec") or {}).get("replicas")


def spec(**autoscaling: Any) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny"},
        "image": "chunkwise:dev",
        "replicas": 1,
        "autoscaling": {
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 4,
            "targets": {"queueDepthPerReplica": 2},
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 1,
            **autoscaling,
        },
    }


async def test_queue_depth_scales_up_then_down(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    await cluster.create_isvc("chat", spec())
    first = await add_pod(cluster, pods, "chat", waiting=5.0)
    # 5 waiting on 1 replica against a target of 2: ceil(1 x 5/2) = 3.
    await eventually(lambda: replicas(cluster, "chat") == 3, what="scale up to 3")
    await eventually(
        lambda: (cluster.get(Cluster.DEPLOYMENTS, "chat") or {}).get("spec", {}).get("replicas") == 3,
        what="the Deployment follows spec.replicas",
    )
    await eventually(lambda: autoscaler_status(cluster, "chat").get("desiredReplicas") == 3, what="status")
    status = autoscaler_status(cluster, "chat")
    assert status["reason"] == "ScaledUp" and status["desiredReplicas"] == 3
    assert status["scaleEvents"][-1]["from"] == 1 and status["scaleEvents"][-1]["to"] == 3
    # Kopf posts events from a queue of its own: the status can land before the event does.
    events = await eventually(
        lambda: [e for e in cluster.events() if e["reason"] == "ScaledUp"], what="ScaledUp event"
    )
    assert events[0]["message"].startswith("1 -> 3 replicas: queueDepthPerReplica asks for 3")

    # Two of the three replicas not ready yet: an idle queue must not scale down meanwhile.
    first.waiting = 0.0
    await eventually(lambda: autoscaler_status(cluster, "chat").get("reason") == "ScaleDownHeld", what="held")
    assert replicas(cluster, "chat") == 3

    await add_pod(cluster, pods, "chat", waiting=0.0)
    await add_pod(cluster, pods, "chat", waiting=0.0)
    await eventually(lambda: replicas(cluster, "chat") == 1, what="scale down to 1", timeout=15)
    # spec.replicas is written before status (two subresources): wait for the status to follow.
    await eventually(lambda: autoscaler_status(cluster, "chat").get("desiredReplicas") == 1, what="status")
    status = autoscaler_status(cluster, "chat")
    assert status["reason"] in ("ScaledDown", "AtMinReplicas")
    assert status["metrics"]["queueDepthPerReplica"] == 0.0
    assert operator.failures() == []


async def test_delegated_scaling_only_reports(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    await cluster.create_isvc("chat", spec(delegated=True))
    await add_pod(cluster, pods, "chat", waiting=8.0)
    await eventually(
        lambda: autoscaler_status(cluster, "chat").get("recommendedReplicas") == 4, what="report"
    )
    status = autoscaler_status(cluster, "chat")
    assert (status["reason"], status["desiredReplicas"]) == ("Delegated", 1)
    assert status["metrics"]["queueDepthPerReplica"] == 8.0
    await asyncio.sleep(0.5)  # several more evaluations
    assert replicas(cluster, "chat") == 1
    assert not [e for e in cluster.events() if e["reason"] == "ScaledUp"]


async def test_a_restarted_operator_resumes_the_stabilization_window(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    name = "chat"
    async with running_operator(cluster, caplog):
        await cluster.create_isvc(name, spec(scaleDownStabilizationSeconds=3600))
        loaded = await add_pod(cluster, pods, name, waiting=5.0)
        await eventually(lambda: replicas(cluster, name) == 3, what="scale up to 3")
    before = autoscaler_status(cluster, name)["recommendations"]

    loaded.waiting = 0.0
    await add_pod(cluster, pods, name, waiting=0.0)
    await add_pod(cluster, pods, name, waiting=0.0)
    async with running_operator(cluster, caplog):
        # The hour-long window began before the restart: the stored recommendation of 3 still holds.
        await eventually(
            lambda: autoscaler_status(cluster, name).get("reason") == "ScaleDownStabilized", what="stabilized"
        )
        await asyncio.sleep(0.5)
        assert replicas(cluster, name) == 3
        after = autoscaler_status(cluster, name)["recommendations"]
        assert after[: len(before)] == before
        assert after[-1]["replicas"] == 1


async def test_no_autoscaler_without_autoscaling(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    await cluster.create_isvc("plain", {**spec(), "autoscaling": {"enabled": False}})
    await add_pod(cluster, pods, "plain", waiting=50.0)
    await eventually(lambda: autoscaler_status(cluster, "plain").get("reason") == "Disabled", what="status")
    await asyncio.sleep(0.5)
    assert replicas(cluster, "plain") == 1
    # No daemon, so no scraping at all (the status refresh lists pods but never asks them for metrics).
    assert [p.scrapes for p in pods] == [0]


def kubectl_scale(cluster: Cluster, name: str, replicas: int) -> None:
    with kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url)) as c:
        kubernetes.client.CustomObjectsApi(c).patch_namespaced_custom_object_scale(
            GROUP, VERSION, NAMESPACE, PLURAL, name, {"spec": {"replicas": replicas}}, _content_type=MERGE
        )


async def test_a_manual_scale_during_an_evaluation_is_not_overwritten(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    await cluster.create_isvc("chat", spec(scaleDownStabilizationSeconds=3600))
    await eventually(lambda: autoscaler_status(cluster, "chat").get("reason"), what="first status")
    # 4 waiting on 1 replica against a target of 2 asks for 2; at 4 replicas (1 ready) a scale down is held.
    pod = await add_pod(cluster, pods, "chat", waiting=4.0)
    pod.during_scrape = lambda: kubectl_scale(cluster, "chat", 4)
    await eventually(lambda: pod.scrapes >= 3, what="two evaluations after the manual scale")
    assert replicas(cluster, "chat") == 4
    assert operator.count("went from 1 to 4 during the evaluation; not overwriting it with 2") == 1
    await eventually(lambda: autoscaler_status(cluster, "chat").get("reason") == "ScaleDownHeld", what="held")
    assert not [e for e in cluster.events() if e["reason"] == "ScaledUp"]
    assert operator.failures() == []


def scaler(kind: str, name: str, target: str) -> dict[str, Any]:
    api_version = "autoscaling/v2" if kind == "HorizontalPodAutoscaler" else "keda.sh/v1alpha1"
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "name": target}
        },
    }


def condition(cluster: Cluster, name: str, ctype: str) -> tuple[str, str, str] | None:
    for c in ((cluster.isvc(name) or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c["status"], c["reason"], c.get("message", "")
    return None


async def test_an_hpa_on_a_non_delegated_service_makes_the_builtin_autoscaler_stand_down(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    hpas = km.resource("autoscaling/v2/horizontalpodautoscalers")
    scaled_objects = km.resource("keda.sh/v1alpha1/scaledobjects")
    cluster.k.objects[hpas, NAMESPACE, "chat"] = scaler("HorizontalPodAutoscaler", "chat", "chat")
    cluster.k.objects[scaled_objects, NAMESPACE, "chat-keda"] = scaler("ScaledObject", "chat-keda", "chat")
    # Aimed elsewhere: not a conflict.
    cluster.k.objects[hpas, NAMESPACE, "other"] = scaler("HorizontalPodAutoscaler", "other", "other")
    await cluster.create_isvc("chat", spec())
    await add_pod(cluster, pods, "chat", waiting=5.0)  # asks for 3

    await eventually(
        lambda: (condition(cluster, "chat", "ScalerConflict") or ("",))[0] == "True", what="conflict"
    )
    _, reason, message = condition(cluster, "chat", "ScalerConflict") or ("", "", "")
    assert reason == "ExternalScaler"
    assert message.startswith("HorizontalPodAutoscaler chat, ScaledObject chat-keda also scales")
    assert autoscaler_status(cluster, "chat")["reason"] == "ScalerConflict"
    await asyncio.sleep(0.5)  # several evaluations
    assert replicas(cluster, "chat") == 1

    await cluster.delete(hpas, "chat")
    await cluster.delete(scaled_objects, "chat-keda")
    await eventually(lambda: replicas(cluster, "chat") == 3, what="the built-in autoscaler resumes")
    await eventually(
        lambda: (condition(cluster, "chat", "ScalerConflict") or ("",))[0] == "False", what="conflict cleared"
    )
    assert operator.failures() == []


async def test_unreachable_metrics_are_a_condition_that_says_why(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    await cluster.create_isvc("chat", spec())
    blocked = await add_pod(cluster, pods, "chat", waiting=5.0)
    blocked.close()  # ready, but nothing answers on its port: what a default-deny NetworkPolicy looks like
    await eventually(
        lambda: (condition(cluster, "chat", "MetricsAvailable") or ("",))[:2] == ("False", "NoMetrics"),
        what="NoMetrics",
    )
    _, _, message = condition(cluster, "chat", "MetricsAvailable") or ("", "", "")
    assert message.startswith("1 ready pod(s) did not answer /metrics (chat-pod-1: ConnectError")
    assert "NetworkPolicy" in message
    assert replicas(cluster, "chat") == 1

    await add_pod(cluster, pods, "chat", waiting=5.0)
    await eventually(
        lambda: (condition(cluster, "chat", "MetricsAvailable") or ("",))[:2] == ("True", "MetricsReported"),
        what="metrics again",
    )
    assert operator.failures() == []


async def test_an_idle_fleet_goes_to_zero_after_scale_to_zero_after_seconds(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    from_zero = {**spec(minReplicas=0, scaleToZeroAfterSeconds=1), "router": {"enabled": True}}
    await cluster.create_isvc("chat", from_zero)
    pod = await add_pod(cluster, pods, "chat", waiting=1.0)  # busy: within target, never idle
    await eventually(lambda: autoscaler_status(cluster, "chat").get("lastActiveTime"), what="activity seen")
    await asyncio.sleep(1.5)
    assert replicas(cluster, "chat") == 1
    pod.waiting = 0.0
    await eventually(lambda: replicas(cluster, "chat") == 0, what="scaled to zero")
    # spec.replicas is written before status (two subresources): wait for the status to follow.
    await eventually(
        lambda: autoscaler_status(cluster, "chat").get("reason") == "ScaledToZero", what="status"
    )
    # Kopf posts events from a queue of its own: the status can land before the event does.
    events = await eventually(
        lambda: [e["message"] for e in cluster.events() if e["reason"] == "ScaledToZero"],
        what="ScaledToZero event",
    )
    assert events[0].startswith("1 -> 0 replicas: no request for ")
    router = cluster.get(Cluster.DEPLOYMENTS, "chat-router") or {}
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--wake-inference-service", "chat"]
    assert operator.failures() == []


async def add_unready_pod(cluster: Cluster, owner: str, name: str, since: float) -> None:
    """A runtime pod that is not ready, and has not been since `since` (Pending: no node for its GPU)."""
    stamp = datetime.datetime.fromtimestamp(since, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": manifests.labels(owner, manifests.RUNTIME),
        },
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"},
                {"type": "Ready", "status": "False", "lastTransitionTime": stamp},
            ],
        },
    }

    await create_pod(cluster, body)


async def test_replicas_unready_past_the_startup_budget_do_not_hold_a_scale_down(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    # Issue 31: 1 of 3 ready and idle; the other two Pending. Just Pending: held, they may yet take load.
    await cluster.create_isvc("chat", {**spec(), "replicas": 3})
    await add_pod(cluster, pods, "chat", waiting=0.0)
    await add_unready_pod(cluster, "chat", "chat-young-1", time.time())
    await add_unready_pod(cluster, "chat", "chat-young-2", time.time())
    await eventually(lambda: autoscaler_status(cluster, "chat").get("reason") == "ScaleDownHeld", what="held")
    await asyncio.sleep(0.5)  # several more evaluations
    assert replicas(cluster, "chat") == 3

    # Pending for longer than the startup probe allows: the ready replica's load decides, as HPA's would.
    await cluster.create_isvc("stuck", {**spec(), "replicas": 3})
    await add_pod(cluster, pods, "stuck", waiting=0.0)
    long_ago = time.time() - STARTUP_BUDGET_S - 60
    await add_unready_pod(cluster, "stuck", "stuck-old-1", long_ago)
    await add_unready_pod(cluster, "stuck", "stuck-old-2", long_ago)
    await eventually(lambda: replicas(cluster, "stuck") == 1, what="scale down to 1", timeout=15)
    assert operator.failures() == []


async def test_replicas_a_quota_refuses_do_not_hold_a_scale_down(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    # Issue 31, point 3: 3 replicas, 1 ready and idle, and no pod for the other two because a quota refuses
    # them (the Deployment says ReplicaFailure). They were held as "starting" forever; now the count goes down.
    await cluster.create_isvc("chat", {**spec(), "replicas": 3})
    await add_pod(cluster, pods, "chat", waiting=0.0)
    await eventually(lambda: autoscaler_status(cluster, "chat").get("reason") == "ScaleDownHeld", what="held")
    failed = {
        "type": "ReplicaFailure",
        "status": "True",
        "lastUpdateTime": "2030-01-01T00:00:00Z",
        "lastTransitionTime": "2030-01-01T00:00:00Z",
        "reason": "FailedCreate",
        "message": 'pods "chat-6c9d8f7b5-" is forbidden: exceeded quota: gpu, requested: requests.nvidia.com/gpu=1',
    }
    generation = (cluster.get(Cluster.DEPLOYMENTS, "chat") or {})["metadata"]["generation"]
    status = {"observedGeneration": generation, "replicas": 1, "conditions": [failed]}
    await cluster.patch_deployment("chat", {"status": status}, status=True)
    await eventually(lambda: replicas(cluster, "chat") == 1, what="scale down to 1", timeout=15)
    assert operator.failures() == []


async def test_a_replica_unready_past_the_startup_budget_is_no_activity_for_scale_to_zero(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    # Issue 31: an idle fleet with one replica Pending for want of a GPU node must still go to zero, or the
    # Pending pod keeps asking the cluster autoscaler for a node forever.
    from_zero = {**spec(minReplicas=0, scaleToZeroAfterSeconds=1), "replicas": 2, "router": {"enabled": True}}
    await cluster.create_isvc("chat", from_zero)
    await add_pod(cluster, pods, "chat", waiting=0.0)
    await add_unready_pod(cluster, "chat", "chat-stuck", time.time() - STARTUP_BUDGET_S - 60)
    await eventually(lambda: replicas(cluster, "chat") == 0, what="scaled to zero", timeout=15)
    assert operator.failures() == []


async def add_router_pod(cluster: Cluster, owner: str, router: RouterMetrics) -> None:
    """A ready router pod of `owner` whose /metrics is `router`."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{owner}-router-pod",
            "namespace": NAMESPACE,
            "labels": manifests.labels(owner, manifests.ROUTER),
            "annotations": {"prometheus.io/port": str(router.port)},
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    await create_pod(cluster, body)


async def test_a_fleet_whose_only_replica_never_became_ready_still_goes_to_zero(
    fast_autoscaler: None, cluster: Cluster, operator: Any
) -> None:
    # No replica to scrape, and the router holds nothing: the fleet is idle, not of unknown activity. Before,
    # no ready replica meant "no data", which counts as activity, and the stuck pod kept the fleet at one.
    router = RouterMetrics(held=0.0)
    try:
        from_zero = {
            **spec(minReplicas=0, scaleToZeroAfterSeconds=1),
            "replicas": 1,
            "router": {"enabled": True},
        }
        await cluster.create_isvc("chat", from_zero)
        await add_router_pod(cluster, "chat", router)
        await add_unready_pod(cluster, "chat", "chat-stuck", time.time() - STARTUP_BUDGET_S - 60)
        await eventually(lambda: replicas(cluster, "chat") == 0, what="scaled to zero", timeout=15)
        assert operator.failures() == []
    finally:
        router.close()


class RouterMetrics(HttpStub):
    """The router's /metrics: chunkwise:router_held_requests as the test sets it."""

    def __init__(self, held: float) -> None:
        self.held = held
        super().__init__(
            lambda path: (
                200,
                "text/plain; version=0.0.4",
                f"# TYPE chunkwise:router_held_requests gauge\nchunkwise:router_held_requests {self.held}\n".encode(),
            )
        )


async def test_from_zero_the_requests_the_router_holds_decide_how_many_replicas(
    fast_autoscaler: None, pods: list[MetricsServer], cluster: Cluster, operator: Any
) -> None:
    # Issue 31: 5 requests held at the router, target 2 per replica: 0 -> 3 at once, not 0 -> 1 and then a
    # second cold start.
    router = RouterMetrics(held=5.0)
    try:
        at_zero = {**spec(minReplicas=0), "replicas": 0, "router": {"enabled": True}}
        await cluster.create_isvc("chat", at_zero)
        await add_router_pod(cluster, "chat", router)
        await eventually(lambda: replicas(cluster, "chat") == 3, what="0 -> 3", timeout=15)
        events = await eventually(
            lambda: [e["message"] for e in cluster.events() if e["reason"] == "ScaledUp"],
            what="ScaledUp event",
        )
        assert events[0].startswith("0 -> 3 replicas: 5 requests held at the router")
        assert operator.failures() == []
    finally:
        router.close()
