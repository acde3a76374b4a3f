"""LoRA adapters in the running replicas (issue 34): what each ready replica serves, what to load or unload
there, and the status that says on how many replicas each adapter of spec.adapters is loaded.

The replicas are read and changed only through the server's OpenAI-compatible API (vLLM's endpoints):
`GET /v1/models` lists the base model and each adapter as {"id": NAME, "parent": BASE, "root": PATH};
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`
change the set, and exist only on a server started with --allow-runtime-lora (spec.engine.runtimeLoraUpdates).

Two ways an adapter reaches a replica (manifests.lora_flags):
- static (the default): an init container fetches it into /adapters/<name> and --lora-modules names it; the
  operator only reads /v1/models, to report readiness. A change of spec.adapters changes the pod template,
  so it rolls the pods like any other change.
- runtime (spec.engine.runtimeLoraUpdates): the pod template names no adapter; the operator loads each one
  into every ready replica with its URI as lora_path (the replica fetches it, as `chunkwise fetch-model`
  would) and unloads the ones the spec no longer names. The replica's /v1/models gives the lora_path back as
  `root`, which is how an adapter whose URI changed in the spec is told apart (unloaded, then loaded again).

The decisions are pure functions (`plan`, `held`, `entries`, `condition`); `sync` is the I/O around them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from chunkwise_operator import manifests
from chunkwise_operator.scrape import DEFAULT_PORT, pod_address, ready
from chunkwise_operator.spec import Adapter, ServiceSpec

MODELS_PATH = "/v1/models"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
LIST_TIMEOUT_S = 5.0
# A load fetches the adapter first (a URI: hf://, s3://, ...): a large one over a slow link takes minutes.
LOAD_TIMEOUT_S = 600.0
# An unload waits for the requests in flight on the adapter to finish.
UNLOAD_TIMEOUT_S = 120.0
# A load a replica refused (a bad URI, a rank above --max-lora-rank) is not tried again on that replica for
# this long, unless the adapter's URI changes: each try may fetch the adapter again.
RETRY_AFTER_S = 60.0

# The status condition, present while the service serves adapters (spec.adapters or runtimeLoraUpdates).
CONDITION = "AdaptersReady"
NO_ADAPTERS = "NoAdapters"
NO_READY_REPLICAS = "NoReadyReplicas"
LOADED = "Loaded"
LOADING = "Loading"
LOAD_FAILED = "AdapterLoadFailed"


@dataclass(frozen=True)
class Replica:
    """A ready runtime pod, reached at its pod IP on the engine's http port."""

    key: str  # the pod's uid: a replacement with the same name starts with no runtime-loaded adapter
    name: str
    url: str  # http://ip:port, no trailing slash


@dataclass(frozen=True)
class Plan:
    """What to change on one replica: unloads first (a changed URI is an unload, then a load), then loads."""

    unload: tuple[str, ...] = ()
    load: tuple[tuple[str, str], ...] = ()  # (lora_name, lora_path)


@dataclass(frozen=True)
class Failure:
    """A load one replica refused: the path it was given, when, and the replica's own words."""

    path: str
    time: float
    message: str


@dataclass
class ReplicaState:
    """One replica after a sync: the adapters it serves (name -> root), None if /v1/models did not answer."""

    replica: Replica
    loaded: dict[str, str] | None
    changes: list[str] = field(default_factory=list)  # "loaded sql", "unloaded chat": for the log
    failed: list[tuple[str, str]] = field(default_factory=list)  # (name, message) of loads refused just now


def replicas(pods: Iterable[Mapping[str, Any]]) -> list[Replica]:
    """The ready runtime pods' API base URLs: the engine container's http port (the one the Service targets),
    else the Prometheus port annotation (the engine serves both on one port), else 8000."""
    result = []
    for pod in pods:
        if not ready(pod):
            continue
        key, name, host = pod_address(pod)
        result.append(Replica(key, name, f"http://{host}:{_api_port(pod)}"))
    return sorted(result, key=lambda r: r.name)


def _api_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    port = ((pod.get("metadata") or {}).get("annotations") or {}).get("prometheus.io/port")
    return int(port) if isinstance(port, str) and port.isdigit() else DEFAULT_PORT


def wanted(spec: ServiceSpec) -> dict[str, str]:
    """Each adapter of the spec and the lora_path a replica serving it reports as its root."""
    if spec.engine.runtime_lora_updates:
        return {a.name: a.uri for a in spec.adapters}
    return {a.name: manifests.adapter_directory(a.name) for a in spec.adapters}


def served(models: Any) -> dict[str, str]:
    """The adapters in a /v1/models answer (the entries with a parent), name -> root."""
    data = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(data, list):
        raise ValueError(f"not a /v1/models answer: {models!r:.200}")
    return {
        str(m["id"]): str(m.get("root") or "")
        for m in data
        if isinstance(m, Mapping) and m.get("parent") and isinstance(m.get("id"), str)
    }


def plan(want: Mapping[str, str], loaded: Mapping[str, str], runtime: bool, held: Iterable[str] = ()) -> Plan:
    """What one replica must load and unload so that it serves exactly `want` (name -> lora_path).

    Only with runtime updates: otherwise the pod template carries the adapters and a replica is never
    changed in place. An adapter loaded from another path than the spec's (its URI changed) is unloaded and
    loaded again; one the spec does not name is unloaded (the operator owns the replica's set). `held`: names
    not to load now (a recent refusal of the same path, see `held`).
    """
    if not runtime:
        return Plan()
    unload = tuple(sorted(n for n, root in loaded.items() if want.get(n) != root))
    skip = set(held)
    load = tuple(sorted((n, p) for n, p in want.items() if loaded.get(n) != p and n not in skip))
    return Plan(unload, load)


def held(
    failures: Mapping[tuple[str, str], Failure], replica: str, want: Mapping[str, str], now: float
) -> set[str]:
    """Adapters whose load this replica refused, for the path still wanted, less than RETRY_AFTER_S ago."""
    result = set()
    for (key, name), f in failures.items():
        if key == replica and want.get(name) == f.path and now - f.time < RETRY_AFTER_S:
            result.add(name)
    return result


def forget(
    failures: MutableMapping[tuple[str, str], Failure], keys: set[str], want: Mapping[str, str]
) -> None:
    """Drop the failures of replicas that are gone and of paths no longer wanted."""
    for k in [k for k, f in failures.items() if k[0] not in keys or want.get(k[1]) != f.path]:
        del failures[k]


def entries(
    adapters: Sequence[Adapter],
    want: Mapping[str, str],
    states: Sequence[ReplicaState],
    failures: Mapping[tuple[str, str], Failure],
) -> list[dict[str, Any]]:
    """status.adapters: per adapter of the spec, the replicas serving it from the wanted path, and the
    first refusal (by pod name) still standing."""
    names = {s.replica.key: s.replica.name for s in states}
    result = []
    for a in adapters:
        path = want[a.name]
        ready_count = sum(1 for s in states if s.loaded is not None and s.loaded.get(a.name) == path)
        item: dict[str, Any] = {"name": a.name, "uri": a.uri, "readyReplicas": ready_count}
        refused = sorted(
            (names[key], f.message)
            for (key, name), f in failures.items()
            if name == a.name and key in names and f.path == path
        )
        if refused:
            item["message"] = f"pod {refused[0][0]}: {refused[0][1]}"
        result.append(item)
    return result


def carried(adapters: Sequence[Adapter], previous: Any) -> list[dict[str, Any]]:
    """status.adapters between syncs: the last sync's entries for the adapters the spec still names with the
    same URI, and 0 replicas for the others (added, or given another URI, since)."""
    before = {
        e.get("name"): e for e in (previous if isinstance(previous, list) else []) if isinstance(e, Mapping)
    }
    result = []
    for a in adapters:
        old = before.get(a.name)
        if old is not None and old.get("uri") == a.uri and isinstance(old.get("readyReplicas"), int):
            result.append(dict(old))
        else:
            result.append({"name": a.name, "uri": a.uri, "readyReplicas": 0})
    return result


def condition(items: Sequence[Mapping[str, Any]], ready_replicas: int) -> tuple[bool | None, str, str]:
    """AdaptersReady: (status, reason, message) from status.adapters and the runtime's ready replicas."""
    if not items:
        return True, NO_ADAPTERS, "spec.adapters names none; runtime loading is on"
    if ready_replicas <= 0:
        return None, NO_READY_REPLICAS, "no runtime replica is ready to serve adapters"
    failed = [i for i in items if i.get("message")]
    if failed:
        first = failed[0]
        more = f" (and {len(failed) - 1} more adapters)" if len(failed) > 1 else ""
        return False, LOAD_FAILED, f"adapter {first['name']} failed to load: {first['message']}{more}"
    short = [i for i in items if int(i.get("readyReplicas") or 0) < ready_replicas]
    if short:
        said = ", ".join(f"{i['name']} on {i.get('readyReplicas', 0)}" for i in short[:5])
        more = ", ..." if len(short) > 5 else ""
        return False, LOADING, f"of {ready_replicas} ready replicas: {said}{more}"
    return True, LOADED, f"all {len(items)} adapters are loaded on all {ready_replicas} ready replicas"


# ---------------------------------------------------------------------------------------------------- I/O


async def sync(
    client: httpx.AsyncClient,
    targets: Sequence[Replica],
    want: Mapping[str, str],
    runtime: bool,
    failures: MutableMapping[tuple[str, str], Failure],
    now: float,
) -> list[ReplicaState]:
    """Read every replica's adapters and, with runtime updates, bring each to `want`; all replicas at once.

    `failures` (kept by the caller between syncs) gains the loads refused now and loses those that succeed.
    """
    forget(failures, {t.key for t in targets}, want)
    return list(await asyncio.gather(*(_one(client, t, want, runtime, failures, now) for t in targets)))


async def _one(
    client: httpx.AsyncClient,
    replica: Replica,
    want: Mapping[str, str],
    runtime: bool,
    failures: MutableMapping[tuple[str, str], Failure],
    now: float,
) -> ReplicaState:
    try:
        resp = await client.get(replica.url + MODELS_PATH, timeout=LIST_TIMEOUT_S)
        resp.raise_for_status()
        loaded = served(resp.json())
    except (httpx.HTTPError, ValueError):
        return ReplicaState(replica, None)
    state = ReplicaState(replica, loaded)
    todo = plan(want, loaded, runtime, held(failures, replica.key, want, now))
    for name in todo.unload:
        try:
            resp = await client.post(
                replica.url + UNLOAD_PATH, json={"lora_name": name}, timeout=UNLOAD_TIMEOUT_S
            )
        except httpx.HTTPError:
            continue  # the next sync finds it still there
        if resp.status_code == 200 or resp.status_code == 404:  # 404: already gone
            loaded.pop(name, None)
            state.changes.append(f"unloaded {name}")
    for name, path in todo.load:
        if name in loaded:
            continue  # its unload did not go through: loading again would be a 409
        try:
            resp = await client.post(
                replica.url + LOAD_PATH,
                json={"lora_name": name, "lora_path": path},
                timeout=LOAD_TIMEOUT_S,
            )
        except httpx.HTTPError:
            continue  # unreachable or timed out: no verdict on the adapter, tried again next sync
        if resp.status_code == 200:
            loaded[name] = path
            failures.pop((replica.key, name), None)
            state.changes.append(f"loaded {name}")
        elif 400 <= resp.status_code < 500 and resp.status_code != 409:
            message = _error_message(resp)
            failures[replica.key, name] = Failure(path, now, message)
            state.failed.append((name, message))
        # 409 (already loaded, a race with another load) and 5xx: the next sync reads /v1/models again
    return state


def _error_message(resp: httpx.Response) -> str:
    """The replica's reason, from OpenAI's error body when it sends one."""
    try:
        body = resp.json()
        message = body["error"]["message"]
        if isinstance(message, str) and message:
            return f"HTTP {resp.status_code}: {' '.join(message.split())[:400]}"
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {resp.status_code}: {' '.join(resp.text.split())[:400]}"
