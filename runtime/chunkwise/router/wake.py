"""Scale from zero: hold requests while no replica is ready, and ask for one through the service's /scale.

A router started with `--wake-inference-service NAME` keeps answering while its InferenceService has no
replica: a request is held (at most `queue_limit` at once, each at most `wait_s`) while the router raises
the InferenceService's /scale from 0 to 1, and goes on as soon as a replica is ready. Past either bound
the client gets a 503 with Retry-After. A held streaming request gets its 200 at once and SSE comments
every `keepalive_s`, so that clients and proxies with idle timeouts keep the connection through a cold start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("chunkwise.router")

# The InferenceService's API (the operator's CRD, crds/inferenceservice.yaml; a contract test holds them).
GROUP, VERSION, PLURAL = "serving.chunkwise.dev", "v1alpha1", "inferenceservices"
# How often a held request looks for a ready replica, and asks for one again (a scale to zero decided
# while requests were held, or a failed patch, is undone by the next ask).
POLL_S = 0.1
ASK_INTERVAL_S = 5.0
# What a 503 past the queue or the wait tells the client: a cold start takes seconds at the least.
WAKE_RETRY_AFTER_S = 10


@dataclass(frozen=True)
class WakeConfig:
    service: str  # the InferenceService whose /scale the router raises
    namespace: str
    queue_limit: int
    wait_s: float
    keepalive_s: float
    retry_after_s: int


class Waker:
    """The held requests' count and the asks for a replica; `ready` says whether one can take a request."""

    def __init__(
        self,
        config: WakeConfig,
        ready: Callable[[], bool],
        scale_up: Callable[[], Awaitable[bool]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.held = 0
        self._ready = ready
        self._scale_up = scale_up
        self._clock = clock
        self._asked_at: float | None = None

    def admit(self) -> bool:
        """Whether one more request may be held."""
        return self.held < self.config.queue_limit

    async def wait(self) -> bool:
        """Hold until a replica is ready (True) or `wait_s` has passed (False)."""
        self.held += 1
        start = self._clock()
        try:
            while not self._ready():
                now = self._clock()
                if now - start >= self.config.wait_s:
                    logger.warning(
                        "no replica ready after %.1f s; %d request(s) held", now - start, self.held
                    )
                    return False
                await self._ask(now)
                await asyncio.sleep(POLL_S)
            waited = self._clock() - start
            if waited > 0:
                logger.info("a replica is ready after %.1f s of holding", waited)
            return True
        finally:
            self.held -= 1

    async def nudge(self) -> None:
        """Ask for a replica without holding a request (the EPP answers the gateway 503 meanwhile)."""
        await self._ask(self._clock())

    async def _ask(self, now: float) -> None:
        if self._asked_at is not None and now - self._asked_at < ASK_INTERVAL_S:
            return
        self._asked_at = now
        try:
            if await self._scale_up():
                logger.info("scaled %s/%s from 0 to 1", self.config.namespace, self.config.service)
        except Exception as e:
            # Asked again at the next interval; meanwhile the requests stay held.
            logger.warning("could not scale %s/%s up: %s", self.config.namespace, self.config.service, e)


class KubeScaler:
    """Raises an InferenceService's /scale from 0 to 1 (never lowers it, never touches a count above 0)."""

    def __init__(self, service: str, namespace: str, api_client: Callable[[], Any]) -> None:
        self.service = service
        self.namespace = namespace
        self._make_client = api_client
        self._client: Any = None

    def scale_up_now(self) -> bool:
        """True if it was at 0 and is now 1."""
        import kubernetes

        if self._client is None:
            self._client = self._make_client()
        api = kubernetes.client.CustomObjectsApi(self._client)
        scale: Any = api.get_namespaced_custom_object_scale(
            GROUP, VERSION, self.namespace, PLURAL, self.service
        )
        if ((scale or {}).get("spec") or {}).get("replicas") != 0:
            return False
        api.patch_namespaced_custom_object_scale(
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            self.service,
            {"spec": {"replicas": 1}},
            _content_type="application/merge-patch+json",
        )
        return True

    async def scale_up(self) -> bool:
        return await asyncio.to_thread(self.scale_up_now)
