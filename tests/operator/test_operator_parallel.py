"""Tensor and pipeline parallelism in the operator (issue 33, item 3): pure rendering and validation.

gpu: N is --tensor-parallel-size N unless spec.engine.tensorParallelSize says otherwise (which must divide
gpu, in the operator and in the CRD's CEL rule alike); spec.engine.pipelineParallelSize above 1 turns the
runtime Deployment into a LeaderWorkerSet whose leader is the Deployment's pod and whose workers serve no
HTTP. The Kopf-on-kmock side is test_operator_parallel_e2e.py.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_harness import ROOT, inference_service, schema_errors
from test_operator_manifests import restricted_violations

from chunkwise_operator import manifests
from chunkwise_operator.spec import MODELED_FLAGS, SpecError, parse

TINY: dict[str, Any] = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}
PIPELINE_EXAMPLE = ROOT / "manifests" / "examples" / "pipeline-service.yaml"
CLI = [sys.executable, "-c", "import sys; from chunkwise.cli import main; sys.exit(main())"]
TP_MESSAGE = (
    "engine.tensorParallelSize must divide resources.gpu: each rank drives one of the pod's GPUs (leave "
    "tensorParallelSize out to shard over all of them)"
)


def with_(base: dict[str, Any], **sections: Any) -> dict[str, Any]:
    result = copy.deepcopy(base)
    result.update(sections)
    return result


def crd_errors(spec: dict[str, Any]) -> list[str]:
    return schema_errors(inference_service("svc", spec))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def engine_of(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    assert container["name"] == "engine"
    return dict(container)


# ------------------------------------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize(
    ("resources", "engine", "expected"),
    [
        ({"gpu": 2}, {}, "2"),
        ({"gpu": 8}, {}, "8"),
        ({"gpu": 4}, {"tensorParallelSize": 2}, "2"),
        ({"gpu": 4}, {"tensorParallelSize": 4}, "4"),
        ({"gpu": 0}, {"tensorParallelSize": 3}, "3"),  # CPU ranks (gloo), passed as given
        ({"gpu": 1}, {}, None),  # one rank: the engine's default, no flag
        ({}, {}, None),
    ],
)
def test_gpu_n_is_tensor_parallel_n_unless_the_spec_says_otherwise(
    resources: dict[str, Any], engine: dict[str, Any], expected: str | None
) -> None:
    data = with_(TINY, resources=resources, engine=engine)
    assert crd_errors(data) == []
    parsed = parse(data)
    assert parsed.engine.tensor_parallel_size == int(expected or 1)
    dep = manifests.runtime_deployment("s", "ml", parsed)
    engine_container = engine_of(dep["spec"]["template"])
    assert flag(engine_container["args"], "--tensor-parallel-size") == expected
    assert flag(engine_container["args"], "--pipeline-parallel-size") is None
    if resources.get("gpu"):
        # The pod asks for every GPU it shards over (a string, as the API server stores quantities).
        assert engine_container["resources"]["limits"]["nvidia.com/gpu"] == str(resources["gpu"])
    kubernetes_validate.validate(dep, "1.30.0", strict=True)


@pytest.mark.parametrize(
    ("resources", "engine", "pod", "size"),
    [
        ({"gpu": 4}, {}, {}, "8Gi"),  # 2Gi a rank
        ({"gpu": 4}, {"tensorParallelSize": 2}, {}, "4Gi"),
        ({"gpu": 1}, {"pipelineParallelSize": 2}, {}, "2Gi"),  # a pipeline stage of one rank
        ({"gpu": 1}, {}, {}, "1Gi"),
        ({"gpu": 0}, {"tensorParallelSize": 4}, {}, "1Gi"),  # gloo on CPU: no NCCL
        ({"gpu": 4}, {}, {"shmSize": "512Mi"}, "512Mi"),  # the spec's own wins
    ],
)
def test_shared_memory_grows_with_the_ranks_of_a_gpu_pod(
    resources: dict[str, Any], engine: dict[str, Any], pod: dict[str, Any], size: str
) -> None:
    data = with_(TINY, resources=resources, engine=engine, pod=pod)
    assert crd_errors(data) == []
    template = manifests.runtime_workload("s", "ml", parse(data))["spec"]
    template = template.get("template") or template["leaderWorkerTemplate"]["leaderTemplate"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}} in template["spec"][
        "volumes"
    ]


def test_a_multi_gpu_deployment_gets_shared_memory_for_nccl() -> None:
    dep = manifests.runtime_deployment("s", "ml", parse(with_(TINY, resources={"gpu": 4})))
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine_of(dep["spec"]["template"])["volumeMounts"]
    # Replaced in place: a surge pod would need 4 more free GPUs.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


@pytest.mark.parametrize(
    ("resources", "engine", "message"),
    [
        (
            {"gpu": 4},
            {"tensorParallelSize": 3},
            "spec.engine.tensorParallelSize (3) must divide spec.resources.gpu (4): each rank drives one of the "
            "pod's GPUs; leave tensorParallelSize out to shard over all 4",
        ),
        (
            {"gpu": 2},
            {"tensorParallelSize": 4},
            "spec.engine.tensorParallelSize (4) must divide spec.resources.gpu (2): each rank drives one of the "
            "pod's GPUs; leave tensorParallelSize out to shard over all 2",
        ),
    ],
)
def test_a_tensor_parallel_size_that_does_not_divide_gpu_is_refused_by_both(
    resources: dict[str, Any], engine: dict[str, Any], message: str
) -> None:
    data = with_(TINY, resources=resources, engine=engine)
    with pytest.raises(SpecError) as caught:
        parse(data)
    assert (caught.value.reason, caught.value.message) == ("InvalidEngine", message)
    assert crd_errors(data) == [f"spec: {TP_MESSAGE}"]


@pytest.mark.parametrize(
    ("engine", "operator_message", "schema_error"),
    [
        (
            {"tensorParallelSize": 0},
            "spec.engine.tensorParallelSize must be an integer in [1, 64], got 0",
            "spec.engine.tensorParallelSize: 0 is less than the minimum of 1",
        ),
        (
            {"tensorParallelSize": 65},
            "spec.engine.tensorParallelSize must be an integer in [1, 64], got 65",
            "spec.engine.tensorParallelSize: 65 is greater than the maximum of 64",
        ),
        (
            {"pipelineParallelSize": 0},
            "spec.engine.pipelineParallelSize must be an integer in [1, 64], got 0",
            "spec.engine.pipelineParallelSize: 0 is less than the minimum of 1",
        ),
        (
            {"pipelineParallelSize": True},
            "spec.engine.pipelineParallelSize must be an integer in [1, 64], got True",
            "spec.engine.pipelineParallelSize: True is not of type 'integer'",
        ),
        (
            {"extraArgs": ["--tensor-parallel-size", "2"]},
            "spec.engine.extraArgs[0] --tensor-parallel-size is what spec.engine.tensorParallelSize sets; use "
            "that field instead",
            None,
        ),
        (
            {"extraArgs": ["--pipeline-parallel-size=2"]},
            "spec.engine.extraArgs[0] --pipeline-parallel-size is what spec.engine.pipelineParallelSize sets; "
            "use that field instead",
            None,
        ),
    ],
)
def test_out_of_range_sizes_and_repeated_flags_are_refused(
    engine: dict[str, Any], operator_message: str, schema_error: str | None
) -> None:
    data = with_(TINY, engine=engine)
    with pytest.raises(SpecError) as caught:
        parse(data)
    assert (caught.value.reason, caught.value.message) == ("InvalidEngine", operator_message)
    errors = crd_errors(data)
    if schema_error is not None:
        assert errors == [schema_error]
    else:
        # The extraArgs item rule (CEL), naming the fields to use.
        (error,) = errors
        assert error.startswith("spec.engine.extraArgs[0]: spec.engine.extraArgs must not repeat a flag")
        assert "tensorParallelSize or pipelineParallelSize" in error


def test_the_crd_and_the_operator_reserve_the_same_flags() -> None:
    for name in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        assert name in MODELED_FLAGS
        assert crd_errors(with_(TINY, engine={"extraArgs": [name, "2"]})) != []


# ----------------------------------------------------------------------------------------- pipeline parallel

PIPELINE: dict[str, Any] = with_(
    TINY,
    replicas=3,
    resources={"gpu": 2},
    engine={"pipelineParallelSize": 4},
    pod={"env": [{"name": "NCCL_DEBUG", "value": "WARN"}]},
)


def test_pipeline_stages_make_a_leader_worker_set_instead_of_the_deployment() -> None:
    parsed = parse(PIPELINE)
    kinds = [
        (c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in manifests.children("llm", "ml", parsed)
    ]
    assert kinds == [
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llm"),
        ("v1", "Service", "llm"),
        ("policy/v1", "PodDisruptionBudget", "llm"),
    ]
    # The Deployment of the one-stage shape is stale (deleted once the group is applied), and back at one
    # stage the group is.
    assert ("apps/v1", "Deployment", "llm") in manifests.stale_children("llm", parsed)
    assert ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llm") not in manifests.stale_children(
        "llm", parsed
    )
    one = parse(with_(PIPELINE, engine={}))
    assert ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llm") in manifests.stale_children("llm", one)
    assert ("apps/v1", "Deployment", "llm") not in manifests.stale_children("llm", one)


def test_the_leader_worker_set_exactly() -> None:
    parsed = parse(PIPELINE)
    lws = manifests.runtime_leader_worker_set("llm", "ml", parsed)
    deployment = manifests.runtime_deployment("llm", "ml", parsed)
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert lws == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": deployment["metadata"],
        "spec": {
            "replicas": 3,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": 4,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
    # The leader is the pod the Deployment of this spec would have, the rendezvous port beside http.
    assert leader == deployment["spec"]["template"]
    rendezvous = [
        {"name": "pp-rendezvous", "containerPort": 29500, "protocol": "TCP"},
        {"name": "pp-steps", "containerPort": 29501, "protocol": "TCP"},
    ]
    assert engine_of(leader)["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        *rendezvous,
    ]
    # The worker: the same command, resources, env and volumes; no http, no probes, no preStop, no scrape.
    leader_engine, worker_engine = engine_of(leader), engine_of(worker)
    assert worker_engine["args"] == leader_engine["args"]
    assert flag(worker_engine["args"], "--pipeline-parallel-size") == "4"
    assert flag(worker_engine["args"], "--tensor-parallel-size") == "2"
    assert worker_engine["ports"] == rendezvous
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        assert key in leader_engine and key not in worker_engine, key
    same = ("image", "command", "resources", "env", "volumeMounts", "securityContext")
    assert {k: worker_engine[k] for k in same} == {k: leader_engine[k] for k in same}
    assert worker["spec"]["volumes"] == leader["spec"]["volumes"]
    assert {k: v for k, v in worker["spec"].items() if k != "containers"} == {
        k: v for k, v in leader["spec"].items() if k != "containers"
    }
    assert "annotations" not in worker["metadata"]
    # /dev/shm on every pod of the group, 2Gi for each of its 2 ranks: NCCL between them, torch's tensors.
    dshm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}
    for template in (leader, worker):
        assert dshm in template["spec"]["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in engine_of(template)["volumeMounts"]
        assert restricted_violations(template["spec"]) == []
        # The pod templates as Kubernetes 1.30 reads them (kubernetes-validate knows no LeaderWorkerSet).
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
            "1.30.0",
            strict=True,
        )


def test_only_leaders_are_selected_by_the_service_the_router_the_pool_and_scale() -> None:
    parsed = parse(with_(PIPELINE, router={"enabled": True}, gateway={"inferencePool": True}))
    lws = manifests.runtime_leader_worker_set("llm", "ml", parsed)
    leader_labels = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    worker_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return selector.items() <= labels.items()

    children = {(c["kind"], c["metadata"]["name"]): c for c in manifests.children("llm", "ml", parsed)}
    selectors = {
        "Service": children["Service", "llm"]["spec"]["selector"],
        "InferencePool": children["InferencePool", "llm"]["spec"]["selector"]["matchLabels"],
        # /scale's status.selector (HPA, KEDA) and the pods the autoscaler and the status read.
        "scale": dict(kv.split("=") for kv in manifests.selector_string("llm").split(",")),
    }
    for what, selector in selectors.items():
        assert selects(selector, leader_labels), what
        assert not selects(selector, worker_labels), what
    assert worker_labels["app.kubernetes.io/component"] == "runtime-worker"
    assert worker_labels["app.kubernetes.io/managed-by"] == "chunkwise-operator"

    # The disruption budget is the exception: evicting a worker restarts its group as a leader would.
    budget = children["PodDisruptionBudget", "llm"]
    kubernetes_validate.validate(budget, "1.30.0", strict=True)
    assert budget["spec"]["maxUnavailable"] == 1

    def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
        return selects(selector.get("matchLabels", {}), labels) and all(
            labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
        )

    assert matches(budget["spec"]["selector"], leader_labels)
    assert matches(budget["spec"]["selector"], worker_labels)
    # ...and only this service's pods: not another service's group, not its router.
    other = manifests.runtime_leader_worker_set("llm2", "ml", parsed)["spec"]["leaderWorkerTemplate"]
    assert not matches(budget["spec"]["selector"], other["workerTemplate"]["metadata"]["labels"])
    assert not matches(budget["spec"]["selector"], manifests.labels("llm", manifests.ROUTER))
    # A one-stage service keeps the budget it always had.
    one = parse(with_(PIPELINE, engine={}))
    assert manifests.children("llm", "ml", one)[2] == manifests.pod_disruption_budget("llm", "ml")


def test_a_cpu_group_surges_and_a_one_stage_service_keeps_its_deployment() -> None:
    cpu = parse(with_(TINY, engine={"pipelineParallelSize": 2, "tensorParallelSize": 2}))
    lws = manifests.runtime_workload("s", "ml", cpu)
    assert lws["kind"] == "LeaderWorkerSet"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxUnavailable": 0,
        "maxSurge": 1,
    }
    worker = engine_of(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    assert (flag(worker["args"], "--tensor-parallel-size"), flag(worker["args"], "--device")) == ("2", "cpu")
    one = parse(with_(TINY, engine={"pipelineParallelSize": 1}))
    assert manifests.runtime_workload("s", "ml", one) == manifests.runtime_deployment("s", "ml", one)
    # No rendezvous port on a Deployment's pod: nothing listens there.
    ports = engine_of(manifests.runtime_deployment("s", "ml", one)["spec"]["template"])["ports"]
    assert [p["name"] for p in ports] == ["http"]


def test_a_fetched_model_is_fetched_by_every_stage() -> None:
    data = with_(PIPELINE, model={"uri": "hf://org/m", "size": "10Gi"})
    lws = manifests.runtime_leader_worker_set("llm", "ml", parse(data))
    for role in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        (fetch,) = pod["initContainers"]
        assert fetch["args"][:2] == ["fetch-model", "hf://org/m"]


def test_the_pipeline_network_policy_admits_a_groups_pods_to_each_other_and_nothing_else() -> None:
    (policy,) = yaml.safe_load_all(
        (ROOT / "manifests" / "examples" / "pipeline-networkpolicy.yaml").read_text()
    )
    kubernetes_validate.validate(policy, "1.30.0", strict=True)
    group = manifests.runtime_leader_worker_set("llm", "ml", parse(PIPELINE))["spec"]["leaderWorkerTemplate"]
    leader = group["leaderTemplate"]["metadata"]["labels"]
    worker = group["workerTemplate"]["metadata"]["labels"]
    router = manifests.labels("llm", manifests.ROUTER)

    def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
        wanted = selector.get("matchLabels", {}).items() <= labels.items()
        return wanted and all(
            labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
        )

    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert matches(spec["podSelector"], leader) and matches(spec["podSelector"], worker)
    assert not matches(spec["podSelector"], router)
    (rule,) = spec["ingress"]
    assert "ports" not in rule  # torch.distributed picks ports beyond the rendezvous one
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace only
    assert matches(peer["podSelector"], leader) and matches(peer["podSelector"], worker)
    assert not matches(peer["podSelector"], router)


# ------------------------------------------------------------------------------------------------- render


def render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "operator", "render", *args], capture_output=True, text=True, timeout=60)


def test_the_pipeline_example_renders_a_leader_worker_set() -> None:
    (doc,) = yaml.safe_load_all(PIPELINE_EXAMPLE.read_text())
    assert schema_errors(doc) == []
    result = render("-f", str(PIPELINE_EXAMPLE))
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    assert objects == manifests.children("llama-70b", "default", parse(doc["spec"]))
    lws = objects[0]
    assert (lws["kind"], lws["spec"]["leaderWorkerTemplate"]["size"]) == ("LeaderWorkerSet", 2)
    for obj in objects[1:]:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    for role in ("leaderTemplate", "workerTemplate"):
        template = lws["spec"]["leaderWorkerTemplate"][role]
        engine = engine_of(template)
        assert flag(engine["args"], "--tensor-parallel-size") == "4"
        assert flag(engine["args"], "--pipeline-parallel-size") == "2"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in template["spec"][
            "volumes"
        ]


def test_render_refuses_a_tensor_parallel_size_that_does_not_divide_gpu(tmp_path: Any) -> None:
    (doc,) = yaml.safe_load_all(PIPELINE_EXAMPLE.read_text())
    doc["spec"]["engine"]["tensorParallelSize"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    result = render("-f", str(bad))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.strip() == (
        f"error: {bad}: document 1 (InferenceService default/llama-70b): InvalidEngine: "
        "spec.engine.tensorParallelSize (3) must divide spec.resources.gpu (4): each rank drives one of the "
        "pod's GPUs; leave tensorParallelSize out to shard over all 4"
    )
