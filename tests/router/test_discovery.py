"""Replica discovery from EndpointSlices: the pure selection, then the real client against kmock."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes

from chunkwise.router.discovery import KubeDiscovery, StaticDiscovery, endpoint_urls


def endpoint_slice(
    name: str, service: str, endpoints: list[dict[str, Any]], port: int | None = 8000
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "ml", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}] if port else [],
    }


def ep(address: str, ready: bool | None = True) -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": [address], "conditions": conditions}


def test_ready_endpoints_of_the_named_service_only() -> None:
    slices = [
        endpoint_slice("chat-a", "chat", [ep("10.0.0.2"), ep("10.0.0.3", ready=False), ep("10.0.0.4", None)]),
        endpoint_slice("chat-b", "chat", [ep("10.0.0.5")], port=9000),
        endpoint_slice("other", "other", [ep("10.0.0.9")]),
        endpoint_slice("chat-v6", "chat", [ep("fd00::7")]),
    ]
    assert endpoint_urls(slices, "chat") == [
        "http://10.0.0.2:8000",
        "http://10.0.0.4:8000",  # no ready condition means ready
        "http://10.0.0.5:9000",
        "http://[fd00::7]:8000",
    ]


async def test_static_discovery_reports_its_list_once() -> None:
    seen: list[list[str]] = []
    await StaticDiscovery(["http://a:1", " ", "http://b:2"]).run(seen.append)
    assert seen == [["http://a:1", "http://b:2"]]


async def test_kube_discovery_follows_endpoint_slices(kube: str) -> None:
    api = kubernetes.client.DiscoveryV1Api(
        kubernetes.client.ApiClient(kubernetes.client.Configuration(host=kube))
    )

    def create(body: dict[str, Any]) -> None:
        api.create_namespaced_endpoint_slice("ml", body)

    await asyncio.to_thread(
        create, endpoint_slice("chat-1", "chat", [ep("127.0.0.2"), ep("127.0.0.3", False)])
    )
    await asyncio.to_thread(create, endpoint_slice("else-1", "else", [ep("127.0.0.9")]))
    discovery = KubeDiscovery("chat", "ml", interval_s=0.05)
    seen: list[list[str]] = []
    task = asyncio.ensure_future(discovery.run(seen.append))
    try:
        while not seen:
            await asyncio.sleep(0.02)
        assert seen[-1] == ["http://127.0.0.2:8000"]

        def patch() -> None:
            api.patch_namespaced_endpoint_slice(
                "chat-1", "ml", {"endpoints": [ep("127.0.0.2"), ep("127.0.0.3", True)]}
            )

        await asyncio.to_thread(patch)
        for _ in range(200):
            if seen[-1] == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]:
                break
            await asyncio.sleep(0.02)
        assert seen[-1] == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
