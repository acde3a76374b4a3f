"""`LocalFleet`: kmock as the Kubernetes API, the real operator, and a harness playing the cluster's part.

The harness is the Deployment controller and the kubelet the operator's objects need, and nothing more:

- for every Deployment the operator owns, it keeps one real process per desired replica: the container's
  own command and arguments (`chunkwise serve ...`, `chunkwise router ...`), with `--host` set to the pod's
  address, a distinct 127.0.0.x (the whole 127/8 is loopback), so every replica keeps its port as in a pod;
- it publishes each as a Pod object (podIP, the Ready condition from GET /health, as the readiness probe
  would) and every Service's endpoints as an EndpointSlice, and writes the Deployments' status;
- on scale-down it does what the kubelet does: the endpoint goes not-ready at once, the preStop sleep
  (capped, to keep tests short) passes, SIGTERM starts the engine's drain, SIGKILL after the grace period.

Not emulated: rolling updates of a changed template (pods keep the arguments they started with), node
placement, resource limits, restarts with backoff (a crashed process is restarted at the next tick).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kmock as km
import yaml
from e2e.local.kube import KubeThread
from e2e.local.processes import CHUNKWISE, Child, address_free

logger = logging.getLogger("e2e.local")

GROUP, VERSION, PLURAL = "serving.chunkwise.dev", "v1alpha1", "inferenceservices"
MANAGED_BY = ("app.kubernetes.io/managed-by", "chunkwise-operator")
COMPONENT = "app.kubernetes.io/component"
MERGE = {"content-type": "application/merge-patch+json"}
# The readiness probe: a pod leaves its endpoints after this many failed probes in a row.
READINESS_FAILURES = 2
PROBE_PERIOD_S = 0.5
PROBE_TIMEOUT_S = 2.0


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class LocalPod:
    name: str
    namespace: str
    deployment: str
    component: str
    host: str
    port: int
    labels: dict[str, str]
    child: Child
    started_at: float
    ready: bool = False
    failures: int = 0
    terminating: bool = False
    ready_at: float | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Sample:
    """One tick of the harness: each runtime Deployment's desired count and its pods' readiness."""

    time: float
    desired: dict[str, int] = field(default_factory=dict)
    ready: dict[str, int] = field(default_factory=dict)


def _with_host(args: list[str], host: str) -> list[str]:
    out = list(args)
    if "--host" in out:
        out[out.index("--host") + 1] = host
    else:
        out += ["--host", host]
    return out


def _container_port(container: Mapping[str, Any]) -> int:
    for p in container.get("ports") or []:
        if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
            return int(p["containerPort"])
    return 8000


def _prestop_seconds(container: Mapping[str, Any]) -> float:
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get(
        "command"
    ) or []
    if len(command) == 2 and command[0] == "sleep":
        with contextlib.suppress(ValueError):
            return float(command[1])
    return 0.0


class LocalFleet:
    def __init__(
        self,
        workdir: Path,
        *,
        namespace: str = "default",
        first_host: int = 2,
        max_prestop_s: float = 1.0,
        operator_args: tuple[str, ...] = ("--autoscaler-interval-seconds", "1"),
        tick_s: float = 0.25,
    ) -> None:
        self.workdir = workdir
        self.namespace = namespace
        self.first_host = first_host
        self.max_prestop_s = max_prestop_s
        self.operator_args = operator_args
        self.tick_s = tick_s
        self.kube = KubeThread()
        self.kubeconfig = workdir / "kubeconfig"
        self.operator: Child | None = None
        self.pods: dict[str, LocalPod] = {}
        self.timeline: list[Sample] = []
        self._hosts_in_use: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._client: httpx.AsyncClient | None = None
        self._controller: Any = None
        self._published: dict[str, Any] = {}
        self._publishing: asyncio.Lock | None = None
        self.errors: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------------------------
    def __enter__(self) -> LocalFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kube.start()
        self.kubeconfig.write_text(yaml.safe_dump(self.kube.kubeconfig()))
        self._controller = self.kube.submit(self._control())
        code = "import sys; from chunkwise_operator.main import run_operator; sys.exit(run_operator(sys.argv[1:]))"
        self.operator = Child(
            "operator",
            [sys.executable, "-c", code, *self.operator_args],
            self.workdir / "operator.log",
            env={"KUBECONFIG": str(self.kubeconfig)},
        )
        # An object created before the operator's watch starts is seen twice (list, then watch).
        self.wait_for(self._operator_watching, timeout=60, what="the operator watching")

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop(grace=10)
        if self._controller is not None:
            self._controller.cancel()
        for pod in list(self.pods.values()):
            pod.child.stop(grace=5)
        self.pods.clear()
        self.kube.stop()

    def _operator_watching(self) -> bool:
        if self.operator is not None and not self.operator.alive():
            raise RuntimeError(f"the operator exited:\n{self.operator.tail()}")
        emulator = self.kube.emulator
        if emulator is None:
            return False
        return len(emulator[km.action.WATCH, km.resource(GROUP, VERSION, PLURAL)]) > 0

    # -- the test's view -----------------------------------------------------------------------------------
    def _api(self) -> httpx.Client:
        return httpx.Client(base_url=self.kube.url, trust_env=False, timeout=10)

    def _isvc_path(self, name: str | None = None) -> str:
        base = f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}"
        return base if name is None else f"{base}/{name}"

    def create_isvc(self, name: str, spec: Mapping[str, Any]) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": dict(spec),
        }
        with self._api() as api:
            api.post(self._isvc_path(), json=body).raise_for_status()

    def patch_isvc(self, name: str, patch: Mapping[str, Any]) -> None:
        with self._api() as api:
            api.patch(self._isvc_path(name), content=json.dumps(patch), headers=MERGE).raise_for_status()

    def isvc(self, name: str) -> dict[str, Any]:
        with self._api() as api:
            resp = api.get(self._isvc_path(name))
            resp.raise_for_status()
            result: dict[str, Any] = resp.json()
            return result

    def events(self) -> list[dict[str, Any]]:
        with self._api() as api:
            resp = api.get(f"/api/v1/namespaces/{self.namespace}/events")
            resp.raise_for_status()
            return list(resp.json().get("items") or [])

    def runtime_pods(self, name: str) -> list[LocalPod]:
        return [p for p in self.pods.values() if p.deployment == name and p.component == "runtime"]

    def router_url(self, name: str) -> str | None:
        for p in self.pods.values():
            if p.deployment == f"{name}-router" and p.ready and not p.terminating:
                return p.url
        return None

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.errors:
                raise RuntimeError(f"the harness failed: {self.errors[-1]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout} s")
            time.sleep(interval)

    # -- the controller (runs on the emulator's loop) ------------------------------------------------------
    async def _control(self) -> None:
        self._client = httpx.AsyncClient(base_url=self.kube.url, trust_env=False, timeout=10)
        try:
            while True:
                try:
                    await self._tick()
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    # Logged and kept: a test waiting on the fleet reports it rather than hanging.
                    self.errors.append(f"{type(e).__name__}: {e}")
                    logger.exception("local fleet tick failed")
                await asyncio.sleep(self.tick_s)
        finally:
            for task in self._tasks:
                task.cancel()
            await self._client.aclose()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _list(self, path: str) -> list[dict[str, Any]]:
        assert self._client is not None
        resp = await self._client.get(path)
        resp.raise_for_status()
        return list(resp.json().get("items") or [])

    async def _tick(self) -> None:
        ns = self.namespace
        deployments = [
            d
            for d in await self._list(f"/apis/apps/v1/namespaces/{ns}/deployments")
            if ((d.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY[0]) == MANAGED_BY[1]
        ]
        names = {d["metadata"]["name"] for d in deployments}
        sample = Sample(time.monotonic())
        for dep in deployments:
            name = dep["metadata"]["name"]
            desired = int((dep.get("spec") or {}).get("replicas", 1))
            live = [p for p in self.pods.values() if p.deployment == name and not p.terminating]
            for _ in range(desired - len(live)):
                await self._start_pod(dep)
            if len(live) > desired:
                # Not-ready pods go first, then the newest, as the ReplicaSet controller prefers.
                victims = sorted(live, key=lambda p: (p.ready, -p.started_at))[: len(live) - desired]
                for pod in victims:
                    self._spawn(self._terminate(pod, dep))
            for pod in live:
                if not pod.child.alive() and not pod.terminating:
                    await self._restart(pod, dep)
            if (dep["metadata"].get("labels") or {}).get(COMPONENT) == "runtime":
                sample.desired[name] = desired
                sample.ready[name] = sum(1 for p in self.pods.values() if p.deployment == name and p.ready)
            await self._deployment_status(dep)
        for pod in list(self.pods.values()):
            if pod.deployment not in names and not pod.terminating:
                self._spawn(self._terminate(pod, None))
        self.timeline.append(sample)
        await self._publish_endpoints()

    # -- pods ----------------------------------------------------------------------------------------------
    def _allocate_host(self) -> str:
        for last in range(self.first_host, 255):
            host = f"127.0.0.{last}"
            if host in self._hosts_in_use:
                continue
            if address_free(host, 8000) and address_free(host, 8080):
                self._hosts_in_use.add(host)
                return host
        raise RuntimeError("no free 127.0.0.x address")

    async def _start_pod(self, dep: Mapping[str, Any]) -> None:
        assert self._client is not None
        template = dep["spec"]["template"]
        container = template["spec"]["containers"][0]
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        annotations = dict((template.get("metadata") or {}).get("annotations") or {})
        name = f"{dep['metadata']['name']}-{uuid.uuid4().hex[:5]}"
        host = self._allocate_host()
        port = _container_port(container)
        command = list(container.get("command") or [])
        if command and command[0] == "chunkwise":
            command[0] = CHUNKWISE
        argv = [*command, *_with_host(list(container.get("args") or []), host)]
        env = {"KUBECONFIG": str(self.kubeconfig)}
        env.update({e["name"]: e["value"] for e in container.get("env") or [] if "value" in e})
        child = Child(name, argv, self.workdir / "pods" / f"{name}.log", env=env)
        pod = LocalPod(
            name=name,
            namespace=self.namespace,
            deployment=dep["metadata"]["name"],
            component=labels.get(COMPONENT, ""),
            host=host,
            port=port,
            labels=labels,
            child=child,
            started_at=time.monotonic(),
        )
        self.pods[name] = pod
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": dep["metadata"]["name"],
                        "uid": dep["metadata"].get("uid", ""),
                    }
                ],
            },
            "spec": template["spec"],
            "status": {
                "phase": "Running",
                "podIP": host,
                "conditions": [{"type": "Ready", "status": "False"}],
            },
        }
        resp = await self._client.post(f"/api/v1/namespaces/{self.namespace}/pods", json=body)
        resp.raise_for_status()
        self._spawn(self._probe_loop(pod))
        logger.info("started pod %s on %s:%d", name, host, port)

    async def _restart(self, pod: LocalPod, dep: Mapping[str, Any]) -> None:
        logger.warning("pod %s exited with %s; restarting", pod.name, pod.child.proc.returncode)
        pod.restarts += 1
        await self._set_ready(pod, False)
        pod.child = Child(pod.name, pod.child.argv, pod.child.log, env={"KUBECONFIG": str(self.kubeconfig)})

    async def _probe_loop(self, pod: LocalPod) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=PROBE_TIMEOUT_S) as client:
            while not pod.terminating:
                try:
                    ok = (await client.get(pod.url + "/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if pod.terminating:
                    return
                if ok:
                    pod.failures = 0
                    if not pod.ready:
                        pod.ready_at = pod.ready_at or time.monotonic()
                        await self._set_ready(pod, True)
                else:
                    pod.failures += 1
                    if pod.ready and pod.failures >= READINESS_FAILURES:
                        await self._set_ready(pod, False)
                await asyncio.sleep(PROBE_PERIOD_S)

    async def _set_ready(self, pod: LocalPod, ready: bool) -> None:
        assert self._client is not None
        pod.ready = ready
        status = {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        await self._client.patch(
            f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
            content=json.dumps(status),
            headers=MERGE,
        )
        await self._publish_endpoints()

    async def _terminate(self, pod: LocalPod, dep: Mapping[str, Any] | None) -> None:
        assert self._client is not None
        pod.terminating = True
        pod.ready = False
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}"
        mark = {
            "metadata": {"deletionTimestamp": _now_iso()},
            "status": {"conditions": [{"type": "Ready", "status": "False"}]},
        }
        await self._client.patch(path, content=json.dumps(mark), headers=MERGE)
        await self._publish_endpoints()
        container = dep["spec"]["template"]["spec"]["containers"][0] if dep else {}
        grace = float(
            (dep or {})
            .get("spec", {})
            .get("template", {})
            .get("spec", {})
            .get("terminationGracePeriodSeconds", 30)
        )
        await asyncio.sleep(min(_prestop_seconds(container), self.max_prestop_s))
        pod.child.terminate()
        if not await asyncio.to_thread(pod.child.wait, grace):
            pod.child.kill()
        await asyncio.to_thread(pod.child.stop, 5)
        await self._client.delete(path)
        self.pods.pop(pod.name, None)
        self._hosts_in_use.discard(pod.host)
        await self._publish_endpoints()
        logger.info("pod %s stopped (exit %s)", pod.name, pod.child.proc.returncode)

    # -- what the cluster publishes ------------------------------------------------------------------------
    async def _deployment_status(self, dep: Mapping[str, Any]) -> None:
        assert self._client is not None
        name = dep["metadata"]["name"]
        pods = [p for p in self.pods.values() if p.deployment == name and not p.terminating]
        ready = sum(1 for p in pods if p.ready)
        status = {
            "observedGeneration": dep["metadata"].get("generation", 1),
            "replicas": len(pods),
            "updatedReplicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        if (dep.get("status") or {}) != {**(dep.get("status") or {}), **status}:
            await self._client.patch(
                f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}/status",
                content=json.dumps({"status": status}),
                headers=MERGE,
            )

    async def _publish_endpoints(self) -> None:
        # Probe loops and the tick all publish; one at a time, or two would create the same slice.
        if self._publishing is None:
            self._publishing = asyncio.Lock()
        async with self._publishing:
            await self._publish_endpoints_now()

    async def _publish_endpoints_now(self) -> None:
        assert self._client is not None
        services = [
            s
            for s in await self._list(f"/api/v1/namespaces/{self.namespace}/services")
            if ((s.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY[0]) == MANAGED_BY[1]
        ]
        for svc in services:
            selector = (svc.get("spec") or {}).get("selector") or {}
            members = [
                p for p in self.pods.values() if all(p.labels.get(k) == v for k, v in selector.items())
            ]
            name = f"{svc['metadata']['name']}-local"
            body = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "labels": {
                        "kubernetes.io/service-name": svc["metadata"]["name"],
                        "endpointslice.kubernetes.io/managed-by": "local-fleet",
                    },
                },
                "addressType": "IPv4",
                "endpoints": [
                    {
                        "addresses": [p.host],
                        "conditions": {
                            "ready": p.ready and not p.terminating,
                            "serving": p.ready,
                            "terminating": p.terminating,
                        },
                        "targetRef": {"kind": "Pod", "name": p.name, "namespace": p.namespace},
                    }
                    for p in sorted(members, key=lambda p: p.host)
                ],
                "ports": [
                    {
                        "name": port.get("name", "http"),
                        "port": members[0].port if members else port.get("port"),
                        "protocol": "TCP",
                    }
                    for port in (svc.get("spec") or {}).get("ports") or []
                ],
            }
            if self._published.get(name) == body:
                continue
            path = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
            if name in self._published:
                resp = await self._client.patch(f"{path}/{name}", content=json.dumps(body), headers=MERGE)
            else:
                resp = await self._client.post(path, json=body)
            resp.raise_for_status()
            self._published[name] = body
