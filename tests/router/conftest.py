"""Shared pieces for the router's unit tests: a router over fake replica URLs with a settable clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from chunkwise.cache.hashing import hash_prefix_blocks
from chunkwise.router.core import Router
from chunkwise.router.policies import CostModel, Defaults
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
