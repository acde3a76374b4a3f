"""manifests.py: exact children for a few specs, and every built object valid for Kubernetes 1.30."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import kubernetes_validate
import pytest

from chunkwise_operator import manifests
from chunkwise_operator.spec import ServiceSpec, SpecError, parse

MINIMAL = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}
GPU_ROUTER: dict[str, Any] = {
    "model": {"pvc": {"claimName": "models", "path": "org/llama"}, "servedName": "llama-8b"},
    "image": "reg/chunkwise:1",
    "imagePullPolicy": "IfNotPresent",
    "replicas": 2,
    "resources": {"cpu": "8", "memory": "64Gi", "gpu": 1},
    "engine": {
        "maxNumSeqs": 128,
        "maxNumBatchedTokens": 2048,
        "blockSize": 32,
        "kvCacheMemory": "40Gi",
        "preemptionMode": "swap",
        "enablePrefixCaching": False,
        "speculation": {"method": "ngram", "numTokens": 3},
        "queueDelaySloSeconds": 2.5,
        "drainGraceSeconds": 60,
    },
    "autoscaling": {"enabled": True, "delegated": True, "minReplicas": 1, "maxReplicas": 8},
    "router": {"enabled": True, "policy": "least-loaded", "replicas": 2},
    "pod": {
        "nodeSelector": {"pool": "h100"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "annotations": {"prometheus.io/scrape": "false", "team": "ml"},
    },
}
HF_GPU: dict[str, Any] = {
    "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main", "credentialsSecret": "hf-token"},
    "resources": {"cpu": "8", "memory": "48Gi", "gpu": 1},
    "engine": {"kvCacheMemory": "40Gi", "extraArgs": ["--max-model-len", "8192"]},
    "router": {"enabled": True},
    "pod": {
        "env": [{"name": "HF_ENDPOINT", "value": "http://mirror.internal"}],
        "imagePullSecrets": [{"name": "r"}],
    },
}
IMAGE_PATH = {
    "model": {"path": "/opt/model"},
    "image": "chunkwise:dev",
    "engine": {"speculation": {"method": "draft"}},
    "replicas": 0,
}
RUNTIME_LABELS = {
    "app.kubernetes.io/name": "chunkwise",
    "app.kubernetes.io/instance": "tiny",
    "app.kubernetes.io/component": "runtime",
    "app.kubernetes.io/managed-by": "chunkwise-operator",
    "serving.chunkwise.dev/inferenceservice": "tiny",
}
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "fsGroup": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}
OWNER: dict[str, Any] = {
    "apiVersion": "serving.chunkwise.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "svc", "namespace": "ml", "uid": "0b5c7a9e-1111-2222-3333-444455556666"},
}


def spec(data: dict[str, Any]) -> ServiceSpec:
    return parse(data)


def test_engine_command_minimal() -> None:
    assert manifests.engine_command(spec(MINIMAL)) == [
        "chunkwise", "serve",
        "--model", "tiny",
        "--served-model-name", "tiny",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--device", "cpu",
        "--dtype", "auto",
        "--max-num-seqs", "256",
        "--max-num-batched-tokens", "1024",
        "--block-size", "16",
        "--preemption-mode", "auto",
        "--enable-prefix-caching",
        "--queue-delay-slo-seconds", "30.0",
        "--drain-timeout-seconds", "30",
    ]  # fmt: skip


def test_engine_command_every_flag() -> None:
    assert manifests.engine_command(spec(GPU_ROUTER)) == [
        "chunkwise", "serve",
        "--model", "/models/org/llama",
        "--served-model-name", "llama-8b",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--device", "cuda",
        "--dtype", "auto",
        "--max-num-seqs", "128",
        "--max-num-batched-tokens", "2048",
        "--block-size", "32",
        "--kv-cache-memory-bytes", str(40 * 2**30),
        "--preemption-mode", "swap",
        "--no-enable-prefix-caching",
        "--speculative-method", "ngram",
        "--num-speculative-tokens", "3",
        "--queue-delay-slo-seconds", "2.5",
        "--drain-timeout-seconds", "60",
    ]  # fmt: skip


def test_engine_command_image_path_and_draft() -> None:
    argv = manifests.engine_command(spec(IMAGE_PATH))
    assert argv[2:6] == ["--model", "/opt/model", "--served-model-name", "model"]
    assert argv[argv.index("--speculative-method") :][:4] == [
        "--speculative-method",
        "draft",
        "--num-speculative-tokens",
        "4",
    ]


def test_runtime_deployment_minimal_exactly() -> None:
    assert manifests.runtime_deployment("tiny", "default", spec(MINIMAL)) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "tiny", "namespace": "default", "labels": RUNTIME_LABELS},
        "spec": {
            "replicas": 1,
            "selector": {
                "matchLabels": {
                    "serving.chunkwise.dev/inferenceservice": "tiny",
                    "app.kubernetes.io/component": "runtime",
                }
            },
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            # Past the startup probe's 600 s, with time for the pull and the fetch (1500 s).
            "progressDeadlineSeconds": 1500,
            "template": {
                "metadata": {
                    "labels": RUNTIME_LABELS,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": "8000",
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    # preStop sleep 5 + drain 30 + margin 10
                    "terminationGracePeriodSeconds": 45,
                    "securityContext": RESTRICTED_POD,
                    "containers": [
                        {
                            "name": "engine",
                            "image": "chunkwise:dev",
                            "command": ["chunkwise"],
                            "args": manifests.engine_command(spec(MINIMAL))[1:],
                            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                            "resources": {
                                "requests": {"cpu": "1", "memory": "2Gi"},
                                "limits": {"memory": "2Gi"},
                            },
                            "startupProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 5,
                                "timeoutSeconds": 2,
                                "failureThreshold": 120,
                            },
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 5,
                                "timeoutSeconds": 2,
                                "failureThreshold": 2,
                            },
                            "livenessProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 10,
                                "timeoutSeconds": 5,
                                # 3 + the 30 s drain in 10 s periods
                                "failureThreshold": 6,
                            },
                            "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                            "securityContext": RESTRICTED_CONTAINER,
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                        }
                    ],
                    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
                },
            },
        },
    }


def test_runtime_deployment_gpu_pvc_and_overrides() -> None:
    dep = manifests.runtime_deployment("llama", "ml", spec(GPU_ROUTER))
    pod = dep["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert engine["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "1"},
    }
    assert engine["imagePullPolicy"] == "IfNotPresent"
    assert engine["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    assert engine["volumeMounts"] == [
        {"name": "model", "mountPath": "/models", "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    assert pod["volumes"] == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
    ]
    assert "initContainers" not in pod
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert pod["tolerations"] == [
        {"operator": "Equal", "key": "dedicated", "value": "llm", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert pod["terminationGracePeriodSeconds"] == 5 + 60 + 10
    assert engine["livenessProbe"]["failureThreshold"] == 3 + 6
    # The user's annotations win over the operator's.
    assert dep["spec"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "false",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
        "team": "ml",
    }


def test_gpu_toleration_is_not_doubled() -> None:
    data = copy.deepcopy(GPU_ROUTER)
    data["pod"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    pod = manifests.runtime_deployment("llama", "ml", spec(data))["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"operator": "Exists", "key": "nvidia.com/gpu"}]


def test_runtime_service_and_pdb() -> None:
    selector = {"serving.chunkwise.dev/inferenceservice": "tiny", "app.kubernetes.io/component": "runtime"}
    assert manifests.runtime_service("tiny", "default") == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "tiny", "namespace": "default", "labels": RUNTIME_LABELS},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    assert manifests.pod_disruption_budget("tiny", "default") == {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "tiny", "namespace": "default", "labels": RUNTIME_LABELS},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }


def test_router_children() -> None:
    parsed = spec(GPU_ROUTER)
    labels = {
        "app.kubernetes.io/name": "chunkwise",
        "app.kubernetes.io/instance": "llama",
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/managed-by": "chunkwise-operator",
        "serving.chunkwise.dev/inferenceservice": "llama",
    }
    meta = {"name": "llama-router", "namespace": "ml", "labels": labels}
    assert manifests.router_command("llama", "ml", parsed) == [
        "chunkwise", "router", "--host", "0.0.0.0", "--port", "8080",
        "--policy", "least-loaded", "--kube-service", "llama", "--namespace", "ml",
        "--tokenizer", "/models/org/llama", "--block-size", "32",
    ]  # fmt: skip
    # minReplicas 0: the router is the one that brings the first replica back.
    from_zero = parse({**GPU_ROUTER, "autoscaling": {"enabled": True, "minReplicas": 0}})
    assert manifests.router_command("llama", "ml", from_zero)[-6:] == [
        "--wake-timeout-seconds", "300", "--wake-queue-limit", "128", "--wake-inference-service", "llama",
    ]  # fmt: skip
    assert manifests.router_service_account("llama", "ml") == {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta,
    }
    assert manifests.router_role_binding("llama", "ml") == {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llama-router"},
        "subjects": [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "ml"}],
    }
    # The router's rights (issue 31, point 9): its EndpointSlices, and the /scale of its own InferenceService
    # only, named, where the shared ClusterRole let every router scale every service of its namespace.
    assert manifests.router_role("llama", "ml") == {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta,
        "rules": [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": ["serving.chunkwise.dev"],
                "resources": ["inferenceservices/scale"],
                "resourceNames": ["llama"],
                "verbs": ["get", "patch"],
            },
        ],
    }
    dep = manifests.router_deployment("llama", "ml", parsed)
    pod = dep["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    assert dep["metadata"] == meta
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["selector"] == {
        "matchLabels": {
            "serving.chunkwise.dev/inferenceservice": "llama",
            "app.kubernetes.io/component": "router",
        }
    }
    assert pod["serviceAccountName"] == "llama-router"
    # spec.image is the service's CUDA build: the router keeps the CPU one.
    assert router["image"] == "chunkwise/runtime:0.1.0"
    assert [router["command"][0], *router["args"]] == manifests.router_command("llama", "ml", parsed)
    assert router["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert router["resources"] == {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": "256Mi"},
    }
    # GPU placement is for the engine only.
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert manifests.router_service("llama", "ml")["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]


def test_children_and_stale_children_follow_router_enabled() -> None:
    with_router = manifests.children("llama", "ml", spec(GPU_ROUTER))
    assert [(c["kind"], c["metadata"]["name"]) for c in with_router] == [
        ("Deployment", "llama"),
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama"),
        ("ServiceAccount", "llama-router"),
        ("Role", "llama-router"),
        ("RoleBinding", "llama-router"),
        ("Deployment", "llama-router"),
        ("PodDisruptionBudget", "llama-router"),
        ("Service", "llama-router"),
    ]
    # No spec.gateway.inferencePool: a pool of this name would be stale (the operator deletes it if it owns it).
    assert manifests.stale_children("llama", spec(GPU_ROUTER)) == [
        ("inference.networking.k8s.io/v1", "InferencePool", "llama"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llama"),
    ]
    without = manifests.children("tiny", "default", spec(MINIMAL))
    assert [(c["kind"], c["metadata"]["name"]) for c in without] == [
        ("Deployment", "tiny"),
        ("Service", "tiny"),
        ("PodDisruptionBudget", "tiny"),
    ]
    assert manifests.stale_children("tiny", spec(MINIMAL)) == [
        ("inference.networking.k8s.io/v1", "InferencePool", "tiny"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "tiny"),
        ("policy/v1", "PodDisruptionBudget", "tiny-router"),
        ("v1", "Service", "tiny-router"),
        ("apps/v1", "Deployment", "tiny-router"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", "tiny-router"),
        ("rbac.authorization.k8s.io/v1", "Role", "tiny-router"),
        ("v1", "ServiceAccount", "tiny-router"),
    ]


def test_url_and_selector() -> None:
    assert manifests.service_url("tiny", "default", spec(MINIMAL)) == "http://tiny.default.svc:8000"
    assert manifests.service_url("llama", "ml", spec(GPU_ROUTER)) == "http://llama-router.ml.svc:8080"
    assert (
        manifests.selector_string("tiny")
        == "app.kubernetes.io/component=runtime,serving.chunkwise.dev/inferenceservice=tiny"
    )


def test_builders_return_fresh_objects() -> None:
    """Callers add owner references in place; one call's output must not leak into the next."""
    parsed = spec(MINIMAL)
    first = manifests.children("tiny", "default", parsed)
    first[0]["metadata"]["labels"]["x"] = "y"
    first[0]["spec"]["template"]["spec"]["containers"][0]["args"].append("--oops")
    assert manifests.children("tiny", "default", parsed) != first
    assert manifests.children("tiny", "default", parsed) == manifests.children("tiny", "default", parsed)


@pytest.mark.parametrize(
    "variant",
    [MINIMAL, GPU_ROUTER, IMAGE_PATH, HF_GPU],
    ids=["minimal", "gpu-router", "image-path", "hf-gpu"],
)
def test_every_built_child_validates_for_kubernetes_1_30(variant: dict[str, Any]) -> None:
    children = manifests.children("svc", "ml", spec(variant))
    kopf.append_owner_reference(children, owner=kopf.Body(OWNER))  # type: ignore[arg-type]
    assert len(children) == (9 if variant in (GPU_ROUTER, HF_GPU) else 3)
    for child in children:
        assert child["metadata"]["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]
        kubernetes_validate.validate(child, "1.30.0", strict=True)


# The `restricted` Pod Security Standard (v1.30), as the admission controller checks it.
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    found = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(key)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    pod_ctx = pod.get("securityContext", {})
    for c in pod.get("initContainers", []) + pod["containers"]:
        ctx = c.get("securityContext", {})
        name = c["name"]
        if ctx.get("privileged"):
            found.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        if not (ctx.get("runAsNonRoot") or (pod_ctx.get("runAsNonRoot") and ctx.get("runAsNonRoot") is None)):
            found.append(f"{name}: runAsNonRoot")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            found.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities.add")
        if any("hostPort" in port for port in c.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


def test_the_restricted_check_can_fail() -> None:
    pod = {"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False}}]}
    assert restricted_violations(pod) == [
        "c: runAsNonRoot",
        "c: seccompProfile",
        "c: capabilities must drop ALL",
    ]
    assert restricted_violations(
        {"volumes": [{"name": "h", "hostPath": {"path": "/"}}], "containers": []}
    ) == ["volume h: ['hostPath']"]


def test_a_gpu_service_from_hugging_face() -> None:
    parsed = spec(HF_GPU)
    dep = manifests.runtime_deployment("llama", "ml", parsed)
    pod = dep["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    (fetch,) = pod["initContainers"]
    model_dir = "/model-cache/" + manifests.cache_directory("hf://meta-llama/Llama-3.1-8B-Instruct@main")
    assert model_dir.startswith("/model-cache/hf-meta-llama-llama-3.1-8b-instruct-main-")
    args = engine["args"]
    assert engine["image"] == fetch["image"] == "chunkwise/runtime:0.1.0-cuda"
    assert args[args.index("--model") + 1] == model_dir
    assert args[args.index("--device") + 1] == "cuda"
    assert args[args.index("--dtype") + 1] == "auto"
    assert args[-2:] == ["--max-model-len", "8192"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert [fetch["command"][0], *fetch["args"]] == [
        "chunkwise", "fetch-model", "hf://meta-llama/Llama-3.1-8B-Instruct@main", model_dir
    ]  # fmt: skip
    assert fetch["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert fetch["env"] == [{"name": "HF_ENDPOINT", "value": "http://mirror.internal"}]
    assert "nvidia.com/gpu" not in fetch["resources"]["limits"]
    # The fetcher writes the cache; the server reads the same volume.
    assert fetch["volumeMounts"] == [{"name": "model-cache", "mountPath": "/model-cache"}]
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in engine["volumeMounts"]
    # No spec.model.size: the GPU default bound, requested as ephemeral storage too.
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "80Gi"}} in pod["volumes"]
    assert engine["resources"]["requests"]["ephemeral-storage"] == "80Gi"
    # Triton's compiled kernels go to a writable directory of the same volume, at a path of its own.
    assert engine["volumeMounts"] == [
        {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True},
        {"name": "model-cache", "mountPath": "/triton-cache", "subPath": "triton-cache"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    assert engine["env"] == [
        {"name": "TRITON_CACHE_DIR", "value": "/triton-cache"},
        {"name": "HF_ENDPOINT", "value": "http://mirror.internal"},
    ]
    assert pod["imagePullSecrets"] == [{"name": "r"}]
    assert restricted_violations(pod) == []

    router_pod = manifests.router_deployment("llama", "ml", parsed)["spec"]["template"]["spec"]
    (router,) = router_pod["containers"]
    (tokenizer,) = router_pod["initContainers"]
    assert router["image"] == tokenizer["image"] == "chunkwise/runtime:0.1.0"
    assert tokenizer["args"] == [
        "fetch-model",
        "hf://meta-llama/Llama-3.1-8B-Instruct@main",
        "/tokenizer",
        "--tokenizer-only",
    ]
    assert router["args"][router["args"].index("--tokenizer") + 1] == "/tokenizer"
    assert router["args"][-2:] == ["--block-size", "16"]
    assert restricted_violations(router_pod) == []


def test_a_shared_cache_claim_and_pod_overrides() -> None:
    data = copy.deepcopy(HF_GPU)
    data["model"] = {"uri": "s3://weights/qwen3-8b", "cache": {"claimName": "model-cache"}}
    data["pod"] = {
        "serviceAccountName": "llm",
        "priorityClassName": "serving",
        "affinity": {"podAntiAffinity": {}},
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        "shmSize": "16Gi",
    }
    pod = manifests.runtime_deployment("q", "ml", spec(data))["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        {"name": "scratch", "emptyDir": {}},
    ]
    assert pod["containers"][0]["volumeMounts"][-1] == {"name": "scratch", "mountPath": "/scratch"}
    assert (pod["serviceAccountName"], pod["priorityClassName"]) == ("llm", "serving")
    assert pod["affinity"] == {"podAntiAffinity": {}}
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    assert "envFrom" not in pod["initContainers"][0]


@pytest.mark.parametrize("variant", [HF_GPU, GPU_ROUTER, MINIMAL], ids=["hf-gpu", "pvc-gpu", "minimal"])
def test_every_pod_meets_the_restricted_profile(variant: dict[str, Any]) -> None:
    for child in manifests.children("svc", "ml", spec(variant)):
        if child["kind"] == "Deployment":
            assert restricted_violations(child["spec"]["template"]["spec"]) == [], child["metadata"]["name"]


def triton_cache(pod: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    (engine,) = pod["containers"]
    mounts = [m for m in engine["volumeMounts"] if m.get("subPath") == "triton-cache"]
    env = [e for e in engine.get("env", []) if e["name"] == "TRITON_CACHE_DIR"]
    return mounts, env


def test_triton_cache_goes_on_a_shared_cache_claim_for_gpu_engines_only() -> None:
    """A cache claim outlives the pod: the next GPU pod finds Triton's kernels compiled. A CPU engine runs no
    Triton; a model from a claim (read-only) or a preset leaves no volume the pod may write."""
    data = copy.deepcopy(HF_GPU)
    data["model"] = {"uri": "s3://weights/qwen3-8b", "cache": {"claimName": "models-rw"}}
    pod = manifests.runtime_deployment("q", "ml", spec(data))["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models-rw"}} in pod["volumes"]
    assert triton_cache(pod) == (
        [{"name": "model-cache", "mountPath": "/triton-cache", "subPath": "triton-cache"}],
        [{"name": "TRITON_CACHE_DIR", "value": "/triton-cache"}],
    )
    assert restricted_violations(pod) == []

    cpu = copy.deepcopy(data)
    cpu["resources"] = {"cpu": "8", "memory": "48Gi"}
    for variant in (cpu, GPU_ROUTER, MINIMAL):
        pod = manifests.runtime_deployment("q", "ml", spec(variant))["spec"]["template"]["spec"]
        assert triton_cache(pod) == ([], []), variant


def test_every_path_the_operator_mounts_into_the_engine_is_reserved() -> None:
    """spec.pod.volumeMounts may not use them: Kubernetes refuses a pod with one mount path twice."""
    from chunkwise_operator.spec import RESERVED_MOUNT_PATHS

    for variant in (HF_GPU, GPU_ROUTER, MINIMAL, IMAGE_PATH):
        pod = manifests.runtime_deployment("q", "ml", spec(variant))["spec"]["template"]["spec"]
        for mount in pod["containers"][0]["volumeMounts"]:
            assert mount["mountPath"] in RESERVED_MOUNT_PATHS, mount
    with pytest.raises(SpecError, match="'/triton-cache/x' is under one the operator mounts"):
        data = copy.deepcopy(HF_GPU)
        data["pod"]["volumes"] = [{"name": "v", "emptyDir": {}}]
        data["pod"]["volumeMounts"] = [{"name": "v", "mountPath": "/triton-cache/x"}]
        spec(data)


def test_a_triton_cache_dir_in_the_spec_is_kept() -> None:
    data = copy.deepcopy(HF_GPU)
    data["pod"]["env"] = [{"name": "TRITON_CACHE_DIR", "value": "/scratch/triton"}]
    pod = manifests.runtime_deployment("q", "ml", spec(data))["spec"]["template"]["spec"]
    assert pod["containers"][0]["env"] == [{"name": "TRITON_CACHE_DIR", "value": "/scratch/triton"}]


def test_the_engine_rollout_deadline_outlasts_its_startup_budget():
    """Kubernetes' default progress deadline (600 s) equals the startup probe's budget: a model that loads
    slowly but well would read as ProgressDeadlineExceeded in the status (status.py reads that condition)."""
    for variant in (MINIMAL, GPU_ROUTER, HF_GPU):
        deployment = manifests.runtime_deployment("tiny", "default", spec(variant))
        probe = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        startup = probe["periodSeconds"] * probe["failureThreshold"]
        assert deployment["spec"]["progressDeadlineSeconds"] == startup + 900 > startup
