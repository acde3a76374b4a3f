"""Test harness for the operator: kmock's emulator made a little more like an API server, and helpers.

A module with a unique name rather than conftest.py, so test files can import it without depending on which
conftest.py pytest imported last.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import decimal
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import celpy
import httpx
import jsonschema
import kmock as km
import kopf
import kubernetes
import pytest
import yaml
from e2e.local.kube import INFERENCE_POOLS, LEADER_WORKER_SETS, Emulator
from kubernetes.utils.quantity import parse_quantity

from chunkwise_operator.spec import GROUP, PLURAL, VERSION

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservice.yaml"
MERGE = "application/merge-patch+json"
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
NAMESPACE = "default"
# What the tests' own requests (kubectl's part) send, so that they can be told apart from the operator's.
TEST_USER_AGENT = "chunkwise-tests/kubectl"


APPLY = "application/apply-patch+yaml"
# The kinds whose quantities the API server canonicalises (typed fields of core kinds; a CR's are strings).
TYPED_WITH_QUANTITIES = ("deployments", "pods")
# Fields whose values are quantities, or maps of them.
QUANTITY_FIELDS = ("requests", "limits", "sizeLimit")


class ApiServer(Emulator):
    """The kmock emulator shared with the local fleet (uid, generation, resourceVersion), plus three things a
    real API server does that the operator's tests depend on; the harness enforces the real server's
    behaviour here, since no kube-apiserver can run in this environment:

    - Server-side apply. kmock treats every PATCH as a JSON merge patch, so a field the operator stops
      sending would stay forever. Here an apply patch (application/apply-patch+yaml) from a field manager
      replaces the set of fields that manager owns: fields it applied before and omits now are removed, and
      the set is recorded in metadata.managedFields (FieldsV1, operation Apply). Simplified: lists are
      atomic (the applied list replaces the live one), and a field another manager also owns is removed
      anyway. kmock answers 404 to an apply of an absent object, where a real server creates it; the
      operator then creates it, and that create (which names the field manager) counts as its first apply.
    - Canonical quantities: a Deployment's or Pod's requests, limits and sizeLimit are stored in canonical
      form ("0.5" as "500m", "1.5Gi" as "1536Mi"), as the API server stores resource.Quantity.
    - A connection that never answers: requests `hang` matches are accepted and left unanswered (a
      half-open connection, an API server wedged behind a load balancer).
    """

    hang: Callable[[Any], bool] | None = None

    async def _handle(self, request: Any) -> Any:
        if self.hang is not None and self.hang(request):
            await asyncio.Event().wait()  # until the server stops
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            manager = request.params.get("fieldManager")
            content_type = request.headers.get("Content-Type", "")
            key = (request.resource, request.namespace, request.name)
            if request.action == km.action.UPDATE and content_type.startswith(APPLY) and manager:
                if key in self.objects and not self.objects[key].deleted:
                    live = copy.deepcopy(dict(self.objects[key].raw))
                    applied = _apply(live, data, manager)
                    _canonicalise(request.resource, applied)
                    patch = _diff(live, applied)
                    data.clear()
                    data.update(patch)
            elif request.action == km.action.CREATE:
                if manager:
                    _record_apply(data, manager)
                _canonicalise(request.resource, data)
            elif request.action == km.action.UPDATE:
                _canonicalise(request.resource, data)
        return await super()._handle(request)


FieldPath = tuple[str, ...]


def _field_paths(obj: Any, prefix: FieldPath = ()) -> set[FieldPath]:
    """Every map field of `obj` as a path; a list or a scalar is a leaf (the harness's lists are atomic)."""
    paths: set[FieldPath] = set()
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if (prefix == () and key == "status") or (prefix == ("metadata",) and key in _SERVER_SET):
                continue
            here = (*prefix, key)
            paths.add(here)
            paths |= _field_paths(value, here)
    return paths


_SERVER_SET = ("managedFields", "resourceVersion", "uid", "generation", "creationTimestamp")


def _fields_v1(paths: set[FieldPath]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path in sorted(paths):
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def _paths_of(fields: Any, prefix: FieldPath = ()) -> set[FieldPath]:
    paths: set[FieldPath] = set()
    if isinstance(fields, Mapping):
        for key, sub in fields.items():
            if key.startswith("f:"):
                here = (*prefix, key[2:])
                paths.add(here)
                paths |= _paths_of(sub, here)
    return paths


def _record_apply(obj: dict[str, Any], manager: str, previous: Any = None) -> None:
    entries = [
        e
        for e in (previous if isinstance(previous, list) else [])
        if not (e.get("manager") == manager and e.get("operation") == "Apply")
    ]
    entries.append(
        {
            "manager": manager,
            "operation": "Apply",
            "apiVersion": obj.get("apiVersion"),
            "fieldsType": "FieldsV1",
            "fieldsV1": _fields_v1(_field_paths(obj)),
        }
    )
    obj.setdefault("metadata", {})["managedFields"] = entries


def _apply(live: dict[str, Any], applied: Mapping[str, Any], manager: str) -> dict[str, Any]:
    """What the API server stores after `manager` applies `applied` over `live`."""
    meta = live.get("metadata") or {}
    before: set[FieldPath] = set()
    for entry in meta.get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            before = _paths_of(entry.get("fieldsV1"))
    result = copy.deepcopy(live)
    # Deepest first, so that a removed map goes after its removed fields.
    for path in sorted(before - _field_paths(applied), key=len, reverse=True):
        node: Any = result
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, Mapping) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    result = _overlay(result, applied)
    _record_apply(result, manager, meta.get("managedFields"))
    return result


def _overlay(live: Any, applied: Any) -> Any:
    if isinstance(live, Mapping) and isinstance(applied, Mapping):
        result = dict(live)
        for key, value in applied.items():
            result[key] = _overlay(live.get(key), value)
        return result
    return copy.deepcopy(applied)


def _diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch turning `old` into `new` (kmock applies PATCH bodies as merge patches)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(old.get(key), Mapping):
            sub = _diff(old[key], value)
            if sub:
                patch[key] = sub
        elif key not in old or old[key] != value:
            patch[key] = copy.deepcopy(value)
    return patch


def canonical_quantity(value: Any) -> str:
    """A quantity as the API server writes it back: the input's format (binary or decimal SI), with the
    largest suffix that keeps the number whole ("1.5Gi" as "1536Mi", "0.5" as "500m", "2000" as "2k")."""
    number = decimal.Decimal(parse_quantity(value))
    text = str(value)
    if text.endswith(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")) and number == number.to_integral_value():
        whole = int(number)
        for suffix, shift in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
            if whole >= 1 << shift and whole % (1 << shift) == 0:
                return f"{whole >> shift}{suffix}"
        return str(whole)
    for suffix, exponent in (
        ("E", 18),
        ("P", 15),
        ("T", 12),
        ("G", 9),
        ("M", 6),
        ("k", 3),
        ("", 0),
        ("m", -3),
    ):
        mantissa = number.scaleb(-exponent)
        if mantissa == mantissa.to_integral_value() and (mantissa != 0 or exponent == 0):
            return f"{int(mantissa)}{suffix}"
    return f"{int(number.scaleb(3).to_integral_value(rounding=decimal.ROUND_CEILING))}m"


def _canonicalise(resource: Any, obj: Any) -> None:
    if getattr(resource, "plural", None) not in TYPED_WITH_QUANTITIES:
        return

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "sizeLimit" and isinstance(value, (str, int, float)):
                    node[key] = canonical_quantity(value)
                elif key in QUANTITY_FIELDS and isinstance(value, dict):
                    for name, q in value.items():
                        if isinstance(q, (str, int, float)) and not isinstance(q, bool):
                            value[name] = canonical_quantity(q)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(obj)


class Cluster:
    """The emulator plus helpers that read and write its objects directly (as kubectl would)."""

    DEPLOYMENTS = km.resource("apps/v1/deployments")
    SERVICES = km.resource("v1/services")
    SERVICE_ACCOUNTS = km.resource("v1/serviceaccounts")
    PDBS = km.resource("policy/v1/poddisruptionbudgets")
    ROLE_BINDINGS = km.resource("rbac.authorization.k8s.io/v1/rolebindings")
    ROLES = km.resource("rbac.authorization.k8s.io/v1/roles")
    EVENTS = km.resource("v1/events")
    ISVCS = km.resource(GROUP, VERSION, PLURAL)
    CHILD_RESOURCES = (DEPLOYMENTS, SERVICES, SERVICE_ACCOUNTS, PDBS, ROLES, ROLE_BINDINGS)
    # A child too, but served only where GAIE's CRDs are (declared unless a test removes it): children()
    # leaves it out, so that counts of children mean the same with and without it.
    POOLS = km.resource(INFERENCE_POOLS)
    # Likewise LeaderWorkerSets (a pipeline-parallel runtime): served unless a test removes it, not in children().
    LWS = km.resource(LEADER_WORKER_SETS)

    def __init__(self, emulator: ApiServer, url: str) -> None:
        self.k = emulator
        self.url = url

    def get(
        self, resource: km.resource, name: str, namespace: str | None = NAMESPACE
    ) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self.k.objects or self.k.objects[key].deleted:
            return None
        return copy.deepcopy(dict(self.k.objects[key].raw))

    def children(self) -> list[dict[str, Any]]:
        result = []
        for (resource, _namespace, _name), obj in self.k.objects.items():
            if resource in self.CHILD_RESOURCES and not obj.deleted:
                result.append(copy.deepcopy(dict(obj.raw)))
        return result

    def events(self) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(dict(obj.raw))
            for (resource, _ns, _name), obj in self.k.objects.items()
            if resource == self.EVENTS and not obj.deleted
        ]

    def watching(self, resource: km.resource) -> bool:
        return len(self.k[km.action.WATCH, resource]) > 0

    def serves(self, resource: km.resource) -> bool:
        return resource in self.k.resources

    def pool(self, name: str) -> dict[str, Any] | None:
        return self.get(self.POOLS, name)

    def isvc(self, name: str) -> dict[str, Any] | None:
        return self.get(self.ISVCS, name)

    # Writes go over HTTP through the real client, so that watchers see them as they would in a cluster.

    def _client(self) -> kubernetes.client.ApiClient:
        client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=self.url))
        client.user_agent = TEST_USER_AGENT
        return client

    async def create_isvc(
        self, name: str, spec: Mapping[str, Any], finalizers: list[str] | None = None
    ) -> None:
        body = inference_service(name, spec)
        if finalizers:
            body["metadata"]["finalizers"] = finalizers

        def call() -> None:
            with self._client() as c:
                kubernetes.client.CustomObjectsApi(c).create_namespaced_custom_object(
                    GROUP, VERSION, NAMESPACE, PLURAL, body
                )

        await asyncio.to_thread(call)

    def create_pod(self, body: Mapping[str, Any]) -> None:
        with self._client() as c:
            kubernetes.client.CoreV1Api(c).create_namespaced_pod(NAMESPACE, dict(body))

    async def patch_isvc(self, name: str, patch: Mapping[str, Any]) -> None:
        def call() -> None:
            with self._client() as c:
                kubernetes.client.CustomObjectsApi(c).patch_namespaced_custom_object(
                    GROUP, VERSION, NAMESPACE, PLURAL, name, dict(patch), _content_type=MERGE
                )

        await asyncio.to_thread(call)

    async def scale_isvc(self, name: str, replicas: int) -> None:
        """What `kubectl scale`, an HPA or KEDA do: write the /scale subresource."""

        def call() -> None:
            with self._client() as c:
                kubernetes.client.CustomObjectsApi(c).patch_namespaced_custom_object_scale(
                    GROUP,
                    VERSION,
                    NAMESPACE,
                    PLURAL,
                    name,
                    {"spec": {"replicas": replicas}},
                    _content_type=MERGE,
                )

        await asyncio.to_thread(call)

    async def patch_deployment(self, name: str, patch: Mapping[str, Any], status: bool = False) -> None:
        def call() -> None:
            with self._client() as c:
                api = kubernetes.client.AppsV1Api(c)
                method = api.patch_namespaced_deployment_status if status else api.patch_namespaced_deployment
                method(name, NAMESPACE, dict(patch), _content_type=MERGE)

        await asyncio.to_thread(call)

    async def create_service(self, name: str) -> None:
        """A Service nobody owns, as a user might have made by hand."""
        body = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"ports": [{"port": 80}]},
        }

        def call() -> None:
            with self._client() as c:
                kubernetes.client.CoreV1Api(c).create_namespaced_service(NAMESPACE, body)

        await asyncio.to_thread(call)

    async def _send(
        self, method: str, resource: km.resource, name: str, body: Mapping[str, Any] | None = None
    ) -> None:
        """A request as kubectl sends it, to any kind the emulator serves (merge patch for PATCH)."""

        def call() -> None:
            url = f"{self.url}{_path(resource)}/namespaces/{NAMESPACE}/{resource.plural}/{name}"
            headers = {"User-Agent": TEST_USER_AGENT}
            if body is not None:
                headers["Content-Type"] = MERGE
            content = None if body is None else json.dumps(body)
            httpx.request(method, url, headers=headers, content=content, timeout=10).raise_for_status()

        await asyncio.to_thread(call)

    async def delete(self, resource: km.resource, name: str) -> None:
        await self._send("DELETE", resource, name)

    async def create(self, resource: km.resource, body: Mapping[str, Any]) -> None:
        """A POST as kubectl sends it, to any kind the emulator serves."""

        def call() -> None:
            url = f"{self.url}{_path(resource)}/namespaces/{NAMESPACE}/{resource.plural}"
            headers = {"User-Agent": TEST_USER_AGENT, "Content-Type": "application/json"}
            httpx.post(url, headers=headers, content=json.dumps(body), timeout=10).raise_for_status()

        await asyncio.to_thread(call)

    async def patch(self, resource: km.resource, name: str, patch: Mapping[str, Any]) -> None:
        await self._send("PATCH", resource, name, patch)

    async def delete_deployment(self, name: str) -> None:
        def call() -> None:
            with self._client() as c:
                kubernetes.client.AppsV1Api(c).delete_namespaced_deployment(name, NAMESPACE)

        await asyncio.to_thread(call)


def _path(resource: km.resource) -> str:
    return f"/apis/{resource.group}/{resource.version}" if resource.group else f"/api/{resource.version}"


def inference_service(name: str, spec: Mapping[str, Any], namespace: str = NAMESPACE) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        # A fixed uid: kubernetes-client refuses owner references without one, and asserts can name it.
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": dict(spec),
    }


async def eventually(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.02)


class _Server(ThreadingHTTPServer):
    # socketserver's backlog of 5 drops the SYNs of a 50-pod scrape, and each dropped one costs the client a
    # 1 s retransmission: a cost of the stub that 50 real pods, each with its own socket, do not have.
    request_queue_size = 128


class HttpStub:
    """A stand-in for a system at the network's edge (a pod's /metrics, Prometheus) on 127.0.0.1:<random>.

    `respond(path)` gives each GET's (status, content type, body); it runs on the server's thread.
    """

    def __init__(self, respond: Callable[[str], tuple[int, str, bytes]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, content_type, body = respond(self.path)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Operator:
    """The running operator as a test sees it: what Kopf logged (captured from its thread by caplog)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    def count(self, text: str) -> int:
        return sum(text in r.getMessage() for r in self._caplog.records)

    def failures(self) -> list[str]:
        """Kopf's lines for a handler that raised (and so would be retried, or gave up)."""
        return [
            r.getMessage()
            for r in self._caplog.records
            if r.getMessage().startswith("Handler '") and " failed " in r.getMessage()
        ]


class _KopfThread:
    """Kopf in its own thread and event loop, stopped by cancelling its task.

    Not in the test's loop: when cancelled, Kopf also cancels every task of its loop that it did not find
    there at start-up, which in the test's loop would include pytest's own fixture teardown. Cancelling is
    instant, where Kopf's stop flag waits out a graceful shutdown.
    """

    def __init__(self, **options: Any) -> None:
        # kopf.operator()'s own arguments: cluster-wide unless told otherwise, standalone unless peering.
        self.options = {"standalone": "peering_name" not in options, "clusterwide": True, **options}
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kopf", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(kopf.operator(**self.options))
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass  # stop() cancels the task: the normal way out
        except BaseException as e:
            self.error = e
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    async def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(lambda: self.task is not None and self.task.cancel())
        # Joined off the test's loop: the emulator there must keep answering while Kopf winds down.
        await asyncio.to_thread(self._thread.join, 10)
        assert not self._thread.is_alive(), "Kopf did not stop"


@contextlib.asynccontextmanager
async def running_operator(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, standby: bool = False, **options: Any
) -> AsyncIterator[Operator]:
    """The operator, once it watches everything; `standby`: once it started (a paused peer watches nothing).

    `options` go to kopf.operator(), e.g. peering_name= or namespaces=.
    """
    caplog.set_level(logging.DEBUG, logger="kopf")
    kopf_thread = _KopfThread(**options)
    try:
        if standby:
            await eventually(
                lambda: not kopf_thread.running or Operator(caplog).count("Activity 'configure' succeeded"),
                what="Kopf started",
            )
        else:
            # Objects created before Kopf's watch starts would be seen twice (list, then watch).
            watched = [Cluster.ISVCS, *Cluster.CHILD_RESOURCES]
            watched += [r for r in (Cluster.POOLS, Cluster.LWS) if cluster.serves(r)]
            await eventually(
                lambda: not kopf_thread.running or all(cluster.watching(r) for r in watched),
                what="Kopf watching",
            )
        assert kopf_thread.running, f"Kopf stopped at start-up: {kopf_thread.error!r}"
        yield Operator(caplog)
    finally:
        await kopf_thread.stop()
    if kopf_thread.error is not None:
        raise kopf_thread.error


def crd() -> dict[str, Any]:
    with CRD_PATH.open() as f:
        result: dict[str, Any] = yaml.safe_load(f)
    return result


def crd_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the one served version."""
    (version,) = crd()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def schema_errors(obj: Mapping[str, Any]) -> list[str]:
    """What the API server says about `obj`: the structural schema, then the CEL rules on the defaulted object."""
    # OpenAPI v3.0 schemas are closest to JSON Schema draft 4; the x-kubernetes-* keywords are ignored.
    validator = jsonschema.Draft4Validator(crd_schema())
    errors = sorted(
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)
    )
    if errors:
        return errors  # the API server runs CEL only on structurally valid objects
    return cel_errors(crd_schema(), apply_defaults(crd_schema(), obj), "")


def cel_errors(schema: Mapping[str, Any], value: Any, path: str) -> list[str]:
    """Every x-kubernetes-validations rule evaluated where its value is present, as the API server does."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            errors.append(f"{path or '<root>'}: {' '.join(rule['message'].split())}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], f"{path}.{key}" if path else key)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """The API server's defaulting: fill absent properties from `default`, then recurse (defaults included)."""
    if isinstance(value, dict) and "properties" in schema:
        result = dict(value)
        for key, sub in schema["properties"].items():
            if key not in result and "default" in sub:
                result[key] = copy.deepcopy(sub["default"])
            if key in result:
                result[key] = apply_defaults(sub, result[key])
        return result
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value
