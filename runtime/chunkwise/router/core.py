"""The router's state and decisions, apart from HTTP: the replica set, picks, ejection and the poller.

Everything here runs on one event loop; `pick` has no await in it, so the accounting of one pick is in
place before the next pick looks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

from chunkwise.router.cost import CostModel, Prediction
from chunkwise.router.estimates import parse_metrics
from chunkwise.router.policies import Policy, make_policy
from chunkwise.router.prompt import RoutedRequest
from chunkwise.router.replica import InFlight, Replica
from chunkwise.router.slo import Shed, Slo, retry_after
from chunkwise.router.telemetry import RouterMetrics

logger = logging.getLogger("chunkwise.router")

# A probe slower than this counts as a failure: a replica that cannot answer /health in time will not
# serve a request in time either.
PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Pick:
    replica: Replica
    request: InFlight
    prediction: Prediction


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


class Router:
    def __init__(
        self,
        *,
        policy: str,
        cost: CostModel,
        client: httpx.AsyncClient,
        poll_interval_s: float = 0.5,
        index_capacity_blocks: int = 65536,
        clock: Callable[[], float] = time.monotonic,
        kv_events: bool = True,
    ) -> None:
        self.cost = cost
        self.client = client
        self.poll_interval_s = poll_interval_s
        self.index_capacity_blocks = index_capacity_blocks
        self.clock = clock
        self.kv_events = kv_events
        self.replicas: dict[str, Replica] = {}
        cost.bind(self.replicas.values)
        self.policy: Policy = make_policy(policy, cost)
        self.metrics = RouterMetrics(self.policy.name, lambda: list(self.replicas.values()), clock)
        self._probing: set[str] = set()
        self._probes: set[asyncio.Task[None]] = set()
        self._any = itertools.count()

    # -- the replica set -----------------------------------------------------------------------------------
    def set_replicas(self, urls: Iterable[str]) -> None:
        """Discovery's view: new URLs join, missing ones stop taking requests and go once idle."""
        wanted = {normalize_url(u) for u in urls}
        for url in wanted - self.replicas.keys():
            self.replicas[url] = Replica(url, self.index_capacity_blocks)
            logger.info("replica %s joined", url)
        for url, replica in list(self.replicas.items()):
            replica.listed = url in wanted
            if not replica.listed and not replica.inflight:
                del self.replicas[url]
                logger.info("replica %s left", url)

    def candidates(self, now: float, exclude: Iterable[str] = ()) -> list[Replica]:
        skip = set(exclude)
        return sorted(
            (r for r in self.replicas.values() if r.candidate(now) and r.url not in skip), key=lambda r: r.url
        )

    def ready(self) -> bool:
        now = self.clock()
        return any(r.healthy and r.candidate(now) for r in self.replicas.values())

    def any_candidate(self, exclude: Iterable[str] = ()) -> Replica | None:
        """For requests that need no routing decision (/v1/models): each candidate in turn."""
        cands = self.candidates(self.clock(), exclude)
        return cands[next(self._any) % len(cands)] if cands else None

    # -- picks ---------------------------------------------------------------------------------------------
    def pick(
        self, request: RoutedRequest, exclude: Iterable[str] = (), slo: Slo | None = None
    ) -> Pick | None:
        """The policy's replica for this request, its accounting begun; None when no replica can take it.
        With targets (`slo`), a replica predicted to meet them instead when the policy's does not; raises
        Shed when none does and the request is sheddable."""
        now = self.clock()
        cands = self.candidates(now, exclude)
        if not cands:
            return None
        replica = self.policy.choose(request, cands, now)
        prediction = self.cost.predict(replica, request, now)
        if slo is not None:
            replica, prediction = self._within(slo, request, cands, replica, prediction, now)
        entry = InFlight(
            prompt_tokens=request.prompt_tokens,
            uncached_tokens=request.prompt_tokens - prediction.cached_tokens,
            output_tokens=request.output_tokens,
            streaming=request.stream,
            started_at=now,
            predicted_ttft=prediction.ttft,
            predicted_completion=prediction.completion,
        )
        replica.begin(entry, request.block_hashes)
        self.cost.observe_request(entry.uncached_tokens, request.output_tokens)
        m = self.metrics
        m.picks.labels(replica.url, self.policy.name).inc()
        m.prompt_tokens.inc(request.prompt_tokens)
        m.predicted_cached_tokens.inc(prediction.cached_tokens)
        m.predicted_ttft.observe(prediction.ttft)
        return Pick(replica, entry, prediction)

    def _within(
        self,
        slo: Slo,
        request: RoutedRequest,
        cands: list[Replica],
        chosen: Replica,
        prediction: Prediction,
        now: float,
    ) -> tuple[Replica, Prediction]:
        def meets(p: Prediction) -> bool:
            return slo.met_by(p.ttft, p.decode_s / max(1, request.output_tokens))

        if meets(prediction):
            return chosen, prediction
        predictions = {r.url: self.cost.predict(r, request, now) for r in cands}
        fits = [r for r in cands if meets(predictions[r.url])]
        if fits:
            best = min(fits, key=lambda r: predictions[r.url].completion)
            self.metrics.slo_redirects.inc()
            return best, predictions[best.url]
        if slo.sheddable:
            self.metrics.shed.inc()
            soonest = min(predictions.values(), key=lambda p: p.ttft)
            raise Shed(
                retry_after([p.queue_s for p in predictions.values()]),
                f"no replica is predicted to meet this request's targets (best predicted TTFT "
                f"{soonest.ttft * 1000:.0f} ms, TPOT {soonest.decode_s / max(1, request.output_tokens) * 1000:.0f} ms)",
            )
        self.metrics.slo_best_effort.inc()
        return chosen, prediction

    def first_token(self, pick: Pick) -> None:
        now = self.clock()
        pick.replica.first_token(pick.request, now)
        observed = now - pick.request.started_at
        self.metrics.observed_ttft.observe(observed)
        self.metrics.ttft_error.observe(abs(observed - pick.prediction.ttft))

    def move(self, pick: Pick, replica: Replica) -> Pick:
        """The request went to `replica` after all (a gateway's fallback): its accounting moves there."""
        self.finish(pick)
        replica.begin(pick.request, pick.request.block_hashes)
        return Pick(replica, pick.request, pick.prediction)

    def finish(self, pick: Pick) -> None:
        pick.replica.end(pick.request)
        if not pick.replica.listed and not pick.replica.inflight:
            self.replicas.pop(pick.replica.url, None)

    def eject(self, replica: Replica, reason: str, *, reachable: bool = False) -> None:
        """Out of rotation until a probe finds it healthy; `reachable`: it answered, just not ready."""
        if replica.healthy is not False:
            logger.warning("replica %s ejected (%s)", replica.url, reason)
            self.metrics.ejections.labels(replica.url, reason).inc()
        replica.eject(self.clock(), self.poll_interval_s, reachable=reachable)

    # -- the poller ----------------------------------------------------------------------------------------
    async def poll_forever(self) -> None:
        while True:
            self.poll_once()
            await asyncio.sleep(self.poll_interval_s)

    def poll_once(self) -> None:
        """Start a probe of every replica that is due (ejected ones wait out their backoff)."""
        now = self.clock()
        for replica in list(self.replicas.values()):
            if replica.listed and not replica.ejected(now) and replica.url not in self._probing:
                self._probing.add(replica.url)
                task = asyncio.ensure_future(self._probe(replica))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def probe_all(self) -> None:
        """Probe every listed replica now and wait for the answers (start-up, tests)."""
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values()) if r.listed))

    async def _probe(self, replica: Replica) -> None:
        try:
            health = await self.client.get(replica.url + "/health", timeout=PROBE_TIMEOUT_S)
            if health.status_code != 200:
                self.eject(replica, f"health {health.status_code}", reachable=True)
                return
            scrape = await self.client.get(replica.url + "/metrics", timeout=PROBE_TIMEOUT_S)
            if scrape.status_code == 200:
                replica.observe(parse_metrics(scrape.text, self.clock()), self.clock())
            if self.kv_events:
                await replica.read_kv_events(self.client, PROBE_TIMEOUT_S)
            if replica.healthy is not True:
                logger.info("replica %s healthy", replica.url)
            replica.recovered()
        except httpx.HTTPError as e:
            self.eject(replica, type(e).__name__)
        except ValueError as e:
            logger.warning("replica %s: unreadable /metrics: %s", replica.url, e)
        finally:
            self._probing.discard(replica.url)

    async def close(self) -> None:
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
