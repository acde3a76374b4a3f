"""Shared pieces for the router's unit tests: a router over fake replica URLs with a settable clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import kmock as km
import pytest
import yaml

from chunkwise.engine.cache.hashing import hash_prefix_blocks
from chunkwise.router import wake
from chunkwise.router.core import Router
from chunkwise.router.cost import CostModel, Defaults
from chunkwise.router.prompt import RoutedRequest

BLOCK = 16
URLS = ["http://127.0.0.2:8000", "http://127.0.0.3:8000", "http://127.0.0.4:8000"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(tokens: list[int], output_tokens: int = 10, stream: bool = True) -> RoutedRequest:
    return RoutedRequest(
        path="/v1/completions",
        prompt_tokens=len(tokens),
        block_hashes=tuple(hash_prefix_blocks(tokens, BLOCK)),
        output_tokens=output_tokens,
        stream=stream,
    )


MakeRouter = Callable[..., Router]


@pytest.fixture
def make_router() -> Iterator[MakeRouter]:
    """Routers whose replicas answer nothing (no transport is ever reached by these tests)."""
    made: list[Router] = []

    def make(policy: str = "predicted-completion", urls: list[str] = URLS, **kwargs: object) -> Router:
        def unreachable(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("no network in unit tests", request=request)

        router = Router(
            policy=policy,
            cost=CostModel(BLOCK, Defaults(prefill_rate=10_000.0, tpot_s=0.01, prompt_tokens=100.0)),
            client=httpx.AsyncClient(transport=httpx.MockTransport(unreachable)),
            clock=kwargs.pop("clock", Clock()),  # type: ignore[arg-type]
            **kwargs,  # type: ignore[arg-type]
        )
        router.set_replicas(urls)
        made.append(router)
        return router

    yield make


KUBE_VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


@pytest.fixture
async def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """kmock's API server with what the router reads and writes, and KUBECONFIG pointing at it."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    async with km.KubernetesEmulator() as emulator, km.Server(emulator) as server:
        emulator.resources["discovery.k8s.io/v1/endpointslices"] = km.ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs=KUBE_VERBS
        )
        emulator.resources[f"{wake.GROUP}/{wake.VERSION}/{wake.PLURAL}"] = km.ResourceInfo(
            kind="InferenceService", namespaced=True, verbs=KUBE_VERBS, subresources={"scale"}
        )
        url = str(server.url).rstrip("/")
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "k", "cluster": {"server": url}}],
            "users": [{"name": "k", "user": {"token": "t"}}],
            "contexts": [{"name": "k", "context": {"cluster": "k", "user": "k"}}],
            "current-context": "k",
        }
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(config))
        monkeypatch.setenv("KUBECONFIG", str(path))
        yield url
