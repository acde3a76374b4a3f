"""The Gateway API Inference Extension from the operator, pure: the InferencePool and the router as its EPP.

The pool is held to GAIE v1.0.0's v1 API (api/v1/inferencepool_types.go at tag v1.0.0 of
kubernetes-sigs/gateway-api-inference-extension), the first release of inference.networking.k8s.io/v1;
the fields used are unchanged through v1.6.0. POOL_SPEC_V1_0_0 below is that API's spec, transcribed by
hand from the Go types' markers (required, optional, enum, bounds), as a JSON Schema.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kopf
import kubernetes_validate
import pytest

from chunkwise_operator import gateway, manifests, status
from chunkwise_operator.spec import SpecError, parse

GAIE_VERSION = "v1.0.0"
ROUTED_POOL: dict[str, Any] = {
    "model": {"preset": "tiny"},
    "image": "chunkwise:dev",
    "router": {"enabled": True},
    "gateway": {"inferencePool": True},
}
ROUTED = {**ROUTED_POOL, "gateway": {"inferencePool": False}}

_PORT = {
    "type": "object",
    "required": ["number"],
    "additionalProperties": False,
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
# InferencePoolSpec of GAIE v1.0.0. additionalProperties: false, because the API server prunes (or, with
# strict field validation, refuses) what the schema does not declare: a field set here and missing there
# would be silently lost.
POOL_SPEC_V1_0_0: dict[str, Any] = {
    "type": "object",
    "required": ["selector", "targetPorts", "endpointPickerRef"],
    "additionalProperties": False,
    "properties": {
        "selector": {
            "type": "object",
            "required": ["matchLabels"],
            "additionalProperties": False,
            "properties": {
                "matchLabels": {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": 64,
                    "additionalProperties": {"type": "string", "maxLength": 63},
                }
            },
        },
        # MaxItems=1 in v1.0.0 (8 from v1.1 on): one port is valid for every v1 release.
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _PORT},
        "endpointPickerRef": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "group": {"type": "string", "maxLength": 253},
                "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                "name": {"type": "string", "minLength": 1, "maxLength": 253},
                "port": _PORT,
                "failureMode": {"enum": ["FailOpen", "FailClose"]},
            },
        },
    },
}


def pool_errors(pool: dict[str, Any]) -> list[str]:
    errors = [e.message for e in jsonschema.Draft4Validator(POOL_SPEC_V1_0_0).iter_errors(pool["spec"])]
    ref = pool["spec"].get("endpointPickerRef") or {}
    # The CEL rule on EndpointPickerRef: "port is required when kind is 'Service' or unspecified".
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("endpointPickerRef.port is required for a Service")
    return errors


def test_the_module_follows_the_gaie_release_this_test_checks() -> None:
    assert gateway.GAIE_VERSION == GAIE_VERSION
    assert (gateway.API_VERSION, gateway.KIND, gateway.PLURAL) == (
        "inference.networking.k8s.io/v1",
        "InferencePool",
        "inferencepools",
    )
    assert GAIE_VERSION in gateway.INSTALL_HINT


def test_the_inference_pool_is_exactly_the_v1_api() -> None:
    pool = manifests.inference_pool("chat", "ml")
    assert pool == {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": "chat",
            "namespace": "ml",
            "labels": {
                "app.kubernetes.io/name": "chunkwise",
                "app.kubernetes.io/instance": "chat",
                "app.kubernetes.io/component": "runtime",
                "app.kubernetes.io/managed-by": "chunkwise-operator",
                "serving.chunkwise.dev/inferenceservice": "chat",
            },
        },
        "spec": {
            "selector": {
                "matchLabels": {
                    "serving.chunkwise.dev/inferenceservice": "chat",
                    "app.kubernetes.io/component": "runtime",
                }
            },
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": "chat-router",
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
    }
    assert pool_errors(pool) == []


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda s: s.pop("endpointPickerRef"), "'endpointPickerRef' is a required property"),
        (lambda s: s["endpointPickerRef"].pop("port"), "endpointPickerRef.port is required for a Service"),
        (lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8001}]), "is too long"),
        (lambda s: s["endpointPickerRef"].update(failureMode="Open"), "is not one of"),
        (lambda s: s.update(appProtocol="http"), "Additional properties are not allowed"),
        (lambda s: s.update(selector={"app": "x"}), "'matchLabels' is a required property"),
    ],
    ids=["no-epp", "no-epp-port", "two-ports", "bad-failure-mode", "v1.4-field", "bare-selector"],
)
def test_the_v1_0_0_check_can_fail(edit: Any, expected: str) -> None:
    pool = manifests.inference_pool("chat", "ml")
    edit(pool["spec"])
    assert any(expected in e for e in pool_errors(pool)), pool_errors(pool)


def test_the_pool_selects_exactly_the_runtime_services_pods_on_the_engines_port() -> None:
    parsed = parse(ROUTED_POOL)
    children = {(c["kind"], c["metadata"]["name"]): c for c in manifests.children("chat", "ml", parsed)}
    pool = children["InferencePool", "chat"]["spec"]
    runtime_service = children["Service", "chat"]["spec"]
    runtime = children["Deployment", "chat"]["spec"]
    router_service = children["Service", "chat-router"]["spec"]
    assert pool["selector"]["matchLabels"] == runtime_service["selector"]
    assert pool["selector"]["matchLabels"] == runtime["selector"]["matchLabels"]
    # Not the router's pods, which carry the same service label.
    router_labels = children["Deployment", "chat-router"]["spec"]["template"]["metadata"]["labels"]
    assert not pool["selector"]["matchLabels"].items() <= router_labels.items()
    (engine,) = runtime["template"]["spec"]["containers"]
    assert pool["targetPorts"] == [{"number": p["containerPort"]} for p in engine["ports"]]
    ref = pool["endpointPickerRef"]
    assert ref["name"] == manifests.router_name("chat")
    # The picker's port is the Service's port (not its target), as GAIE's API says for kind Service.
    assert ref["port"]["number"] in [p["port"] for p in router_service["ports"]]


def test_the_router_is_the_endpoint_picker_on_9002() -> None:
    parsed = parse(ROUTED_POOL)
    argv = manifests.router_command("chat", "ml", parsed)
    assert argv[-2:] == ["--epp-port", "9002"]
    deployment = manifests.router_deployment("chat", "ml", parsed)
    (router,) = deployment["spec"]["template"]["spec"]["containers"]
    assert router["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"},
        {"name": "grpc-epp", "containerPort": 9002, "protocol": "TCP"},
    ]
    service = manifests.router_service("chat", "ml", epp=True)
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"},
        {
            "name": "grpc-epp",
            "port": 9002,
            "targetPort": "grpc-epp",
            "protocol": "TCP",
            "appProtocol": "kubernetes.io/h2c",
        },
    ]
    children = manifests.children("chat", "ml", parsed)
    assert children[-2] == service and children[-1] == manifests.inference_pool("chat", "ml")


def test_without_the_field_there_is_no_pool_and_no_epp() -> None:
    parsed = parse(ROUTED)
    children = manifests.children("chat", "ml", parsed)
    assert gateway.KIND not in [c["kind"] for c in children]
    assert "--epp-port" not in manifests.router_command("chat", "ml", parsed)
    router_service = manifests.router_service("chat", "ml")
    assert [p["name"] for p in router_service["spec"]["ports"]] == ["http"]
    assert children[-1] == router_service
    assert ("inference.networking.k8s.io/v1", "InferencePool", "chat") in manifests.stale_children(
        "chat", parsed
    )
    with_pool = manifests.stale_children("chat", parse(ROUTED_POOL))
    assert with_pool == [("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "chat")]


def test_every_builtin_child_with_a_pool_validates_for_kubernetes_1_30() -> None:
    children = manifests.children("chat", "ml", parse(ROUTED_POOL))
    kopf.append_owner_reference(
        children,
        owner=kopf.Body(
            {
                "apiVersion": "serving.chunkwise.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "chat", "uid": "u"},
            }
        ),
    )  # type: ignore[arg-type]
    assert len(children) == 10  # the router has its PodDisruptionBudget and its Role
    for child in children:
        assert child["metadata"]["ownerReferences"][0]["uid"] == "u"
        if child["kind"] == gateway.KIND:
            assert pool_errors(child) == []
        else:
            kubernetes_validate.validate(child, "1.30.0", strict=True)


def pool_conditions(status: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (c["status"], c["reason"], c["message"])
        for c in status["conditions"]
        if c["type"] == gateway.CONDITION
    ]


def test_the_pool_condition_follows_the_reconcile_and_survives_the_other_writers() -> None:
    common: dict[str, Any] = {"name": "chat", "namespace": "ml", "runtime": None, "router": None}
    pooled = parse(ROUTED_POOL)
    pending = status.compute_status(**common, parsed=pooled, previous={}, now="2030-01-01T00:00:00Z")
    assert pool_conditions(pending) == [("Unknown", "Pending", "the InferencePool has not been applied yet")]
    missing = status.PoolState(False, gateway.CRD_NOT_INSTALLED, gateway.not_installed_message())
    first = status.compute_status(
        **common, parsed=pooled, previous=pending, now="2030-01-01T00:01:00Z", pool=missing
    )
    assert pool_conditions(first) == [("False", "CRDNotInstalled", gateway.not_installed_message())]
    # The Deployment watch and the status refresh know nothing of the pool: they keep what the reconcile found.
    kept = status.compute_status(**common, parsed=pooled, previous=first, now="2030-01-01T00:02:00Z")
    assert pool_conditions(kept) == pool_conditions(first)
    applied = status.PoolState(True, gateway.APPLIED, gateway.applied_message("chat", "chat-router", 8000))
    ready = status.compute_status(
        **common, parsed=pooled, previous=kept, now="2030-01-01T00:03:00Z", pool=applied
    )
    assert pool_conditions(ready) == [("True", "Applied", applied.message)]
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times[gateway.CONDITION] == "2030-01-01T00:03:00Z"
    # An invalid spec leaves the pool as it is, and its condition too.
    invalid = SpecError("InvalidRouter", "spec.router.policy must be one of ...")
    frozen = status.compute_status(**common, parsed=invalid, previous=ready, now="2030-01-01T00:04:00Z")
    assert pool_conditions(frozen) == pool_conditions(ready)
    # The field turned off: the pool is deleted and the condition goes.
    off = status.compute_status(**common, parsed=parse(ROUTED), previous=ready, now="2030-01-01T00:05:00Z")
    assert pool_conditions(off) == []
    assert status.INFERENCE_POOL_READY in status.CONDITION_TYPES
