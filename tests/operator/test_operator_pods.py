"""The pods on day two (issue 31): the router through drains and rollouts (point 4), cold starts sized from the
spec (point 6), GitOps beside a scaler (point 7) and accelerators other than one nvidia.com/gpu (point 10).

Rendered objects are checked by exact assertion and by kubernetes-validate; custom resources by the CRD's
own schema (jsonschema + CEL, operator_harness.schema_errors); the operator's wiring on kmock.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_harness import (
    ROOT,
    Cluster,
    apply_defaults,
    crd_schema,
    eventually,
    inference_service,
    schema_errors,
)
from test_autoscale_operator import (  # noqa: F401  (fixtures)
    MetricsServer,
    add_pod,
    add_unready_pod,
    autoscaler_status,
    fast_autoscaler,
    pods,
    replicas,
)
from test_autoscale_operator import spec as autoscaled
from test_operator_manifests import restricted_violations

from chunkwise_operator import manifests, status
from chunkwise_operator.spec import ServiceSpec, SpecError, parse

GPU_EXAMPLE = ROOT / "manifests" / "examples" / "gpu-service.yaml"
HF_GPU: dict[str, Any] = {
    "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "credentialsSecret": "hf-token"},
    "image": "reg/chunkwise:1-cuda",
    "resources": {"cpu": "8", "gpu": 1},
    "router": {"enabled": True},
}


def by_kind(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def pod_of(deployment: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def validate(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def crd_accepts(spec: dict[str, Any]) -> bool:
    return schema_errors(inference_service("svc", spec)) == []


# ---------------------------------------------------------------------------------- point 4: the router


def test_the_router_has_a_disruption_budget_a_prestop_and_a_grace_over_its_wake_timeout() -> None:
    """Issue 31, point 4: a drain evicts one router at a time, each stops taking requests before SIGTERM,
    and the kubelet waits out a request held for the wake timeout plus a drain of what streams."""
    data = copy.deepcopy(HF_GPU)
    data["router"] = {"enabled": True, "wakeTimeoutSeconds": 900, "drainGraceSeconds": 120}
    children = manifests.children("llama", "ml", parse(data))
    validate(children)
    pdb = by_kind(children, "PodDisruptionBudget", "llama-router")
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {
            "matchLabels": {
                "serving.chunkwise.dev/inferenceservice": "llama",
                "app.kubernetes.io/component": "router",
            }
        },
    }
    router = by_kind(children, "Deployment", "llama-router")
    pod = pod_of(router)
    (container,) = pod["containers"]
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    # preStop 5 + wake 900 + drain 120 + margin 10.
    assert pod["terminationGracePeriodSeconds"] == 1035
    # Two by default: with the budget, a drain or a rollout always leaves one serving.
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    # Disabling the router removes its budget with it.
    off = parse({**data, "router": {"enabled": False}})
    assert ("policy/v1", "PodDisruptionBudget", "llama-router") in manifests.stale_children("llama", off)


def test_the_router_defaults_to_two_replicas_in_the_crd_too() -> None:
    defaulted = apply_defaults(crd_schema()["properties"]["spec"], {"model": {"preset": "tiny"}})
    assert defaulted["router"]["replicas"] == 2 == parse({"model": {"preset": "tiny"}}).router.replicas
    assert defaulted["router"]["wakeTimeoutSeconds"] == 300
    assert defaulted["router"]["drainGraceSeconds"] == 60


def test_the_wake_knobs_reach_the_router_as_flags_it_accepts() -> None:
    """wakeTimeoutSeconds was not in the CRD: editing the router Deployment was reverted as drift."""
    from chunkwise.router.args import add_router_args

    data = copy.deepcopy(HF_GPU)
    data["autoscaling"] = {"enabled": True, "minReplicas": 0}
    data["router"] = {"enabled": True, "wakeTimeoutSeconds": 1200, "wakeQueueLimit": 16}
    argv = manifests.router_command("llama", "ml", parse(data))
    assert argv[:2] == ["chunkwise", "router"]
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    args = parser.parse_args(argv[2:])
    assert (args.wake_inference_service, args.wake_timeout_seconds, args.wake_queue_limit) == (
        "llama",
        1200,
        16,
    )
    assert crd_accepts(data)
    for bad in ({"wakeTimeoutSeconds": 0}, {"wakeQueueLimit": 0}, {"drainGraceSeconds": -1}):
        with pytest.raises(SpecError):
            parse({**data, "router": {"enabled": True, **bad}})
        assert not crd_accepts({**data, "router": {"enabled": True, **bad}})


def test_the_router_runs_the_cpu_image_unless_router_image_says_otherwise() -> None:
    """spec.image on a GPU service is the CUDA build: gigabytes more for a router that never uses CUDA."""
    gpu = manifests.router_deployment("llama", "ml", parse(HF_GPU))
    (container,) = pod_of(gpu)["containers"]
    (tokenizer,) = pod_of(gpu)["initContainers"]
    assert container["image"] == tokenizer["image"] == "chunkwise/runtime:0.1.0"
    named = parse({**HF_GPU, "router": {"enabled": True, "image": "reg/router:2"}})
    assert (
        pod_of(manifests.router_deployment("llama", "ml", named))["containers"][0]["image"] == "reg/router:2"
    )
    # On a CPU service spec.image is a CPU build: the router runs the same release as the engine.
    cpu = parse({"model": {"preset": "tiny"}, "image": "reg/chunkwise:1", "router": {"enabled": True}})
    assert cpu.router.image == "reg/chunkwise:1"


# ---------------------------------------------------------------------------------- point 6: cold start


def startup_budget(deployment: dict[str, Any]) -> int:
    probe = pod_of(deployment)["containers"][0]["startupProbe"]
    return int(probe["periodSeconds"] * probe["failureThreshold"])


@pytest.mark.parametrize(
    ("data", "budget"),
    [
        ({"model": {"preset": "tiny"}}, 600),
        ({"model": {"preset": "tiny"}, "resources": {"gpu": 1}}, 1800),
        ({"model": {"preset": "tiny"}, "engine": {"startupTimeoutSeconds": 7200}}, 7200),
        (
            {"model": {"preset": "tiny"}, "resources": {"gpu": 1}, "engine": {"startupTimeoutSeconds": 3601}},
            3605,
        ),
    ],
    ids=["cpu-default", "gpu-default", "cpu-given", "gpu-given-rounded-up"],
)
def test_the_startup_budget_and_the_rollout_deadline_follow_the_spec(
    data: dict[str, Any], budget: int
) -> None:
    """Issue 31, point 6: the probe was fixed at 10 minutes; a GPU replica gets 30 by default, and the
    progress deadline stays the budget plus 15 minutes for the pull and the fetch."""
    deployment = manifests.runtime_deployment("s", "ml", parse(data))
    assert startup_budget(deployment) == budget
    assert deployment["spec"]["progressDeadlineSeconds"] == budget + 900
    validate([deployment])
    assert crd_accepts(data)


def test_a_startup_timeout_out_of_bounds_is_refused() -> None:
    for value in (29, 86401, "600"):
        data = {"model": {"preset": "tiny"}, "engine": {"startupTimeoutSeconds": value}}
        with pytest.raises(SpecError) as caught:
            parse(data)
        assert caught.value.reason == "InvalidEngine"
        assert not crd_accepts(data)


@pytest.mark.parametrize(
    ("model", "gpu", "limit"),
    [
        # 16Gi x 1.1 + 2Gi = 19.6Gi, in whole Gi.
        ({"uri": "hf://org/m", "size": "16Gi"}, 1, "20Gi"),
        # An archive lies beside what it extracts: twice the size.
        ({"uri": "https://host/m.tar.gz", "size": "16Gi"}, 1, "38Gi"),
        # 16 GB (not GiB) of a decimal size.
        ({"uri": "s3://bucket/m", "size": "16G"}, 0, "19Gi"),
        ({"uri": "hf://org/m"}, 1, "80Gi"),
        ({"uri": "hf://org/m"}, 0, "20Gi"),
        ({"uri": "hf://org/m", "size": "16Gi", "cache": {"sizeLimit": "100Gi"}}, 1, "100Gi"),
    ],
    ids=["hf-size", "archive-size", "decimal-size", "gpu-default", "cpu-default", "given"],
)
def test_the_model_cache_is_bounded_and_requested(model: dict[str, Any], gpu: int, limit: str) -> None:
    """Issue 31, point 6: an emptyDir with no sizeLimit and no request fills the node's disk."""
    data = {"model": model, "resources": {"gpu": gpu}}
    deployment = manifests.runtime_deployment("s", "ml", parse(data))
    pod = pod_of(deployment)
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": limit}} in pod["volumes"]
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == limit
    validate([deployment])
    assert crd_accepts(data)


def test_a_shared_cache_claim_asks_for_no_ephemeral_storage() -> None:
    data = {"model": {"uri": "hf://org/m", "size": "16Gi", "cache": {"claimName": "models"}}}
    pod = pod_of(manifests.runtime_deployment("s", "ml", parse(data)))
    assert "ephemeral-storage" not in pod["containers"][0]["resources"]["requests"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]


@pytest.mark.parametrize(
    ("data", "memory"),
    [
        ({"model": {"preset": "tiny"}}, "2Gi"),
        ({"model": {"uri": "hf://org/m"}, "resources": {"gpu": 1}}, "32Gi"),
        # 16Gi of weights + 8Gi for torch, the CUDA context and the swap space.
        ({"model": {"uri": "hf://org/m", "size": "16Gi"}, "resources": {"gpu": 1}}, "24Gi"),
        ({"model": {"pvc": {"claimName": "w"}, "size": "140G"}, "resources": {"gpu": 1}}, "139Gi"),
        ({"model": {"uri": "hf://org/m", "size": "16Gi"}, "resources": {"gpu": 1, "memory": "64Gi"}}, "64Gi"),
    ],
    ids=["cpu", "gpu-unknown-size", "gpu-16gi", "gpu-140gb", "given"],
)
def test_a_gpu_replica_gets_host_memory_that_holds_its_weights(data: dict[str, Any], memory: str) -> None:
    """Issue 31, point 6: a GPU service got 2Gi, the CRD's default, under what loading an 8B model needs.

    Through the CRD's defaulting, as the operator sees a spec in a cluster: the schema must not fill 2Gi in.
    """
    defaulted = apply_defaults(crd_schema()["properties"]["spec"], copy.deepcopy(data))
    parsed = parse(defaulted)
    assert parsed.resources.memory == memory
    (engine,) = pod_of(manifests.runtime_deployment("s", "ml", parsed))["containers"]
    assert engine["resources"]["requests"]["memory"] == engine["resources"]["limits"]["memory"] == memory


def test_a_model_size_that_is_no_byte_count_is_refused() -> None:
    for size in ("big", "1.5Ki", "100m", 0):
        data = {"model": {"uri": "hf://org/m", "size": size}}
        with pytest.raises(SpecError) as caught:
            parse(data)
        assert caught.value.reason == "InvalidModelSource"


async def test_the_autoscaler_counts_a_replica_as_starting_for_the_specs_startup_budget(
    fast_autoscaler: None,  # noqa: F811
    pods: list[MetricsServer],  # noqa: F811
    cluster: Cluster,
    operator: Any,
) -> None:
    """Issue 31, point 6: autoscale.STARTUP_GRACE_S (600 s) was the grace whatever the spec said. With a
    60 s startup budget, replicas unready for 120 s have failed to start: they hold no scale down."""
    quick = {**autoscaled(), "replicas": 3, "engine": {"startupTimeoutSeconds": 60}}
    await cluster.create_isvc("quick", quick)
    await add_pod(cluster, pods, "quick", waiting=0.0)
    await add_unready_pod(cluster, "quick", "quick-old-1", time.time() - 120)
    await add_unready_pod(cluster, "quick", "quick-old-2", time.time() - 120)
    await eventually(lambda: replicas(cluster, "quick") == 1, what="scale down to 1", timeout=15)
    # spec.replicas is written before the status (two subresources): the status follows.
    await eventually(
        lambda: autoscaler_status(cluster, "quick").get("reason") not in (None, "ScaleDownHeld"),
        what="a status that holds nothing",
    )
    assert operator.failures() == []


# ---------------------------------------------------------------------------------- point 7: GitOps

SSA_REPLICAS = {
    "manager": "kustomize-controller",
    "operation": "Apply",
    "apiVersion": "serving.chunkwise.dev/v1alpha1",
    "fieldsType": "FieldsV1",
    "fieldsV1": {"f:spec": {"f:model": {"f:preset": {}}, "f:replicas": {}}},
}
HPA_SCALE = {
    "manager": "kube-controller-manager",
    "operation": "Update",
    "subresource": "scale",
    "fieldsType": "FieldsV1",
    "fieldsV1": {"f:spec": {"f:replicas": {}}},
}


# Where `kubectl apply` keeps what it applied.
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def last_applied(spec: dict[str, Any]) -> dict[str, Any]:
    body = inference_service("svc", spec)
    return {"annotations": {LAST_APPLIED: json.dumps(body)}}


def test_the_gpu_example_leaves_replicas_to_its_scaler() -> None:
    """Issue 31, point 7: the example set replicas: 2 with delegated autoscaling; each sync reset the HPA."""
    (doc,) = yaml.safe_load_all(GPU_EXAMPLE.read_text())
    assert doc["spec"]["autoscaling"]["enabled"] is True
    assert "replicas" not in doc["spec"]
    # A manifest applied as it is would not fight the scaler.
    assert status.replicas_fight(parse(doc["spec"]), last_applied(doc["spec"])) is None


@pytest.mark.parametrize(
    ("metadata", "writers"),
    [
        ({}, ()),
        (last_applied({"model": {"preset": "tiny"}}), ()),
        (
            last_applied({"model": {"preset": "tiny"}, "replicas": 2}),
            ("kubectl apply (its last-applied-configuration)",),
        ),
        ({"managedFields": [SSA_REPLICAS]}, ("server-side apply by kustomize-controller",)),
        # The HPA's (and KEDA's) writes through /scale, the operator's own patches, a one-off kubectl scale.
        ({"managedFields": [HPA_SCALE]}, ()),
        ({"managedFields": [{**SSA_REPLICAS, "manager": "chunkwise-operator"}]}, ()),
        ({"managedFields": [{**SSA_REPLICAS, "operation": "Update", "manager": "kubectl-edit"}]}, ()),
        # An applier that leaves replicas out.
        ({"managedFields": [{**SSA_REPLICAS, "fieldsV1": {"f:spec": {"f:model": {}}}}]}, ()),
        ({"annotations": {LAST_APPLIED: "not json"}}, ()),
    ],
    ids=[
        "none",
        "applied-without",
        "client-side",
        "server-side",
        "hpa",
        "operator",
        "update",
        "ssa-without",
        "bad",
    ],
)
def test_who_declares_spec_replicas(metadata: dict[str, Any], writers: tuple[str, ...]) -> None:
    assert status.replicas_writers(metadata) == writers


def test_a_declared_replicas_fights_only_a_scaler() -> None:
    declared = {"managedFields": [SSA_REPLICAS]}
    fixed = parse({"model": {"preset": "tiny"}, "replicas": 2})
    assert status.replicas_fight(fixed, declared) is None  # no scaler: replicas is the user's to set
    delegated = parse({"model": {"preset": "tiny"}, "autoscaling": {"enabled": True, "delegated": True}})
    assert status.replicas_fight(delegated, declared) == (
        "spec.replicas is declared by server-side apply by kustomize-controller while the HPA or KEDA "
        "(autoscaling.delegated) owns it: every sync writes its count back over the scaler's; leave replicas "
        "out of the manifest (docs/operator.md, GitOps)"
    )
    builtin = parse({"model": {"preset": "tiny"}, "autoscaling": {"enabled": True}})
    message = status.replicas_fight(builtin, declared)
    assert message is not None and "while the built-in autoscaler owns it" in message


def scaler_conflict(st: dict[str, Any]) -> tuple[str, str]:
    (cond,) = [c for c in st["conditions"] if c["type"] == "ScalerConflict"]
    return cond["status"], cond["reason"]


def computed(
    spec: ServiceSpec, metadata: dict[str, Any], previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    return status.compute_status(
        name="svc",
        namespace="ml",
        parsed=spec,
        runtime=None,
        router=None,
        previous=previous or {},
        now="2030-01-01T00:00:00Z",
        generation=1,
        failure=None,
        metadata=metadata,
    )


def test_the_fight_is_a_condition_for_either_scaler_and_an_event_once() -> None:
    declared = {"managedFields": [SSA_REPLICAS]}
    delegated = parse({"model": {"preset": "tiny"}, "autoscaling": {"enabled": True, "delegated": True}})
    calm = computed(delegated, {})
    assert scaler_conflict(calm) == ("False", "NoConflict")
    fighting = computed(delegated, declared, calm)
    assert scaler_conflict(fighting) == ("True", "ReplicasFightScaler")
    # One event when it begins, none while it goes on.
    assert status.replicas_fight_began(calm, fighting) == status.replicas_fight(delegated, declared)
    assert status.replicas_fight_began(fighting, computed(delegated, declared, fighting)) is None

    builtin = parse({"model": {"preset": "tiny"}, "autoscaling": {"enabled": True}})
    assert scaler_conflict(computed(builtin, {})) == ("False", "NoExternalScaler")
    assert scaler_conflict(computed(builtin, declared)) == ("True", "ReplicasFightScaler")
    # An HPA beside the built-in autoscaler is the conflict reported first: it stops the autoscaler.
    external = {"autoscaler": {"reason": "ScalerConflict", "desiredReplicas": 1, "message": "hpa/x"}}
    assert scaler_conflict(computed(builtin, declared, external)) == ("True", "ExternalScaler")
    # Without autoscaling there is no scaler to fight.
    fixed = parse({"model": {"preset": "tiny"}, "replicas": 2})
    assert not [c for c in computed(fixed, declared)["conditions"] if c["type"] == "ScalerConflict"]


async def test_a_sync_that_writes_replicas_over_the_hpa_is_reported(cluster: Cluster, operator: Any) -> None:
    """Issue 31, point 7, on kmock: `kubectl apply` of a manifest with replicas: 2 after the HPA scaled the
    service to 5 resets it, and the operator says so (a condition and a Warning event)."""
    spec = {
        "model": {"preset": "tiny"},
        "image": "chunkwise:dev",
        "autoscaling": {"enabled": True, "delegated": True},
    }
    await cluster.create_isvc("chat", spec)
    await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat"), what="deployment")
    await eventually(
        lambda: (
            "ScalerConflict"
            in [c["type"] for c in (cluster.isvc("chat") or {}).get("status", {}).get("conditions", [])]
        ),
        what="ScalerConflict condition",
    )
    await cluster.scale_isvc("chat", 5)
    applied = {**spec, "replicas": 2}
    await cluster.patch_isvc(
        "chat",
        {"metadata": last_applied(applied), "spec": {"replicas": 2}},
    )

    def conflict() -> dict[str, Any] | None:
        for cond in (cluster.isvc("chat") or {}).get("status", {}).get("conditions", []):
            if cond["type"] == "ScalerConflict" and cond["status"] == "True":
                return dict(cond)
        return None

    cond = await eventually(conflict, what="conflict reported")
    assert cond["reason"] == "ReplicasFightScaler"
    assert "kubectl apply" in cond["message"]
    events = await eventually(
        lambda: [e for e in cluster.events() if e["reason"] == "ReplicasFightScaler"], what="event"
    )
    assert events[0]["type"] == "Warning" and events[0]["message"] == cond["message"]
    assert operator.failures() == []


# ---------------------------------------------------------------------------------- point 10: accelerators


@pytest.mark.parametrize(
    ("accelerator", "tolerated"),
    [
        ("amd.com/gpu", ["amd.com/gpu"]),
        ("nvidia.com/mig-3g.40gb", ["nvidia.com/mig-3g.40gb", "nvidia.com/gpu"]),
        ("gpu.intel.com/i915", ["gpu.intel.com/i915"]),
    ],
)
def test_the_accelerator_names_the_resource_and_its_taint(accelerator: str, tolerated: list[str]) -> None:
    """Issue 31, point 10: nvidia.com/gpu was hard-coded."""
    data = {**HF_GPU, "resources": {"gpu": 1, "accelerator": accelerator}}
    children = manifests.children("llama", "ml", parse(data))
    validate(children)
    pod = pod_of(by_kind(children, "Deployment", "llama"))
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits[accelerator] == "1" and (accelerator == "nvidia.com/gpu" or "nvidia.com/gpu" not in limits)
    assert [t["key"] for t in pod["tolerations"]] == tolerated
    assert crd_accepts(data)


@pytest.mark.parametrize(
    "accelerator",
    ["gpu", "kubernetes.io/gpu", "node.kubernetes.io/gpu", "Nvidia.com/gpu", "nvidia.com/", "a/b c"],
)
def test_an_accelerator_that_is_no_extended_resource_is_refused(accelerator: str) -> None:
    data = {**HF_GPU, "resources": {"gpu": 1, "accelerator": accelerator}}
    with pytest.raises(SpecError) as caught:
        parse(data)
    assert caught.value.reason == "InvalidResources"
    assert "spec.resources.accelerator" in caught.value.message
    if (
        "kubernetes.io" not in accelerator
    ):  # the schema's pattern; the reserved domain is the operator's check
        assert not crd_accepts(data)


def test_up_to_16_gpus_a_pod_each_a_tensor_parallel_rank() -> None:
    """Issue 33: gpu: N is N tensor-parallel ranks (tests/operator/test_operator_parallel.py has the rest);
    the cap is 16, in the operator and in the schema alike."""
    data = {**HF_GPU, "resources": {"gpu": 16}}
    assert parse(data).engine.tensor_parallel_size == 16
    assert crd_accepts(data)
    over = {**HF_GPU, "resources": {"gpu": 17}}
    with pytest.raises(SpecError) as caught:
        parse(over)
    assert caught.value.reason == "InvalidResources"
    assert caught.value.message == "spec.resources.gpu must be an integer in [0, 16], got 17"
    assert not crd_accepts(over)


def test_a_runtime_class_for_the_engine_only() -> None:
    data = {**HF_GPU, "pod": {"runtimeClassName": "nvidia"}}
    children = manifests.children("llama", "ml", parse(data))
    validate(children)
    assert pod_of(by_kind(children, "Deployment", "llama"))["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in pod_of(by_kind(children, "Deployment", "llama-router"))
    assert crd_accepts(data)
    bad = {**HF_GPU, "pod": {"runtimeClassName": "NVIDIA"}}
    with pytest.raises(SpecError):
        parse(bad)
    assert not crd_accepts(bad)


def test_the_platform_may_assign_the_uid() -> None:
    """Issue 31, point 10: OpenShift's restricted-v2 SCC refuses the fixed UID 65532 and assigns its own."""
    data = {**HF_GPU, "pod": {"platformAssignsUID": True}}
    children = manifests.children("llama", "ml", parse(data))
    validate(children)
    for name in ("llama", "llama-router"):
        pod = pod_of(by_kind(children, "Deployment", name))
        assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        for container in pod["containers"] + pod.get("initContainers", []):
            assert not {"runAsUser", "runAsGroup"} & set(container["securityContext"])
        assert restricted_violations(pod) == []
    assert crd_accepts(data)
    # By default the image's user, so that the cache volumes are writable for it (fsGroup).
    default = pod_of(manifests.runtime_deployment("llama", "ml", parse(HF_GPU)))
    assert default["securityContext"]["runAsUser"] == default["securityContext"]["fsGroup"] == 65532
