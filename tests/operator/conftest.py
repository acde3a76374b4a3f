"""Fixtures: an emulated API server per test, and the real Kopf operator running against it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import kmock as km
import kubernetes
import pytest
import yaml
from e2e.local.kube import declare
from operator_harness import NAMESPACE, ApiServer, Cluster, Operator, running_operator

import chunkwise_operator.main  # noqa: F401  (registers the handlers in Kopf's default registry)


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Path]]:
    """Points KUBECONFIG (read by Kopf's login and by the operator's client alike) at a server URL."""
    # Inside a pod the in-cluster credentials would win over KUBECONFIG and reach a real cluster.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)

    def write(url: str) -> Path:
        path = tmp_path / "kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}],
            "users": [{"name": "kmock", "user": {"token": "test"}}],
            "contexts": [
                {"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NAMESPACE}}
            ],
            "current-context": "kmock",
        }
        path.write_text(yaml.safe_dump(config))
        monkeypatch.setenv("KUBECONFIG", str(path))
        # Kopf's own login reads the kubernetes package's default, frozen from KUBECONFIG at its import.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        return path

    yield write


@pytest.fixture
async def cluster(kubeconfig: Callable[[str], Path]) -> AsyncIterator[Cluster]:
    async with ApiServer() as emulator, km.Server(emulator) as server:
        # Kopf hangs at start-up unless every resource it touches is declared, its own included.
        declare(emulator)
        url = str(server.url).rstrip("/")
        kubeconfig(url)
        yield Cluster(emulator, url)


@pytest.fixture
async def operator(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Operator]:
    async with running_operator(cluster, caplog) as op:
        yield op
