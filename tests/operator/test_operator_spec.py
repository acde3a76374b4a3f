"""spec.py: the typed view of the CR, its defaults (equal to the CRD's) and its validation."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from operator_harness import ROOT, apply_defaults, crd_schema, inference_service, schema_errors

from chunkwise_operator.spec import (
    AutoscalingSpec,
    AutoscalingTargets,
    AutoscalingTolerances,
    EngineSpec,
    EnvVar,
    GatewaySpec,
    ModelCache,
    ModelSpec,
    PodOverrides,
    Resources,
    RouterResources,
    RouterSpec,
    ServiceSpec,
    SpecError,
    Speculation,
    Toleration,
    parse,
    parse_bytes,
    validate_name,
)

MINIMAL = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}


def with_(base: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return {**base, **sections}


def test_minimal_spec_gets_every_default() -> None:
    assert parse(MINIMAL) == ServiceSpec(
        model=ModelSpec(source="preset", served_name="tiny", preset="tiny"),
        image="chunkwise:dev",
        image_pull_policy=None,
        replicas=1,
        resources=Resources(cpu="1", memory="2Gi", gpu=0),
        engine=EngineSpec(
            dtype="auto",
            max_num_seqs=256,
            max_num_batched_tokens=1024,
            block_size=16,
            kv_cache_memory_bytes=None,
            preemption_mode="auto",
            enable_prefix_caching=True,
            speculation=Speculation(method="none", num_tokens=4),
            queue_delay_slo_seconds=30.0,
            drain_grace_seconds=30,
            extra_args=(),
        ),
        autoscaling=AutoscalingSpec(
            enabled=False,
            delegated=False,
            min_replicas=1,
            max_replicas=4,
            targets=AutoscalingTargets(
                queue_depth_per_replica=8.0,
                preemption_rate_per_second=1.0,
                p99_step_time_seconds=0.5,
                kv_usage_fraction=0.9,
            ),
            scale_up_stabilization_seconds=30,
            scale_down_stabilization_seconds=300,
        ),
        router=RouterSpec(
            enabled=False,
            policy="predicted-completion",
            replicas=2,
            image="chunkwise:dev",
            resources=RouterResources(cpu="250m", memory="256Mi"),
        ),
        gateway=GatewaySpec(inference_pool=False),
        pod=PodOverrides(node_selector=(), tolerations=(), env=(), annotations=(), shm_size="1Gi"),
    )


def test_defaults_equal_the_crd_defaults() -> None:
    """The API server fills the CRD's defaults in before the operator sees a spec; both must mean the same."""
    spec_schema = crd_schema()["properties"]["spec"]
    defaulted = apply_defaults(spec_schema, dict(MINIMAL))
    # The defaulting really filled every section, so the comparison below covers them.
    assert sorted(defaulted) == sorted(
        ["model", "image", "replicas", "resources", "engine", "autoscaling", "router", "gateway", "pod"]
    )
    assert defaulted["gateway"] == {"inferencePool": False}
    assert defaulted["engine"]["speculation"] == {"method": "none", "numTokens": 4}
    assert defaulted["autoscaling"]["targets"]["kvUsageFraction"] == 0.9
    assert defaulted["autoscaling"]["tolerance"]["kvUsageFraction"] == 0.1
    assert parse(defaulted) == parse(MINIMAL)


def test_full_spec_is_read_field_by_field() -> None:
    spec = {
        "model": {"pvc": {"claimName": "models", "path": "org/llama-8b"}, "servedName": "llama"},
        "image": "registry.example/chunkwise:1.0",
        "imagePullPolicy": "IfNotPresent",
        "replicas": 3,
        "resources": {"cpu": 8, "memory": "64Gi", "gpu": 1},
        "engine": {
            "maxNumSeqs": 128,
            "maxNumBatchedTokens": 4096,
            "blockSize": 32,
            "kvCacheMemory": "40Gi",
            "preemptionMode": "swap",
            "enablePrefixCaching": False,
            "speculation": {"method": "draft", "numTokens": 6},
            "queueDelaySloSeconds": 1,
            "drainGraceSeconds": 90,
        },
        "autoscaling": {
            "enabled": True,
            "delegated": True,
            "minReplicas": 2,
            "maxReplicas": 10,
            "targets": {
                "queueDepthPerReplica": 4,
                "preemptionRatePerSecond": 0.25,
                "p99StepTimeSeconds": 0.2,
                "kvUsageFraction": 0.8,
            },
            "tolerance": {"queueDepthPerReplica": 0.25, "kvUsageFraction": 0.05},
            "scaleUpStabilizationSeconds": 10,
            "scaleDownStabilizationSeconds": 600,
        },
        "router": {
            "enabled": True,
            "policy": "prefix-affinity",
            "replicas": 2,
            "image": "registry.example/router:1.0",
            "resources": {"cpu": "1", "memory": "1Gi"},
        },
        "gateway": {"inferencePool": True},
        "pod": {
            "nodeSelector": {"pool": "gpu", "a": "b"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute"}],
            "env": [
                {"name": "A", "value": "1"},
                {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            ],
            "annotations": {"team": "ml"},
        },
    }
    parsed = parse(spec)
    assert parsed.model == ModelSpec(
        source="pvc", served_name="llama", claim_name="models", path="org/llama-8b"
    )
    assert parsed.image_pull_policy == "IfNotPresent"
    assert parsed.replicas == 3
    assert parsed.resources == Resources(cpu="8", memory="64Gi", gpu=1)
    assert parsed.engine == EngineSpec(
        max_num_seqs=128,
        max_num_batched_tokens=4096,
        block_size=32,
        kv_cache_memory_bytes=40 * 2**30,
        preemption_mode="swap",
        enable_prefix_caching=False,
        speculation=Speculation(method="draft", num_tokens=6),
        queue_delay_slo_seconds=1.0,
        drain_grace_seconds=90,
        startup_timeout_seconds=1800,  # the GPU default
    )
    assert parsed.autoscaling == AutoscalingSpec(
        enabled=True,
        delegated=True,
        min_replicas=2,
        max_replicas=10,
        targets=AutoscalingTargets(4.0, 0.25, 0.2, 0.8),
        tolerance=AutoscalingTolerances(queue_depth_per_replica=0.25, kv_usage_fraction=0.05),
        scale_up_stabilization_seconds=10,
        scale_down_stabilization_seconds=600,
    )
    assert parsed.router == RouterSpec(
        enabled=True,
        policy="prefix-affinity",
        replicas=2,
        image="registry.example/router:1.0",
        resources=RouterResources(cpu="1", memory="1Gi"),
    )
    assert parsed.gateway == GatewaySpec(inference_pool=True)
    assert parsed.pod.node_selector == (("a", "b"), ("pool", "gpu"))
    assert parsed.pod.tolerations == (
        Toleration(key="dedicated", operator="Equal", value="llm", effect="NoExecute"),
    )
    assert parsed.pod.env[0] == EnvVar(name="A", value="1")
    assert parsed.pod.env[1].name == "B"
    assert dict(parsed.pod.env[1].value_from or {}) == {"secretKeyRef": {"name": "s", "key": "k"}}
    assert parsed.pod.annotations == (("team", "ml"),)
    # The same spec passes the CRD's schema: the two agree on what is valid.
    assert schema_errors(inference_service("llama", spec)) == []


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"preset": "small"}, ModelSpec(source="preset", served_name="small", preset="small")),
        (
            {"path": "/opt/models/qwen/"},
            ModelSpec(source="image", served_name="qwen", path="/opt/models/qwen/"),
        ),
        (
            {"pvc": {"claimName": "weights"}},
            ModelSpec(source="pvc", served_name="weights", claim_name="weights", path=""),
        ),
        (
            {"pvc": {"claimName": "weights", "path": "a/b/mistral-7b/"}},
            ModelSpec(source="pvc", served_name="mistral-7b", claim_name="weights", path="a/b/mistral-7b"),
        ),
        (
            {"preset": "tiny", "servedName": "gpt-x"},
            ModelSpec(source="preset", served_name="gpt-x", preset="tiny"),
        ),
    ],
)
def test_model_sources_and_served_name_defaults(model: dict[str, Any], expected: ModelSpec) -> None:
    assert parse({"model": model, "image": "i"}).model == expected


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (
            {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main", "credentialsSecret": "hf-token"},
            ModelSpec(
                source="uri",
                served_name="Llama-3.1-8B-Instruct",
                uri="hf://meta-llama/Llama-3.1-8B-Instruct@main",
                credentials_secret="hf-token",
                # The per-pod emptyDir is always bounded: the CPU default without spec.model.size.
                cache=ModelCache(size_limit="20Gi"),
            ),
        ),
        (
            {"uri": "s3://weights/org/qwen3-8b/", "cache": {"claimName": "model-cache"}},
            ModelSpec(
                source="uri",
                served_name="qwen3-8b",
                uri="s3://weights/org/qwen3-8b/",
                cache=ModelCache(claim_name="model-cache"),
            ),
        ),
        (
            {"uri": "gs://bucket/m", "cache": {"sizeLimit": "40Gi"}, "servedName": "m1"},
            ModelSpec(
                source="uri", served_name="m1", uri="gs://bucket/m", cache=ModelCache(size_limit="40Gi")
            ),
        ),
        (
            {"uri": "https://host/a/llama-57m.tar.gz#sha256=" + "0" * 64},
            ModelSpec(
                source="uri",
                served_name="llama-57m",
                uri="https://host/a/llama-57m.tar.gz#sha256=" + "0" * 64,
                cache=ModelCache(size_limit="20Gi"),
            ),
        ),
        (
            {"uri": "pvc://models/org/llama"},
            ModelSpec(source="pvc", served_name="llama", claim_name="models", path="org/llama"),
        ),
    ],
)
def test_model_uris(model: dict[str, Any], expected: ModelSpec) -> None:
    assert parse({"model": model}).model == expected
    assert schema_errors(inference_service("svc", {"model": model})) == []


def test_the_image_follows_the_device_unless_given() -> None:
    cpu = parse({"model": {"preset": "tiny"}})
    gpu = parse({"model": {"preset": "tiny"}, "resources": {"gpu": 1}})
    given = parse({"model": {"preset": "tiny"}, "resources": {"gpu": 1}, "image": "reg/cw:2"})
    assert (cpu.image, cpu.router.image) == ("chunkwise/runtime:0.1.0", "chunkwise/runtime:0.1.0")
    # The router never needs CUDA: it keeps the CPU build unless an image is named.
    assert (gpu.image, gpu.router.image) == ("chunkwise/runtime:0.1.0-cuda", "chunkwise/runtime:0.1.0")
    # A GPU service's spec.image is a CUDA build: the router keeps the CPU one. On CPU spec.image is one.
    assert (given.image, given.router.image) == ("reg/cw:2", "chunkwise/runtime:0.1.0")
    cpu_given = parse({"model": {"preset": "tiny"}, "image": "reg/cw:2"})
    assert (cpu_given.image, cpu_given.router.image) == ("reg/cw:2", "reg/cw:2")


def test_zero_replicas_floor_is_allowed_when_delegated() -> None:
    data = with_(MINIMAL, autoscaling={"enabled": True, "delegated": True, "minReplicas": 0})
    assert parse(data).autoscaling.min_replicas == 0
    assert schema_errors(inference_service("svc", data)) == []


def test_zero_replicas_floor_is_allowed_with_a_router_to_wake_it() -> None:
    data = with_(
        MINIMAL,
        autoscaling={"enabled": True, "minReplicas": 0, "scaleToZeroAfterSeconds": 60},
        router={"enabled": True},
    )
    assert parse(data).autoscaling.min_replicas == 0
    assert parse(data).autoscaling.scale_to_zero_after_seconds == 60
    assert schema_errors(inference_service("svc", data)) == []


def test_pod_overrides_pass_through() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    data = with_(
        MINIMAL,
        pod={
            "imagePullSecrets": [{"name": "regcred"}],
            "serviceAccountName": "llm",
            "priorityClassName": "serving-high",
            "affinity": affinity,
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            "shmSize": "8Gi",
        },
        engine={"extraArgs": ["--max-model-len", "8192"], "dtype": "bfloat16"},
    )
    parsed = parse(data)
    assert parsed.pod.image_pull_secrets == ("regcred",)
    assert (parsed.pod.service_account_name, parsed.pod.priority_class_name) == ("llm", "serving-high")
    assert dict(parsed.pod.affinity or {}) == affinity
    assert [dict(v) for v in parsed.pod.volumes] == [{"name": "scratch", "emptyDir": {}}]
    assert parsed.pod.shm_size == "8Gi"
    assert parsed.engine.extra_args == ("--max-model-len", "8192")
    assert parsed.engine.dtype == "bfloat16"
    assert schema_errors(inference_service("svc", data)) == []


# (spec, reason, message, whether the API server rejects it too: the CRD's schema or one of its CEL rules).
# The ones it accepts are the checks only the operator makes.
INVALID = [
    (
        with_(MINIMAL, autoscaling={"tolerance": {"p99StepTimeSeconds": 1.5}}),
        "InvalidAutoscaling",
        "spec.autoscaling.tolerance.p99StepTimeSeconds must be a number in [0, 1], got 1.5",
        True,
    ),
    (
        with_(MINIMAL, autoscaling={"minReplicas": 5, "maxReplicas": 2}),
        "InvalidAutoscaling",
        "spec.autoscaling.minReplicas (5) must not exceed spec.autoscaling.maxReplicas (2)",
        True,
    ),
    (
        with_(MINIMAL, autoscaling={"enabled": True, "minReplicas": 0}),
        "InvalidAutoscaling",
        "spec.autoscaling.minReplicas 0 needs spec.router.enabled (the router holds requests and scales from "
        "zero) or spec.autoscaling.delegated: true (an HPA or KEDA that can scale from zero); the built-in "
        "autoscaler has no metrics at 0 replicas",
        True,
    ),
    (
        with_(MINIMAL, resources={"gpu": -3}),
        "InvalidResources",
        "spec.resources.gpu must be an integer in [0, 16], got -3",
        True,
    ),
    (
        with_(MINIMAL, resources={"memory": "8Gi"}, engine={"kvCacheMemory": "8Gi"}),
        "InsufficientMemory",
        f"spec.engine.kvCacheMemory ({8 * 2**30} bytes) does not fit in spec.resources.memory (8Gi = "
        f"{8 * 2**30} bytes), which must also hold the weights; raise the memory or lower the cache",
        False,
    ),
    (
        with_(MINIMAL, model={"uri": "ftp://host/model.tar"}),
        "InvalidModelSource",
        "spec.model.uri must start with one of hf://, s3://, gs://, http://, https://, pvc://; "
        "got 'ftp://host/model.tar'",
        True,
    ),
    (
        with_(MINIMAL, model={"uri": "hf://just-a-name"}),
        "InvalidModelSource",
        "spec.model.uri 'hf://just-a-name' must be hf://org/name or hf://org/name@revision",
        True,
    ),
    (
        with_(MINIMAL, model={"uri": "https://host/?id=7"}),
        "InvalidModelSource",
        "give spec.model.servedName: 'https://host/?id=7' has no usable base name",
        False,
    ),
    (
        with_(MINIMAL, model={"uri": "pvc://models/../etc"}),
        "InvalidModelSource",
        "spec.model.uri's path must be relative to the claim's root, without '..'; got '../etc'",
        True,
    ),
    (
        with_(MINIMAL, model={"preset": "tiny", "credentialsSecret": "hf"}),
        "InvalidModelSource",
        "spec.model.credentialsSecret applies only to a fetched spec.model.uri",
        True,
    ),
    (
        with_(MINIMAL, model={"uri": "pvc://models/llama", "cache": {"claimName": "c"}}),
        "InvalidModelSource",
        "spec.model.cache applies only to a fetched spec.model.uri",
        True,
    ),
    (
        with_(MINIMAL, engine={"extraArgs": ["--max-model-len", "8192", "--block-size=32"]}),
        "InvalidEngine",
        "spec.engine.extraArgs[2] --block-size is what spec.engine.blockSize sets; use that field instead",
        True,
    ),
    (
        with_(MINIMAL, engine={"extraArgs": ["8192"]}),
        "InvalidEngine",
        "spec.engine.extraArgs must start with a flag, got '8192'",
        True,
    ),
    (
        with_(MINIMAL, engine={"dtype": "int4"}),
        "InvalidEngine",
        "spec.engine.dtype must be one of auto, float32, bfloat16, float16; got 'int4'",
        True,
    ),
    (
        with_(MINIMAL, pod={"volumes": [{"name": "dshm", "emptyDir": {}}]}),
        "InvalidPodOverrides",
        "spec.pod.volumes[0].name 'dshm' is taken (reserved: ('model', 'model-cache', 'dshm', 'adapters'))",
        True,
    ),
    (
        with_(
            MINIMAL,
            pod={
                "volumes": [{"name": "x", "emptyDir": {}}],
                "volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}],
            },
        ),
        "InvalidPodOverrides",
        "spec.pod.volumeMounts[0].mountPath '/dev/shm' is under one the operator mounts",
        True,
    ),
    (
        with_(MINIMAL, engine={"preemptionMode": "lru"}),
        "InvalidEngine",
        "spec.engine.preemptionMode must be one of auto, swap, recompute; got 'lru'",
        True,
    ),
    (
        with_(MINIMAL, model={"preset": "tiny", "path": "/m"}),
        "InvalidModelSource",
        "spec.model must give exactly one of preset, pvc, path or uri; got preset, path",
        True,
    ),
    (
        with_(MINIMAL, model={"servedName": "x"}),
        "InvalidModelSource",
        "spec.model must give exactly one of preset, pvc, path or uri; got none",
        True,
    ),
    (
        with_(MINIMAL, model={"preset": "huge"}),
        "InvalidModelSource",
        "spec.model.preset must be one of tiny, small; got 'huge'",
        True,
    ),
    (
        with_(MINIMAL, model={"path": "models/x"}),
        "InvalidModelSource",
        "spec.model.path must be an absolute path without '..', got 'models/x'",
        True,
    ),
    (
        with_(MINIMAL, model={"pvc": {"claimName": "m", "path": "a/../../etc"}}),
        "InvalidModelSource",
        "spec.model.pvc.path must be relative to the claim's root, without '..'; got 'a/../../etc'",
        True,
    ),
    (
        with_(MINIMAL, replicas=-1),
        "InvalidReplicas",
        "spec.replicas must be an integer in [0, 1000], got -1",
        True,
    ),
    (
        with_(MINIMAL, replicas=True),
        "InvalidReplicas",
        "spec.replicas must be an integer in [0, 1000], got True",
        True,
    ),
    (
        with_(MINIMAL, resources={"gpu": 17}),
        "InvalidResources",
        "spec.resources.gpu must be an integer in [0, 16], got 17",
        True,
    ),
    (
        with_(MINIMAL, resources={"memory": "lots"}),
        "InvalidResources",
        "spec.resources.memory must be a quantity such as 2, 500m or 8Gi; got 'lots'",
        True,
    ),
    (
        with_(MINIMAL, engine={"kvCacheMemory": "512Ki"}),
        "InvalidEngine",
        "spec.engine.kvCacheMemory must be at least 1Mi, got '512Ki'",
        False,
    ),
    (
        with_(MINIMAL, engine={"kvCacheMemory": "1.5"}),
        "InvalidEngine",
        "spec.engine.kvCacheMemory: '1.5' is not a positive whole number of bytes",
        False,
    ),
    (
        with_(MINIMAL, engine={"speculation": {"method": "medusa"}}),
        "InvalidEngine",
        "spec.engine.speculation.method must be one of none, ngram, draft; got 'medusa'",
        True,
    ),
    (
        with_(MINIMAL, engine={"queueDelaySloSeconds": -1}),
        "InvalidEngine",
        "spec.engine.queueDelaySloSeconds must be a number in [0, 3600], got -1",
        True,
    ),
    (
        with_(MINIMAL, router={"policy": "random"}),
        "InvalidRouter",
        "spec.router.policy must be one of predicted-completion, round-robin, least-loaded, prefix-affinity; "
        "got 'random'",
        True,
    ),
    (
        # The router is the pool's endpoint picker: the schema's CEL rule and the operator both say so.
        with_(MINIMAL, gateway={"inferencePool": True}),
        "InvalidGateway",
        "spec.gateway.inferencePool needs spec.router.enabled: the router is the pool's endpoint picker (EPP)",
        True,
    ),
    (
        with_(MINIMAL, gateway={"inferencePool": True}, router={"enabled": False}),
        "InvalidGateway",
        "spec.gateway.inferencePool needs spec.router.enabled: the router is the pool's endpoint picker (EPP)",
        True,
    ),
    (
        with_(MINIMAL, gateway={"inferencePool": "yes"}),
        "InvalidGateway",
        "spec.gateway.inferencePool must be true or false, got 'yes'",
        True,
    ),
    (
        with_(MINIMAL, pod={"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
        "InvalidPodOverrides",
        "spec.pod.tolerations[0].value must be empty when operator is Exists",
        True,
    ),
    (
        with_(MINIMAL, pod={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
        "InvalidPodOverrides",
        "spec.pod.env has 'A' twice",
        False,
    ),
    (
        with_(MINIMAL, pod={"nodeSelector": {"gpu": True}}),
        "InvalidPodOverrides",
        "spec.pod.nodeSelector must map strings to strings, got {'gpu': True}",
        True,
    ),
]


@pytest.mark.parametrize(("spec", "reason", "message", "schema_rejects"), INVALID)
def test_invalid_specs_have_a_reason_and_a_message(
    spec: dict[str, Any], reason: str, message: str, schema_rejects: bool
) -> None:
    with pytest.raises(SpecError) as caught:
        parse(spec)
    assert (caught.value.reason, caught.value.message) == (reason, message)
    assert bool(schema_errors(inference_service("svc", spec))) is schema_rejects


def test_a_spec_that_is_not_an_object_is_invalid() -> None:
    with pytest.raises(SpecError) as caught:
        parse(["model"])  # type: ignore[arg-type]
    assert caught.value.reason == "InvalidSpec"


@pytest.mark.parametrize(
    ("name", "valid"),
    [("tiny", True), ("a" * 56, True), ("a" * 57, False), ("Tiny", False), ("my.svc", False), ("1st", False)],
)
def test_names_must_fit_the_children(name: str, valid: bool) -> None:
    if valid:
        validate_name(name)
    else:
        with pytest.raises(SpecError) as caught:
            validate_name(name)
        assert caught.value.reason == "InvalidName"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4Gi", 4 * 2**30), ("512M", 512_000_000), (1000, 1000), ("1.5Ki", 1536), ("2", 2), ("1E", 10**18)],
)
def test_parse_bytes(value: int | str, expected: int) -> None:
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["1.5", "0", 0, "1e3", "4gi", "-1", "500m"])
def test_parse_bytes_rejects(value: int | str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(value)


def test_examples_are_valid_specs() -> None:
    for path in sorted((ROOT / "manifests" / "examples").glob("*service.yaml")):
        obj = yaml.safe_load(path.read_text())
        assert isinstance(parse(obj["spec"]), ServiceSpec), path


@pytest.mark.parametrize(
    "uri",
    [
        "hf://meta-llama/Llama-3.1-8B-Instruct",
        "hf://Qwen/Qwen3-8B@a1b2c3",
        "s3://weights/org/qwen3-8b/",
        "gs://bucket/m",
        "https://host/a/llama-57m.tar.gz#sha256=" + "0" * 64,
        "http://10.0.0.1:8080/m.zip",
    ],
)
def test_a_uri_the_operator_accepts_is_one_the_fetcher_parses(uri: str) -> None:
    """The operator checks the shape at admission; `chunkwise fetch-model` in the init container must agree."""
    from chunkwise.fetch.uri import parse_uri

    assert parse({"model": {"uri": uri}}).model.uri == uri
    parse_uri(uri)


@pytest.mark.parametrize(
    "uri", ["hf://onlyorg", "s3://", "ftp://host/m.tar", "gs:///prefix", "https:///m.tar"]
)
def test_a_uri_the_fetcher_refuses_is_refused_at_admission(uri: str) -> None:
    from chunkwise.fetch.errors import UsageError
    from chunkwise.fetch.uri import parse_uri

    with pytest.raises(UsageError):
        parse_uri(uri)
    with pytest.raises(SpecError):
        parse({"model": {"uri": uri}})
