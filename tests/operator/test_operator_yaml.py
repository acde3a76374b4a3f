"""Every YAML under crds/ and manifests/: valid for Kubernetes 1.30, or checked against its own schema."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_harness import ROOT, crd, schema_errors

from chunkwise_operator import manifests
from chunkwise_operator.main import PEERING_NAME, POD_NAMESPACE_ENV
from chunkwise_operator.spec import API_VERSION, GROUP, KIND, PLURAL, SHORT_NAME, VERSION, parse
from chunkwise_operator.status import compute_status

FILES = sorted([*(ROOT / "crds").rglob("*.yaml"), *(ROOT / "manifests").rglob("*.yaml")])
# Kinds kubernetes-validate cannot know (custom resources, kustomize's config); each gets its own check below.
CUSTOM = {
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
    (API_VERSION, KIND),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def all_documents() -> list[tuple[str, dict[str, Any]]]:
    return [(str(path.relative_to(ROOT)), doc) for path in FILES for doc in documents(path)]


def find(kind: str, name: str | None = None, path: str | None = None) -> dict[str, Any]:
    (doc,) = [
        d
        for p, d in all_documents()
        if d["kind"] == kind and name in (None, (d.get("metadata") or {}).get("name")) and path in (None, p)
    ]
    return doc


def test_the_expected_files_exist() -> None:
    assert [str(p.relative_to(ROOT)) for p in FILES] == [
        "crds/inferenceservice.yaml",
        "crds/kopf-peering.yaml",
        "crds/kustomization.yaml",
        "manifests/examples/gateway-httproute.yaml",
        "manifests/examples/gateway-service.yaml",
        "manifests/examples/gpu-service.yaml",
        "manifests/examples/hpa.yaml",
        "manifests/examples/keda-scaledobject.yaml",
        "manifests/examples/lora-service.yaml",
        "manifests/examples/metrics-networkpolicy.yaml",
        "manifests/examples/multitenant-service.yaml",
        "manifests/examples/pipeline-networkpolicy.yaml",
        "manifests/examples/pipeline-service.yaml",
        "manifests/examples/service.yaml",
        "manifests/kustomization.yaml",
        "manifests/monitoring/kustomization.yaml",
        "manifests/monitoring/prometheusrule.yaml",
        "manifests/monitoring/servicemonitor.yaml",
        "manifests/namespace.yaml",
        "manifests/namespaced/kustomization.yaml",
        "manifests/namespaced/rbac.yaml",
        "manifests/operator/kustomization.yaml",
        "manifests/operator/operator.yaml",
        "manifests/rbac.yaml",
    ]


BUILTIN = [(path, doc) for path, doc in all_documents() if (doc["apiVersion"], doc["kind"]) not in CUSTOM]


@pytest.mark.parametrize(
    ("path", "doc"), BUILTIN, ids=[f"{p}:{d['kind']}:{d['metadata']['name']}" for p, d in BUILTIN]
)
def test_builtin_kinds_validate_for_kubernetes_1_30(path: str, doc: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(doc, "1.30.0", strict=True) == "1.30"


def test_every_document_is_covered_by_a_check() -> None:
    kinds = sorted({(d["apiVersion"], d["kind"]) for _, d in all_documents()})
    assert kinds == sorted(
        [
            ("apiextensions.k8s.io/v1", "CustomResourceDefinition"),
            ("apps/v1", "Deployment"),
            ("autoscaling/v2", "HorizontalPodAutoscaler"),
            ("networking.k8s.io/v1", "NetworkPolicy"),
            ("rbac.authorization.k8s.io/v1", "ClusterRole"),
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
            ("rbac.authorization.k8s.io/v1", "Role"),
            ("rbac.authorization.k8s.io/v1", "RoleBinding"),
            ("v1", "Namespace"),
            ("v1", "ServiceAccount"),
            *CUSTOM,
        ]
    )


def test_crd_contract() -> None:
    c = crd()
    assert c["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert c["spec"]["group"] == GROUP
    assert c["spec"]["scope"] == "Namespaced"
    names = c["spec"]["names"]
    assert (names["kind"], names["plural"], names["singular"]) == (KIND, PLURAL, "inferenceservice")
    assert names["shortNames"] == [SHORT_NAME]
    assert "isvc" not in names["shortNames"]
    (version,) = c["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {col["name"]: col["jsonPath"] for col in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Replicas"] == ".status.replicas"
    assert columns["Model"] == ".status.model"
    assert columns["Age"] == ".metadata.creationTimestamp"
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["model"]
    assert spec["properties"]["engine"]["properties"]["preemptionMode"]["enum"] == [
        "auto",
        "swap",
        "recompute",
    ]
    assert spec["properties"]["router"]["properties"]["policy"]["enum"] == [
        "predicted-completion",
        "round-robin",
        "least-loaded",
        "prefix-affinity",
    ]


def test_status_written_by_the_operator_fits_the_crd() -> None:
    """The API server prunes status fields its schema lacks; everything the operator writes must be declared."""
    spec = {
        "model": {"preset": "tiny"},
        "image": "i",
        "autoscaling": {"enabled": True},
        "router": {"enabled": True},
        "gateway": {"inferencePool": True},
        "adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}],
        "engine": {"runtimeLoraUpdates": True},
    }
    parsed = parse(spec)
    adapters = [{"name": "sql", "uri": "hf://org/sql-lora", "readyReplicas": 1, "message": "pod p: HTTP 400"}]
    status = compute_status(
        name="tiny",
        namespace="default",
        parsed=parsed,
        runtime=None,
        router=None,
        previous={"adapters": adapters},
        now="2030-01-01T00:00:00Z",
        generation=3,
    )
    obj = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "tiny"},
        "spec": spec,
        "status": status,
    }
    assert {"InferencePoolReady", "AdaptersReady"} <= {c["type"] for c in status["conditions"]}
    assert status["adapters"] == adapters
    assert schema_errors(obj) == []
    declared = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status) <= set(declared)
    assert set(status["autoscaler"]) <= set(declared["autoscaler"]["properties"])
    assert set(status["adapters"][0]) <= set(declared["adapters"]["items"]["properties"])
    for cond in status["conditions"]:
        assert set(cond) <= set(declared["conditions"]["items"]["properties"])


@pytest.mark.parametrize(
    "name",
    [
        "service.yaml",
        "gpu-service.yaml",
        "gateway-service.yaml",
        "pipeline-service.yaml",
        "lora-service.yaml",
        "multitenant-service.yaml",
    ],
)
def test_inference_service_examples_match_the_crd_schema(name: str) -> None:
    (doc,) = documents(ROOT / "manifests" / "examples" / name)
    assert (doc["apiVersion"], doc["kind"]) == (API_VERSION, KIND)
    assert schema_errors(doc) == []
    parse(doc["spec"])


def test_the_tiny_example_is_a_cpu_service_and_the_gpu_one_uses_gpus() -> None:
    tiny = parse(documents(ROOT / "manifests" / "examples" / "service.yaml")[0]["spec"])
    gpu = parse(documents(ROOT / "manifests" / "examples" / "gpu-service.yaml")[0]["spec"])
    assert (tiny.model.preset, tiny.resources.gpu) == ("tiny", 0)
    assert gpu.resources.gpu == 1 and gpu.router.enabled and gpu.autoscaling.delegated


def test_schema_rejects_what_it_should() -> None:
    base = documents(ROOT / "manifests" / "examples" / "service.yaml")[0]
    bad = {**base, "spec": {**base["spec"], "engine": {"preemptionMode": "lru"}, "replicas": -1}}
    assert schema_errors(bad) == [
        "spec.engine.preemptionMode: 'lru' is not one of ['auto', 'swap', 'recompute']",
        "spec.replicas: -1 is less than the minimum of 0",
    ]


def kustomization_resources(directory: Path) -> list[Path]:
    (k,) = documents(directory / "kustomization.yaml")
    assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    result = []
    for entry in k["resources"]:
        target = (directory / entry).resolve()
        if target.is_dir():
            # Under kustomize's default load restrictions a path outside the directory must be a base.
            assert (target / "kustomization.yaml").is_file(), entry
            result += kustomization_resources(target)
        else:
            assert target.is_file(), entry
            assert directory.resolve() in target.parents, f"{entry} is outside {directory}"
            result.append(target)
    return result


def test_kustomizations_resolve() -> None:
    # The CRDs are their own install (crds/), not part of manifests/: `kubectl delete -k manifests/` must not
    # delete the CRD, which would delete every InferenceService with it (issue 31, point 9).
    assert [str(p.relative_to(ROOT)) for p in kustomization_resources(ROOT / "crds")] == [
        "crds/inferenceservice.yaml",
        "crds/kopf-peering.yaml",
    ]
    installed = kustomization_resources(ROOT / "manifests")
    assert [str(p.relative_to(ROOT)) for p in installed] == [
        "manifests/namespace.yaml",
        "manifests/rbac.yaml",
        "manifests/operator/operator.yaml",
    ]
    # The namespaced install holds nothing cluster-scoped: an administrator applies crds/ for it.
    namespaced = kustomization_resources(ROOT / "manifests" / "namespaced")
    assert [str(p.relative_to(ROOT)) for p in namespaced] == [
        "manifests/namespaced/rbac.yaml",
        "manifests/operator/operator.yaml",
    ]
    assert {d["kind"] for p in namespaced for d in documents(p)} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
    }
    monitoring = kustomization_resources(ROOT / "manifests" / "monitoring")
    assert [p.name for p in monitoring] == ["servicemonitor.yaml", "prometheusrule.yaml"]


def test_rbac_bindings_name_the_accounts() -> None:
    """The rules themselves are held against a running operator's requests in test_operator_rbac.py."""
    # No ClusterRole for routers any more: each router's Role names its own InferenceService
    # (test_operator_manifests.py), so a router cannot scale its neighbours.
    assert not [
        d for _p, d in all_documents() if d["kind"] == "ClusterRole" and "router" in d["metadata"]["name"]
    ]
    binding = find("ClusterRoleBinding", "chunkwise-operator")
    account = find("ServiceAccount", "chunkwise-operator", "manifests/rbac.yaml")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    # The namespaced install: its binding names the account in the namespace kustomize puts it in.
    kustomization = find("Kustomization", path="manifests/namespaced/kustomization.yaml")
    namespaced = find("RoleBinding", "chunkwise-operator", "manifests/namespaced/rbac.yaml")
    assert namespaced["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "chunkwise-operator",
    }
    assert namespaced["subjects"] == [
        {"kind": "ServiceAccount", "name": "chunkwise-operator", "namespace": kustomization["namespace"]}
    ]


def test_operator_deployment_runs_the_package() -> None:
    dep = find("Deployment", "chunkwise-operator")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert [*container["command"], *container["args"]] == [
        "kopf",
        "run",
        "--all-namespaces",
        f"--peering={PEERING_NAME}",
        "--liveness=http://0.0.0.0:8080/healthz",
        "-m",
        "chunkwise_operator.main",
    ]
    assert pod["serviceAccountName"] == "chunkwise-operator"
    # Two replicas in peering; a rollout may overlap them, since only one is active at a time.
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_ID": "metadata.name", POD_NAMESPACE_ENV: "metadata.namespace"}
    # The namespaced install watches the namespace it runs in, with the same peering.
    kustomization = find("Kustomization", path="manifests/namespaced/kustomization.yaml")
    (patch,) = kustomization["patches"]
    (patched,) = yaml.safe_load(patch["patch"])["spec"]["template"]["spec"]["containers"]
    assert patched["args"] == [
        "run",
        f"--namespace=$({POD_NAMESPACE_ENV})",
        f"--peering={PEERING_NAME}",
        *container["args"][3:],
    ]


def test_service_monitor_selects_the_runtime_services() -> None:
    sm = find("ServiceMonitor", "chunkwise-runtime")
    assert set(sm) == {"apiVersion", "kind", "metadata", "spec"}
    service = manifests.runtime_service("tiny", "default")
    selector = sm["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    # The router's Service must not be scraped as a replica.
    assert not selector.items() <= manifests.router_service("tiny", "default")["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == manifests.METRICS_PATH
    assert sm["spec"]["namespaceSelector"] == {"any": True}
    assert sm["spec"]["targetLabels"] == [manifests.LABEL_SERVICE]


def test_a_second_service_monitor_scrapes_the_routers_for_their_held_requests() -> None:
    # Issue 31, point 3: --prometheus-url mode reads chunkwise:router_held_requests by the service label.
    sm = find("ServiceMonitor", "chunkwise-router")
    service = manifests.router_service("tiny", "default")
    selector = sm["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert not selector.items() <= manifests.runtime_service("tiny", "default")["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == manifests.METRICS_PATH
    assert sm["spec"]["targetLabels"] == [manifests.LABEL_SERVICE]


ALERTS = {
    "ChunkwiseStepConvoy": [
        "chunkwise:step_duration_seconds_bucket",
        "chunkwise:step_duration_seconds_sum",
        "chunkwise:step_duration_seconds_count",
    ],
    "ChunkwiseAdmissionThrash": ["vllm:num_preemptions_total"],
    "ChunkwiseUnboundedQueue": ["vllm:num_requests_waiting"],
    "ChunkwiseCacheHitBlindness": ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"],
}


def test_prometheus_rule_alerts_name_the_scheduler_patterns() -> None:
    rule = find("PrometheusRule")
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert sorted(alerts) == sorted(ALERTS)
    patterns = {name: r["labels"]["pattern"] for name, r in alerts.items()}
    assert patterns == {
        "ChunkwiseStepConvoy": "convoy",
        "ChunkwiseAdmissionThrash": "admission-thrash",
        "ChunkwiseUnboundedQueue": "unbounded-queue",
        "ChunkwiseCacheHitBlindness": "cache-hit-blindness",
    }
    for name, r in alerts.items():
        assert set(r) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"\d+[smh]", r["for"]), name
        assert r["labels"]["severity"] in {"info", "warning", "critical"}
        assert {"summary", "description"} <= set(r["annotations"])
        metrics = set(re.findall(r"\b(?:vllm|chunkwise):[a-z_]+", r["expr"]))
        assert metrics == set(ALERTS[name]), name
        assert r["expr"].count("(") == r["expr"].count(")"), name
    # The convoy alert compares the p99 with the mean, not with a fixed number alone.
    assert "histogram_quantile(0.99" in alerts["ChunkwiseStepConvoy"]["expr"]
    assert "deriv(" in alerts["ChunkwiseUnboundedQueue"]["expr"]


def test_scalers_target_the_scale_subresource() -> None:
    hpa = find("HorizontalPodAutoscaler")
    keda = find("ScaledObject")
    target = {"apiVersion": API_VERSION, "kind": KIND, "name": "llama"}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert keda["spec"]["scaleTargetRef"] == target
    gpu = documents(ROOT / "manifests" / "examples" / "gpu-service.yaml")[0]
    assert gpu["metadata"]["name"] == "llama" and gpu["spec"]["autoscaling"]["delegated"] is True
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    assert isinstance(trigger["metadata"]["threshold"], str)
    assert {"minReplicaCount", "maxReplicaCount"} <= set(keda["spec"])


def test_the_gateway_example_routes_to_the_pool_its_service_gets() -> None:
    (service,) = documents(ROOT / "manifests" / "examples" / "gateway-service.yaml")
    route = find("HTTPRoute", "chat")
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    parsed = parse(service["spec"])
    assert parsed.router.enabled and parsed.gateway.inference_pool
    (pool,) = [c for c in manifests.children(name, namespace, parsed) if c["kind"] == "InferencePool"]
    assert route["metadata"]["namespace"] == pool["metadata"]["namespace"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["group"], parent["kind"]) == ("gateway.networking.k8s.io", "Gateway")


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_the_metrics_network_policy_admits_the_operator_prometheus_and_routers() -> None:
    policy = find("NetworkPolicy", "chunkwise-runtime-metrics")
    spec = parse({"model": {"preset": "tiny"}, "router": {"enabled": True}})
    runtime = manifests.runtime_deployment("tiny", "ml", spec)["spec"]["template"]
    router = manifests.router_deployment("tiny", "ml", spec)["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"], runtime["metadata"]["labels"])
    assert not selects(policy["spec"]["podSelector"], router)
    (rule,) = policy["spec"]["ingress"]
    # The port the operator scrapes: the engine's named port, where the pods' annotation says /metrics is.
    (engine,) = [c for c in runtime["spec"]["containers"] if c["name"] == "engine"]
    (port,) = [p for p in engine["ports"] if p["name"] == rule["ports"][0]["port"]]
    assert str(port["containerPort"]) == runtime["metadata"]["annotations"]["prometheus.io/port"]

    operator_pod = find("Deployment", "chunkwise-operator")["spec"]["template"]["metadata"]["labels"]
    namespace = find("Namespace", "chunkwise-system")["metadata"]["name"]

    def admitted(labels: dict[str, str], in_namespace: str | None) -> bool:
        """Some peer admits a pod with `labels` in `in_namespace` (None: the policy's own namespace)."""
        for peer in rule["from"]:
            ns = peer.get("namespaceSelector")
            if ns is None and in_namespace is not None:
                continue
            if ns is not None and in_namespace is None:
                continue
            ns_labels = {"kubernetes.io/metadata.name": in_namespace or ""}
            if (ns is None or selects(ns, ns_labels)) and selects(peer["podSelector"], labels):
                return True
        return False

    assert admitted(operator_pod, namespace)  # the cluster-wide install
    assert admitted(operator_pod, None)  # the namespaced install, beside the pods
    assert admitted(router, None)
    assert admitted({"app.kubernetes.io/name": "prometheus"}, "monitoring")
    assert not admitted({"app": "anything-else"}, "default")


def test_deleting_the_operator_install_keeps_the_crds() -> None:
    """What `kubectl delete -k manifests/` deletes is what kubectl's own kustomize builds from it: no CRD."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl binary on PATH (its built-in kustomize builds the install)")
    built = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "manifests")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    kinds = {o["kind"] for o in yaml.safe_load_all(built.stdout) if o}
    assert "CustomResourceDefinition" not in kinds
    assert "Deployment" in kinds
    crds = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "crds")], capture_output=True, text=True, timeout=60, check=True
    )
    names = {
        o["metadata"]["name"]
        for o in yaml.safe_load_all(crds.stdout)
        if o and o["kind"] == "CustomResourceDefinition"
    }
    assert "inferenceservices.serving.chunkwise.dev" in names
