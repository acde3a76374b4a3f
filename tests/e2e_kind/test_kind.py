"""The platform in a real cluster: the example InferenceService served, scaled, autoscaled and deleted.

Runs against a kind cluster made by e2e/kind/kind-up.sh (`make e2e`), named by KIND_CLUSTER; skips with the
reason everywhere else. The tests are one story in file order: the example service comes up, answers
completions through its Service, exposes metrics, follows /scale, is scaled up by the operator's autoscaler
under load, and is deleted with everything it owned.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e_kind.kube import ROOT, Kubectl, cluster_context, wait_for

CONTEXT, SKIP_REASON = cluster_context()
pytestmark = [pytest.mark.e2e_kind, pytest.mark.skipif(CONTEXT is None, reason=SKIP_REASON or "")]

EXAMPLE = ROOT / "manifests" / "examples" / "service.yaml"
KIND = "inferenceservices.serving.chunkwise.dev"
RUNTIME_PORT = 8000
# A pod's start (image already on the node) plus the built-in model's construction, with room for a slow
# CI machine.
READY_TIMEOUT_S = 300


def example() -> dict[str, Any]:
    with EXAMPLE.open() as f:
        body: dict[str, Any] = yaml.safe_load(f)
    return body


NAME = example()["metadata"]["name"]
NAMESPACE = example()["metadata"]["namespace"]
SELECTOR = f"app.kubernetes.io/component=runtime,serving.chunkwise.dev/inferenceservice={NAME}"


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return {}


def settled(obj: dict[str, Any] | None, replicas: int) -> dict[str, Any] | None:
    """The InferenceService once the operator has seen its spec and `replicas` runtime pods are ready."""
    if obj is None:
        return None
    status = obj.get("status") or {}
    if (
        status.get("observedGeneration") == obj["metadata"]["generation"]
        and obj["spec"].get("replicas") == replicas
        and status.get("replicas") == replicas
        and status.get("readyReplicas") == replicas
        and condition(obj, "Ready").get("status") == "True"
    ):
        return obj
    return None


def rolled_out(deployment: dict[str, Any] | None, replicas: int) -> bool:
    """Every pod of the Deployment runs its current template and is ready; no old pod is left."""
    if deployment is None:
        return False
    s = deployment.get("status") or {}
    return (
        s.get("observedGeneration") == deployment["metadata"]["generation"]
        and deployment["spec"]["replicas"] == replicas
        and s.get("updatedReplicas") == replicas
        and s.get("readyReplicas") == replicas
        and s.get("replicas") == replicas
    )


@pytest.fixture(scope="module")
def kube() -> Kubectl:
    assert CONTEXT is not None
    return Kubectl(CONTEXT, NAMESPACE)


@pytest.fixture(scope="module")
def service(kube: Kubectl) -> Iterator[str]:
    """The example InferenceService, applied from manifests/examples/service.yaml as a user would."""
    # A leftover of an interrupted run (KEEP_CLUSTER=1) would carry another spec and history.
    kube.delete(KIND, NAME)
    wait_for(lambda: not kube.items("pods", SELECTOR), 180, "pods of an earlier run gone")
    # The operator's pods must be admitted where the `restricted` Pod Security level is enforced.
    kube.run("label", "--overwrite", "namespace", NAMESPACE, "pod-security.kubernetes.io/enforce=restricted")
    kube.run("apply", "-f", str(EXAMPLE))
    yield NAME
    kube.delete(KIND, NAME, wait=False)


def client(base_url: str) -> openai.OpenAI:
    # No retries: a refusal (429) must be seen as one, not hidden behind the client's backoff.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_example_service_becomes_ready(kube: Kubectl, service: str) -> None:
    obj = wait_for(lambda: settled(kube.get(KIND, service), 1), READY_TIMEOUT_S, "the example Ready")
    status = obj["status"]
    assert status["model"] == "tiny"
    assert status["url"] == f"http://{service}.{NAMESPACE}.svc:{RUNTIME_PORT}"
    assert status["selector"] == SELECTOR
    assert status["autoscaler"]["reason"] == "Disabled"
    assert condition(obj, "Degraded")["status"] == "False"

    uid = obj["metadata"]["uid"]
    for kind in ("deployment", "service", "poddisruptionbudget"):
        child = kube.get(kind, service)
        assert child is not None, kind
        owners = child["metadata"].get("ownerReferences") or []
        assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [("InferenceService", service, uid)], (
            kind
        )

    (pod,) = kube.items("pods", SELECTOR)
    (container,) = pod["spec"]["containers"]
    assert container["image"] == example()["spec"]["image"]
    assert [container["command"][0], *container["args"][:3]] == ["chunkwise", "serve", "--model", "tiny"]
    assert all(s["ready"] for s in pod["status"]["containerStatuses"])


def test_completions_through_the_service(kube: Kubectl, service: str) -> None:
    wait_for(lambda: settled(kube.get(KIND, service), 1), READY_TIMEOUT_S, "the example Ready")
    with kube.port_forward(f"service/{service}", RUNTIME_PORT) as url:
        c = client(url)
        assert [m.id for m in c.models.list().data] == ["tiny"]

        # ignore_eos: the random model may pick its EOS token early; the counts below must be exact.
        fixed = {"ignore_eos": True}
        first = c.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, extra_body=fixed
        )
        again = c.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, extra_body=fixed
        )
        assert first.choices[0].finish_reason == "length"
        assert first.usage is not None and first.usage.completion_tokens == 8
        assert first.choices[0].text == again.choices[0].text  # greedy: the same tokens every time

        usage = None
        deltas = []
        for chunk in c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=fixed,
        ):
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == 8
        assert deltas


def samples(metrics_text: str) -> dict[str, float]:
    """Sample name (labels summed over) -> value."""
    result: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            result[s.name] = result.get(s.name, 0.0) + s.value
    return result


def test_metrics_of_the_replica(kube: Kubectl, service: str) -> None:
    wait_for(lambda: settled(kube.get(KIND, service), 1), READY_TIMEOUT_S, "the example Ready")
    with kube.port_forward(f"service/{service}", RUNTIME_PORT) as url:
        before = samples(httpx.get(f"{url}/metrics", timeout=30).text)
        client(url).completions.create(
            model="tiny", prompt="metrics", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        after = samples(httpx.get(f"{url}/metrics", timeout=30).text)
    assert after["vllm:request_success_total"] == before.get("vllm:request_success_total", 0.0) + 1
    assert after["vllm:generation_tokens_total"] >= before.get("vllm:generation_tokens_total", 0.0) + 4
    assert after["chunkwise:step_duration_seconds_count"] > before.get(
        "chunkwise:step_duration_seconds_count", 0
    )
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in after, name


def test_scale_subresource(kube: Kubectl, service: str) -> None:
    """`kubectl scale` (what HPA and KEDA do) moves the runtime Deployment, and status follows."""
    wait_for(lambda: settled(kube.get(KIND, service), 1), READY_TIMEOUT_S, "the example Ready")
    kube.run("scale", f"{KIND}/{service}", "--replicas", "2")
    wait_for(lambda: rolled_out(kube.get("deployment", service), 2), READY_TIMEOUT_S, "Deployment at 2")
    wait_for(lambda: settled(kube.get(KIND, service), 2), 60, "status at 2 replicas")

    kube.run("scale", f"{KIND}/{service}", "--replicas", "1")
    wait_for(lambda: rolled_out(kube.get("deployment", service), 1), 180, "Deployment back at 1")
    wait_for(lambda: settled(kube.get(KIND, service), 1), 60, "status back at 1 replica")


class Load:
    """Completions sent back to back from `workers` threads until stopped; counts what came back."""

    def __init__(self, url: str, workers: int, max_tokens: int) -> None:
        self._client = client(url)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.ok = 0
        self.refused = 0
        self.errors: list[str] = []
        self._max_tokens = max_tokens
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="load")
        self._futures = [self._pool.submit(self._worker, i) for i in range(workers)]

    def _worker(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                self._client.completions.create(
                    model="tiny",
                    prompt=f"load {i}",
                    max_tokens=self._max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                outcome = "ok"
            except openai.RateLimitError:
                outcome = "refused"  # load shedding: the queue is long, which is the point
                time.sleep(0.2)
            except (openai.APIError, httpx.HTTPError) as e:
                outcome = f"{type(e).__name__}: {e}"
                time.sleep(0.5)
            with self._lock:
                if outcome == "ok":
                    self.ok += 1
                elif outcome == "refused":
                    self.refused += 1
                else:
                    self.errors.append(outcome)

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=180)
        self._pool.shutdown()


def test_autoscaler_scales_up_under_load(kube: Kubectl, service: str) -> None:
    """The operator's own autoscaler: queue depth above target on one replica -> spec.replicas 2."""
    wait_for(lambda: settled(kube.get(KIND, service), 1), READY_TIMEOUT_S, "the example Ready")
    kube.merge_patch(
        KIND,
        service,
        {
            "spec": {
                # Two sequences per step: anything beyond waits in the queue the autoscaler reads.
                "engine": {"maxNumSeqs": 2},
                "autoscaling": {
                    "enabled": True,
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "targets": {"queueDepthPerReplica": 1},
                    "scaleUpStabilizationSeconds": 0,
                    # No scale-down within the test, once the load stops.
                    "scaleDownStabilizationSeconds": 3600,
                },
            }
        },
    )
    wait_for(lambda: rolled_out(kube.get("deployment", service), 1), READY_TIMEOUT_S, "new engine arguments")
    deployment = kube.get("deployment", service)
    assert deployment is not None
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "2"
    wait_for(lambda: settled(kube.get(KIND, service), 1), 60, "Ready after the change")
    # The autoscaler has scraped the replica at least once (it says something other than waiting for it).
    wait_for(
        lambda: (
            ((kube.get(KIND, service) or {}).get("status") or {}).get("autoscaler", {}).get("reason")
            not in (None, "Disabled", "AwaitingMetrics")
        ),
        60,
        "a first autoscaler evaluation",
    )

    with kube.port_forward(f"service/{service}", RUNTIME_PORT) as url:
        load = Load(url, workers=12, max_tokens=256)
        try:
            wait_for(
                lambda: (kube.get(KIND, service) or {}).get("spec", {}).get("replicas") == 2,
                240,
                "the autoscaler's scale-up to 2",
                interval=2,
            )
        finally:
            load.stop()
    assert load.ok > 0, f"no completion succeeded under load: {load.errors[:3]}"

    def scale_event() -> dict[str, Any] | None:
        # The operator writes spec.replicas first and status.autoscaler right after.
        autoscaler = ((kube.get(KIND, service) or {}).get("status") or {}).get("autoscaler") or {}
        moved = any(e.get("from") == 1 and e.get("to") == 2 for e in autoscaler.get("scaleEvents") or [])
        return autoscaler if moved and autoscaler.get("lastScaleTime") else None

    wait_for(scale_event, 30, "status.autoscaler recording the 1 -> 2 scale event")

    def scaled_up_events() -> list[dict[str, Any]]:
        out = kube.run(
            "get",
            "events",
            "--field-selector",
            f"involvedObject.kind=InferenceService,involvedObject.name={service},reason=ScaledUp",
            "-o",
            "json",
        )
        items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
        return items

    (event, *_) = wait_for(scaled_up_events, 30, "a ScaledUp event on the InferenceService")
    assert event["type"] == "Normal"
    assert "1 -> 2 replicas" in event["message"]

    # The second replica comes up, and status reports it; the count holds (no scale-down within an hour).
    obj = wait_for(lambda: settled(kube.get(KIND, service), 2), READY_TIMEOUT_S, "2 ready replicas")
    assert obj["status"]["autoscaler"]["desiredReplicas"] == 2


def test_delete_removes_everything(kube: Kubectl, service: str) -> None:
    """Deleting the InferenceService deletes its children through their owner references."""
    assert kube.get(KIND, service) is not None
    kube.delete(KIND, service)

    def gone(kind: str) -> bool:
        return kube.get(kind, service) is None

    for kind in ("deployment", "service", "poddisruptionbudget"):
        wait_for(lambda: gone(kind), 120, f"{kind} {service} deleted")  # noqa: B023  (called at once)
    # Pods drain first (preStop, then SIGTERM); idle ones finish at once.
    wait_for(lambda: not kube.items("pods", SELECTOR), 180, "runtime pods gone")
    assert kube.get(KIND, service) is None
