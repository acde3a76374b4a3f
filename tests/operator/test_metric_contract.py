"""The operator reads the engine's and the router's metrics by name without importing the engine (its image
needs no torch); each name it reads must be one the engine owns in chunkwise.metric_names (issue 32)."""

from __future__ import annotations

from chunkwise import metric_names
from chunkwise_operator import prometheus, scrape


def metric_constants(module: object) -> dict[str, str]:
    return {
        k: v
        for k, v in vars(module).items()
        if k.isupper() and isinstance(v, str) and v.startswith(("vllm:", "chunkwise:"))
    }


def test_every_name_the_operator_reads_is_one_the_engine_or_router_exports() -> None:
    owned = set(metric_constants(metric_names).values())
    read = metric_constants(scrape)
    assert set(read) >= {"WAITING", "RUNNING", "FINISHED", "KV", "PREEMPTIONS", "STEP", "HELD"}
    assert {k: v for k, v in read.items() if v not in owned} == {}


def test_the_prometheus_queries_use_those_names() -> None:
    queries = " ".join(prometheus.queries("ns", "svc").values())
    for name in (scrape.WAITING, scrape.RUNNING, scrape.FINISHED, scrape.KV, scrape.PREEMPTIONS, scrape.STEP):
        assert name in queries
