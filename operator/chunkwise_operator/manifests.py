"""Pure builders: an InferenceService's name, namespace and parsed spec in, its children's manifests out.

Nothing here talks to the API server, so every object can be checked by exact assertion and by
kubernetes-validate. Owner references are added by the caller (reconcile.py), which holds the owner's body.
"""

from __future__ import annotations

import math
from typing import Any

from chunkwise_operator.spec import GROUP, ServiceSpec

RUNTIME_PORT = 8000
ROUTER_PORT = 8080
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MODEL_MOUNT_PATH = "/models"
GPU_RESOURCE = "nvidia.com/gpu"

# The preStop sleep lets endpoint removal reach every kube-proxy and the router before SIGTERM starts the
# engine's drain; without it, requests keep arriving at a replica that has begun refusing them.
PRESTOP_SLEEP_SECONDS = 5
# Slack after the drain for the process to flush and exit before the kubelet's SIGKILL.
SHUTDOWN_MARGIN_SECONDS = 10
LIVENESS_PERIOD_SECONDS = 10
# Loading weights can take minutes; the startup probe holds liveness off for up to this long.
STARTUP_PERIOD_SECONDS = 5
STARTUP_FAILURE_THRESHOLD = 120

MANAGER = "chunkwise-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = f"{GROUP}/inferenceservice"
RUNTIME = "runtime"
ROUTER = "router"
# Shipped in manifests/rbac.yaml: read access to EndpointSlices, bound per namespace to each router.
ROUTER_CLUSTER_ROLE = "chunkwise-router"

Manifest = dict[str, Any]


def runtime_name(name: str) -> str:
    return name


def router_name(name: str) -> str:
    return f"{name}-router"


def labels(name: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "chunkwise",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGER,
        LABEL_SERVICE: name,
    }


def match_labels(name: str, component: str) -> dict[str, str]:
    """The Deployment selector; immutable once created, so it never depends on the spec."""
    return {LABEL_SERVICE: name, LABEL_COMPONENT: component}


def selector_string(name: str) -> str:
    """The runtime pods' selector in the form /scale publishes (status.selector), for HPA and KEDA."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels(name, RUNTIME).items()))


def service_url(name: str, namespace: str, spec: ServiceSpec) -> str:
    """Where clients send requests: the router when there is one, else the runtime Service."""
    if spec.router.enabled:
        return f"http://{router_name(name)}.{namespace}.svc:{ROUTER_PORT}"
    return f"http://{runtime_name(name)}.{namespace}.svc:{RUNTIME_PORT}"


def model_argument(spec: ServiceSpec) -> str:
    model = spec.model
    if model.source == "preset":
        assert model.preset is not None
        return model.preset
    if model.source == "pvc":
        return f"{MODEL_MOUNT_PATH}/{model.path}" if model.path else MODEL_MOUNT_PATH
    assert model.path is not None
    return model.path


def engine_command(spec: ServiceSpec) -> list[str]:
    """`chunkwise serve ...` with exactly the flags the runtime defines, in its documented order."""
    e = spec.engine
    argv = [
        "chunkwise",
        "serve",
        "--model",
        model_argument(spec),
        "--served-model-name",
        spec.model.served_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(RUNTIME_PORT),
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--block-size",
        str(e.block_size),
    ]
    if e.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
    argv += ["--preemption-mode", e.preemption_mode]
    argv.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    if e.speculation.method != "none":
        argv += [
            "--speculative-method",
            e.speculation.method,
            "--num-speculative-tokens",
            str(e.speculation.num_tokens),
        ]
    argv += [
        "--queue-delay-slo-seconds",
        repr(e.queue_delay_slo_seconds),
        "--drain-timeout-seconds",
        str(e.drain_grace_seconds),
    ]
    return argv


def router_command(name: str, namespace: str, spec: ServiceSpec) -> list[str]:
    return [
        "chunkwise",
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        str(ROUTER_PORT),
        "--policy",
        spec.router.policy,
        "--kube-service",
        runtime_name(name),
        "--namespace",
        namespace,
    ]


def termination_grace_seconds(spec: ServiceSpec) -> int:
    return PRESTOP_SLEEP_SECONDS + spec.engine.drain_grace_seconds + SHUTDOWN_MARGIN_SECONDS


def _metadata(name: str, namespace: str, component: str) -> Manifest:
    child = runtime_name(name) if component == RUNTIME else router_name(name)
    return {"name": child, "namespace": namespace, "labels": labels(name, component)}


def _http_probe(port: str, period: int, timeout: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _runtime_resources(spec: ServiceSpec) -> Manifest:
    r = spec.resources
    # No CPU limit: CFS throttling stretches step times (the p99 the autoscaler watches) for no gain.
    limits: dict[str, Any] = {"memory": r.memory}
    if r.gpu:
        # A string, as the API server stores quantities: an int would read as drift on every comparison.
        limits[GPU_RESOURCE] = str(r.gpu)
    return {"requests": {"cpu": r.cpu, "memory": r.memory}, "limits": limits}


def _tolerations(spec: ServiceSpec) -> list[Manifest]:
    result: list[Manifest] = []
    for t in spec.pod.tolerations:
        item: Manifest = {"operator": t.operator}
        if t.key is not None:
            item["key"] = t.key
        if t.value is not None:
            item["value"] = t.value
        if t.effect is not None:
            item["effect"] = t.effect
        if t.toleration_seconds is not None:
            item["tolerationSeconds"] = t.toleration_seconds
        result.append(item)
    # GPU nodes are commonly tainted so that only GPU workloads land there.
    if spec.resources.gpu and not any(t.key == GPU_RESOURCE for t in spec.pod.tolerations):
        result.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return result


def _env(spec: ServiceSpec) -> list[Manifest]:
    result: list[Manifest] = []
    for var in spec.pod.env:
        item: Manifest = {"name": var.name}
        if var.value is not None:
            item["value"] = var.value
        if var.value_from is not None:
            item["valueFrom"] = dict(var.value_from)
        result.append(item)
    return result


def runtime_deployment(name: str, namespace: str, spec: ServiceSpec) -> Manifest:
    component = RUNTIME
    drain = spec.engine.drain_grace_seconds
    argv = engine_command(spec)
    container: Manifest = {
        "name": "engine",
        "image": spec.image,
        "command": argv[:1],
        "args": argv[1:],
        "ports": [{"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        "resources": _runtime_resources(spec),
        "startupProbe": _http_probe("http", STARTUP_PERIOD_SECONDS, 2, STARTUP_FAILURE_THRESHOLD),
        # /health answers 503 while draining: readiness drops the replica from endpoints at once.
        "readinessProbe": _http_probe("http", 5, 2, 2),
        # Liveness must outlast a full drain of 503s, or the kubelet kills a replica mid-drain.
        "livenessProbe": _http_probe(
            "http", LIVENESS_PERIOD_SECONDS, 5, 3 + math.ceil(drain / LIVENESS_PERIOD_SECONDS)
        ),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy
    env = _env(spec)
    if env:
        container["env"] = env

    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(RUNTIME_PORT),
        "prometheus.io/path": METRICS_PATH,
    }
    annotations.update(dict(spec.pod.annotations))

    pod: Manifest = {
        # The engine never calls the Kubernetes API; no token is mounted into it.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [container],
    }
    if spec.pod.node_selector:
        pod["nodeSelector"] = dict(spec.pod.node_selector)
    tolerations = _tolerations(spec)
    if tolerations:
        pod["tolerations"] = tolerations
    if spec.model.source == "pvc":
        pod["volumes"] = [
            {"name": "model", "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True}}
        ]
        container["volumeMounts"] = [{"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}]

    # A surge pod needs a free accelerator, which GPU pools rarely have: replace in place instead.
    if spec.resources.gpu:
        rolling = {"maxSurge": 0, "maxUnavailable": 1}
    else:
        rolling = {"maxSurge": 1, "maxUnavailable": 0}

    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, component),
        "spec": {
            # The CR's spec.replicas is the single source: /scale, HPA, KEDA and the autoscaler all write it.
            "replicas": spec.replicas,
            "selector": {"matchLabels": match_labels(name, component)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": {
                "metadata": {"labels": labels(name, component), "annotations": annotations},
                "spec": pod,
            },
        },
    }


def runtime_service(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, RUNTIME),
        "spec": {
            "type": "ClusterIP",
            "selector": match_labels(name, RUNTIME),
            "ports": [{"name": "http", "port": RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(name: str, namespace: str) -> Manifest:
    # maxUnavailable rather than minAvailable: a one-replica service must still let nodes drain.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, RUNTIME),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": match_labels(name, RUNTIME)}},
    }


def router_service_account(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(name, namespace, ROUTER),
    }


def router_role_binding(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(name, namespace, ROUTER),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": ROUTER_CLUSTER_ROLE,
        },
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": namespace}],
    }


def router_deployment(name: str, namespace: str, spec: ServiceSpec) -> Manifest:
    argv = router_command(name, namespace, spec)
    r = spec.router.resources
    container: Manifest = {
        "name": "router",
        "image": spec.router.image or spec.image,
        "command": argv[:1],
        "args": argv[1:],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": r.cpu, "memory": r.memory}, "limits": {"memory": r.memory}},
        "readinessProbe": _http_probe("http", 5, 2, 2),
        "livenessProbe": _http_probe("http", LIVENESS_PERIOD_SECONDS, 5, 3),
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if spec.router.image is None and spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, ROUTER),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": match_labels(name, ROUTER)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels(name, ROUTER)},
                "spec": {
                    # The router watches EndpointSlices of the runtime Service, so it needs its token.
                    "serviceAccountName": router_name(name),
                    "automountServiceAccountToken": True,
                    "containers": [container],
                },
            },
        },
    }


def router_service(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, ROUTER),
        "spec": {
            "type": "ClusterIP",
            "selector": match_labels(name, ROUTER),
            "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def children(name: str, namespace: str, spec: ServiceSpec) -> list[Manifest]:
    """Every object the service should have, in creation order (a router's account before its pods)."""
    result = [
        runtime_deployment(name, namespace, spec),
        runtime_service(name, namespace),
        pod_disruption_budget(name, namespace),
    ]
    if spec.router.enabled:
        result += [
            router_service_account(name, namespace),
            router_role_binding(name, namespace),
            router_deployment(name, namespace, spec),
            router_service(name, namespace),
        ]
    return result


def router_children_refs(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what exists only while the router is enabled; removed when it is not."""
    n = router_name(name)
    return [
        ("v1", "Service", n),
        ("apps/v1", "Deployment", n),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", n),
        ("v1", "ServiceAccount", n),
    ]


def stale_children(name: str, spec: ServiceSpec) -> list[tuple[str, str, str]]:
    return [] if spec.router.enabled else router_children_refs(name)
