"""LoRA adapters in the real Kopf operator against kmock, with replicas that speak the server's contract.

Each replica is a Pod object in the emulator (ready, podIP 127.0.0.1, its engine's http port the port of a
real HTTP server on loopback), as the autoscaler's tests reach pods' /metrics. The server implements what
`chunkwise serve --enable-lora` answers (vLLM's endpoints), each replica with its own state:
`GET /v1/models`, and with --allow-runtime-lora `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kmock as km
import pytest
from operator_harness import NAMESPACE, VERBS, Cluster, eventually

from chunkwise_operator import manifests
from chunkwise_operator.main import ADAPTER_INTERVAL_ENV

BASE = "tiny"
SQL = {"name": "sql", "uri": "hf://org/sql-lora"}
CHAT = {"name": "chat", "uri": "s3://adapters/chat/"}
BAD = {"name": "bad", "uri": "hf://org/rank-256"}


class LoraReplica:
    """One replica's LoRA endpoints on 127.0.0.1:<random>, with the contract's answers and its own state.

    `adapters` maps a name to the path it was loaded from (what /v1/models gives as root); `refuse` maps a
    lora_path to the 400 message the replica answers a load of it with (a bad config, a rank too high).
    """

    def __init__(self, adapters: dict[str, str] | None = None, runtime: bool = True) -> None:
        self.adapters: dict[str, str] = dict(adapters or {})
        self.runtime = runtime
        self.refuse: dict[str, str] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    return self._send(404, _error("not found", "NotFoundError", 404))
                with replica.lock:
                    data = [{"id": BASE, "object": "model", "root": BASE, "parent": None}]
                    data += [
                        {"id": n, "object": "model", "root": p, "parent": BASE}
                        for n, p in replica.adapters.items()
                    ]
                self._send(200, {"object": "list", "data": data})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with replica.lock:
                    replica.calls.append((self.path, body))
                    status, answer = replica.post(self.path, body)
                self._send(status, answer)

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path not in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") or not self.runtime:
            return 404, _error("not found", "NotFoundError", 404)  # runtime loading is off
        name = body.get("lora_name")
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(name, None) is None:
                return 404, _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
            return 200, {}
        lora_path = body.get("lora_path")
        if name in self.adapters:
            return 409, _error(f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput", 409)
        if lora_path in self.refuse:
            return 400, _error(self.refuse[lora_path], "BadRequestError", 400)
        self.adapters[str(name)] = str(lora_path)
        return 200, {}

    def loaded(self) -> dict[str, str]:
        with self.lock:
            return dict(self.adapters)

    def loads(self) -> list[str]:
        with self.lock:
            return [b["lora_name"] for p, b in self.calls if p == "/v1/load_lora_adapter"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _error(message: str, type_: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


@pytest.fixture
def fast_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by the operator's start-up handler: the fixture must come before `operator` in a test's arguments.
    monkeypatch.setenv(ADAPTER_INTERVAL_ENV, "0.2")


@pytest.fixture
def replicas(cluster: Cluster) -> Iterator[list[LoraReplica]]:
    cluster.k.resources["v1/pods"] = km.ResourceInfo(kind="Pod", namespaced=True, verbs=VERBS)
    servers: list[LoraReplica] = []
    yield servers
    for s in servers:
        s.close()


async def add_replica(cluster: Cluster, servers: list[LoraReplica], owner: str, **kwargs: Any) -> LoraReplica:
    """A ready runtime pod as the kubelet would report it, its engine's http port the replica's."""
    server = LoraReplica(**kwargs)
    servers.append(server)
    name = f"{owner}-pod-{len(servers)}"
    # Through the real client, off the test's loop: the emulator answers on it.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-{name}",
            "labels": manifests.labels(owner, manifests.RUNTIME),
        },
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": server.port}]}]
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    await asyncio.to_thread(cluster.create_pod, pod)
    return server


def adapter_status(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return list(((cluster.isvc(name) or {}).get("status") or {}).get("adapters") or [])


def adapters_ready(cluster: Cluster, name: str) -> tuple[str, str, str] | None:
    for c in ((cluster.isvc(name) or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == "AdaptersReady":
            return c["status"], c["reason"], c["message"]
    return None


def template(cluster: Cluster, name: str) -> Any:
    return ((cluster.get(Cluster.DEPLOYMENTS, name) or {}).get("spec") or {}).get("template")


async def deployment_ready(cluster: Cluster, name: str, ready: int) -> None:
    """kmock has no Deployment controller: the test reports the replicas ready, as the controller would."""
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, name), what="the runtime Deployment")
    status = {"replicas": ready, "readyReplicas": ready, "updatedReplicas": ready}
    await cluster.patch_deployment(name, {"status": status}, status=True)


async def test_runtime_updates_load_and_unload_adapters_without_a_rollout(
    fast_sync: None, replicas: list[LoraReplica], cluster: Cluster, operator: Any
) -> None:
    spec = {
        "model": {"preset": "tiny"},
        "replicas": 2,
        "adapters": [SQL],
        "engine": {"runtimeLoraUpdates": True},
    }
    await cluster.create_isvc("chat", spec)
    first = await add_replica(cluster, replicas, "chat")
    second = await add_replica(cluster, replicas, "chat", adapters={"stray": "hf://org/stray"})
    await deployment_ready(cluster, "chat", 2)

    # Every ready replica gets the adapter, from its URI; what the spec does not name is unloaded.
    for r in (first, second):
        await eventually(lambda r=r: r.loaded() == {"sql": SQL["uri"]}, what="sql loaded, stray unloaded")
    await eventually(
        lambda: adapter_status(cluster, "chat") == [{"name": "sql", "uri": SQL["uri"], "readyReplicas": 2}],
        what="status.adapters",
    )
    await eventually(lambda: (adapters_ready(cluster, "chat") or ("",))[0] == "True", what="AdaptersReady")
    assert adapters_ready(cluster, "chat") == (
        "True",
        "Loaded",
        "all 1 adapters are loaded on all 2 ready replicas",
    )
    before = template(cluster, "chat")
    assert "--lora-modules" not in before["spec"]["containers"][0]["args"]

    # Add one, remove one: the replicas change in place, the pod template not at all.
    await cluster.patch_isvc("chat", {"spec": {"adapters": [CHAT]}})
    for r in (first, second):
        await eventually(lambda r=r: r.loaded() == {"chat": CHAT["uri"]}, what="chat in, sql out")
    await eventually(
        lambda: adapter_status(cluster, "chat") == [{"name": "chat", "uri": CHAT["uri"], "readyReplicas": 2}],
        what="status follows",
    )
    # The reconcile of the new spec has run (it wrote observedGeneration) and left the template alone.
    await eventually(
        lambda: (cluster.isvc("chat") or {}).get("status", {}).get("observedGeneration") == 2,
        what="the update reconciled",
    )
    assert template(cluster, "chat") == before

    # The same name from another URI (a new version of the adapter): unloaded, then loaded from the new one.
    moved = {**CHAT, "uri": "s3://adapters/chat-v2/"}
    await cluster.patch_isvc("chat", {"spec": {"adapters": [moved]}})
    for r in (first, second):
        await eventually(lambda r=r: r.loaded() == {"chat": moved["uri"]}, what="chat reloaded from v2")

    # A replica that starts later (a scale up, a restart) gets every adapter once it is ready.
    third = await add_replica(cluster, replicas, "chat")
    await eventually(lambda: third.loaded() == {"chat": moved["uri"]}, what="the new replica is given chat")
    assert first.loads() == ["sql", "chat", "chat"]  # each load once: nothing is loaded again and again
    assert template(cluster, "chat") == before
    assert operator.failures() == []


async def test_a_refused_load_is_reported_per_adapter_and_not_hammered(
    fast_sync: None, replicas: list[LoraReplica], cluster: Cluster, operator: Any
) -> None:
    spec = {
        "model": {"preset": "tiny"},
        "replicas": 2,
        "adapters": [SQL, BAD],
        "engine": {"runtimeLoraUpdates": True, "maxLoraRank": 16},
    }
    await cluster.create_isvc("chat", spec)
    good = await add_replica(cluster, replicas, "chat")
    picky = await add_replica(cluster, replicas, "chat")
    picky.refuse[BAD["uri"]] = "LoRA rank 256 is greater than max_lora_rank 16."
    await deployment_ready(cluster, "chat", 2)

    expected = [
        {"name": "sql", "uri": SQL["uri"], "readyReplicas": 2},
        {
            "name": "bad",
            "uri": BAD["uri"],
            "readyReplicas": 1,
            "message": "pod chat-pod-2: HTTP 400: LoRA rank 256 is greater than max_lora_rank 16.",
        },
    ]
    await eventually(lambda: adapter_status(cluster, "chat") == expected, what="the refusal in status")
    await eventually(
        lambda: (adapters_ready(cluster, "chat") or ("", ""))[1] == "AdapterLoadFailed", what="condition"
    )
    assert good.loaded() == {"sql": SQL["uri"], "bad": BAD["uri"]}
    events = await eventually(
        lambda: [e for e in cluster.events() if e["reason"] == "AdapterLoadFailed"], what="a Warning event"
    )
    assert events[0]["type"] == "Warning" and "adapter bad on pod chat-pod-2" in events[0]["message"]
    # Many sync passes later (0.2 s apart) the refused load was still tried once: each try may fetch again.
    await eventually(lambda: len(good.calls) >= 2 and picky.loads().count("sql") == 1, what="settled")
    await asyncio.sleep(1.0)
    assert picky.loads().count("bad") == 1

    # Dropping the adapter from the spec clears the failure and the condition.
    await cluster.patch_isvc("chat", {"spec": {"adapters": [SQL]}})
    await eventually(lambda: (adapters_ready(cluster, "chat") or ("",))[0] == "True", what="recovered")
    await eventually(lambda: good.loaded() == {"sql": SQL["uri"]}, what="bad unloaded where it loaded")


async def test_static_adapters_are_only_observed(
    fast_sync: None, replicas: list[LoraReplica], cluster: Cluster, operator: Any
) -> None:
    """Without runtime updates the pods start with their adapters (--lora-modules): the operator reads
    /v1/models to report them and never calls the load endpoints; a change rolls the pods instead."""
    await cluster.create_isvc("chat", {"model": {"preset": "tiny"}, "replicas": 2, "adapters": [SQL]})
    started = await add_replica(cluster, replicas, "chat", adapters={"sql": "/adapters/sql"}, runtime=False)
    # A pod of the template from before the adapter, not yet replaced by the rollout.
    old = await add_replica(cluster, replicas, "chat", runtime=False)
    await deployment_ready(cluster, "chat", 2)
    await eventually(
        lambda: adapter_status(cluster, "chat") == [{"name": "sql", "uri": SQL["uri"], "readyReplicas": 1}],
        what="status.adapters",
    )
    loading = ("False", "Loading", "of 2 ready replicas: sql on 1")
    # Written after status.adapters, by the status refresh that follows it.
    await eventually(lambda: adapters_ready(cluster, "chat") == loading, what="AdaptersReady Loading")
    before = template(cluster, "chat")
    assert "sql=/adapters/sql" in before["spec"]["containers"][0]["args"]

    await cluster.patch_isvc("chat", {"spec": {"adapters": [SQL, CHAT]}})
    await eventually(lambda: template(cluster, "chat") != before, what="a new pod template (a rollout)")
    after = template(cluster, "chat")["spec"]
    assert [c["name"] for c in after["initContainers"]] == ["fetch-adapter-sql", "fetch-adapter-chat"]
    assert started.calls == [] and old.calls == []
    assert operator.failures() == []
