"""The autoscaler's signals from Prometheus: the queries and answers (pure), then the real Kopf operator on
kmock scaling from a Prometheus HTTP API that serves the answers a test sets, with no pod to scrape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from operator_harness import Cluster, HttpStub, Operator, eventually

from chunkwise_operator import prometheus
from chunkwise_operator.autoscale import KV_USAGE, P99_STEP_TIME, PREEMPTION_RATE, QUEUE_DEPTH
from chunkwise_operator.main import AUTOSCALER_INTERVAL_ENV, PROMETHEUS_URL_ENV


def vector(value: float | None) -> dict[str, Any]:
    result = [] if value is None else [{"metric": {}, "value": [1700000000.0, repr(value)]}]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def test_queries_select_one_service_by_the_service_monitor_label() -> None:
    q = prometheus.queries("ml", "chat")
    sel = 'namespace="ml",serving_chunkwise_dev_inferenceservice="chat"'
    assert q[prometheus.REPORTING] == f"count(vllm:num_requests_waiting{{{sel}}})"
    assert q[QUEUE_DEPTH] == f"sum(vllm:num_requests_waiting{{{sel}}})"
    assert q[PREEMPTION_RATE] == f"sum(rate(vllm:num_preemptions_total{{{sel}}}[1m]))"
    assert q[P99_STEP_TIME] == (
        f"histogram_quantile(0.99, sum by (le) (rate(chunkwise:step_duration_seconds_bucket{{{sel}}}[1m])))"
    )
    assert q[KV_USAGE] == f"sum(vllm:kv_cache_usage_perc{{{sel}}})"
    # The routers' series, from the chunkwise-router ServiceMonitor, carry the same label.
    assert q[prometheus.HELD_REQUESTS] == f"sum(chunkwise:router_held_requests{{{sel}}})"
    # A name is quoted as PromQL wants, whatever it holds.
    assert 'serving_chunkwise_dev_inferenceservice="a\\"b"' in prometheus.queries("ml", 'a"b')[QUEUE_DEPTH]


def test_answers_become_per_replica_signals() -> None:
    assert prometheus.scalar(vector(2.5)) == 2.5
    assert prometheus.scalar(vector(None)) is None
    assert prometheus.scalar(vector(float("nan"))) is None
    with pytest.raises(ValueError, match="bad_data: parse error"):
        prometheus.scalar({"status": "error", "errorType": "bad_data", "error": "parse error"})
    # 2 pods report for a spec of 4 replicas: extensive signals divide by 4 (the starting pods count idle).
    seen = prometheus.observed(
        {prometheus.REPORTING: 2, QUEUE_DEPTH: 12.0, PREEMPTION_RATE: 2.0, P99_STEP_TIME: 0.3, KV_USAGE: 1.2},
        replicas=4,
    )
    assert seen.ready_replicas == 2
    assert seen.values == {QUEUE_DEPTH: 3.0, PREEMPTION_RATE: 0.5, P99_STEP_TIME: 0.3, KV_USAGE: 0.3}
    # No pod reports: no signal at all, whatever stale series say.
    none = prometheus.observed({prometheus.REPORTING: None, QUEUE_DEPTH: 5.0}, replicas=1)
    assert none.ready_replicas == 0 and set(none.values.values()) == {None}


def test_requests_held_at_the_router_count_as_waiting() -> None:
    # Issue 31, point 3: at zero replicas nothing reports, but 5 requests wait at the router; over one replica.
    cold = prometheus.observed({prometheus.REPORTING: None, prometheus.HELD_REQUESTS: 5.0}, replicas=0)
    assert cold.values[QUEUE_DEPTH] == 5.0 and cold.requests == 5.0 and cold.ready_replicas == 0
    # With replicas reporting, the held join their queue and the requests, like scrape.signals.
    warm = prometheus.observed(
        {
            prometheus.REPORTING: 2,
            QUEUE_DEPTH: 2.0,
            prometheus.REQUESTS: 3.0,
            prometheus.HELD_REQUESTS: 2.0,
        },
        replicas=2,
    )
    assert warm.values[QUEUE_DEPTH] == 2.0 and warm.requests == 5.0


class FakePrometheus(HttpStub):
    """Prometheus's instant-query API, answering by the metric each query names (as the test sets it)."""

    def __init__(self) -> None:
        self.answers: dict[str, float | None] = {}
        self.queries: list[str] = []
        super().__init__(self._query)

    def _query(self, path: str) -> tuple[int, str, bytes]:
        url = urlparse(path)
        (query,) = parse_qs(url.query)["query"]
        self.queries.append(query)
        value = next((v for k, v in self.answers.items() if query.startswith(k)), None)
        return (
            200 if url.path == "/api/v1/query" else 404,
            "application/json",
            json.dumps(vector(value)).encode(),
        )


@pytest.fixture
def prom(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePrometheus]:
    server = FakePrometheus()
    # Read by the operator's start-up handler: the fixture must come before `operator` in a test's arguments.
    monkeypatch.setenv(PROMETHEUS_URL_ENV, server.url)
    monkeypatch.setenv(AUTOSCALER_INTERVAL_ENV, "0.2")
    yield server
    server.close()


async def test_the_autoscaler_scales_from_prometheus_without_scraping_pods(
    prom: FakePrometheus, cluster: Cluster, operator: Operator
) -> None:
    prom.answers = {"count(vllm:num_requests_waiting": 1, "sum(vllm:num_requests_waiting": 6.0}
    spec = {
        "model": {"preset": "tiny"},
        "image": "chunkwise:dev",
        "autoscaling": {"enabled": True, "maxReplicas": 4, "targets": {"queueDepthPerReplica": 2}},
    }
    await cluster.create_isvc("chat", spec)
    # 6 waiting on 1 replica against 2: ceil(1 x 3) = 3. There is no pod object at all.
    await eventually(lambda: (cluster.isvc("chat") or {})["spec"].get("replicas") == 3, what="scaled to 3")
    assert any('serving_chunkwise_dev_inferenceservice="chat"' in q for q in prom.queries)
    assert operator.failures() == []


async def test_from_zero_prometheus_mode_goes_straight_to_what_the_held_requests_need(
    prom: FakePrometheus, cluster: Cluster, operator: Operator
) -> None:
    # Issue 31, point 3, in --prometheus-url mode: 5 requests held at the router and no replica, target 2 per
    # replica: 0 -> 3 at once (it went 0 -> 1, then paid a second cold start).
    prom.answers = {"sum(chunkwise:router_held_requests": 5.0}
    spec = {
        "model": {"preset": "tiny"},
        "image": "chunkwise:dev",
        "replicas": 0,
        "router": {"enabled": True},
        "autoscaling": {
            "enabled": True,
            "minReplicas": 0,
            "maxReplicas": 4,
            "targets": {"queueDepthPerReplica": 2},
        },
    }
    await cluster.create_isvc("chat", spec)
    await eventually(lambda: (cluster.isvc("chat") or {})["spec"].get("replicas") == 3, what="scaled to 3")
    assert operator.failures() == []
