"""The built images as containers (marker slow; `make images-local` first, or any build of the two tags).

The runtime image, as the platform runs it but stricter (read-only root filesystem, a tmpfs on /tmp, no
capabilities), serves a completion to the official client and drains to exit 0 on SIGTERM. The operator
image, the same way, reaches a Kubernetes API (kmock's emulator on this host, through a kubeconfig) and
reconciles an InferenceService into its children.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import kmock as km
import openai
import pytest
import yaml

from chunkwise_operator.spec import GROUP, PLURAL, VERSION
from tests.operator.operator_harness import VERBS, ApiServer, Cluster, eventually

pytestmark = pytest.mark.slow

RUNTIME_IMAGE = os.environ.get("RUNTIME_IMAGE", "chunkwise/runtime:0.1.0")
OPERATOR_IMAGE = os.environ.get("OPERATOR_IMAGE", "chunkwise/operator:0.1.0")
USER = "65532:65532"
# What the kubelet gives the containers in manifests/operator/operator.yaml, and more: no writable root at all.
LOCKED_DOWN = [
    "--read-only",
    "--tmpfs",
    "/tmp:rw,size=256m,mode=1777",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
]


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def _skip_reason(image: str) -> str | None:
    if shutil.which("docker") is None:
        return "no docker binary on PATH"
    try:
        if docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False).returncode != 0:
            return "no Docker daemon answers (e2e/images/dockerd.sh start)"
        if docker("image", "inspect", image, timeout=30, check=False).returncode != 0:
            return f"no image {image} (make images-local, or e2e/images/build-images.sh)"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"docker does not answer: {e}"
    return None


@pytest.fixture
def container_name() -> Iterator[str]:
    name = f"chunkwise-test-{uuid.uuid4().hex[:8]}"
    yield name
    docker("rm", "--force", name, check=False)


def image_config(image: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]
    return config


def test_runtime_image_serves_a_completion(container_name: str) -> None:
    reason = _skip_reason(RUNTIME_IMAGE)
    if reason:
        pytest.skip(reason)
    config = image_config(RUNTIME_IMAGE)
    assert config["User"] == USER
    assert config["Cmd"] == ["chunkwise", "serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "8000"]

    # The image's own command: the built-in tiny model on 0.0.0.0:8000, published on a free loopback port,
    # within the memory limit of manifests/examples/service.yaml.
    docker(
        "run",
        "--detach",
        "--name",
        container_name,
        *LOCKED_DOWN,
        "--memory",
        "2g",
        "-p",
        "127.0.0.1::8000",
        RUNTIME_IMAGE,
    )
    port = docker("port", container_name, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
    url = f"http://127.0.0.1:{port}"

    deadline = time.monotonic() + 180
    while True:
        state = json.loads(docker("inspect", container_name).stdout)[0]["State"]
        assert state["Running"], docker("logs", container_name).stdout + docker("logs", container_name).stderr
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the runtime container never became healthy"
        time.sleep(0.5)

    assert docker("exec", container_name, "id", "-u").stdout.strip() == "65532"
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = c.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8
    assert "vllm:request_success_total" in httpx.get(f"{url}/metrics", timeout=10).text

    # SIGTERM drains and exits 0, well within Docker's 10 s before SIGKILL.
    docker("stop", "--time", "30", container_name, timeout=60)
    state = json.loads(docker("inspect", container_name).stdout)[0]["State"]
    assert state["ExitCode"] == 0, docker("logs", container_name).stderr[-2000:]


NO_TORCH_PROBE = """
import importlib.util, json, sys
import chunkwise_operator, chunkwise_operator.main, chunkwise_operator.reconcile, chunkwise_operator.autoscale
print(json.dumps({
    "imported": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
    "installed": importlib.util.find_spec("torch") is not None,
}))
"""


def test_operator_image_carries_no_torch() -> None:
    reason = _skip_reason(OPERATOR_IMAGE)
    if reason:
        pytest.skip(reason)
    out = docker(
        "run", "--rm", *LOCKED_DOWN, "--network", "none", OPERATOR_IMAGE, "python", "-c", NO_TORCH_PROBE
    )
    assert json.loads(out.stdout) == {"imported": [], "installed": False}


def test_runtime_image_runs_the_router_too() -> None:
    """The router (`chunkwise router`, spec.router) runs from the runtime image; it lists EndpointSlices."""
    reason = _skip_reason(RUNTIME_IMAGE)
    if reason:
        pytest.skip(reason)
    probe = "import kubernetes, chunkwise.router.discovery, chunkwise.router.run"
    docker("run", "--rm", *LOCKED_DOWN, "--network", "none", RUNTIME_IMAGE, "python", "-c", probe)
    out = docker(
        "run", "--rm", *LOCKED_DOWN, "--network", "none", RUNTIME_IMAGE, "chunkwise", "router", "--help"
    )
    assert "--kube-service" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """kmock's Kubernetes emulator on a loopback port, with the resources the operator touches."""
    async with ApiServer() as emulator, km.Server(emulator) as server:
        r = emulator.resources
        r[f"{GROUP}/{VERSION}/{PLURAL}"] = km.ResourceInfo(
            kind="InferenceService",
            singular="inferenceservice",
            shortnames={"infsvc"},
            namespaced=True,
            verbs=VERBS,
            subresources={"status", "scale"},
        )
        for path, kind, namespaced in [
            ("apps/v1/deployments", "Deployment", True),
            ("v1/services", "Service", True),
            ("v1/serviceaccounts", "ServiceAccount", True),
            ("v1/events", "Event", True),
            ("v1/pods", "Pod", True),
            ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True),
            ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True),
            ("rbac.authorization.k8s.io/v1/roles", "Role", True),
            ("v1/namespaces", "Namespace", False),
            ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False),
        ]:
            r[path] = km.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS)
        yield Cluster(emulator, str(server.url).rstrip("/"))


async def test_operator_image_reaches_its_api_and_reconciles(
    cluster: Cluster, container_name: str, tmp_path: Path
) -> None:
    reason = _skip_reason(OPERATOR_IMAGE)
    if reason:
        pytest.skip(reason)
    config = image_config(OPERATOR_IMAGE)
    assert config["User"] == USER
    deployment = yaml.safe_load(
        (Path(__file__).parents[2] / "manifests" / "operator" / "operator.yaml").read_text()
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert (
        config["Cmd"] == container["command"] + container["args"]
    )  # the image runs what the Deployment does

    # The operator finds the API through KUBECONFIG, as outside a cluster; the host's network namespace lets
    # it reach kmock on this machine's loopback.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
                "users": [{"name": "kmock", "user": {"token": "test"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
                "current-context": "kmock",
            }
        )
    )
    kubeconfig.chmod(0o644)
    liveness = f"http://127.0.0.1:{_free_port()}/healthz"
    # Off the event loop: kmock answers the operator from this loop while docker works.
    await asyncio.to_thread(
        docker,
        "run",
        "--detach",
        "--name",
        container_name,
        *LOCKED_DOWN,
        "--network",
        "host",
        "-v",
        f"{kubeconfig}:/etc/chunkwise/kubeconfig:ro",
        "-e",
        "KUBECONFIG=/etc/chunkwise/kubeconfig",
        OPERATOR_IMAGE,
        *container["command"],
        *[a for a in container["args"] if not a.startswith("--liveness")],
        f"--liveness={liveness}",
    )

    async def state() -> dict[str, Any]:
        out = await asyncio.to_thread(docker, "inspect", container_name)
        result: dict[str, Any] = json.loads(out.stdout)[0]["State"]
        return result

    async def logs() -> str:
        out = await asyncio.to_thread(docker, "logs", container_name, check=False)
        return out.stdout + out.stderr

    deadline = time.monotonic() + 60
    while not cluster.watching(Cluster.ISVCS):
        assert (await state())["Running"], await logs()
        assert time.monotonic() < deadline, f"the operator never watched InferenceServices: {await logs()}"
        await asyncio.sleep(0.2)

    await cluster.create_isvc("tiny", {"model": {"preset": "tiny"}, "image": RUNTIME_IMAGE})
    created = await eventually(
        lambda: cluster.get(Cluster.DEPLOYMENTS, "tiny"), timeout=60, what="Deployment"
    )
    assert created["spec"]["template"]["spec"]["containers"][0]["image"] == RUNTIME_IMAGE
    await eventually(
        lambda: ((cluster.isvc("tiny") or {}).get("status") or {}).get("observedGeneration") == 1,
        timeout=30,
        what="status written",
    )
    async with httpx.AsyncClient() as http:
        health = await http.get(liveness, timeout=10)
    assert health.status_code == 200, health.text

    # SIGTERM: Kopf stops gracefully and exits 0.
    await asyncio.to_thread(docker, "stop", "--time", "30", container_name, timeout=60)
    final, output = await state(), await logs()
    assert final["ExitCode"] == 0, output[-3000:]
    assert "Handler 'reconcile-create' succeeded" in output
