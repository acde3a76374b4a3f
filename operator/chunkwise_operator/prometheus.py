"""The autoscaler's signals read from Prometheus instead of scraping the pods (`--prometheus-url`).

For clusters where the operator may not reach pod IPs but Prometheus already scrapes them (through
manifests/monitoring/servicemonitor.yaml, which labels every series with the InferenceService's name). The
signals mean what scrape.signals computes: extensive ones divided by max(spec.replicas, pods reporting), the
preemption rate and p99 step time over RATE_WINDOW, and the requests the routers hold (read from their own
ServiceMonitor, chunkwise-router) joining the queue, so that from zero the count goes straight to what they need.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Mapping
from typing import Any

import httpx

from chunkwise_operator import manifests
from chunkwise_operator.autoscale import KV_USAGE, P99_STEP_TIME, PREEMPTION_RATE, QUEUE_DEPTH, Observed
from chunkwise_operator.scrape import (
    FINISHED,
    HELD,
    KV,
    PREEMPTIONS,
    RUNNING,
    SCRAPE_TIMEOUT_S,
    STEP,
    WAITING,
)

# Two scrape intervals of the ServiceMonitor (15 s) and more: rate() needs two samples in its window.
RATE_WINDOW = "1m"
REPORTING = "reporting"
REQUESTS = "requests"
HELD_REQUESTS = "held"
# The label Prometheus gives the ServiceMonitor's targetLabels entry (non-identifier characters become _).
SERVICE_LABEL = re.sub(r"[^a-zA-Z0-9_]", "_", manifests.LABEL_SERVICE)


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def queries(namespace: str, name: str) -> dict[str, str]:
    """PromQL for each signal of one InferenceService, and for how many of its pods report at all."""
    sel = f"namespace={_quote(namespace)},{SERVICE_LABEL}={_quote(name)}"
    return {
        REPORTING: f"count({WAITING}{{{sel}}})",
        QUEUE_DEPTH: f"sum({WAITING}{{{sel}}})",
        PREEMPTION_RATE: f"sum(rate({PREEMPTIONS}{{{sel}}}[{RATE_WINDOW}]))",
        P99_STEP_TIME: f"histogram_quantile(0.99, sum by (le) (rate({STEP}_bucket{{{sel}}}[{RATE_WINDOW}])))",
        KV_USAGE: f"sum({KV}{{{sel}}})",
        REQUESTS: f"sum({WAITING}{{{sel}}}) + sum({RUNNING}{{{sel}}}) + sum(increase({FINISHED}{{{sel}}}[{RATE_WINDOW}]))",
        HELD_REQUESTS: f"sum({HELD}{{{sel}}})",
    }


def scalar(response: Mapping[str, Any]) -> float | None:
    """The one value of an instant-vector answer; None for no series (or NaN: a histogram with no steps)."""
    if response.get("status") != "success":
        raise ValueError(f"Prometheus answered {response.get('errorType')}: {response.get('error')}")
    result = (response.get("data") or {}).get("result") or []
    if not result:
        return None
    value = float(result[0]["value"][1])
    return value if math.isfinite(value) else None


def observed(values: Mapping[str, float | None], replicas: int) -> Observed:
    """The signals as scrape.signals makes them: the routers' held requests count as waiting (and as requests),
    with no replica reporting as well (over one replica at zero)."""
    reporting = int(values.get(REPORTING) or 0)
    divisor = max(replicas, reporting, 1)
    held = values.get(HELD_REQUESTS) or 0.0
    per_replica = {QUEUE_DEPTH, PREEMPTION_RATE, KV_USAGE}
    result: dict[str, float | None] = {}
    for metric in (QUEUE_DEPTH, PREEMPTION_RATE, P99_STEP_TIME, KV_USAGE):
        value = values.get(metric) if reporting else None
        if metric == QUEUE_DEPTH and held:
            value = (value or 0.0) + held
        result[metric] = value / divisor if value is not None and metric in per_replica else value
    requests = values.get(REQUESTS) if reporting else None
    if held:
        requests = (requests or 0.0) + held
    return Observed(result, ready_replicas=reporting, requests=requests)


async def observe(client: httpx.AsyncClient, url: str, namespace: str, name: str, replicas: int) -> Observed:
    """One instant query per signal; an unreachable or failing Prometheus raises (httpx.HTTPError, ValueError)."""
    endpoint = url.rstrip("/") + "/api/v1/query"

    async def one(query: str) -> float | None:
        resp = await client.get(endpoint, params={"query": query}, timeout=SCRAPE_TIMEOUT_S)
        resp.raise_for_status()
        return scalar(resp.json())

    wanted = queries(namespace, name)
    answers = await asyncio.gather(*(one(q) for q in wanted.values()))
    return observed(dict(zip(wanted, answers)), replicas)
