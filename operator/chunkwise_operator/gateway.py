"""The Gateway API Inference Extension (GAIE) as the operator writes it: an InferencePool and its messages.

A gateway that implements GAIE sends each request for an InferencePool to the pool's endpoint picker (EPP)
over Envoy ext_proc, and the picker names the pod. Here the picker is the chunkwise router, which already
knows each replica's queue and prefix cache.

The fields follow GAIE's v1 API as released in v1.0.0 (api/v1/inferencepool_types.go at tag v1.0.0), the
first release of `inference.networking.k8s.io/v1`; every field used here is unchanged through v1.6.0:

- spec.selector: {matchLabels: {...}}, required (1 to 64 labels; no matchExpressions).
- spec.targetPorts: [{number}], required, 1 item in v1.0.0 (up to 8 later); the model servers' port.
- spec.endpointPickerRef: required in v1.0.0 (optional since v1.5.0, still required by most gateways):
  group (optional, default ""), kind (optional, default Service), name (required), port: {number}
  (required when kind is Service: the Service's port, not the target port), failureMode (optional,
  FailOpen | FailClose, default FailClose).

`spec.appProtocol` (v1.4.0 on) is left out: its default, http (HTTP/1.1), is what the engine speaks, and
a v1.0.0 API server would reject the field.

Pure: nothing here talks to the API server; manifests.py supplies the names and labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The GAIE release whose v1 API this module follows; the install hint below names it too.
GAIE_VERSION = "v1.0.0"
GROUP = "inference.networking.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
# How `kubectl get crd` names it, and how the condition's message names what is missing.
CRD_NAME = f"{PLURAL}.{GROUP}"
# The port GAIE implementations assume for an EPP Service; the router serves ext_proc (gRPC) there.
EPP_PORT = 9002
EPP_PORT_NAME = "grpc-epp"
# Plaintext HTTP/2 (gRPC without TLS), the Kubernetes-defined appProtocol a gateway reads off the port.
EPP_APP_PROTOCOL = "kubernetes.io/h2c"
# GAIE's default, stated so the live object never reads as drift: with the router down the gateway refuses
# the request rather than send it to a pod of its own picking (which at zero replicas would not exist).
FAILURE_MODE = "FailClose"
INSTALL_HINT = (
    "kubectl apply -f https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/"
    f"{GAIE_VERSION}/manifests.yaml"
)

# The status condition that reports the pool, and its reasons.
CONDITION = "InferencePoolReady"
APPLIED = "Applied"
CRD_NOT_INSTALLED = "CRDNotInstalled"
PENDING = "Pending"


def inference_pool(
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
    target_port: int,
    picker_service: str,
) -> dict[str, Any]:
    """The InferencePool `name`: the pods `selector` matches, on `target_port`, picked by `picker_service`."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": target_port}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker_service,
                "port": {"number": EPP_PORT},
                "failureMode": FAILURE_MODE,
            },
        },
    }


def applied_message(name: str, picker_service: str, target_port: int) -> str:
    return (
        f"InferencePool {name} selects the runtime pods on port {target_port}; its endpoint picker is "
        f"Service {picker_service} port {EPP_PORT}"
    )


def not_installed_message() -> str:
    return (
        f"the API server does not serve {CRD_NAME}/{VERSION}: install the Gateway API Inference Extension's "
        f"CRDs ({INSTALL_HINT}); the operator checks again every status refresh and creates the pool then"
    )
