"""A typed, frozen view of an InferenceService spec, with its defaults and validation.

The CRD's openAPIV3Schema (crds/inferenceservice.yaml) is the user-facing contract and rejects most bad
specs at admission. This module repeats those checks because the operator must not trust that: the CRD
installed in a cluster may be older than the operator, schema validation can be off (test emulators), and
cross-field rules are only expressible as CEL there. Every default here equals the schema's default; a
test holds the two together.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from types import MappingProxyType
from typing import Any

GROUP = "serving.chunkwise.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAME = "infsvc"

PRESETS = ("tiny", "small")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# What `chunkwise fetch-model` downloads; pvc:// is mounted instead.
URI_SCHEMES = ("hf", "s3", "gs", "http", "https", "pvc")
# The image tag this operator release runs when spec.image is not given; the CUDA build is tagged -cuda.
# A service records the one it started with (status.runtimeImage) and keeps it across operator upgrades until
# asked to move (reconcile.UPGRADE_RUNTIME_ANNOTATION; docs/operator.md, "Upgrading").
DEFAULT_IMAGE = "chunkwise/runtime:0.1.0"
DEFAULT_SHM_SIZE = "1Gi"
# /dev/shm per tensor-parallel rank on a GPU pod of several ranks or of a pipeline group, when spec.pod.shmSize
# is not given: NCCL's shared-memory transport and torch's shared tensors live there. LeaderWorkerSet's vLLM
# example gives 15Gi to an 8-GPU pod; 2Gi a rank is as much. A cap, not a reservation: only what is written
# counts against the memory limit.
GPU_SHM_PER_RANK_GIB = 2
GIB = 2**30
# The extended resource a GPU replica asks for; AMD (amd.com/gpu) and MIG slices (nvidia.com/mig-1g.10gb)
# are other names for the same one device the engine drives with --device cuda (ROCm's torch calls it cuda).
DEFAULT_ACCELERATOR = "nvidia.com/gpu"
# GPUs per pod: the engine shards a replica over them with tensor parallelism (issue 33), one rank per GPU
# (spec.engine.tensorParallelSize, default spec.resources.gpu). 16: the largest node GPU count in common
# offerings (8 on most, 16 on a few), the cap this field had before tensor parallelism was declared.
MAX_GPUS = 16
# Ranks a CPU replica may shard over (gloo, one process each): well past the cores a useful split needs.
MAX_CPU_TENSOR_PARALLEL = 64
# Pipeline stages of a replica, one pod each (a LeaderWorkerSet group of this size).
MAX_PIPELINE_PARALLEL = 64
# Cold start: how long the startup probe waits for /health. The CPU default is what the probe always had
# (10 minutes; the built-in models start in seconds). A GPU replica loads gigabytes of weights, then
# compiles Triton kernels and captures CUDA graphs: 30 minutes, as KubeAI and KServe allow for large models.
DEFAULT_STARTUP_TIMEOUT_SECONDS = 600
DEFAULT_GPU_STARTUP_TIMEOUT_SECONDS = 1800
# Host memory. On CPU the weights and the KV cache live in it (spec.resources.memory is checked against
# the cache). On a GPU the weights pass through it while loading, beside torch, the CUDA context and the
# swap space for preempted requests (1 GiB): the weights' size plus GPU_MEMORY_HEADROOM when spec.model.size
# is given, else DEFAULT_GPU_MEMORY, which holds a checkpoint of about 24 GiB (a 12B model in bf16).
DEFAULT_MEMORY = "2Gi"
DEFAULT_GPU_MEMORY = "32Gi"
GPU_MEMORY_HEADROOM = 8 * GIB
# The per-pod model cache (an emptyDir) when spec.model.cache.sizeLimit is not given. From spec.model.size:
# the weights (twice for an http(s) archive, which lies beside what it extracts until the end), a tenth
# more for the user's estimate, and CACHE_HEADROOM for the tokenizer, configs and Triton's kernels. Without
# a size: a default per device that holds the models such a replica usually serves.
CACHE_HEADROOM = 2 * GIB
DEFAULT_CPU_MODEL_CACHE = "20Gi"
DEFAULT_GPU_MODEL_CACHE = "80Gi"
PREEMPTION_MODES = ("auto", "swap", "recompute")
# Multi-tenant scheduling (issue 37), vLLM's names: --scheduling-policy orders by each request's priority;
# --fairness vtc shares a replica between tenants by the service each has had (Virtual Token Counter).
SCHEDULING_POLICIES = ("fcfs", "priority")
FAIRNESS_POLICIES = ("none", "vtc")
# The request header that names a request's tenant (`chunkwise serve --tenant-header`); the router passes
# every request header through to the replica, this one included. An HTTP field name (RFC 9110 token), kept
# to the characters every proxy passes (no '_': nginx drops such headers by default).
DEFAULT_TENANT_HEADER = "x-tenant-id"
HEADER_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$"
MAX_HEADER_NAME_LENGTH = 128
SPECULATIVE_METHODS = ("none", "ngram", "draft")
ROUTER_POLICIES = ("predicted-completion", "round-robin", "least-loaded", "prefix-affinity")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

# LoRA adapters (spec.adapters, issue 34). A name is what clients send as `model`, a directory name under
# /adapters and part of its fetcher's container name (fetch-adapter-<name>, at most 63 characters).
ADAPTER_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_ADAPTER_NAME_LENGTH = 48
# Init containers run one after another, and each runtime-loaded adapter is a call per replica: a bound that
# keeps both, and the CRD's CEL cost, small. KubeAI and vLLM deployments serve tens.
MAX_ADAPTERS = 64
ADAPTER_URI_SCHEMES = ("hf", "s3", "gs", "http", "https")
# vLLM's bounds: --max-lora-rank up to 512; the resident and host-memory counts are capped well past any GPU's.
MAX_LORAS = 256
MAX_LORA_RANK = 512
MAX_CPU_LORAS = 4096

# Children are named `<name>` and `<name>-router`; Services need DNS-1035 labels of at most 63 characters.
MAX_NAME_LENGTH = 63 - len("-router")

# Kubernetes' own resource.Quantity grammar, as the API server's OpenAPI publishes it.
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# A byte count: an integer with an optional binary or decimal suffix (no milli, no exponent).
BYTES_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_BYTE_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
DNS_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
IMAGE_PATTERN = r"^\S+$"
# An extended resource name as Kubernetes accepts it in limits: a DNS-subdomain prefix, '/', a name.
EXTENDED_RESOURCE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class SpecError(ValueError):
    """An invalid spec. `reason` is a CamelCase word for conditions and events; `message` says what and where."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ModelCache:
    """Where a fetched model is kept: a PVC that replicas share (one download), else a per-pod emptyDir."""

    claim_name: str | None = None
    size_limit: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Where the weights come from: a built-in preset, a PVC directory, an image path or a fetched URI."""

    source: str  # "preset" | "pvc" | "image" | "uri"
    served_name: str
    preset: str | None = None
    claim_name: str | None = None
    # For "pvc": a directory relative to the claim's root ("" is the root); for "image": an absolute path.
    path: str | None = None
    # For "uri": what `chunkwise fetch-model` downloads (hf://, s3://, gs://, http(s)://).
    uri: str | None = None
    cache: ModelCache = field(default_factory=ModelCache)
    # A Secret whose keys become the fetcher's environment (HF_TOKEN, AWS_*, GOOGLE_OAUTH_ACCESS_TOKEN).
    credentials_secret: str | None = None
    # spec.model.size: the checkpoint's bytes on disk, when the user states it. It sizes the per-pod cache
    # and a GPU replica's host memory; the operator never downloads the model to find out.
    size_bytes: int | None = None


@dataclass(frozen=True)
class Resources:
    cpu: str = "1"
    # Resolved by parse(): DEFAULT_MEMORY on CPU; on a GPU from spec.model.size, else DEFAULT_GPU_MEMORY.
    memory: str = DEFAULT_MEMORY
    gpu: int = 0
    # The extended resource `gpu` counts (spec.resources.accelerator).
    accelerator: str = DEFAULT_ACCELERATOR


@dataclass(frozen=True)
class Speculation:
    method: str = "none"
    num_tokens: int = 4


@dataclass(frozen=True)
class EngineSpec:
    # The engine's own defaults (runtime/chunkwise/engine/datatypes/config.py), so an empty spec runs the engine as shipped.
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    preemption_mode: str = "auto"
    enable_prefix_caching: bool = True
    speculation: Speculation = field(default_factory=Speculation)
    queue_delay_slo_seconds: float = 30.0
    drain_grace_seconds: int = 30
    # The startup probe's budget; resolved by parse() from the device when the spec leaves it out.
    startup_timeout_seconds: int = DEFAULT_STARTUP_TIMEOUT_SECONDS
    # Flags the CRD does not model, appended to `chunkwise serve`; the runtime validates them at start.
    extra_args: tuple[str, ...] = ()
    # --tensor-parallel-size: ranks per pod. Resolved by parse(): spec.engine.tensorParallelSize, else
    # spec.resources.gpu on a GPU replica (one rank per GPU), else 1.
    tensor_parallel_size: int = 1
    # --pipeline-parallel-size: pods per replica. Above 1 the replica is a LeaderWorkerSet group.
    pipeline_parallel_size: int = 1
    # LoRA (issue 34), vLLM's flags; rendered only when the service serves adapters (ServiceSpec.lora_enabled).
    # --max-loras: adapters resident on the device at once (a step mixes at most this many).
    max_loras: int = 1
    # --max-lora-rank: the largest rank an adapter may have; a higher one is refused at load.
    max_lora_rank: int = 16
    # --max-cpu-loras: adapters kept in host memory (an LRU); None: the engine's default.
    max_cpu_loras: int | None = None
    # spec.engine.runtimeLoraUpdates: adapters are loaded into running replicas through their
    # /v1/load_lora_adapter endpoint (--allow-runtime-lora), so that adding or removing one restarts no pod;
    # off, they are fetched by init containers and passed as --lora-modules (a change rolls the pods).
    runtime_lora_updates: bool = False
    # Multi-tenant scheduling (issue 37). Each is rendered only when it differs from the engine's default, so
    # that a service which leaves them out keeps the command (and the pods) it had, and a service pinned to
    # an older runtime image (status.runtimeImage) is not given flags that image lacks.
    # --scheduling-policy: fcfs (arrival order) or priority (each request's `priority`, lower first).
    scheduling_policy: str = "fcfs"
    # --fairness: none, or vtc (within a priority, the waiting tenant with the least service goes first).
    fairness: str = "none"
    # spec.engine.kvOffloadingMemory in bytes, 0 = off: host memory for the prefix cache's second tier,
    # rendered as --kv-offloading-size in GiB (vLLM's unit). It is host memory on top of the engine's own:
    # parse() adds it to the default spec.resources.memory, and refuses a given memory that cannot hold it.
    kv_offloading_bytes: int = 0


@dataclass(frozen=True)
class AutoscalingTargets:
    queue_depth_per_replica: float = 8.0
    preemption_rate_per_second: float = 1.0
    p99_step_time_seconds: float = 0.5
    kv_usage_fraction: float = 0.9


@dataclass(frozen=True)
class AutoscalingTolerances:
    """Per metric, the relative band around its target in which the count is left alone (HPA's tolerance).

    kvUsageFraction is a threshold: above its target it scales up at once, and the band applies below only,
    so a target of 0.9 acts at 90% and not at 99%.
    """

    queue_depth_per_replica: float = 0.1
    preemption_rate_per_second: float = 0.1
    p99_step_time_seconds: float = 0.1
    kv_usage_fraction: float = 0.1


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    delegated: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    targets: AutoscalingTargets = field(default_factory=AutoscalingTargets)
    tolerance: AutoscalingTolerances = field(default_factory=AutoscalingTolerances)
    scale_up_stabilization_seconds: int = 30
    scale_down_stabilization_seconds: int = 300
    # With minReplicas 0: seconds without a request before the built-in autoscaler goes to 0 replicas.
    scale_to_zero_after_seconds: int = 300


@dataclass(frozen=True)
class RouterResources:
    cpu: str = "250m"
    memory: str = "256Mi"


@dataclass(frozen=True)
class RouterSpec:
    enabled: bool = False
    policy: str = "predicted-completion"
    # Two, so that a node drain or a rollout (with the router's PodDisruptionBudget) leaves one serving.
    replicas: int = 2
    # spec.router.image, else the CPU image: spec.image on a CPU service, the default CPU build on a GPU
    # one. The router never needs CUDA, and the CUDA build is gigabytes more to pull on every node.
    image: str = DEFAULT_IMAGE
    resources: RouterResources = field(default_factory=RouterResources)
    # Scale from zero (`chunkwise router --wake-timeout-seconds`, --wake-queue-limit): how long a request
    # is held for a replica, and how many at once. The runtime's defaults; raise the timeout for a model
    # whose cold start (pull, fetch, load) takes longer.
    wake_timeout_seconds: int = 300
    wake_queue_limit: int = 128
    # How long a stopping router keeps streaming the responses it has in flight (after the wake timeout,
    # for a request that was held). The pod's terminationGracePeriodSeconds is derived from both.
    drain_grace_seconds: int = 60
    # spec.router.tenantHeader, lowercased (HTTP field names are case-insensitive): the header the runtime
    # pods read a request's tenant from (--tenant-header, rendered only when not the default). The router
    # forwards it as it forwards every request header; a client that talks to the replicas directly or
    # through a gateway sends the same one.
    tenant_header: str = DEFAULT_TENANT_HEADER


@dataclass(frozen=True)
class GatewaySpec:
    """The Gateway API Inference Extension: an InferencePool whose endpoint picker is the router."""

    inference_pool: bool = False


@dataclass(frozen=True)
class Toleration:
    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str | None = None
    # An arbitrary core/v1 EnvVarSource, passed through untouched (read-only view).
    value_from: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PodOverrides:
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    env: tuple[EnvVar, ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str | None = None
    priority_class_name: str | None = None
    # core/v1 objects passed through as given (read-only views): the API server validates them.
    affinity: Mapping[str, Any] | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    # Resolved by parse(): DEFAULT_SHM_SIZE, or default_shm_size's for a multi-rank GPU pod.
    shm_size: str = DEFAULT_SHM_SIZE
    # A RuntimeClass for the runtime pods (e.g. `nvidia` where the NVIDIA container runtime is not the
    # node's default).
    runtime_class_name: str | None = None
    # Leave runAsUser, runAsGroup and fsGroup out of every pod, for platforms that assign them from the
    # namespace's range and refuse a fixed one (OpenShift's restricted-v2 SCC refuses the image's 65532).
    platform_assigns_uid: bool = False


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter of spec.adapters: the name clients send as `model`, and where its files come from."""

    name: str
    # What `chunkwise fetch-model --adapter` fetches: hf://, s3://, gs:// or an http(s) archive.
    uri: str


@dataclass(frozen=True)
class ServiceSpec:
    model: ModelSpec
    image: str
    image_pull_policy: str | None = None
    replicas: int = 1
    resources: Resources = field(default_factory=Resources)
    engine: EngineSpec = field(default_factory=EngineSpec)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    router: RouterSpec = field(default_factory=RouterSpec)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    pod: PodOverrides = field(default_factory=PodOverrides)
    adapters: tuple[Adapter, ...] = ()

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine runs with --enable-lora: it serves adapters, or may be given some at run time."""
        return bool(self.adapters) or self.engine.runtime_lora_updates


# ---------------------------------------------------------------------------------------------- readers


def _section(data: Mapping[str, Any], key: str, path: str, reason: str) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(reason, f"{path}{key} must be an object, got {value!r}")
    return value


def _int(
    data: Mapping[str, Any], key: str, path: str, reason: str, default: int | None, lo: int, hi: int
) -> int | None:
    value = data.get(key)
    if value is None:
        return default
    # bool is an int in Python; a YAML `true` is never a count.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecError(reason, f"{path}{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _req_int(
    data: Mapping[str, Any], key: str, path: str, reason: str, default: int, lo: int, hi: int
) -> int:
    value = _int(data, key, path, reason, default, lo, hi)
    assert value is not None
    return value


def _num(
    data: Mapping[str, Any], key: str, path: str, reason: str, default: float, lo: float, hi: float
) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise SpecError(reason, f"{path}{key} must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def _bool(data: Mapping[str, Any], key: str, path: str, reason: str, default: bool) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(reason, f"{path}{key} must be true or false, got {value!r}")
    return value


def _str(
    data: Mapping[str, Any],
    key: str,
    path: str,
    reason: str,
    default: str | None,
    *,
    choices: Sequence[str] | None = None,
    pattern: str | None = None,
    max_length: int = 4096,
) -> str | None:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise SpecError(reason, f"{path}{key} must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise SpecError(reason, f"{path}{key} must be one of {', '.join(choices)}; got {value!r}")
    if pattern is not None and not re.fullmatch(pattern, value):
        raise SpecError(reason, f"{path}{key} {value!r} does not match {pattern}")
    if len(value) > max_length:
        raise SpecError(reason, f"{path}{key} is longer than {max_length} characters")
    return value


def _quantity(data: Mapping[str, Any], key: str, path: str, reason: str, default: str) -> str:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SpecError(reason, f"{path}{key} must be a quantity such as 2, 500m or 8Gi; got {value!r}")
    text = str(value)
    if not re.fullmatch(QUANTITY_PATTERN, text):
        raise SpecError(reason, f"{path}{key} must be a quantity such as 2, 500m or 8Gi; got {value!r}")
    return text


def parse_bytes(value: int | str) -> int:
    """A byte count from an integer or a quantity string with a binary/decimal suffix ("4Gi", "512M")."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte count: {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a byte count must be positive, got {value}")
        return value
    match = re.fullmatch(BYTES_PATTERN, value)
    if match is None:
        raise ValueError(f"not a byte count: {value!r} (use e.g. 4Gi, 512Mi or 1000000)")
    suffix = match.group(2) or ""
    number = Decimal(value[: len(value) - len(suffix)]) * _BYTE_SUFFIXES[suffix]
    if number != number.to_integral_value() or number <= 0:
        raise ValueError(f"{value!r} is not a positive whole number of bytes")
    return int(number)


def _string_map(data: Mapping[str, Any], key: str, path: str, reason: str) -> tuple[tuple[str, str], ...]:
    value = data.get(key)
    if value is None:
        return ()
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SpecError(reason, f"{path}{key} must map strings to strings, got {value!r}")
    return tuple(sorted(value.items()))


# ---------------------------------------------------------------------------------------------- sections


def validate_name(name: str) -> None:
    """The InferenceService's own name must also be a valid name for the Services it gets."""
    if not re.fullmatch(DNS_LABEL_PATTERN, name) or len(name) > MAX_NAME_LENGTH:
        raise SpecError(
            "InvalidName",
            f"metadata.name {name!r} must be a DNS-1035 label (lowercase letters, digits, '-', starting "
            f"with a letter) of at most {MAX_NAME_LENGTH} characters, so its Services can be named after it",
        )


def _model(spec: Mapping[str, Any]) -> ModelSpec:
    model = _model_source(spec)
    data = _section(spec, "model", "spec.", "InvalidModelSource")
    size = _bytes(data, "size", "spec.model.", "InvalidModelSource", minimum=2**20)
    return model if size is None else replace(model, size_bytes=size)


def _bytes(data: Mapping[str, Any], key: str, path: str, reason: str, minimum: int) -> int | None:
    """A byte count such as 16Gi or 16000000000, or None when absent."""
    raw = data.get(key)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise SpecError(reason, f"{path}{key} must be a byte count such as 4Gi, got {raw!r}")
    try:
        value = parse_bytes(raw)
    except ValueError as e:
        raise SpecError(reason, f"{path}{key}: {e}") from None
    if value < minimum:
        raise SpecError(reason, f"{path}{key} must be at least {minimum} bytes, got {raw!r}")
    return value


def _model_source(spec: Mapping[str, Any]) -> ModelSpec:
    reason = "InvalidModelSource"
    if spec.get("model") is None:
        raise SpecError(reason, "spec.model is required: give one of preset, pvc, path or uri")
    data = _section(spec, "model", "spec.", reason)
    given = [key for key in ("preset", "pvc", "path", "uri") if data.get(key) is not None]
    if len(given) != 1:
        raise SpecError(
            reason,
            "spec.model must give exactly one of preset, pvc, path or uri; "
            + (f"got {', '.join(given)}" if given else "got none"),
        )
    served = _str(
        data, "servedName", "spec.model.", reason, None, pattern=SERVED_NAME_PATTERN, max_length=256
    )
    fetched = given == ["uri"] and not str(data.get("uri")).startswith("pvc://")
    for key in ("cache", "credentialsSecret"):
        if data.get(key) is not None and not fetched:
            raise SpecError(reason, f"spec.model.{key} applies only to a fetched spec.model.uri")
    if given == ["preset"]:
        preset = _str(data, "preset", "spec.model.", reason, None, choices=PRESETS)
        assert preset is not None
        return ModelSpec(source="preset", served_name=served or preset, preset=preset)
    if given == ["path"]:
        path = _str(data, "path", "spec.model.", reason, None)
        assert path is not None
        if not path.startswith("/") or _bad_path(path):
            raise SpecError(reason, f"spec.model.path must be an absolute path without '..', got {path!r}")
        return ModelSpec(source="image", served_name=served or _base_name(path), path=path)
    if given == ["uri"]:
        return _model_uri(data, served)
    pvc = _section(data, "pvc", "spec.model.", reason)
    claim = _str(
        pvc, "claimName", "spec.model.pvc.", reason, None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253
    )
    if claim is None:
        raise SpecError(reason, "spec.model.pvc.claimName is required")
    sub = _str(pvc, "path", "spec.model.pvc.", reason, "")
    assert sub is not None
    return _pvc_model(claim, sub, served, "spec.model.pvc.path")


def _pvc_model(claim: str, sub: str, served: str | None, where: str) -> ModelSpec:
    if sub.startswith("/") or _bad_path(sub):
        raise SpecError(
            "InvalidModelSource", f"{where} must be relative to the claim's root, without '..'; got {sub!r}"
        )
    sub = sub.strip("/")
    return ModelSpec(source="pvc", served_name=served or _base_name(sub or claim), claim_name=claim, path=sub)


# The shape of each scheme's remainder; `chunkwise fetch-model` parses it fully in the init container.
HF_REPO_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+(@[-A-Za-z0-9_./]+)?$"
BUCKET_PATTERN = r"^[a-z0-9][-a-z0-9._]{1,220}[a-z0-9](/[^\s]*)?$"
URL_REST_PATTERN = r"^[^/\s]+(/\S*)?$"
URI_PATTERN = r"^(hf|s3|gs|https?|pvc)://\S+$"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar", ".zip")


def _model_uri(data: Mapping[str, Any], served: str | None) -> ModelSpec:
    reason = "InvalidModelSource"
    p = "spec.model."
    uri = _str(data, "uri", p, reason, None, max_length=4096)
    assert uri is not None
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in URI_SCHEMES or not rest or any(c.isspace() for c in uri):
        raise SpecError(
            reason, f"{p}uri must start with one of {', '.join(s + '://' for s in URI_SCHEMES)}; got {uri!r}"
        )
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        if not re.fullmatch(DNS_SUBDOMAIN_PATTERN, claim) or len(claim) > 253:
            raise SpecError(reason, f"{p}uri {uri!r}: {claim!r} is not a PersistentVolumeClaim name")
        return _pvc_model(claim, sub, served, f"{p}uri's path")
    if scheme == "hf":
        if not re.fullmatch(HF_REPO_PATTERN, rest):
            raise SpecError(reason, f"{p}uri {uri!r} must be hf://org/name or hf://org/name@revision")
        default_name = rest.split("@", 1)[0].split("/", 1)[1]
    elif scheme in ("s3", "gs"):
        if not re.fullmatch(BUCKET_PATTERN, rest):
            raise SpecError(reason, f"{p}uri {uri!r} must be {scheme}://bucket/prefix")
        default_name = rest.rstrip("/").rsplit("/", 1)[-1]
    else:
        # An archive; the fetcher tells its type from the name, the Content-Type or the bytes themselves.
        path = rest.split("#", 1)[0].split("?", 1)[0]
        if not re.fullmatch(URL_REST_PATTERN, path):
            raise SpecError(reason, f"{p}uri {uri!r} is not an http(s) URL")
        default_name = path.rsplit("/", 1)[-1]
        for suffix in ARCHIVE_SUFFIXES:
            if default_name.lower().endswith(suffix):
                default_name = default_name[: -len(suffix)]
                break
    cache_data = _section(data, "cache", p, reason)
    cache = ModelCache(
        claim_name=_str(
            cache_data, "claimName", p + "cache.", reason, None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253
        ),
        size_limit=_quantity_or_none(cache_data, "sizeLimit", p + "cache.", reason),
    )
    if cache.claim_name is not None and cache.size_limit is not None:
        raise SpecError(reason, f"{p}cache.sizeLimit is for the default emptyDir, not a claim")
    secret = _str(data, "credentialsSecret", p, reason, None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    if served is None and not re.fullmatch(SERVED_NAME_PATTERN, default_name or ""):
        raise SpecError(reason, f"give spec.model.servedName: {uri!r} has no usable base name")
    return ModelSpec(
        source="uri",
        served_name=served or default_name,
        uri=uri,
        cache=cache,
        credentials_secret=secret,
    )


def _quantity_or_none(data: Mapping[str, Any], key: str, path: str, reason: str) -> str | None:
    return None if data.get(key) is None else _quantity(data, key, path, reason, "")


def _base_name(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if not re.fullmatch(SERVED_NAME_PATTERN, name):
        raise SpecError("InvalidModelSource", f"give spec.model.servedName: {path!r} has no usable base name")
    return name


def _bad_path(path: str) -> bool:
    return ".." in path.split("/") or any(c.isspace() for c in path) or "\x00" in path


def _resources(spec: Mapping[str, Any], model: ModelSpec) -> Resources:
    reason = "InvalidResources"
    p = "spec.resources."
    data = _section(spec, "resources", "spec.", reason)
    d = Resources()
    gpu = _req_int(data, "gpu", p, reason, d.gpu, 0, MAX_GPUS)
    accelerator = _str(
        data, "accelerator", p, reason, d.accelerator, pattern=EXTENDED_RESOURCE_PATTERN, max_length=317
    )
    assert accelerator is not None
    domain, _, resource = accelerator.partition("/")
    if (
        domain == "kubernetes.io"
        or domain.endswith(".kubernetes.io")
        or len(domain) > 253
        or len(resource) > 63
    ):
        raise SpecError(
            reason,
            f"{p}accelerator {accelerator!r} must be an extended resource name, domain/name, outside "
            "kubernetes.io (e.g. nvidia.com/gpu, amd.com/gpu, nvidia.com/mig-1g.10gb)",
        )
    return Resources(
        cpu=_quantity(data, "cpu", p, reason, d.cpu),
        memory=_quantity(data, "memory", p, reason, default_memory(gpu, model.size_bytes)),
        gpu=gpu,
        accelerator=accelerator,
    )


def default_memory(gpu: int, model_bytes: int | None) -> str:
    """spec.resources.memory when the spec leaves it out (see DEFAULT_GPU_MEMORY for why)."""
    if not gpu:
        return DEFAULT_MEMORY
    if model_bytes is None:
        return DEFAULT_GPU_MEMORY
    return f"{math.ceil((model_bytes + GPU_MEMORY_HEADROOM) / GIB)}Gi"


def default_shm_size(gpu: int, engine: EngineSpec) -> str:
    """spec.pod.shmSize when the spec leaves it out (see GPU_SHM_PER_RANK_GIB)."""
    if gpu and (engine.tensor_parallel_size > 1 or engine.pipeline_parallel_size > 1):
        return f"{GPU_SHM_PER_RANK_GIB * engine.tensor_parallel_size}Gi"
    return DEFAULT_SHM_SIZE


def default_cache_size(model: ModelSpec, gpu: int) -> str:
    """The per-pod model cache's sizeLimit (and ephemeral-storage request) when the spec leaves it out."""
    if model.size_bytes is None:
        return DEFAULT_GPU_MODEL_CACHE if gpu else DEFAULT_CPU_MODEL_CACHE
    copies = 2 if (model.uri or "").startswith(("http://", "https://")) else 1
    return f"{math.ceil(model.size_bytes * copies * 1.1 / GIB + CACHE_HEADROOM / GIB)}Gi"


def _engine(spec: Mapping[str, Any], gpu: int) -> EngineSpec:
    reason = "InvalidEngine"
    p = "spec.engine."
    data = _section(spec, "engine", "spec.", reason)
    d = EngineSpec()
    kv: int | None = None
    raw_kv = data.get("kvCacheMemory")
    if raw_kv is not None:
        if not isinstance(raw_kv, (int, str)):
            raise SpecError(reason, f"{p}kvCacheMemory must be a byte count such as 4Gi, got {raw_kv!r}")
        try:
            kv = parse_bytes(raw_kv)
        except ValueError as e:
            raise SpecError(reason, f"{p}kvCacheMemory: {e}") from None
        if kv < 2**20:
            raise SpecError(reason, f"{p}kvCacheMemory must be at least 1Mi, got {raw_kv!r}")
    spec_data = _section(data, "speculation", p, reason)
    sd = Speculation()
    speculation = Speculation(
        method=_str(spec_data, "method", p + "speculation.", reason, sd.method, choices=SPECULATIVE_METHODS)
        or sd.method,
        num_tokens=_req_int(spec_data, "numTokens", p + "speculation.", reason, sd.num_tokens, 1, 16),
    )
    result = EngineSpec(
        dtype=_str(data, "dtype", p, reason, d.dtype, choices=DTYPES) or d.dtype,
        max_num_seqs=_req_int(data, "maxNumSeqs", p, reason, d.max_num_seqs, 1, 4096),
        max_num_batched_tokens=_req_int(
            data, "maxNumBatchedTokens", p, reason, d.max_num_batched_tokens, 1, 1 << 20
        ),
        block_size=_req_int(data, "blockSize", p, reason, d.block_size, 1, 256),
        kv_cache_memory_bytes=kv,
        preemption_mode=_str(data, "preemptionMode", p, reason, d.preemption_mode, choices=PREEMPTION_MODES)
        or d.preemption_mode,
        enable_prefix_caching=_bool(data, "enablePrefixCaching", p, reason, d.enable_prefix_caching),
        speculation=speculation,
        queue_delay_slo_seconds=_num(
            data, "queueDelaySloSeconds", p, reason, d.queue_delay_slo_seconds, 0, 3600
        ),
        drain_grace_seconds=_req_int(data, "drainGraceSeconds", p, reason, d.drain_grace_seconds, 0, 3600),
        extra_args=_extra_args(data, p, reason),
        startup_timeout_seconds=_req_int(
            data,
            "startupTimeoutSeconds",
            p,
            reason,
            DEFAULT_GPU_STARTUP_TIMEOUT_SECONDS if gpu else DEFAULT_STARTUP_TIMEOUT_SECONDS,
            30,
            86400,
        ),
        tensor_parallel_size=_tensor_parallel_size(data, p, reason, gpu),
        pipeline_parallel_size=_req_int(
            data, "pipelineParallelSize", p, reason, d.pipeline_parallel_size, 1, MAX_PIPELINE_PARALLEL
        ),
        max_loras=_req_int(data, "maxLoras", p, reason, d.max_loras, 1, MAX_LORAS),
        max_lora_rank=_req_int(data, "maxLoraRank", p, reason, d.max_lora_rank, 1, MAX_LORA_RANK),
        max_cpu_loras=_int(data, "maxCpuLoras", p, reason, None, 1, MAX_CPU_LORAS),
        runtime_lora_updates=_bool(data, "runtimeLoraUpdates", p, reason, d.runtime_lora_updates),
        scheduling_policy=_str(
            data, "schedulingPolicy", p, reason, d.scheduling_policy, choices=SCHEDULING_POLICIES
        )
        or d.scheduling_policy,
        fairness=_str(data, "fairness", p, reason, d.fairness, choices=FAIRNESS_POLICIES) or d.fairness,
        kv_offloading_bytes=_offloading_bytes(data, p, reason),
    )
    if result.kv_offloading_bytes and not result.enable_prefix_caching:
        # The tier holds blocks the prefix cache evicts and is looked up by their prefix hashes: without the
        # prefix cache there is nothing to keep (the engine refuses the same; the CRD's CEL rule too).
        raise SpecError(
            reason,
            f"{p}kvOffloadingMemory needs {p}enablePrefixCaching: the host tier keeps the blocks the prefix "
            "cache evicts; turn prefix caching on or leave kvOffloadingMemory out",
        )
    if result.max_cpu_loras is not None and result.max_cpu_loras < result.max_loras:
        # The host LRU holds every adapter resident on the device (vLLM refuses the same).
        raise SpecError(
            reason,
            f"{p}maxCpuLoras ({result.max_cpu_loras}) must be at least {p}maxLoras ({result.max_loras}): "
            "the host cache holds every adapter on the device",
        )
    return result


# A byte count of zero in any unit ("0", "0Gi", "0.0"): spec.engine.kvOffloadingMemory's "off".
ZERO_BYTES_PATTERN = r"^0+(\.0+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"


def _offloading_bytes(data: Mapping[str, Any], p: str, reason: str) -> int:
    """spec.engine.kvOffloadingMemory in bytes; 0 when absent or zero (the tier off)."""
    raw = data.get("kvOffloadingMemory")
    if raw is None or (isinstance(raw, (int, str)) and re.fullmatch(ZERO_BYTES_PATTERN, str(raw))):
        return 0
    value = _bytes(data, "kvOffloadingMemory", p, reason, minimum=2**20)
    assert value is not None
    return value


def _tensor_parallel_size(data: Mapping[str, Any], p: str, reason: str, gpu: int) -> int:
    """spec.engine.tensorParallelSize, else one rank per GPU (`gpu: N` means --tensor-parallel-size N).

    On a GPU replica it must divide spec.resources.gpu (the CRD's CEL rule says the same): the pod's GPUs
    are whole tensor-parallel groups, never a group split across a GPU it does not have. On CPU (gpu 0) it
    is the engine's gloo ranks, passed as given.
    """
    if not gpu:
        return _req_int(data, "tensorParallelSize", p, reason, 1, 1, MAX_CPU_TENSOR_PARALLEL)
    tp = _req_int(data, "tensorParallelSize", p, reason, gpu, 1, MAX_GPUS)
    if gpu % tp:
        raise SpecError(
            reason,
            f"{p}tensorParallelSize ({tp}) must divide spec.resources.gpu ({gpu}): each rank drives one of "
            f"the pod's GPUs; leave tensorParallelSize out to shard over all {gpu}",
        )
    return tp


# Flags the operator derives from the spec: given again in extraArgs they would fight the field (argparse
# keeps the last one), so each is refused with the field to use instead.
MODELED_FLAGS = {
    "--model": "spec.model",
    "--served-model-name": "spec.model.servedName",
    "--host": "(set by the operator)",
    "--port": "(set by the operator)",
    "--device": "spec.resources.gpu",
    "--dtype": "spec.engine.dtype",
    "--max-num-seqs": "spec.engine.maxNumSeqs",
    "--max-num-batched-tokens": "spec.engine.maxNumBatchedTokens",
    "--block-size": "spec.engine.blockSize",
    "--kv-cache-memory-bytes": "spec.engine.kvCacheMemory",
    "--preemption-mode": "spec.engine.preemptionMode",
    "--enable-prefix-caching": "spec.engine.enablePrefixCaching",
    "--no-enable-prefix-caching": "spec.engine.enablePrefixCaching",
    "--speculative-method": "spec.engine.speculation.method",
    "--num-speculative-tokens": "spec.engine.speculation.numTokens",
    "--queue-delay-slo-seconds": "spec.engine.queueDelaySloSeconds",
    "--drain-timeout-seconds": "spec.engine.drainGraceSeconds",
    "--tensor-parallel-size": "spec.engine.tensorParallelSize",
    "--pipeline-parallel-size": "spec.engine.pipelineParallelSize",
    "--enable-lora": "spec.adapters",
    "--lora-modules": "spec.adapters",
    "--max-loras": "spec.engine.maxLoras",
    "--max-lora-rank": "spec.engine.maxLoraRank",
    "--max-cpu-loras": "spec.engine.maxCpuLoras",
    "--allow-runtime-lora": "spec.engine.runtimeLoraUpdates",
    "--scheduling-policy": "spec.engine.schedulingPolicy",
    "--fairness": "spec.engine.fairness",
    "--kv-offloading-size": "spec.engine.kvOffloadingMemory",
    "--tenant-header": "spec.router.tenantHeader",
}


def _extra_args(data: Mapping[str, Any], p: str, reason: str) -> tuple[str, ...]:
    raw = data.get("extraArgs")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
        raise SpecError(reason, f"{p}extraArgs must be a list of strings, got {raw!r}")
    if len(raw) > 64:
        raise SpecError(reason, f"{p}extraArgs holds {len(raw)} items; at most 64")
    for i, arg in enumerate(raw):
        if not arg or len(arg) > 4096 or "\x00" in arg:
            raise SpecError(
                reason, f"{p}extraArgs[{i}] must be a non-empty string of at most 4096 characters"
            )
        flag = arg.split("=", 1)[0]
        if flag in MODELED_FLAGS:
            raise SpecError(
                reason, f"{p}extraArgs[{i}] {flag} is what {MODELED_FLAGS[flag]} sets; use that field instead"
            )
    if not raw[0].startswith("-"):
        raise SpecError(reason, f"{p}extraArgs must start with a flag, got {raw[0]!r}")
    return tuple(raw)


def _adapters(spec: Mapping[str, Any], model: ModelSpec) -> tuple[Adapter, ...]:
    """spec.adapters: unique DNS-label names, none the base model's own, each with a fetchable URI."""
    reason = "InvalidAdapters"
    p = "spec.adapters"
    raw = spec.get("adapters")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError(reason, f"{p} must be a list of {{name, uri}} objects, got {raw!r}")
    if len(raw) > MAX_ADAPTERS:
        raise SpecError(reason, f"{p} holds {len(raw)} adapters; at most {MAX_ADAPTERS}")
    result: list[Adapter] = []
    for i, item in enumerate(raw):
        ap = f"{p}[{i}]."
        if not isinstance(item, Mapping):
            raise SpecError(reason, f"{ap[:-1]} must be an object, got {item!r}")
        name = item.get("name")
        if (
            not isinstance(name, str)
            or not re.fullmatch(ADAPTER_NAME_PATTERN, name)
            or len(name) > MAX_ADAPTER_NAME_LENGTH
        ):
            raise SpecError(
                reason,
                f"{ap}name must be a DNS label (lowercase letters, digits and '-', starting with a letter) of at "
                f"most {MAX_ADAPTER_NAME_LENGTH} characters, got {name!r}",
            )
        if name == model.served_name:
            raise SpecError(
                reason,
                f"{ap}name {name!r} is the base model's served name: clients could not tell them apart",
            )
        if any(a.name == name for a in result):
            raise SpecError(reason, f"{p} names {name!r} twice: adapter names must be unique")
        uri = item.get("uri")
        if not isinstance(uri, str):
            raise SpecError(reason, f"{ap}uri is required (hf://, s3://, gs:// or http(s)://), got {uri!r}")
        result.append(Adapter(name=name, uri=_adapter_uri(uri, ap, reason)))
    return tuple(result)


def _adapter_uri(uri: str, ap: str, reason: str) -> str:
    """An adapter's URI: one `chunkwise fetch-model` fetches (pvc:// is a mount, which adapters do not get)."""
    scheme, sep, rest = uri.partition("://")
    if (
        len(uri) > 4096
        or not sep
        or scheme not in ADAPTER_URI_SCHEMES
        or not rest
        or any(c.isspace() for c in uri)
    ):
        raise SpecError(
            reason,
            f"{ap}uri must start with one of {', '.join(s + '://' for s in ADAPTER_URI_SCHEMES)}; got {uri!r}",
        )
    if scheme == "hf" and not re.fullmatch(HF_REPO_PATTERN, rest):
        raise SpecError(reason, f"{ap}uri {uri!r} must be hf://org/name or hf://org/name@revision")
    if scheme in ("s3", "gs") and not re.fullmatch(BUCKET_PATTERN, rest):
        raise SpecError(reason, f"{ap}uri {uri!r} must be {scheme}://bucket/prefix")
    if scheme in ("http", "https") and not re.fullmatch(
        URL_REST_PATTERN, rest.split("#", 1)[0].split("?", 1)[0]
    ):
        raise SpecError(reason, f"{ap}uri {uri!r} is not an http(s) URL")
    return uri


def _autoscaling(spec: Mapping[str, Any]) -> AutoscalingSpec:
    reason = "InvalidAutoscaling"
    p = "spec.autoscaling."
    data = _section(spec, "autoscaling", "spec.", reason)
    d = AutoscalingSpec()
    t = _section(data, "targets", p, reason)
    td = AutoscalingTargets()
    tp = p + "targets."
    targets = AutoscalingTargets(
        queue_depth_per_replica=_num(
            t, "queueDepthPerReplica", tp, reason, td.queue_depth_per_replica, 0.1, 1e5
        ),
        preemption_rate_per_second=_num(
            t, "preemptionRatePerSecond", tp, reason, td.preemption_rate_per_second, 0.001, 1e5
        ),
        p99_step_time_seconds=_num(t, "p99StepTimeSeconds", tp, reason, td.p99_step_time_seconds, 0.001, 60),
        kv_usage_fraction=_num(t, "kvUsageFraction", tp, reason, td.kv_usage_fraction, 0.01, 1.0),
    )
    tol = _section(data, "tolerance", p, reason)
    tod = AutoscalingTolerances()
    tolp = p + "tolerance."
    tolerance = AutoscalingTolerances(
        **{
            attr: _num(tol, key, tolp, reason, getattr(tod, attr), 0.0, 1.0)
            for key, attr in (
                ("queueDepthPerReplica", "queue_depth_per_replica"),
                ("preemptionRatePerSecond", "preemption_rate_per_second"),
                ("p99StepTimeSeconds", "p99_step_time_seconds"),
                ("kvUsageFraction", "kv_usage_fraction"),
            )
        }
    )
    result = AutoscalingSpec(
        enabled=_bool(data, "enabled", p, reason, d.enabled),
        delegated=_bool(data, "delegated", p, reason, d.delegated),
        min_replicas=_req_int(data, "minReplicas", p, reason, d.min_replicas, 0, 1000),
        max_replicas=_req_int(data, "maxReplicas", p, reason, d.max_replicas, 1, 1000),
        targets=targets,
        tolerance=tolerance,
        scale_up_stabilization_seconds=_req_int(
            data, "scaleUpStabilizationSeconds", p, reason, d.scale_up_stabilization_seconds, 0, 3600
        ),
        scale_down_stabilization_seconds=_req_int(
            data, "scaleDownStabilizationSeconds", p, reason, d.scale_down_stabilization_seconds, 0, 3600
        ),
        scale_to_zero_after_seconds=_req_int(
            data, "scaleToZeroAfterSeconds", p, reason, d.scale_to_zero_after_seconds, 1, 86400
        ),
    )
    router = spec.get("router")
    if (
        result.min_replicas == 0
        and not result.delegated
        and not (isinstance(router, Mapping) and router.get("enabled") is True)
    ):
        # At 0 replicas there is nothing to scrape: something must bring the first replica back.
        raise SpecError(
            reason,
            f"{p}minReplicas 0 needs spec.router.enabled (the router holds requests and scales from zero) "
            f"or {p}delegated: true (an HPA or KEDA that can scale from zero); the built-in autoscaler "
            "has no metrics at 0 replicas",
        )
    if result.min_replicas > result.max_replicas:
        raise SpecError(
            reason,
            f"{p}minReplicas ({result.min_replicas}) must not exceed {p}maxReplicas ({result.max_replicas})",
        )
    return result


def _router(spec: Mapping[str, Any], default_image: str) -> RouterSpec:
    reason = "InvalidRouter"
    p = "spec.router."
    data = _section(spec, "router", "spec.", reason)
    d = RouterSpec()
    res = _section(data, "resources", p, reason)
    rd = RouterResources()
    return RouterSpec(
        enabled=_bool(data, "enabled", p, reason, d.enabled),
        policy=_str(data, "policy", p, reason, d.policy, choices=ROUTER_POLICIES) or d.policy,
        replicas=_req_int(data, "replicas", p, reason, d.replicas, 1, 100),
        image=_str(data, "image", p, reason, default_image, pattern=IMAGE_PATTERN) or default_image,
        resources=RouterResources(
            cpu=_quantity(res, "cpu", p + "resources.", reason, rd.cpu),
            memory=_quantity(res, "memory", p + "resources.", reason, rd.memory),
        ),
        wake_timeout_seconds=_req_int(
            data, "wakeTimeoutSeconds", p, reason, d.wake_timeout_seconds, 1, 86400
        ),
        wake_queue_limit=_req_int(data, "wakeQueueLimit", p, reason, d.wake_queue_limit, 1, 100000),
        drain_grace_seconds=_req_int(data, "drainGraceSeconds", p, reason, d.drain_grace_seconds, 0, 3600),
        tenant_header=(
            _str(
                data,
                "tenantHeader",
                p,
                reason,
                d.tenant_header,
                pattern=HEADER_NAME_PATTERN,
                max_length=MAX_HEADER_NAME_LENGTH,
            )
            or d.tenant_header
        ).lower(),
    )


def _gateway(spec: Mapping[str, Any], router: RouterSpec) -> GatewaySpec:
    reason = "InvalidGateway"
    p = "spec.gateway."
    data = _section(spec, "gateway", "spec.", reason)
    result = GatewaySpec(inference_pool=_bool(data, "inferencePool", p, reason, GatewaySpec().inference_pool))
    if result.inference_pool and not router.enabled:
        # The pool names the router's Service as its endpoint picker: without a router, nothing answers.
        raise SpecError(
            reason,
            f"{p}inferencePool needs spec.router.enabled: the router is the pool's endpoint picker (EPP)",
        )
    return result


def _pod(spec: Mapping[str, Any], default_shm: str = DEFAULT_SHM_SIZE) -> PodOverrides:
    reason = "InvalidPodOverrides"
    p = "spec.pod."
    data = _section(spec, "pod", "spec.", reason)

    raw_tolerations = data.get("tolerations") or []
    if not isinstance(raw_tolerations, list):
        raise SpecError(reason, f"{p}tolerations must be a list, got {raw_tolerations!r}")
    tolerations = []
    for i, item in enumerate(raw_tolerations):
        tp = f"{p}tolerations[{i}]."
        if not isinstance(item, Mapping):
            raise SpecError(reason, f"{tp[:-1]} must be an object, got {item!r}")
        tol = Toleration(
            key=_str(item, "key", tp, reason, None),
            operator=_str(item, "operator", tp, reason, "Equal", choices=TOLERATION_OPERATORS) or "Equal",
            value=_str(item, "value", tp, reason, None),
            effect=_str(item, "effect", tp, reason, None, choices=TAINT_EFFECTS),
            toleration_seconds=_int(item, "tolerationSeconds", tp, reason, None, 0, 2**62),
        )
        if tol.operator == "Exists" and tol.value:
            raise SpecError(reason, f"{tp}value must be empty when operator is Exists")
        if tol.key is None and tol.operator != "Exists":
            raise SpecError(reason, f"{tp}operator must be Exists when key is empty")
        tolerations.append(tol)

    raw_env = data.get("env") or []
    if not isinstance(raw_env, list):
        raise SpecError(reason, f"{p}env must be a list, got {raw_env!r}")
    env = []
    seen: set[str] = set()
    for i, item in enumerate(raw_env):
        ep = f"{p}env[{i}]."
        if not isinstance(item, Mapping):
            raise SpecError(reason, f"{ep[:-1]} must be an object, got {item!r}")
        name = _str(item, "name", ep, reason, None, pattern=ENV_NAME_PATTERN)
        if name is None:
            raise SpecError(reason, f"{ep}name is required")
        if name in seen:
            raise SpecError(reason, f"{p}env has {name!r} twice")
        seen.add(name)
        value = _str(item, "value", ep, reason, None, max_length=1 << 20)
        value_from = item.get("valueFrom")
        if value_from is not None and (not isinstance(value_from, Mapping) or value is not None):
            raise SpecError(reason, f"{ep}valueFrom must be an object and cannot be combined with value")
        env.append(
            EnvVar(
                name=name,
                value=value,
                value_from=None if value_from is None else MappingProxyType(dict(value_from)),
            )
        )

    pull_secrets = []
    for i, item in enumerate(_objects(data, "imagePullSecrets", p, reason)):
        secret = _str(item, "name", f"{p}imagePullSecrets[{i}].", reason, None, pattern=DNS_SUBDOMAIN_PATTERN)
        if secret is None:
            raise SpecError(reason, f"{p}imagePullSecrets[{i}].name is required")
        pull_secrets.append(secret)
    affinity = data.get("affinity")
    if affinity is not None and not isinstance(affinity, Mapping):
        raise SpecError(reason, f"{p}affinity must be an object, got {affinity!r}")
    volumes = _objects(data, "volumes", p, reason)
    mounts = _objects(data, "volumeMounts", p, reason)
    names = [v.get("name") for v in volumes]
    for i, name in enumerate(names):
        if not isinstance(name, str) or not re.fullmatch(DNS_LABEL_PATTERN, name):
            raise SpecError(reason, f"{p}volumes[{i}].name must be a DNS label, got {name!r}")
        if name in RESERVED_VOLUMES or names.count(name) > 1:
            raise SpecError(reason, f"{p}volumes[{i}].name {name!r} is taken (reserved: {RESERVED_VOLUMES})")
    for i, mount in enumerate(mounts):
        mp = f"{p}volumeMounts[{i}]."
        if mount.get("name") not in names:
            raise SpecError(reason, f"{mp}name {mount.get('name')!r} is none of {p}volumes")
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/") or _bad_path(path):
            raise SpecError(reason, f"{mp}mountPath must be an absolute path, got {path!r}")
        if any(path == r or path.startswith(r + "/") for r in RESERVED_MOUNT_PATHS):
            raise SpecError(reason, f"{mp}mountPath {path!r} is under one the operator mounts")

    return PodOverrides(
        node_selector=_string_map(data, "nodeSelector", p, reason),
        tolerations=tuple(tolerations),
        env=tuple(env),
        annotations=_string_map(data, "annotations", p, reason),
        image_pull_secrets=tuple(pull_secrets),
        service_account_name=_str(
            data, "serviceAccountName", p, reason, None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253
        ),
        priority_class_name=_str(
            data, "priorityClassName", p, reason, None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253
        ),
        affinity=None if affinity is None else _frozen(affinity),
        topology_spread_constraints=tuple(
            _frozen(c) for c in _objects(data, "topologySpreadConstraints", p, reason)
        ),
        volumes=tuple(_frozen(v) for v in volumes),
        volume_mounts=tuple(_frozen(m) for m in mounts),
        shm_size=_quantity(data, "shmSize", p, reason, default_shm),
        runtime_class_name=_str(
            data, "runtimeClassName", p, reason, None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253
        ),
        platform_assigns_uid=_bool(data, "platformAssignsUID", p, reason, False),
    )


# Volumes and mount paths of the operator's own; spec.pod.volumes must keep clear of them.
RESERVED_VOLUMES = ("model", "model-cache", "dshm", "adapters")
# /triton-cache: a GPU engine's Triton cache, a directory of the model cache (manifests.TRITON_CACHE_MOUNT_PATH);
# /adapters: the LoRA adapters the init containers fetch (manifests.ADAPTERS_MOUNT_PATH).
RESERVED_MOUNT_PATHS = ("/models", "/model-cache", "/dev/shm", "/triton-cache", "/adapters")


def _objects(data: Mapping[str, Any], key: str, path: str, reason: str) -> list[Mapping[str, Any]]:
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise SpecError(reason, f"{path}{key} must be a list of objects, got {value!r}")
    return value


def _frozen(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


def parse(spec: Mapping[str, Any] | None, pinned_image: str | None = None) -> ServiceSpec:
    """The typed view of `spec`, defaults filled in. Raises SpecError with a reason and a message.

    `pinned_image` is the (CPU) runtime image the service is pinned to, used where spec.image and
    spec.router.image are not given (its CUDA build, tagged -cuda, for GPUs); None: this release's DEFAULT_IMAGE.
    """
    if spec is None or not isinstance(spec, Mapping):
        raise SpecError("InvalidSpec", f"spec must be an object, got {spec!r}")
    model = _model(spec)
    resources = _resources(spec, model)
    engine = _engine(spec, resources.gpu)
    memory_given = _section(spec, "resources", "spec.", "InvalidResources").get("memory") is not None
    if engine.kv_offloading_bytes and not memory_given:
        # The host tier is memory on top of what the engine otherwise needs: the default grows by it.
        resources = replace(
            resources, memory=format_bytes(parse_bytes(resources.memory) + engine.kv_offloading_bytes)
        )
    if model.source == "uri" and model.cache.claim_name is None and model.cache.size_limit is None:
        # The per-pod emptyDir is always bounded: unbounded, a fetch fills the node's disk (and every pod
        # on it is evicted), and without a request the scheduler places the pod where it cannot fit.
        model = replace(model, cache=ModelCache(size_limit=default_cache_size(model, resources.gpu)))
    # The release recorded in status (an operator upgrade rolls nothing until asked), else this operator's.
    base_image = pinned_image or DEFAULT_IMAGE
    default_image = base_image + "-cuda" if resources.gpu else base_image
    image = _str(spec, "image", "spec.", "InvalidImage", default_image, pattern=IMAGE_PATTERN)
    assert image is not None
    _check_memory(resources, engine)
    # In the order of the fields, so that of several errors the first field's is the one reported.
    pull_policy = _str(spec, "imagePullPolicy", "spec.", "InvalidImage", None, choices=PULL_POLICIES)
    replicas = _req_int(spec, "replicas", "spec.", "InvalidReplicas", 1, 0, 1000)
    autoscaling = _autoscaling(spec)
    # The router runs the CPU build: spec.image is one only on a CPU service.
    router = _router(spec, base_image if resources.gpu else image)
    return ServiceSpec(
        model=model,
        image=image,
        image_pull_policy=pull_policy,
        replicas=replicas,
        resources=resources,
        engine=engine,
        autoscaling=autoscaling,
        router=router,
        gateway=_gateway(spec, router),
        pod=_pod(spec, default_shm_size(resources.gpu, engine)),
        adapters=_adapters(spec, model),
    )


def _check_memory(resources: Resources, engine: EngineSpec) -> None:
    """What the spec puts in the pod's memory must fit under its limit (spec.resources.memory), with room
    left for the weights: a pod that asks for more than its limit would be OOM-killed, so the spec is refused
    (InsufficientMemory in the status) rather than the request clamped.

    On CPU the KV cache lives there; on a GPU it is in device memory, which the spec does not state. The
    prefix cache's host tier (kvOffloadingMemory) lives there on either device. A default memory already
    includes the tier (parse()), so only a memory given too small for it is refused.
    """
    kv_cache = 0 if resources.gpu or engine.kv_cache_memory_bytes is None else engine.kv_cache_memory_bytes
    if not kv_cache and not engine.kv_offloading_bytes:
        return
    try:
        limit = parse_bytes(resources.memory)
    except ValueError:
        return  # a quantity such as 1e9 or 500m: valid for Kubernetes, too odd to reason about here
    if kv_cache + engine.kv_offloading_bytes < limit:
        return
    if not engine.kv_offloading_bytes:
        raise SpecError(
            "InsufficientMemory",
            f"spec.engine.kvCacheMemory ({kv_cache} bytes) does not fit in "
            f"spec.resources.memory ({resources.memory} = {limit} bytes), which must also hold the weights; "
            "raise the memory or lower the cache",
        )
    what = f"spec.engine.kvOffloadingMemory ({engine.kv_offloading_bytes} bytes)"
    if kv_cache:
        what += f" with spec.engine.kvCacheMemory ({kv_cache} bytes)"
    raise SpecError(
        "InsufficientMemory",
        f"{what} does not fit in spec.resources.memory ({resources.memory} = {limit} bytes), the pod's memory "
        "request and limit, which must also hold the weights; raise spec.resources.memory (or leave it out: "
        "its default grows by kvOffloadingMemory) or lower kvOffloadingMemory",
    )


def format_bytes(value: int) -> str:
    """A byte count as a quantity: whole Gi or Mi where it is one, else plain bytes."""
    for unit, size in (("Gi", GIB), ("Mi", 2**20)):
        if value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


def gib(value: int) -> str:
    """Bytes as a decimal count of GiB, exact (a byte count over 2**30 always ends), without trailing zeros:
    what --kv-offloading-size takes (vLLM's unit)."""
    whole, rest = divmod(value, GIB)
    if not rest:
        return str(whole)
    # rest / 2**30 = rest * 5**30 / 10**30: thirty decimal places hold it exactly.
    return f"{whole}.{rest * 5**30:030d}".rstrip("0")


# An operator upgrade must not roll every service at once: each service records in its status the default
# runtime image it was first served with and keeps it. This annotation, set to "true", moves it (and keeps it)
# on the running operator's default; removing it afterwards pins the service there again. Not under GROUP's
# prefix: Kopf keeps its own state in annotations there and leaves them out of the diffs it handles, so a
# change of such an annotation would call no handler.
UPGRADE_RUNTIME_ANNOTATION = "chunkwise.dev/upgrade-runtime"
RUNTIME_IMAGE_STATUS = "runtimeImage"


def runtime_image(body: Mapping[str, Any]) -> str:
    """The default runtime image `body` runs: the one its status records, or this operator's when there is none
    yet or the upgrade annotation asks for it."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    pinned = (body.get("status") or {}).get(RUNTIME_IMAGE_STATUS)
    if annotations.get(UPGRADE_RUNTIME_ANNOTATION) == "true" or not isinstance(pinned, str) or not pinned:
        return DEFAULT_IMAGE  # the module's global, read now: the default of the operator running now
    return pinned
