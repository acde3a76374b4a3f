"""kmock's Kubernetes emulator in a background thread, with what the operator and the router rely on.

kmock leaves out uid, generation, resourceVersion, creationTimestamp and generateName, and learns no
resource from a CRD; this adds the first five and declares every resource the fleet touches.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import kmock as km

VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
# Declared by default; a test of a cluster without GAIE's CRDs deletes it from `emulator.resources`.
INFERENCE_POOLS = "inference.networking.k8s.io/v1/inferencepools"
# LeaderWorkerSet (kubernetes-sigs/lws): a pipeline-parallel runtime, where the cluster has LWS installed.
LEADER_WORKER_SETS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
T = TypeVar("T")


def _merge(old: Any, patch: Any) -> Any:
    if isinstance(old, Mapping) and isinstance(patch, Mapping):
        result = dict(old)
        for key, value in patch.items():
            if value is None:
                result.pop(key, None)
            else:
                result[key] = _merge(old.get(key), value)
        return result
    return patch


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Emulator(km.KubernetesEmulator):
    _versions = itertools.count(1)

    async def _handle(self, request: Any) -> Any:
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            if request.action == km.action.UPDATE:
                self._check_precondition(request, data)
            if request.action in (km.action.CREATE, km.action.UPDATE):
                data.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
            if request.action == km.action.CREATE:
                meta = data["metadata"]
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", _now())
            elif request.action == km.action.UPDATE and request.subresource in (None, "scale"):
                key = (request.resource, request.namespace, request.name)
                if "spec" in data and key in self.objects and not self.objects[key].deleted:
                    current = self.objects[key].raw
                    if _merge(current.get("spec"), data["spec"]) != current.get("spec"):
                        generation = (current.get("metadata") or {}).get("generation") or 1
                        data.setdefault("metadata", {})["generation"] = generation + 1
        return await super()._handle(request)

    def _check_precondition(self, request: Any, data: Mapping[str, Any]) -> None:
        """A write that names a resourceVersion applies only to that version, as on an API server."""
        expected = (data.get("metadata") or {}).get("resourceVersion")
        key = (request.resource, request.namespace, request.name)
        if expected is None or key not in self.objects or self.objects[key].deleted:
            return
        current = (self.objects[key].raw.get("metadata") or {}).get("resourceVersion")
        if current is not None and str(expected) != str(current):
            raise km.KubernetesError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": the object '
                "has been modified; please apply your changes to the latest version and try again",
            )


def declare(emulator: km.KubernetesEmulator) -> None:
    r = emulator.resources
    r["serving.chunkwise.dev/v1alpha1/inferenceservices"] = km.ResourceInfo(
        kind="InferenceService",
        singular="inferenceservice",
        shortnames={"infsvc"},
        namespaced=True,
        verbs=VERBS,
        subresources={"status", "scale"},
    )
    for key, kind, sub in (
        ("apps/v1/deployments", "Deployment", {"status"}),
        ("v1/pods", "Pod", {"status"}),
        ("v1/services", "Service", set()),
        ("v1/serviceaccounts", "ServiceAccount", set()),
        ("v1/events", "Event", set()),
        ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", set()),
        ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", set()),
        ("rbac.authorization.k8s.io/v1/roles", "Role", set()),
        ("discovery.k8s.io/v1/endpointslices", "EndpointSlice", set()),
        ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", set()),
        ("keda.sh/v1alpha1/scaledobjects", "ScaledObject", set()),
        # The Gateway API Inference Extension's CRD, as a cluster with GAIE installed serves it.
        (INFERENCE_POOLS, "InferencePool", {"status"}),
        # LWS's CRD, as a cluster with LeaderWorkerSet installed serves it.
        (LEADER_WORKER_SETS, "LeaderWorkerSet", {"status", "scale"}),
    ):
        r[key] = km.ResourceInfo(kind=kind, namespaced=True, verbs=VERBS, subresources=sub)
    # Kopf's peering (several operator replicas): cluster-wide and per namespace.
    r["kopf.dev/v1/clusterkopfpeerings"] = km.ResourceInfo(
        kind="ClusterKopfPeering", namespaced=False, verbs=VERBS
    )
    r["kopf.dev/v1/kopfpeerings"] = km.ResourceInfo(kind="KopfPeering", namespaced=True, verbs=VERBS)
    # Kopf hangs at start-up unless these exist too.
    r["v1/namespaces"] = km.ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
    r["apiextensions.k8s.io/v1/customresourcedefinitions"] = km.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS
    )


class KubeThread:
    """The emulator and its HTTP server on 127.0.0.1:<random>, on an event loop in a daemon thread."""

    def __init__(self) -> None:
        self.url = ""
        self.emulator: Emulator | None = None
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)

    def start(self) -> KubeThread:
        self._thread.start()
        if not self._ready.wait(15) or self._error is not None:
            raise RuntimeError(f"kmock did not start: {self._error!r}")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:
            self._error = e
            self._ready.set()
        finally:
            self.loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with Emulator() as emulator, km.Server(emulator) as server:
            declare(emulator)
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()
            # Let tasks the harness started on this loop wind down before the server goes.
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

    def submit(self, coro: Any) -> Future[Any]:
        """Run a coroutine on the emulator's loop (the harness's controller lives there too)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def kubeconfig(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "local-fleet"}}],
            "contexts": [
                {"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}
            ],
            "current-context": "kmock",
        }
