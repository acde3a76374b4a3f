"""LoRA affinity end to end: `chunkwise router` in front of two real `chunkwise serve --enable-lora` replicas,
each holding a different adapter on its device (one slot each). With no load to tell them apart, every
request goes to the replica that holds its adapter, learned from the replicas' own metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e.local.processes import Child, free_hosts, serve_argv, wait_healthy

from chunkwise.bench.lora import write_random_adapter
from chunkwise.engine.model.presets import PRESETS
from tests.router.test_router_integration import STARTUP_S, RouterProcess


@pytest.fixture(scope="module")
def lora_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    workdir = tmp_path_factory.mktemp("router-lora")
    adapters = [
        f"{n}={write_random_adapter(PRESETS['tiny'], workdir / n, 4, seed=i)}"
        for i, n in enumerate(("sql", "chat"))
    ]
    flags = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "4", "--lora-modules", *adapters]
    hosts = free_hosts(8000, 2, first=70)
    children = [Child(f"lora-{h}", serve_argv(h, 8000, *flags), workdir / f"lora-{h}.log") for h in hosts]
    try:
        for h, c in zip(hosts, children):
            wait_healthy(f"http://{h}:8000", STARTUP_S, c)
        yield workdir, [f"http://{h}:8000" for h in hosts]
    finally:
        for c in children:
            c.stop()


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "SELECT", "max_tokens": 2, "temperature": 0.0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r


def test_each_request_goes_to_the_replica_holding_its_adapter(lora_replicas: tuple[Path, list[str]]) -> None:
    workdir, (first, second) = lora_replicas
    # One slot each: the first replica holds sql, the second chat.
    _complete(first, "sql")
    _complete(second, "chat")
    router = RouterProcess(workdir, [first, second])
    try:
        wait_healthy(router.url, 30, router.child)
        time.sleep(1.0)  # a few scrapes at 0.2 s: both replicas' adapters are known
        served = [(m, _complete(router.url, m).headers["x-chunkwise-replica"]) for m in ["sql", "chat"] * 4]
    finally:
        router.child.stop()
    assert served == [("sql", first), ("chat", second)] * 4
