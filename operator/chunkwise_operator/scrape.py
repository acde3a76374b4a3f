"""Reading the runtime pods' /metrics and turning them into the autoscaler's per-replica signals.

The operator parses the Prometheus text itself (prometheus_client's parser), with no code from the
engine: it must run without torch, and it reads replicas only through /metrics and the Kubernetes API.

Signals, over the window between two scrapes of the same pod:
- queue depth: vllm:num_requests_waiting, summed over the ready pods;
- preemption rate: the increase of vllm:num_preemptions_total over the window's length;
- p99 step time: from the increase of chunkwise:step_duration_seconds's buckets, merged over pods,
  interpolated within a bucket as Prometheus' histogram_quantile does;
- KV usage: vllm:kv_cache_usage_perc;
- requests (for scaling to zero only): running and waiting now, plus vllm:request_success_total's increase.
- held: chunkwise:router_held_requests, summed over the ready router pods: requests the router holds while
  no replica is ready. They wait as much as a replica's queue does, so they join the queue depth (and the
  requests): from zero, or from a replica still starting, the count goes straight to what they need.
Extensive signals are divided by the current replica count, not by the pods that answered, so that pods not
ready yet count as idle: HPA's rule, which keeps a scale up from being repeated for pods still starting.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from chunkwise_operator.autoscale import KV_USAGE, P99_STEP_TIME, PREEMPTION_RATE, QUEUE_DEPTH, Observed

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
FINISHED = "vllm:request_success_total"
KV = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
STEP = "chunkwise:step_duration_seconds"
HELD = "chunkwise:router_held_requests"
DEFAULT_PORT = 8000
DEFAULT_PATH = "/metrics"
SCRAPE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Target:
    """A ready runtime pod to scrape."""

    key: str  # the pod's uid: a replacement pod with the same name has fresh counters
    name: str
    url: str


@dataclass(frozen=True)
class PodSample:
    key: str
    time: float
    waiting: float
    kv_usage: float
    preemptions: float
    # Cumulative (upper bound, count) pairs of the step-time histogram, +Inf last.
    step_buckets: tuple[tuple[float, float], ...]
    running: float = 0.0
    finished: float = 0.0

    @property
    def steps(self) -> float:
        return self.step_buckets[-1][1] if self.step_buckets else 0.0


def ready(pod: Mapping[str, Any]) -> bool:
    """A pod the kubelet reports Ready, with an IP, and not being deleted: one to scrape (or to call)."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
        if isinstance(c, Mapping)
    )


def _port(pod: Mapping[str, Any]) -> int:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    port = annotations.get("prometheus.io/port")
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return DEFAULT_PORT


def pod_address(pod: Mapping[str, Any]) -> tuple[str, str, str]:
    """(key: its uid, else its name; its name; its IP as a URL's host, bracketed for IPv6) of a ready pod."""
    meta = pod.get("metadata") or {}
    ip = str(pod["status"]["podIP"])
    host = f"[{ip}]" if ":" in ip else ip
    return str(meta.get("uid") or meta.get("name")), str(meta.get("name")), host


def targets(pods: Iterable[Mapping[str, Any]]) -> list[Target]:
    """The ready pods' metrics URLs (from their Prometheus annotations, as the pod template sets them)."""
    result = []
    for pod in pods:
        if not ready(pod):
            continue
        key, name, host = pod_address(pod)
        path = ((pod.get("metadata") or {}).get("annotations") or {}).get(
            "prometheus.io/path"
        ) or DEFAULT_PATH
        result.append(Target(key, name, f"http://{host}:{_port(pod)}{path}"))
    return sorted(result, key=lambda t: t.name)


# The families parse() reads: the engine exports some 290 lines (latency histograms, token counters), and
# prometheus_client's parser costs about 15 us a line, so the rest is dropped before it is parsed.
READ = (WAITING, RUNNING, "vllm:request_success", KV, "vllm:num_preemptions", STEP)


def only(text: str, families: tuple[str, ...]) -> str:
    """The lines of `families` (their samples, and their # HELP and # TYPE lines) in a /metrics text."""
    kept = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(families):
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse(text: str, key: str, now: float) -> PodSample:
    values: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(only(text, READ)):
        for s in family.samples:
            if s.name == STEP + "_bucket":
                le = float(s.labels.get("le", "nan"))
                if not math.isnan(le):
                    buckets[le] = buckets.get(le, 0.0) + float(s.value)
            else:
                values[s.name] = values.get(s.name, 0.0) + float(s.value)
    return PodSample(
        key=key,
        time=now,
        waiting=values.get(WAITING, 0.0),
        kv_usage=values.get(KV, 0.0),
        preemptions=values.get(PREEMPTIONS, 0.0),
        step_buckets=tuple(sorted(buckets.items())),
        running=values.get(RUNNING, 0.0),
        finished=values.get(FINISHED, 0.0),
    )


async def scrape(
    client: httpx.AsyncClient, pods: Sequence[Target], now: float
) -> tuple[list[PodSample], list[str]]:
    """Samples of the pods that answered, and a line for each that did not.

    All pods at once, so that an evaluation takes as long as the slowest pod (at most SCRAPE_TIMEOUT_S),
    not the sum. Each text is parsed in a worker thread: the event loop is Kopf's, and 50 replicas' texts
    parsed on it in a row would stall every watch and daemon of the operator for that long.
    """

    async def one(t: Target) -> PodSample | str:
        try:
            resp = await client.get(t.url, timeout=SCRAPE_TIMEOUT_S)
            resp.raise_for_status()
            return await asyncio.to_thread(parse, resp.text, t.key, now)
        except (httpx.HTTPError, ValueError) as e:
            return f"{t.name}: {type(e).__name__}: {e}"

    results = await asyncio.gather(*(one(t) for t in pods))
    return [r for r in results if isinstance(r, PodSample)], [r for r in results if isinstance(r, str)]


async def held(client: httpx.AsyncClient, routers: Sequence[Target]) -> float | None:
    """Requests the ready router pods hold, summed; None when no router answered (or none exports it)."""

    async def one(t: Target) -> float | None:
        try:
            resp = await client.get(t.url, timeout=SCRAPE_TIMEOUT_S)
            resp.raise_for_status()
            values = await asyncio.to_thread(_held_values, resp.text)
        except (httpx.HTTPError, ValueError):
            return None
        return sum(values) if values else None

    answers = [a for a in await asyncio.gather(*(one(t) for t in routers)) if a is not None]
    return sum(answers) if answers else None


def _held_values(text: str) -> list[float]:
    return [
        float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == HELD
    ]


def unreachable(failed: Sequence[str]) -> str:
    """Why there are no metrics although pods are ready: what the scrapes met, and the likely cause."""
    return (
        f"{len(failed)} ready pod(s) did not answer /metrics ({failed[0]}"
        + (f"; and {len(failed) - 1} more" if len(failed) > 1 else "")
        + "); if a NetworkPolicy isolates the runtime pods, admit the operator to their port "
        "(manifests/examples/metrics-networkpolicy.yaml)"
    )


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """histogram_quantile over cumulative (le, count) pairs; None when the histogram is empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower  # the top finite bound: all one can say of the +Inf bucket
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _delta_buckets(now: PodSample, before: PodSample) -> list[tuple[float, float]] | None:
    old = dict(before.step_buckets)
    out = []
    for le, count in now.step_buckets:
        d = count - old.get(le, 0.0)
        if d < 0:
            return None  # counters went back: the engine restarted within the window
        out.append((le, d))
    return out


def signals(
    samples: Sequence[PodSample],
    previous: Mapping[str, PodSample],
    replicas: int,
    held: float | None = None,
) -> Observed:
    """The per-replica signals of this scrape, against each pod's previous sample; `held`: requests the
    router holds for want of a ready replica, counted as waiting (at 0 replicas, over one)."""
    divisor = max(replicas, len(samples), 1)
    if not samples:
        queue = held / divisor if held else None
        values = {QUEUE_DEPTH: queue, PREEMPTION_RATE: None, P99_STEP_TIME: None, KV_USAGE: None}
        # The router's count is the fleet's whole activity when no replica is ready: 0 held is an idle fleet
        # (a replica stuck unready must not keep it up), no router reading is no data.
        return Observed(values, 0, requests=held)
    held = held or 0.0
    rate = 0.0
    rated = 0
    merged: dict[float, float] = {}
    requests = held
    for s in samples:
        requests += s.waiting + s.running
        before = previous.get(s.key)
        if before is None or s.time <= before.time:
            continue
        # Finished since the last scrape: requests shorter than the interval leave no other trace.
        requests += max(0.0, s.finished - before.finished)
        d_preempt = s.preemptions - before.preemptions
        deltas = _delta_buckets(s, before)
        if d_preempt < 0 or deltas is None:
            continue
        rated += 1
        rate += d_preempt / (s.time - before.time)
        for le, d in deltas:
            merged[le] = merged.get(le, 0.0) + d
    p99 = quantile(0.99, sorted(merged.items())) if merged else None
    return Observed(
        {
            QUEUE_DEPTH: (sum(s.waiting for s in samples) + held) / divisor,
            PREEMPTION_RATE: rate / divisor if rated else None,
            P99_STEP_TIME: p99,
            KV_USAGE: sum(s.kv_usage for s in samples) / divisor,
        },
        ready_replicas=len(samples),
        requests=requests,
    )
