"""Where the replicas are: a static list of URLs, or the EndpointSlices of the runtime Service.

EndpointSlices are listed every poll interval with the kubernetes client (the label selector is sent, and
also checked here, since not every API server emulator honours it). An endpoint counts while its `ready`
condition is not false: Kubernetes leaves the condition out to mean ready, and sets it false while the pod
fails its readiness probe or is terminating, which is when the router must stop sending to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

logger = logging.getLogger("chunkwise.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
DEFAULT_PORT = 8000
PORT_NAME = "http"

Update = Callable[[list[str]], None]


class Discovery(Protocol):
    async def run(self, update: Update) -> None:
        """Call `update` with the full list of replica URLs whenever it may have changed; run until cancelled."""
        ...


class StaticDiscovery:
    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = [u for u in urls if u.strip()]

    async def run(self, update: Update) -> None:
        update(self.urls)


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def endpoint_urls(slices: Iterable[Mapping[str, Any]], service: str) -> list[str]:
    """Ready endpoint URLs of `service`'s EndpointSlices (a pure function of the listed objects)."""
    urls: set[str] = set()
    for s in slices:
        labels = (s.get("metadata") or {}).get("labels") or {}
        if labels.get(SERVICE_NAME_LABEL) != service:
            continue
        ports = [p for p in s.get("ports") or [] if isinstance(p, Mapping)]
        named = [p for p in ports if p.get("name") == PORT_NAME]
        chosen = (named or ports or [{}])[0]
        port = chosen.get("port") or DEFAULT_PORT
        for ep in s.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            if conditions.get("ready") is False:
                continue
            for address in (ep.get("addresses") or [])[:1]:
                urls.add(_url(str(address), int(port)))
    return sorted(urls)


def kube_api_client() -> Any:
    """A client with in-cluster credentials in a pod, else the kubeconfig's (discovery and scaling share it)."""
    # Imported here: only a router that discovers replicas in Kubernetes needs the client.
    import kubernetes

    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=config, persist_config=False
        )
    return kubernetes.client.ApiClient(config)


class KubeDiscovery:
    def __init__(self, service: str, namespace: str, interval_s: float) -> None:
        self.service = service
        self.namespace = namespace
        self.interval_s = interval_s
        self._api: Any = None

    def _client(self) -> Any:
        if self._api is None:
            import kubernetes

            self._api = kubernetes.client.DiscoveryV1Api(kube_api_client())
        return self._api

    def list_urls(self) -> list[str]:
        response = self._client().list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
            _preload_content=False,
        )
        items = json.loads(response.data).get("items") or []
        return endpoint_urls(items, self.service)

    async def run(self, update: Update) -> None:
        last: list[str] | None = None
        while True:
            try:
                urls = await asyncio.to_thread(self.list_urls)
            except Exception as e:
                # Keep routing to the last known replicas: an API server hiccup is no reason to stop serving.
                logger.warning("listing EndpointSlices of %s/%s failed: %s", self.namespace, self.service, e)
            else:
                if urls != last:
                    logger.info(
                        "service %s/%s: %d ready endpoint(s)", self.namespace, self.service, len(urls)
                    )
                    last = urls
                update(urls)
            await asyncio.sleep(self.interval_s)
