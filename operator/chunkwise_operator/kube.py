"""Thin I/O against the Kubernetes API: read, create-or-patch and delete the children; read and patch the CR.

Children are written with server-side apply under one field manager, so a field the operator stops setting
(an env var, a node selector) is removed, while fields others own (defaults, other controllers' annotations)
stay. `apply` reads first and writes only when the live object has drifted from the desired one: a field it
sends differs (after canonicalising both sides: the API server stores `cpu: 0.5` as `500m`), or a field its
field manager owns on the live object is one it no longer sends.

Every call carries a timeout and is not retried by the HTTP client: a half-open connection to the API server
raises ApiUnreachable after `timeout` seconds instead of blocking its caller (and what it holds) forever.
"""

from __future__ import annotations

import decimal
import enum
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
import urllib3
from kubernetes.utils.quantity import parse_quantity

from chunkwise_operator import gateway, manifests
from chunkwise_operator.spec import GROUP, PLURAL, VERSION

FIELD_MANAGER = "chunkwise-operator"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
# Seconds one API call may take, connection included. Long enough for a loaded API server's write (its own
# request timeout is 60 s, but a healthy one answers in well under a second), short enough that a dead
# connection frees its caller within one Kopf retry.
DEFAULT_API_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ChildKind:
    """A kind of child object: where the API serves it, and the typed client that reads and writes it.

    A kind without a typed client (`api` None) is a custom resource, written through CustomObjectsApi.
    """

    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    api: Callable[[kubernetes.client.ApiClient], Any] | None = None
    suffix: str = ""  # of the client's *_namespaced_<suffix> methods

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


# Every kind the operator creates; each is watched (drift and deletion are undone) and nothing else is written.
CHILD_KINDS = (
    ChildKind("apps", "v1", "deployments", "Deployment", kubernetes.client.AppsV1Api, "deployment"),
    ChildKind("", "v1", "services", "Service", kubernetes.client.CoreV1Api, "service"),
    ChildKind("", "v1", "serviceaccounts", "ServiceAccount", kubernetes.client.CoreV1Api, "service_account"),
    ChildKind(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        kubernetes.client.PolicyV1Api,
        "pod_disruption_budget",
    ),
    ChildKind(
        "rbac.authorization.k8s.io",
        "v1",
        "rolebindings",
        "RoleBinding",
        kubernetes.client.RbacAuthorizationV1Api,
        "role_binding",
    ),
    # Each router's own Role (manifests.router_role).
    ChildKind(
        "rbac.authorization.k8s.io", "v1", "roles", "Role", kubernetes.client.RbacAuthorizationV1Api, "role"
    ),
    # Served only where GAIE's CRDs are installed: Kopf watches it once it is, and `serves` tells.
    ChildKind(gateway.GROUP, gateway.VERSION, gateway.PLURAL, gateway.KIND),
    # A pipeline-parallel runtime (manifests.runtime_leader_worker_set); served only where LWS is installed.
    ChildKind(manifests.LWS_GROUP, manifests.LWS_VERSION, manifests.LWS_PLURAL, manifests.LWS_KIND),
)
_APIS = {(c.api_version, c.kind): c for c in CHILD_KINDS}
INFERENCE_POOL = _APIS[(gateway.API_VERSION, gateway.KIND)]
LEADER_WORKER_SET = _APIS[(manifests.LWS_API_VERSION, manifests.LWS_KIND)]

# (group, version, plural, kind) of the scalers that may target an InferenceService's /scale: HPA and KEDA.
SCALER_KINDS = (
    ("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler"),
    ("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject"),
)

ApiException = kubernetes.client.ApiException


class ApiUnreachable(ApiException):
    """No answer from the API server: a timeout, a refused or dropped connection.

    An ApiException (status 0), so every caller that handles the API server's errors handles this one too.
    """

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(status=0, reason=f"no answer from the API server to {what}: {error}")


class Outcome(enum.Enum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


class ChildConflict(Exception):
    """An object with a child's name exists but belongs to someone else; it is never taken over."""


# Fields holding quantities (or maps of them): the API server stores a quantity in canonical form, so
# `cpu: "0.5"` and `memory: 1.5Gi` read back as "500m" and "1536Mi".
QUANTITIES = frozenset({"requests", "limits", "sizeLimit"})


def _quantity(value: Any) -> decimal.Decimal | None:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    try:
        return decimal.Decimal(parse_quantity(value))
    except (ValueError, decimal.InvalidOperation):
        return None


def differs(desired: Any, live: Any, quantity: bool = False) -> bool:
    """True when some field of `desired` is missing from or differs in `live`.

    Extra fields in `live` are no difference here: the API server adds defaults and status, other controllers
    add annotations (`unsent` finds the extra fields that are the operator's own). Lists compare element by
    element, so a reordered or shortened list differs. `quantity`: compare by value, not spelling.
    """
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return True
        return any(
            key not in live or differs(value, live[key], quantity or key in QUANTITIES)
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return True
        return any(differs(d, v) for d, v in zip(desired, live))
    if quantity and desired != live:
        a = _quantity(desired)
        return a is None or a != _quantity(live)
    return bool(desired != live)


def unsent(fields: Any, desired: Any, path: str = "") -> Iterator[str]:
    """The fields of a managedFields entry (FieldsV1) that `desired` no longer has: what the operator owns
    on the live object and stopped sending, which only an apply removes.

    FieldsV1 names a map's field "f:<name>", a list element by its merge key "k:{json}" (e.g. a container
    by name), a set element "v:<json>", a position "i:<n>"; "." is the node itself.
    """
    if not isinstance(fields, Mapping):
        return
    for key, sub in fields.items():
        if key == ".":
            continue
        here = f"{path}.{key}" if path else key
        child = _resolve(key, desired)
        if child is _ABSENT:
            yield here
        else:
            yield from unsent(sub, child, here)


_ABSENT = object()


def _resolve(key: str, desired: Any) -> Any:
    kind, _, rest = key.partition(":")
    if kind == "f":
        return desired[rest] if isinstance(desired, Mapping) and rest in desired else _ABSENT
    if not isinstance(desired, list):
        return _ABSENT
    if kind == "i":
        return desired[int(rest)] if rest.isdigit() and int(rest) < len(desired) else _ABSENT
    try:
        value = json.loads(rest)
    except ValueError:
        return _ABSENT
    if kind == "v":
        return value if value in desired else _ABSENT
    if kind == "k" and isinstance(value, Mapping):
        for item in desired:
            # A key field the operator leaves to the server's default (a port's protocol) is absent here.
            if isinstance(item, Mapping) and all(
                item.get(k) == v for k, v in value.items() if k in item or k != "protocol"
            ):
                return item
    return _ABSENT


def owned_fields(live: Mapping[str, Any], manager: str = FIELD_MANAGER) -> Any:
    """The FieldsV1 that `manager` set by apply on `live` (None if it applied nothing there)."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if (
            isinstance(entry, Mapping)
            and entry.get("manager") == manager
            and entry.get("operation") == "Apply"
            and entry.get("subresource") in (None, "")
        ):
            return entry.get("fieldsV1")
    return None


def drifted(desired: Any, live: Any) -> bool:
    """True when `live` is not what an apply of `desired` would leave: a sent field differs, or a field this
    field manager owns on `live` is no longer sent (an env var or a nodeSelector deleted from the spec)."""
    if differs(desired, live):
        return True
    owned = owned_fields(live) if isinstance(live, Mapping) else None
    return next(unsent(owned, desired), None) is not None


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(ref, Mapping) and ref.get("uid") == uid for ref in refs)


def controller_owner(obj: Mapping[str, Any]) -> str | None:
    """The name of the InferenceService controlling `obj`, if one does."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if (
            isinstance(ref, Mapping)
            and ref.get("controller")
            and ref.get("apiVersion") == f"{GROUP}/{VERSION}"
            and ref.get("kind") == "InferenceService"
        ):
            name = ref.get("name")
            return name if isinstance(name, str) else None
    return None


class _Timed:
    """A typed API client whose every call carries the timeout and raises ApiUnreachable for no answer."""

    def __init__(self, api: Any, timeout: float) -> None:
        self._api = api
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._api, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs, _request_timeout=self._timeout)
            except urllib3.exceptions.HTTPError as e:
                raise ApiUnreachable(name, e) from e

        return call


class Kube:
    def __init__(
        self, api_client: kubernetes.client.ApiClient, timeout: float = DEFAULT_API_TIMEOUT_S
    ) -> None:
        self._client = api_client
        self.timeout = timeout

    @classmethod
    def from_configuration(
        cls, config: kubernetes.client.Configuration, timeout: float = DEFAULT_API_TIMEOUT_S
    ) -> Kube:
        # No retries inside the HTTP client: urllib3 would retry a GET that timed out three more times,
        # quadrupling the bound. A failed call fails its handler, and Kopf's retry (with its delay) decides.
        config.retries = False
        return cls(kubernetes.client.ApiClient(config), timeout)

    @classmethod
    def from_environment(cls, timeout: float = DEFAULT_API_TIMEOUT_S) -> Kube:
        """In-cluster credentials when running in a pod, else the kubeconfig (the same order Kopf uses)."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            # KUBECONFIG read now, not when the kubernetes package was imported (its default's behaviour).
            kubernetes.config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=config, persist_config=False
            )
        return cls.from_configuration(config, timeout)

    def close(self) -> None:
        self._client.close()

    def _api(self, api: Callable[[kubernetes.client.ApiClient], Any]) -> Any:
        """Every API call goes through here, so that none is made without the timeout."""
        return _Timed(api(self._client), self.timeout)

    def _call(self, api_version: str, kind: str, verb: str, **kwargs: Any) -> Any:
        try:
            child_kind = _APIS[(api_version, kind)]
        except KeyError:
            raise ValueError(f"the operator does not manage {api_version} {kind}") from None
        if child_kind.api is None:
            response = self._custom_call(child_kind, verb, **kwargs)
        else:
            method = getattr(self._api(child_kind.api), f"{verb}_namespaced_{child_kind.suffix}")
            # Raw JSON, not the client's models: the builders and the status code speak plain dicts.
            response = method(**kwargs, _preload_content=False)
        data = response.data
        return json.loads(data) if data else None

    def _custom_call(self, c: ChildKind, verb: str, namespace: str, name: str = "", **kwargs: Any) -> Any:
        """The typed clients' verbs for a custom resource: CustomObjectsApi spells each one differently."""
        api = self._api(kubernetes.client.CustomObjectsApi)
        where = (c.group, c.version, namespace, c.plural)
        if verb == "read":
            return api.get_namespaced_custom_object(*where, name, **kwargs, _preload_content=False)
        if verb == "patch":
            body = kwargs.pop("body")
            return api.patch_namespaced_custom_object(*where, name, body, **kwargs, _preload_content=False)
        if verb == "create":
            body = kwargs.pop("body")
            return api.create_namespaced_custom_object(*where, body, **kwargs, _preload_content=False)
        if verb == "delete":
            return api.delete_namespaced_custom_object(*where, name, **kwargs, _preload_content=False)
        raise ValueError(f"no verb {verb!r} for {c.api_version} {c.kind}")

    def serves(self, child_kind: ChildKind) -> bool:
        """Whether the API server serves `child_kind` (discovery of its group/version: 404 when absent).

        Discovery, not a failed write: on a real API server a write to an unserved resource and a read of an
        absent object both answer 404, and discovery is open to every authenticated client (no RBAC rule).
        """
        api = self._api(kubernetes.client.CustomObjectsApi)
        try:
            response: Any = api.get_api_resources(
                child_kind.group, child_kind.version, _preload_content=False
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        resources = json.loads(response.data or b"{}").get("resources") or []
        return any(isinstance(r, Mapping) and r.get("name") == child_kind.plural for r in resources)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self._call(api_version, kind, "read", name=name, namespace=namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return result

    def apply(self, desired: Mapping[str, Any], owner_uid: str) -> Outcome:
        """Create `desired`, or server-side-apply it over a drifted live object owned by `owner_uid`."""
        api_version, kind = desired["apiVersion"], desired["kind"]
        meta = desired["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        live = self.get(api_version, kind, namespace, name)
        if live is not None and not owned_by(live, owner_uid):
            raise ChildConflict(f"{kind} {namespace}/{name} exists and is not owned by this InferenceService")
        if live is not None and not drifted(desired, live):
            return Outcome.UNCHANGED
        if live is not None and "roleRef" in desired and live.get("roleRef") != desired["roleRef"]:
            # A RoleBinding's roleRef cannot change in place (the API server refuses the patch): one from an
            # older operator (bound to the shared ClusterRole chunkwise-router) is deleted and created anew.
            self._call(api_version, kind, "delete", name=name, namespace=namespace)
            live = None
        try:
            self._call(
                api_version,
                kind,
                "patch",
                name=name,
                namespace=namespace,
                body=dict(desired),
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=APPLY,
            )
        except ApiException as e:
            # A real API server creates on apply; emulators that only patch existing objects answer 404.
            if e.status != 404 or live is not None:
                raise
            self._call(
                api_version,
                kind,
                "create",
                namespace=namespace,
                body=dict(desired),
                field_manager=FIELD_MANAGER,
            )
        return Outcome.CREATED if live is None else Outcome.PATCHED

    def delete_owned(self, api_version: str, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the object if it exists and is owned by `owner_uid`; True if a delete was sent."""
        live = self.get(api_version, kind, namespace, name)
        if live is None or not owned_by(live, owner_uid):
            return False
        try:
            self._call(
                api_version, kind, "delete", name=name, namespace=namespace, propagation_policy="Background"
            )
        except ApiException as e:
            if e.status != 404:
                raise
            return False
        return True

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        api = self._api(kubernetes.client.CustomObjectsApi)
        try:
            response: Any = api.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        result: dict[str, Any] = json.loads(response.data)
        return result

    def patch_inference_service(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """A merge patch of the CR itself: the autoscaler writes spec.replicas here, the count's one source.

        A metadata.resourceVersion in `patch` is a precondition: the API server answers 409 if it is stale.
        """
        api = self._api(kubernetes.client.CustomObjectsApi)
        api.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            dict(patch),
            field_manager=FIELD_MANAGER,
            _content_type=MERGE,
            _preload_content=False,
        )

    def ensure_peering(self, name: str, namespace: str | None) -> bool:
        """Create the ClusterKopfPeering (or, for a namespace, KopfPeering) `name`; True if it was absent.

        The operator makes its own, rather than manifests/: `kubectl apply -k` of a CRD and an object of it
        together fails on a fresh cluster, before the CRD is established.
        """
        api = self._api(kubernetes.client.CustomObjectsApi)
        kind = "ClusterKopfPeering" if namespace is None else "KopfPeering"
        body = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": name}}
        try:
            if namespace is None:
                api.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", body)
            else:
                api.create_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", body)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def list_scalers(self, namespace: str) -> list[dict[str, Any]]:
        """Every HPA and ScaledObject in the namespace; a kind the cluster does not serve (no KEDA) has none."""
        api = self._api(kubernetes.client.CustomObjectsApi)
        result: list[dict[str, Any]] = []
        for group, version, plural, kind in SCALER_KINDS:
            try:
                response: Any = api.list_namespaced_custom_object(
                    group, version, namespace, plural, _preload_content=False
                )
            except ApiException as e:
                if e.status == 404:
                    continue
                raise
            # List items carry no kind of their own.
            result += [{**item, "kind": kind} for item in json.loads(response.data).get("items") or []]
        return result

    def list_pods(self, namespace: str, match_labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Pods carrying all of `match_labels` (checked here too: not every API server emulator filters)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        response: Any = self._api(kubernetes.client.CoreV1Api).list_namespaced_pod(
            namespace, label_selector=selector, _preload_content=False
        )
        items = json.loads(response.data).get("items") or []
        return [
            pod
            for pod in items
            if all(
                ((pod.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in match_labels.items()
            )
        ]

    def patch_inference_service_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        api = self._api(kubernetes.client.CustomObjectsApi)
        api.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": dict(patch)},
            field_manager=FIELD_MANAGER,
            _content_type=MERGE,
            _preload_content=False,
        )
