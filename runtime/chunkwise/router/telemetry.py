"""The router's own /metrics, in a registry of its own (several routers can live in one test process).

Per-replica state (health, requests in flight, learned speed) is read at scrape time by a collector, so
replicas that come and go never leave stale series behind; counters carry the replica's URL as a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chunkwise import metric_names
from chunkwise.router.replica import Replica

TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _ReplicaCollector(Collector):
    def __init__(self, source: Callable[[], Sequence[Replica]], clock: Callable[[], float]) -> None:
        self.source = source
        self.clock = clock

    def collect(self) -> Iterable[Metric]:
        now = self.clock()
        healthy = GaugeMetricFamily(
            "chunkwise:router_replica_healthy",
            "1 when the replica takes requests (listed, healthy, not ejected).",
            labels=["replica"],
        )
        inflight = GaugeMetricFamily(
            "chunkwise:router_replica_inflight",
            "Requests the router has in flight there.",
            labels=["replica"],
        )
        rate = GaugeMetricFamily(
            "chunkwise:router_replica_prefill_rate_tokens_per_second",
            "Learned prefill rate (0: not measured yet).",
            labels=["replica"],
        )
        tpot = GaugeMetricFamily(
            "chunkwise:router_replica_tpot_seconds",
            "Measured time per output token (0: not measured yet).",
            labels=["replica"],
        )
        blocks = GaugeMetricFamily(
            "chunkwise:router_replica_prefix_index_blocks",
            "Blocks the router believes the replica caches.",
            labels=["replica"],
        )
        for r in self.source():
            healthy.add_metric([r.url], 1.0 if r.candidate(now) else 0.0)
            inflight.add_metric([r.url], len(r.inflight))
            rate.add_metric([r.url], r.estimates.prefill_rate or 0.0)
            tpot.add_metric([r.url], r.estimates.tpot or 0.0)
            blocks.add_metric([r.url], len(r.index))
        yield from (healthy, inflight, rate, tpot, blocks)


class RouterMetrics:
    def __init__(
        self, policy: str, replicas: Callable[[], Sequence[Replica]], clock: Callable[[], float]
    ) -> None:
        self.policy = policy
        r = self.registry = CollectorRegistry()
        self.picks = Counter(
            "chunkwise:router_picks", "Requests sent to each replica.", ["replica", "policy"], registry=r
        )
        self.responses = Counter(
            "chunkwise:router_responses", "Answers given, by HTTP status code.", ["code"], registry=r
        )
        self.retries = Counter(
            "chunkwise:router_retries",
            "Requests tried again on another replica, by cause.",
            ["reason"],
            registry=r,
        )
        self.ejections = Counter(
            "chunkwise:router_ejections",
            "Times a replica was taken out of rotation, by cause.",
            ["replica", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "chunkwise:router_prompt_tokens", "Prompt tokens of routed requests.", registry=r
        )
        self.predicted_cached_tokens = Counter(
            "chunkwise:router_predicted_cached_tokens",
            "Prompt tokens the prefix index expected the chosen replica to have cached.",
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "chunkwise:router_predicted_ttft_seconds",
            "Predicted time to first token at the chosen replica.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.observed_ttft = Histogram(
            "chunkwise:router_observed_ttft_seconds",
            "Time to the first streamed chunk, as the router saw it (streaming requests only).",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.ttft_error = Histogram(
            "chunkwise:router_ttft_prediction_error_seconds",
            "|observed - predicted| time to first token (streaming requests only).",
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.slo_redirects = Counter(
            "chunkwise:router_slo_redirects",
            "Requests with latency targets sent elsewhere than the policy chose, to meet them.",
            registry=r,
        )
        self.slo_best_effort = Counter(
            "chunkwise:router_slo_best_effort",
            "Requests no replica was predicted to serve within their targets, sent anyway (not sheddable).",
            registry=r,
        )
        self.shed = Counter(
            "chunkwise:router_shed",
            "Sheddable requests refused (429): no replica was predicted to meet their targets.",
            registry=r,
        )
        self.epp_streams = Counter(
            "chunkwise:router_epp_streams",
            "ext_proc streams from the gateway, by outcome (routed, shed, unavailable, bad_request, ...).",
            ["outcome"],
            registry=r,
        )
        # The operator reads it to scale from zero straight to what the held demand needs (not 0 -> 1 only).
        self.held = Gauge(
            metric_names.ROUTER_HELD_REQUESTS,
            "Requests held while no replica is ready (scale from zero); 0 when the router wakes nothing.",
            registry=r,
        )
        r.register(_ReplicaCollector(replicas, clock))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
