"""Pure builders: an InferenceService's name, namespace and parsed spec in, its children's manifests out.

Nothing here talks to the API server, so every object can be checked by exact assertion and by
kubernetes-validate. Owner references are added by the caller (reconcile.py), which holds the owner's body.
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
from typing import Any

from chunkwise_operator import gateway
from chunkwise_operator.spec import DEFAULT_TENANT_HEADER, GROUP, Adapter, EngineSpec, ServiceSpec, gib

RUNTIME_PORT = 8000
ROUTER_PORT = 8080
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MODEL_MOUNT_PATH = "/models"
# Where a fetched model is kept (emptyDir or a shared PVC); each URI gets a directory of its own below it.
MODEL_CACHE_MOUNT_PATH = "/model-cache"
SHM_MOUNT_PATH = "/dev/shm"
# A GPU engine's Triton kernels and launchers, compiled at its first steps (seconds each), kept in a directory
# of the model cache so that a cache that outlives the pod (a PVC) spares the next pod the compiles. Mounted
# read-write at a path of its own: the model beside it stays read-only. No fetched model's directory has
# this name (cache_directory ends in a hash). Triton writes each entry to a temporary file and renames it,
# so replicas sharing one claim can fill it at once.
TRITON_CACHE_SUBPATH = "triton-cache"
TRITON_CACHE_MOUNT_PATH = "/triton-cache"
# The taint GPU node pools commonly carry (GKE, EKS, AKS), also where the resource is a MIG slice.
NVIDIA_GPU_TAINT = "nvidia.com/gpu"
# The runtime image's user (runtime/Dockerfile); fsGroup makes the cache volumes writable for it.
RUNTIME_UID = 65532
# The tokenizer is all the router needs of a fetched model.
ROUTER_TOKENIZER_PATH = "/tokenizer"

# The preStop sleep lets endpoint removal reach every kube-proxy and the router before SIGTERM starts the
# engine's drain; without it, requests keep arriving at a replica that has begun refusing them.
PRESTOP_SLEEP_SECONDS = 5
# Slack after the drain for the process to flush and exit before the kubelet's SIGKILL.
SHUTDOWN_MARGIN_SECONDS = 10
LIVENESS_PERIOD_SECONDS = 10
# Loading weights can take minutes; the startup probe holds liveness off for spec.engine.startupTimeoutSeconds.
STARTUP_PERIOD_SECONDS = 5
# The engine Deployment's progress deadline is the startup budget plus this: 15 minutes for the image pull
# and the model fetch before it. At Kubernetes' default (600 s, no more than the startup budget) a model
# that loads slowly but well would read as ProgressDeadlineExceeded in the status.
PULL_AND_FETCH_SECONDS = 900
# Pipeline parallel: every pod of a group runs the same `chunkwise serve`; the LWS_WORKER_INDEX 0 pod leads
# (serves HTTP) and the others rendezvous with it at LWS_LEADER_ADDRESS (both set by LeaderWorkerSet) on this
# port, torch.distributed's customary MASTER_PORT. Declared on every pod of the group, so a NetworkPolicy or a
# reader of the pod can name it.
PP_RENDEZVOUS_PORT = 29500
PP_RENDEZVOUS_PORT_NAME = "pp-rendezvous"
# The engine's --distributed-port default is the rendezvous port; its step messages to the other stages' ranks
# go over the next one (engine/loop/tp_ranks.py), declared beside it.
PP_STEPS_PORT = PP_RENDEZVOUS_PORT + 1
PP_STEPS_PORT_NAME = "pp-steps"
# LeaderWorkerSet (kubernetes-sigs/lws), the API a pipeline-parallel replica group is written in.
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
# The release whose install the status names when the API is missing. The v1 fields used here (size,
# restartPolicy, leaderTemplate, workerTemplate, startupPolicy, rolloutStrategy's maxUnavailable and
# maxSurge) are in its API (api/leaderworkerset/v1/leaderworkerset_types.go); older releases may lack some.
LWS_RELEASE = "v0.7.0"
LWS_INSTALL_HINT = (
    f"kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/{LWS_RELEASE}/"
    "manifests.yaml"
)
# A stage's failure leaves its group unable to step (the other stages wait on it): recreate the whole group.
LWS_RESTART_POLICY = "RecreateGroupOnPodRestart"
# Workers start with the leader, not after it is ready: the leader is ready only once every stage has joined.
LWS_STARTUP_POLICY = "LeaderCreated"
# LoRA adapters (spec.adapters) fetched by init containers, one directory each (/adapters/<name>), on an emptyDir
# of their own: a preset or PVC model has no cache volume to share. Bounded per adapter: 2Gi holds a rank-64
# adapter on every projection of a 70B Llama in bf16 (about 1.7 GB); typical ones are tens of megabytes.
ADAPTERS_VOLUME = "adapters"
ADAPTERS_MOUNT_PATH = "/adapters"
ADAPTER_CACHE_GIB_PER_ADAPTER = 2
# With runtime updates the engine fetches the URIs it is asked to load into that volume itself
# (--lora-cache-dir): sized for this many adapters at least, whatever the list (which the pod must not depend
# on), or for --max-cpu-loras / --max-loras when that is more.
RUNTIME_ADAPTER_CACHE_MIN_ADAPTERS = 8
# The router's tokenizer emptyDir: tokenizer.json and its configs, tens of megabytes.
ROUTER_TOKENIZER_CACHE_SIZE = "1Gi"

MANAGER = "chunkwise-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = f"{GROUP}/inferenceservice"
RUNTIME = "runtime"
# A pipeline stage worker of a LeaderWorkerSet group (index > 0): no HTTP, so its component differs from the
# leader's and every runtime selector (the Service, the router, the InferencePool, /scale, the scrape)
# matches leaders only.
RUNTIME_WORKER = "runtime-worker"
ROUTER = "router"
# Before issue 31 the routers shared a ClusterRole `chunkwise-router` (shipped in crds/), which let every router
# patch the /scale of every InferenceService in its namespace. Each router now gets a Role of its own, naming
# its one InferenceService; a RoleBinding left over from then is replaced (roleRef cannot be changed in place).
LEGACY_ROUTER_CLUSTER_ROLE = "chunkwise-router"

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


def cache_directory(uri: str) -> str:
    """A fetched model's directory in the cache: readable, and distinct per URI on a shared PVC."""
    slug = re.sub(r"[^a-z0-9.]+", "-", uri.lower()).strip("-.")[:48].strip("-.")
    return f"{slug}-{hashlib.sha256(uri.encode()).hexdigest()[:10]}"


def model_argument(spec: ServiceSpec) -> str:
    model = spec.model
    if model.source == "preset":
        assert model.preset is not None
        return model.preset
    if model.source == "pvc":
        return f"{MODEL_MOUNT_PATH}/{model.path}" if model.path else MODEL_MOUNT_PATH
    if model.source == "uri":
        assert model.uri is not None
        return f"{MODEL_CACHE_MOUNT_PATH}/{cache_directory(model.uri)}"
    assert model.path is not None
    return model.path


def device(spec: ServiceSpec) -> str:
    return "cuda" if spec.resources.gpu else "cpu"


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
        "--device",
        device(spec),
        "--dtype",
        e.dtype,
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
    # Multi-tenant scheduling (issue 37): only where they differ from the engine's defaults, so that a service
    # without them keeps its command, and one pinned to an older runtime image gets no flag it lacks.
    if e.kv_offloading_bytes:
        argv += ["--kv-offloading-size", gib(e.kv_offloading_bytes)]
    if e.scheduling_policy != EngineSpec.scheduling_policy:
        argv += ["--scheduling-policy", e.scheduling_policy]
    if e.fairness != EngineSpec.fairness:
        argv += ["--fairness", e.fairness]
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
    if spec.router.tenant_header != DEFAULT_TENANT_HEADER:
        argv += ["--tenant-header", spec.router.tenant_header]
    # Only above the engine's default of 1, so a one-rank service's command is what it always was.
    if e.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(e.tensor_parallel_size)]
    if e.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(e.pipeline_parallel_size)]
    argv += lora_flags(spec)
    # Last, so the runtime's own parser is the judge of them (a bad one becomes the pod's termination message).
    return argv + list(e.extra_args)


def lora_flags(spec: ServiceSpec) -> list[str]:
    """The engine's LoRA flags (vLLM's names); none for a service without adapters or runtime updates.

    Adapters fetched at start are named by --lora-modules. With runtime updates the command names none, so
    that it (and the pod template) is the same whatever spec.adapters holds: the operator loads them into the
    running replicas (adapters.py), and a change of the list restarts no pod.
    """
    if not spec.lora_enabled:
        return []
    e = spec.engine
    argv = ["--enable-lora"]
    if static_adapters(spec):
        argv += ["--lora-modules", *(f"{a.name}={adapter_directory(a.name)}" for a in spec.adapters)]
    argv += ["--max-loras", str(e.max_loras), "--max-lora-rank", str(e.max_lora_rank)]
    if e.max_cpu_loras is not None:
        argv += ["--max-cpu-loras", str(e.max_cpu_loras)]
    if e.runtime_lora_updates:
        argv += ["--allow-runtime-lora", "--lora-cache-dir", ADAPTERS_MOUNT_PATH]
    return argv


def static_adapters(spec: ServiceSpec) -> bool:
    """Whether the adapters are part of the pod: fetched by init containers, passed as --lora-modules."""
    return bool(spec.adapters) and not spec.engine.runtime_lora_updates


def adapter_directory(name: str) -> str:
    """Where an adapter's init container fetches it (an adapter name is a DNS label: a safe directory name)."""
    return f"{ADAPTERS_MOUNT_PATH}/{name}"


def adapter_fetch_container_name(name: str) -> str:
    return f"fetch-adapter-{name}"


def fetch_command(spec: ServiceSpec, tokenizer_only: bool = False) -> list[str]:
    assert spec.model.uri is not None
    if tokenizer_only:
        return ["chunkwise", "fetch-model", spec.model.uri, ROUTER_TOKENIZER_PATH, "--tokenizer-only"]
    return ["chunkwise", "fetch-model", spec.model.uri, model_argument(spec)]


def router_tokenizer(spec: ServiceSpec) -> str:
    """What `chunkwise router --tokenizer` is given: the model's own tokenizer wherever the router can read it."""
    source = spec.model.source
    if source == "preset":
        return "byte"
    if source == "uri":
        return ROUTER_TOKENIZER_PATH
    return model_argument(spec)  # the PVC mounted read-only as for the engine, or the path in the image


def router_command(name: str, namespace: str, spec: ServiceSpec) -> list[str]:
    r = spec.router
    wake = [
        "--wake-timeout-seconds",
        str(r.wake_timeout_seconds),
        "--wake-queue-limit",
        str(r.wake_queue_limit),
        "--wake-inference-service",
        name,
    ]
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
        "--tokenizer",
        router_tokenizer(spec),
        "--block-size",
        str(spec.engine.block_size),
        # minReplicas 0: at zero replicas the router holds requests and raises /scale to 1.
        *(wake if scales_from_zero(spec) else []),
        # The gateway's endpoint picker: Envoy ext_proc (gRPC, plaintext) for the InferencePool.
        *(["--epp-port", str(gateway.EPP_PORT)] if spec.gateway.inference_pool else []),
    ]


def scales_from_zero(spec: ServiceSpec) -> bool:
    return spec.autoscaling.enabled and spec.autoscaling.min_replicas == 0 and spec.router.enabled


def termination_grace_seconds(spec: ServiceSpec) -> int:
    return PRESTOP_SLEEP_SECONDS + spec.engine.drain_grace_seconds + SHUTDOWN_MARGIN_SECONDS


def router_termination_grace_seconds(spec: ServiceSpec) -> int:
    """A stopping router finishes what it holds: a request held up to the wake timeout, then streamed.

    uvicorn stops accepting at SIGTERM and waits for every open response, so the grace period is the only
    bound; the kubelet ends the pod as soon as the last one is done. Counted whether or not the router
    wakes the service: it costs nothing to a router with nothing in flight, and minReplicas 0 can be set
    later without a rollout of the router caught short.
    """
    r = spec.router
    return PRESTOP_SLEEP_SECONDS + r.wake_timeout_seconds + r.drain_grace_seconds + SHUTDOWN_MARGIN_SECONDS


def startup_failure_threshold(spec: ServiceSpec) -> int:
    """Startup probe failures allowed: spec.engine.startupTimeoutSeconds in probe periods."""
    return math.ceil(spec.engine.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)


def progress_deadline_seconds(spec: ServiceSpec) -> int:
    return STARTUP_PERIOD_SECONDS * startup_failure_threshold(spec) + PULL_AND_FETCH_SECONDS


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


# The `restricted` Pod Security profile, for every container the operator builds.
def container_security_context() -> Manifest:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security_context(spec: ServiceSpec) -> Manifest:
    if spec.pod.platform_assigns_uid:
        # OpenShift's restricted-v2 SCC assigns runAsUser and fsGroup from the namespace's range and refuses
        # a pod that names others; runAsNonRoot still holds whatever UID it picks.
        return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _runtime_resources(spec: ServiceSpec) -> Manifest:
    r = spec.resources
    # No CPU limit: CFS throttling stretches step times (the p99 the autoscaler watches) for no gain.
    requests: dict[str, Any] = {"cpu": r.cpu, "memory": r.memory}
    limits: dict[str, Any] = {"memory": r.memory}
    if r.gpu:
        # A string, as the API server stores quantities: an int would read as drift on every comparison.
        limits[r.accelerator] = str(r.gpu)
    cache = _cache_size_limit(spec)
    if cache is not None:
        # The emptyDir's bound as a request too: the scheduler then places the pod on a node whose disk
        # holds the model, rather than one where the fetch gets it evicted.
        requests["ephemeral-storage"] = cache
    return {"requests": requests, "limits": limits}


def _cache_size_limit(spec: ServiceSpec) -> str | None:
    """The per-pod model cache's bound; None where the model needs no emptyDir (a claim, a preset)."""
    model = spec.model
    if model.source != "uri" or model.cache.claim_name is not None:
        return None
    return model.cache.size_limit


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
    # GPU nodes are commonly tainted with the resource's name so that only GPU workloads land there; NVIDIA
    # pools keep the nvidia.com/gpu taint when they hand out MIG slices.
    if spec.resources.gpu:
        accelerator = spec.resources.accelerator
        taints = [accelerator]
        if accelerator.startswith("nvidia.com/") and accelerator != NVIDIA_GPU_TAINT:
            taints.append(NVIDIA_GPU_TAINT)
        for taint in taints:
            if not any(t.key == taint for t in spec.pod.tolerations):
                result.append({"key": taint, "operator": "Exists", "effect": "NoSchedule"})
    return result


def _env(spec: ServiceSpec, triton_cache: bool = False) -> list[Manifest]:
    """The pod's env; with triton_cache, TRITON_CACHE_DIR on the cache volume unless the spec sets it."""
    result: list[Manifest] = []
    if triton_cache and not any(var.name == "TRITON_CACHE_DIR" for var in spec.pod.env):
        result.append({"name": "TRITON_CACHE_DIR", "value": TRITON_CACHE_MOUNT_PATH})
    for var in spec.pod.env:
        item: Manifest = {"name": var.name}
        if var.value is not None:
            item["value"] = var.value
        if var.value_from is not None:
            item["valueFrom"] = dict(var.value_from)
        result.append(item)
    return result


def _fetch_container(spec: ServiceSpec, tokenizer_only: bool, resources: Manifest) -> Manifest:
    """The init container that downloads the model (or its tokenizer) before the server starts."""
    argv = fetch_command(spec, tokenizer_only)
    container: Manifest = {
        "name": "fetch-tokenizer" if tokenizer_only else "fetch-model",
        "image": spec.image,
        "command": argv[:1],
        "args": argv[1:],
        "resources": resources,
        # The fetcher writes its one-line error here: `kubectl describe pod` and the status show it.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(),
        "volumeMounts": [
            {
                "name": "model-cache",
                "mountPath": ROUTER_TOKENIZER_PATH if tokenizer_only else MODEL_CACHE_MOUNT_PATH,
            }
        ],
    }
    return _with_fetch_env(spec, container)


def _with_fetch_env(spec: ServiceSpec, container: Manifest) -> Manifest:
    """A fetcher's pull policy, environment and credentials (the model's and the adapters' alike)."""
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy
    env = _env(spec)
    if env:
        container["env"] = env
    if spec.model.credentials_secret is not None:
        container["envFrom"] = [{"secretRef": {"name": spec.model.credentials_secret}}]
    return container


def _adapter_fetch_container(spec: ServiceSpec, adapter: Adapter, resources: Manifest) -> Manifest:
    """The init container that fetches one adapter into /adapters/<name> (the model's fetcher's shape)."""
    container: Manifest = {
        "name": adapter_fetch_container_name(adapter.name),
        "image": spec.image,
        "command": ["chunkwise"],
        "args": ["fetch-model", adapter.uri, adapter_directory(adapter.name), "--adapter"],
        "resources": copy.deepcopy(resources),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_MOUNT_PATH}],
    }
    return _with_fetch_env(spec, container)


def _model_volumes(spec: ServiceSpec) -> tuple[list[Manifest], list[Manifest]]:
    """The engine's model volume(s) and its mounts: a claim read-only, or the fetched cache."""
    model = spec.model
    if model.source == "pvc":
        return (
            [{"name": "model", "persistentVolumeClaim": {"claimName": model.claim_name, "readOnly": True}}],
            [{"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}],
        )
    if model.source == "uri":
        if model.cache.claim_name is not None:
            volume: Manifest = {
                "name": "model-cache",
                "persistentVolumeClaim": {"claimName": model.cache.claim_name},
            }
        else:
            # Bounded (spec.parse always gives it a size): past it the kubelet evicts this pod, not its
            # neighbours after the node's disk is full.
            volume = {"name": "model-cache", "emptyDir": {"sizeLimit": model.cache.size_limit}}
        mounts = [{"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT_PATH, "readOnly": True}]
        if _triton_cache(spec):
            mounts.append(
                {"name": "model-cache", "mountPath": TRITON_CACHE_MOUNT_PATH, "subPath": TRITON_CACHE_SUBPATH}
            )
        return [volume], mounts
    return [], []


def _triton_cache(spec: ServiceSpec) -> bool:
    """Whether the engine keeps Triton's cache on the model-cache volume: a GPU engine (the only one that
    runs Triton) with a fetched model (the only source with a volume the pod may write)."""
    return bool(spec.resources.gpu) and spec.model.source == "uri"


def pipeline_parallel(spec: ServiceSpec) -> bool:
    """Whether a replica is a LeaderWorkerSet group of pipeline stages rather than one Deployment pod."""
    return spec.engine.pipeline_parallel_size > 1


def runtime_kind(spec: ServiceSpec) -> tuple[str, str]:
    """(apiVersion, kind) of the runtime's workload: a Deployment, or a LeaderWorkerSet for pipeline stages."""
    return (LWS_API_VERSION, LWS_KIND) if pipeline_parallel(spec) else ("apps/v1", "Deployment")


def _runtime_pod_template(name: str, spec: ServiceSpec, worker: bool = False) -> Manifest:
    """The runtime pod: a Deployment's, an LWS group's leader, or (`worker`) a pipeline stage worker.

    A worker runs the same container and command (the engine tells its role from LWS_WORKER_INDEX) with
    the same resources and volumes, but serves no HTTP: no http port, no probes (a probe of a port nobody
    listens on would restart it), no preStop (it is no endpoint), no scrape annotations.
    """
    drain = spec.engine.drain_grace_seconds
    argv = engine_command(spec)
    volumes, mounts = _model_volumes(spec)
    if static_adapters(spec):
        size = f"{ADAPTER_CACHE_GIB_PER_ADAPTER * len(spec.adapters)}Gi"
        volumes.append({"name": ADAPTERS_VOLUME, "emptyDir": {"sizeLimit": size}})
        mounts.append({"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_MOUNT_PATH, "readOnly": True})
    elif spec.engine.runtime_lora_updates:
        e = spec.engine
        count = max(RUNTIME_ADAPTER_CACHE_MIN_ADAPTERS, e.max_cpu_loras or e.max_loras)
        volumes.append(
            {"name": ADAPTERS_VOLUME, "emptyDir": {"sizeLimit": f"{ADAPTER_CACHE_GIB_PER_ADAPTER * count}Gi"}}
        )
        mounts.append({"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_MOUNT_PATH})
    # /dev/shm as a memory emptyDir: the runtime's default 64Mi is too small for torch's shared tensors and
    # for NCCL's shared-memory transport between the ranks of a tensor-parallel pod.
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.pod.shm_size}})
    mounts.append({"name": "dshm", "mountPath": SHM_MOUNT_PATH})
    volumes += [dict(v) for v in spec.pod.volumes]
    mounts += [dict(m) for m in spec.pod.volume_mounts]
    ports: list[Manifest] = []
    if not worker:
        ports.append({"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"})
    if pipeline_parallel(spec):
        ports.append(
            {"name": PP_RENDEZVOUS_PORT_NAME, "containerPort": PP_RENDEZVOUS_PORT, "protocol": "TCP"}
        )
        ports.append({"name": PP_STEPS_PORT_NAME, "containerPort": PP_STEPS_PORT, "protocol": "TCP"})
    container: Manifest = {
        "name": "engine",
        "image": spec.image,
        "command": argv[:1],
        "args": argv[1:],
        "ports": ports,
        "resources": _runtime_resources(spec),
    }
    if not worker:
        container.update(
            {
                "startupProbe": _http_probe(
                    "http", STARTUP_PERIOD_SECONDS, 2, startup_failure_threshold(spec)
                ),
                # /health answers 503 while draining: readiness drops the replica from endpoints at once.
                "readinessProbe": _http_probe("http", 5, 2, 2),
                # Liveness must outlast a full drain of 503s, or the kubelet kills a replica mid-drain.
                "livenessProbe": _http_probe(
                    "http", LIVENESS_PERIOD_SECONDS, 5, 3 + math.ceil(drain / LIVENESS_PERIOD_SECONDS)
                ),
                "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
            }
        )
    container.update(
        {
            # A flag the engine refuses (engine.extraArgs) exits with the reason here; the status reports it.
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": container_security_context(),
            "volumeMounts": mounts,
        }
    )
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy
    env = _env(spec, triton_cache=_triton_cache(spec))
    if env:
        container["env"] = env
    if spec.engine.runtime_lora_updates and spec.model.credentials_secret is not None:
        # With runtime updates the engine fetches each adapter's uri itself, with the model's credentials.
        container["envFrom"] = [{"secretRef": {"name": spec.model.credentials_secret}}]

    annotations: dict[str, str] = {}
    if not worker:
        annotations.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(RUNTIME_PORT),
                "prometheus.io/path": METRICS_PATH,
            }
        )
    annotations.update(dict(spec.pod.annotations))

    pod: Manifest = {
        # The engine never calls the Kubernetes API; no token is mounted into it.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": pod_security_context(spec),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.pod.runtime_class_name is not None:
        pod["runtimeClassName"] = spec.pod.runtime_class_name
    r = spec.resources
    fetch_resources = {"requests": {"cpu": r.cpu, "memory": r.memory}, "limits": {"memory": r.memory}}
    init: list[Manifest] = []
    if spec.model.source == "uri":
        init.append(_fetch_container(spec, False, fetch_resources))
    if static_adapters(spec):
        init += [_adapter_fetch_container(spec, a, fetch_resources) for a in spec.adapters]
    if init:
        pod["initContainers"] = init
    _pod_overrides(pod, spec)
    tolerations = _tolerations(spec)
    if tolerations:
        pod["tolerations"] = tolerations
    metadata: Manifest = {"labels": labels(name, RUNTIME_WORKER if worker else RUNTIME)}
    if annotations:
        metadata["annotations"] = annotations
    return {"metadata": metadata, "spec": pod}


def runtime_deployment(name: str, namespace: str, spec: ServiceSpec) -> Manifest:
    component = RUNTIME
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
            "progressDeadlineSeconds": progress_deadline_seconds(spec),
            "template": _runtime_pod_template(name, spec),
        },
    }


def runtime_leader_worker_set(name: str, namespace: str, spec: ServiceSpec) -> Manifest:
    """A pipeline-parallel runtime: spec.replicas groups of pipelineParallelSize pods, one stage each.

    The leader is the Deployment's pod (probes, metrics, the http port) and the only pod the runtime
    selectors match; workers carry RUNTIME_WORKER. Rollouts replace a group at a time, as the Deployment
    does its pods: in place on GPUs (no spare accelerators for a surge group), surging on CPU.
    """
    if spec.resources.gpu:
        rolling = {"maxUnavailable": 1, "maxSurge": 0}
    else:
        rolling = {"maxUnavailable": 0, "maxSurge": 1}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": _metadata(name, namespace, RUNTIME),
        "spec": {
            # As for the Deployment: the CR's spec.replicas (groups) is the count's one source.
            "replicas": spec.replicas,
            "startupPolicy": LWS_STARTUP_POLICY,
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": rolling},
            "leaderWorkerTemplate": {
                "size": spec.engine.pipeline_parallel_size,
                "restartPolicy": LWS_RESTART_POLICY,
                "leaderTemplate": _runtime_pod_template(name, spec),
                "workerTemplate": _runtime_pod_template(name, spec, worker=True),
            },
        },
    }


def runtime_workload(name: str, namespace: str, spec: ServiceSpec) -> Manifest:
    """The runtime's workload for `spec`: a Deployment, or a LeaderWorkerSet with pipeline parallelism."""
    if pipeline_parallel(spec):
        return runtime_leader_worker_set(name, namespace, spec)
    return runtime_deployment(name, namespace, spec)


def _pod_overrides(pod: Manifest, spec: ServiceSpec) -> None:
    o = spec.pod
    if o.node_selector:
        pod["nodeSelector"] = dict(o.node_selector)
    if o.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in o.image_pull_secrets]
    if o.service_account_name is not None:
        pod["serviceAccountName"] = o.service_account_name
    if o.priority_class_name is not None:
        pod["priorityClassName"] = o.priority_class_name
    if o.affinity is not None:
        pod["affinity"] = dict(o.affinity)
    if o.topology_spread_constraints:
        pod["topologySpreadConstraints"] = [dict(c) for c in o.topology_spread_constraints]


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


def pod_disruption_budget(
    name: str, namespace: str, component: str = RUNTIME, groups: bool = False
) -> Manifest:
    """One pod of the component evicted at a time (the runtime's, or with ROUTER the router's).

    maxUnavailable rather than minAvailable: a one-replica service must still let nodes drain. With `groups`
    (the runtime is a LeaderWorkerSet) the budget covers the stage workers too: evicting any pod of a group
    restarts the whole group (RecreateGroupOnPodRestart), so a worker counts as much as its leader, and one
    pod at a time keeps a drain from taking down two groups at once.
    """
    selector: Manifest = {"matchLabels": match_labels(name, component)}
    if groups:
        selector = {
            "matchLabels": {LABEL_SERVICE: name},
            "matchExpressions": [
                {"key": LABEL_COMPONENT, "operator": "In", "values": [RUNTIME, RUNTIME_WORKER]}
            ],
        }
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, component),
        "spec": {"maxUnavailable": 1, "selector": selector},
    }


def router_service_account(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(name, namespace, ROUTER),
    }


def router_role(name: str, namespace: str) -> Manifest:
    """What one router needs, and only for its own InferenceService.

    It finds the runtime replicas through their Service's EndpointSlices (list and watch cannot be narrowed by
    name: the router filters by label), and, scaling from zero, reads and raises its InferenceService's /scale
    (chunkwise.router.wake): that right names the one service. Kubernetes lets the operator create this Role
    only because it holds every one of these permissions itself (RBAC's escalation check), which is why its
    ClusterRole (manifests/rbac.yaml) grants endpointslices get/list/watch and inferenceservices/scale get/patch
    that its own code never sends.
    """
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(name, namespace, ROUTER),
        "rules": [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": [GROUP],
                "resources": ["inferenceservices/scale"],
                "resourceNames": [name],
                "verbs": ["get", "patch"],
            },
        ],
    }


def router_role_binding(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(name, namespace, ROUTER),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": router_name(name),
        },
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": namespace}],
    }


def router_deployment(name: str, namespace: str, spec: ServiceSpec) -> Manifest:
    argv = router_command(name, namespace, spec)
    r = spec.router.resources
    ports: list[Manifest] = [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}]
    if spec.gateway.inference_pool:
        ports.append({"name": gateway.EPP_PORT_NAME, "containerPort": gateway.EPP_PORT, "protocol": "TCP"})
    container: Manifest = {
        "name": "router",
        "image": spec.router.image,
        "command": argv[:1],
        "args": argv[1:],
        "ports": ports,
        "resources": {"requests": {"cpu": r.cpu, "memory": r.memory}, "limits": {"memory": r.memory}},
        "readinessProbe": _http_probe("http", 5, 2, 2),
        "livenessProbe": _http_probe("http", LIVENESS_PERIOD_SECONDS, 5, 3),
        # As for the engine: the endpoint removal reaches every kube-proxy and gateway before SIGTERM
        # closes the router's listener.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "securityContext": container_security_context(),
    }
    if spec.router.image == spec.image and spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod: Manifest = {
        # The router watches EndpointSlices of the runtime Service, so it needs its token.
        "serviceAccountName": router_name(name),
        "automountServiceAccountToken": True,
        "terminationGracePeriodSeconds": router_termination_grace_seconds(spec),
        "securityContext": pod_security_context(spec),
        "containers": [container],
    }
    model = spec.model
    if model.source == "pvc":
        pod["volumes"] = [
            {"name": "model", "persistentVolumeClaim": {"claimName": model.claim_name, "readOnly": True}}
        ]
        container["volumeMounts"] = [{"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}]
    elif model.source == "uri":
        # Only the tokenizer files, into the router's own small emptyDir.
        pod["volumes"] = [{"name": "model-cache", "emptyDir": {"sizeLimit": ROUTER_TOKENIZER_CACHE_SIZE}}]
        container["volumeMounts"] = [
            {"name": "model-cache", "mountPath": ROUTER_TOKENIZER_PATH, "readOnly": True}
        ]
        # A copy: one dict in two containers is a YAML alias (&id001) in `operator render`, and an edit of
        # one container's resources would change the other's.
        fetch = _fetch_container(spec, True, copy.deepcopy(container["resources"]))
        # The tokenizer fetcher runs the router's image, which is the CPU build unless told otherwise.
        fetch["image"] = spec.router.image
        pod["initContainers"] = [fetch]
    if spec.pod.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.pod.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, ROUTER),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": match_labels(name, ROUTER)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels(name, ROUTER)}, "spec": pod},
        },
    }


def router_service(name: str, namespace: str, epp: bool = False) -> Manifest:
    """The router's Service; `epp`: also the endpoint picker's port, which an InferencePool names."""
    ports: list[Manifest] = [{"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}]
    if epp:
        ports.append(
            {
                "name": gateway.EPP_PORT_NAME,
                "port": gateway.EPP_PORT,
                "targetPort": gateway.EPP_PORT_NAME,
                "protocol": "TCP",
                # A gateway must speak gRPC over plaintext HTTP/2 to it, not HTTP/1.1.
                "appProtocol": gateway.EPP_APP_PROTOCOL,
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, ROUTER),
        "spec": {"type": "ClusterIP", "selector": match_labels(name, ROUTER), "ports": ports},
    }


def inference_pool(name: str, namespace: str) -> Manifest:
    """The GAIE InferencePool: exactly the runtime Service's pods, picked by the router (see gateway.py)."""
    return gateway.inference_pool(
        name=runtime_name(name),
        namespace=namespace,
        labels=labels(name, RUNTIME),
        selector=match_labels(name, RUNTIME),
        target_port=RUNTIME_PORT,
        picker_service=router_name(name),
    )


def children(name: str, namespace: str, spec: ServiceSpec) -> list[Manifest]:
    """Every object the service should have, in creation order (a router's account before its pods)."""
    result = [
        runtime_workload(name, namespace, spec),
        runtime_service(name, namespace),
        pod_disruption_budget(name, namespace, groups=pipeline_parallel(spec)),
    ]
    if spec.router.enabled:
        result += [
            router_service_account(name, namespace),
            router_role(name, namespace),
            router_role_binding(name, namespace),
            router_deployment(name, namespace, spec),
            pod_disruption_budget(name, namespace, ROUTER),
            router_service(name, namespace, epp=spec.gateway.inference_pool),
        ]
    if spec.gateway.inference_pool:
        # Last: it names the router's Service, which should exist by the time a gateway reads it.
        result.append(inference_pool(name, namespace))
    return result


def router_children_refs(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what exists only while the router is enabled; removed when it is not."""
    n = router_name(name)
    return [
        ("policy/v1", "PodDisruptionBudget", n),
        ("v1", "Service", n),
        ("apps/v1", "Deployment", n),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", n),
        ("rbac.authorization.k8s.io/v1", "Role", n),
        ("v1", "ServiceAccount", n),
    ]


def inference_pool_ref(name: str) -> tuple[str, str, str]:
    return (gateway.API_VERSION, gateway.KIND, runtime_name(name))


def leader_worker_set_ref(name: str) -> tuple[str, str, str]:
    return (LWS_API_VERSION, LWS_KIND, runtime_name(name))


def stale_children(name: str, spec: ServiceSpec) -> list[tuple[str, str, str]]:
    """What must not exist for `spec`: the pool first, since it names the router's Service; then the runtime
    workload of the other shape (a Deployment after pipelineParallelSize went above 1, an LWS after it fell
    back to 1), removed once its successor has been applied."""
    result = [] if spec.gateway.inference_pool else [inference_pool_ref(name)]
    if pipeline_parallel(spec):
        result.append(("apps/v1", "Deployment", runtime_name(name)))
    else:
        result.append(leader_worker_set_ref(name))
    return result + ([] if spec.router.enabled else router_children_refs(name))
