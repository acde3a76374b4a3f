"""Issue 31, point 5: no Kubernetes API call waits forever, and a hung object wedges neither itself nor others.

The harness's API server accepts the requests `hang` picks and never answers them: a half-open connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import kopf
import kubernetes
import pytest
import tomllib
from operator_harness import NAMESPACE, ROOT, TEST_USER_AGENT, Cluster, eventually, running_operator
from packaging.requirements import Requirement

from chunkwise_operator import main
from chunkwise_operator.kube import ApiUnreachable, Kube
from chunkwise_operator.manifests import LABEL_MANAGED_BY, MANAGER
from chunkwise_operator.spec import GROUP, VERSION

TIMEOUT_S = 0.5
# With Kopf, kmock and the test on one core, an answered call can take a good part of a second.
KOPF_TIMEOUT_S = 2.0
TINY = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}


def from_the_operator(request: Any) -> bool:
    """A request of the operator's own client (not Kopf's, not the test's kubectl)."""
    agent = request.headers.get("User-Agent", "")
    return agent != TEST_USER_AGENT and not agent.lower().startswith("kopf")


@pytest.fixture
def kube(cluster: Cluster) -> Iterator[Kube]:
    client = Kube.from_configuration(kubernetes.client.Configuration(host=cluster.url), timeout=TIMEOUT_S)
    yield client
    client.close()


async def test_a_call_that_gets_no_answer_fails_within_its_timeout(cluster: Cluster, kube: Kube) -> None:
    cluster.k.hang = lambda request: request.name == "stuck"
    started = time.monotonic()
    with pytest.raises(ApiUnreachable, match="no answer from the API server"):
        # The outer bound only keeps a regression from hanging the suite.
        await asyncio.wait_for(
            asyncio.to_thread(kube.get, "apps/v1", "Deployment", NAMESPACE, "stuck"), timeout=10
        )
    elapsed = time.monotonic() - started
    # One timeout, not four: urllib3 would retry a GET three times.
    assert TIMEOUT_S <= elapsed < 2 * TIMEOUT_S + 0.5, elapsed
    # The same client still serves other objects.
    assert await asyncio.to_thread(kube.get, "apps/v1", "Deployment", NAMESPACE, "other") is None


async def test_an_object_whose_calls_hang_fails_its_handler_and_the_others_proceed(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(main.API_TIMEOUT_ENV, str(KOPF_TIMEOUT_S))
    hanging = True
    cluster.k.hang = lambda request: hanging and request.name == "stuck" and from_the_operator(request)
    async with running_operator(cluster, caplog) as operator:
        await cluster.create_isvc("stuck", TINY)
        await cluster.create_isvc("fine", TINY)
        await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "fine"), what="the other object reconciled")
        await eventually(
            lambda: any(
                "reconcile-create" in line and "no answer from the API server" in line
                for line in operator.failures()
            ),
            what="the hung object's handler failed (to be retried)",
        )
        assert cluster.get(Cluster.DEPLOYMENTS, "stuck") is None

        # Its lock is free again: the next handler for it runs at once. A Deployment of its appears (as an
        # edited one would): the child's watch takes the object's lock and puts the spec's Deployment back.
        hanging = False
        await cluster.create(Cluster.DEPLOYMENTS, owned_deployment("stuck"))
        await eventually(
            lambda: (cluster.get(Cluster.DEPLOYMENTS, "stuck") or {}).get("spec", {}).get("template"),
            what="the hung object's Deployment restored",
        )
        # The log line follows the write the condition above saw.
        await eventually(
            lambda: operator.count("Restored Deployment stuck: it had been edited") == 1,
            what="the restore logged",
        )
        assert operator.count("not checked for drift") == 0


def owned_deployment(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {LABEL_MANAGED_BY: MANAGER},
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "InferenceService",
                    "name": name,
                    "uid": f"uid-{name}",
                    "controller": True,
                }
            ],
        },
        "spec": {"replicas": 5},
    }


async def test_kopf_s_own_calls_and_watches_have_timeouts(
    kubeconfig: Any, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(main.API_TIMEOUT_ENV, "7")
    settings = kopf.OperatorSettings()
    memo = kopf.Memo()
    main.configure(settings=settings, memo=memo, logger=logging.getLogger("test"))
    try:
        assert settings.networking.request_timeout == 7
        assert settings.networking.connect_timeout == 7
        assert settings.watching.server_timeout is not None
        assert settings.watching.client_timeout is not None
        assert settings.watching.client_timeout > settings.watching.server_timeout
        assert memo.reconciler.kube.timeout == 7
    finally:
        memo.reconciler.close()


def test_kopf_is_pinned_to_the_version_the_private_hook_is_tested_against() -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        deps = tomllib.load(f)["project"]["optional-dependencies"]["operator"]
    (kopf_req,) = [Requirement(d) for d in deps if Requirement(d).name == "kopf"]
    assert any(s.operator in ("<", "<=", "==", "~=") for s in kopf_req.specifier), kopf_req
    assert metadata.version("kopf") in kopf_req.specifier


def test_a_kopf_without_the_private_registry_stops_the_operator_at_import() -> None:
    with pytest.raises(RuntimeError, match=r"pinned in pyproject\.toml"):
        main._without_finalizers(object())  # type: ignore[arg-type]
