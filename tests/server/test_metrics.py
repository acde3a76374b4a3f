"""Prometheus metrics: the contracted names exactly, per-app registries, values from the step loop."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from chunkwise.engine import StepStats
from chunkwise.engine.datatypes.outputs import CompletionOutput, RequestOutput
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.loop.metrics import EngineMetrics
from chunkwise.engine.sched.output import SchedulerStats
from chunkwise.metric_names import CONTRACT_NAMES
from tests.server.harness import MODEL, LiveServer, wait_for

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def exposes(names: dict[str, object], name: str) -> bool:
    return name in names or all(name + suffix in names for suffix in HISTOGRAM_SUFFIXES)


def value(text: str, name: str, **labels: str) -> float:
    want = tuple(sorted({"model_name": "m", **labels}.items()))
    return samples(text)[name][want]


def test_every_contracted_name_is_exposed_exactly(live: LiveServer) -> None:
    r = httpx.get(f"{live.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = samples(r.text)
    missing = [n for n in CONTRACT_NAMES if not exposes(names, n)]
    assert not missing
    # Counters carry the contract's own `_total` name, not a doubled `_total_total`.
    assert not [n for n in names if n.endswith("_total_total")]
    for counter in (
        "vllm:request_success_total",
        "chunkwise:admission_rejections_total",
        "vllm:prompt_tokens_total",
        "chunkwise:preemption_fallbacks_total",
    ):
        assert counter in names
    # Step duration is a histogram fine enough for a p99: buckets from 1 ms to 5 s.
    buckets = {float(dict(labels)["le"]) for labels in names["chunkwise:step_duration_seconds_bucket"]}
    assert min(buckets) == 0.001 and 5.0 in buckets and len(buckets) >= 20
    assert {dict(k)["mode"] for k in names["chunkwise:preemptions_total"]} == {"swap", "recompute"}
    assert {dict(k)["reason"] for k in names["chunkwise:admission_rejections_total"]} == {"queue_full", "slo"}
    assert all(dict(k)["model_name"] == MODEL for k in names["vllm:num_requests_running"])
    # vLLM's cache info metric, which the router reads the KV capacity from.
    [info] = names["vllm:cache_config_info"]
    assert dict(info)["num_gpu_blocks"] == str(live.engine.core.num_blocks)
    assert dict(info)["block_size"] == str(live.engine.core.config.cache.block_size)


def test_step_loop_updates_the_metrics(live: LiveServer) -> None:
    def scrape() -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        return samples(httpx.get(f"{live.url}/metrics").text)

    key = (("model_name", MODEL),)
    before = scrape()
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0) as client:
        client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0)

    def counted() -> bool:
        after = scrape()
        length = (("finished_reason", "length"), ("model_name", MODEL))
        return (
            after["vllm:request_success_total"][length] == before["vllm:request_success_total"][length] + 1
            and after["vllm:generation_tokens_total"][key] == before["vllm:generation_tokens_total"][key] + 5
            and after["vllm:prompt_tokens_total"][key]
            == before["vllm:prompt_tokens_total"][key] + 1 + len(b"count me")
            and after["vllm:e2e_request_latency_seconds_count"][key]
            == before["vllm:e2e_request_latency_seconds_count"][key] + 1
        )

    wait_for(counted)
    after = scrape()
    assert (
        after["chunkwise:step_duration_seconds_count"][key]
        >= before["chunkwise:step_duration_seconds_count"][key] + 5
    )
    assert (
        after["vllm:time_to_first_token_seconds_count"][key]
        == before["vllm:time_to_first_token_seconds_count"][key] + 1
    )
    assert (
        after["vllm:inter_token_latency_seconds_count"][key]
        >= before["vllm:inter_token_latency_seconds_count"][key] + 4
    )
    assert after["vllm:prefix_cache_queries_total"][key] > before["vllm:prefix_cache_queries_total"][key]


def _request(rid: str, arrival: float, scheduled: float, finished: float, reason: str) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(), arrival_time=arrival, max_tokens=4)
    req.first_scheduled_time = scheduled
    req.finished_time = finished
    req.finish_reason = reason
    return req


def _output(rid: str, tokens: list[int], finished: bool, arrival: float, first: float) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        outputs=[CompletionOutput(0, "x" * len(tokens), tokens, "length" if finished else None)],
        finished=finished,
        arrival_time=arrival,
        first_token_time=first,
    )


def test_engine_metrics_from_step_records() -> None:
    stats = SchedulerStats(num_running=2, num_waiting=3, kv_usage=0.25, num_preemptions_swap=1)
    stats.num_preemptions_recompute = 2
    stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, stats.spec_draft_length = 40, 30, 4
    m = EngineMetrics("m", stats_source=lambda: stats)
    step = StepStats(0.004, 0.0001, 0.003, num_batched_tokens=12, num_prefill_tokens=10, num_decode_rows=2)
    m.on_step(step, [_output("a", [7], False, 0.0, 0.5)], [])
    m.on_step(step, [_output("a", [8, 9], True, 0.0, 0.5)], [_request("a", 0.0, 0.25, 1.0, "length")])
    m.record_rejection("slo")
    text = m.exposition().decode()
    assert value(text, "vllm:num_requests_running") == 2
    assert value(text, "vllm:num_requests_waiting") == 3
    assert value(text, "vllm:kv_cache_usage_perc") == 0.25
    assert value(text, "vllm:num_preemptions_total") == 3
    assert value(text, "chunkwise:preemptions_total", mode="swap") == 1
    assert value(text, "chunkwise:preemptions_total", mode="recompute") == 2
    assert value(text, "vllm:spec_decode_num_draft_tokens_total") == 40
    assert value(text, "vllm:spec_decode_num_accepted_tokens_total") == 30
    assert value(text, "chunkwise:spec_draft_length") == 4
    assert value(text, "vllm:prompt_tokens_total") == 3  # counted once, at the first token
    assert value(text, "vllm:generation_tokens_total") == 3
    assert value(text, "vllm:time_to_first_token_seconds_sum") == 0.5
    assert value(text, "vllm:inter_token_latency_seconds_count") == 2
    assert value(text, "vllm:request_queue_time_seconds_sum") == 0.25
    assert value(text, "vllm:e2e_request_latency_seconds_sum") == 1.0
    assert value(text, "vllm:request_success_total", finished_reason="length") == 1
    assert value(text, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(text, "chunkwise:step_duration_seconds_count") == 2
    assert value(text, "vllm:iteration_tokens_total_sum") == 24
    assert value(text, "chunkwise:admission_rejections_total", reason="slo") == 1
    assert value(text, "chunkwise:admission_rejections_total", reason="queue_full") == 0


def test_registries_are_per_app() -> None:
    a, b = EngineMetrics("m"), EngineMetrics("m")
    a.record_rejection("queue_full")
    assert value(a.exposition().decode(), "chunkwise:admission_rejections_total", reason="queue_full") == 1
    assert value(b.exposition().decode(), "chunkwise:admission_rejections_total", reason="queue_full") == 0
    # Without an engine (still loading) every name is still exposed, at zero.
    names = samples(b.exposition().decode())
    assert all(exposes(names, n) for n in CONTRACT_NAMES)


def test_a_request_is_counted_by_how_its_output_ended() -> None:
    """A stop string found on the output side ends the output before the scheduler hears of it (its request
    has no finish_reason yet) or after the scheduler ended it by length in the same step: either way the
    client saw "stop", and so do the metrics."""
    m = EngineMetrics("m", stats_source=lambda: SchedulerStats())
    mid_run = _output("mid", [7], True, 0.0, 0.5)
    last_token = _output("last", [8], True, 0.0, 0.5)
    for out in (mid_run, last_token):
        out.outputs[0].finish_reason = "stop"
    untold = _request("mid", 0.0, 0.25, 1.0, "length")
    untold.finish_reason = None
    m.on_step(None, [mid_run, last_token], [untold, _request("last", 0.0, 0.25, 1.0, "length")])
    text = m.exposition().decode()
    assert value(text, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(text, "vllm:request_success_total", finished_reason="length") == 0
    assert value(text, "vllm:request_success_total", finished_reason="abort") == 0


def test_every_engine_name_of_the_one_module_is_exposed(live: LiveServer) -> None:
    """metric_names owns the names the router, the benchmark client and the operator read (issue 32): each of
    the engine's is on a live server's /metrics, so a rename in one place cannot leave a reader behind."""
    from chunkwise import metric_names

    engine_names = [
        v
        for k, v in vars(metric_names).items()
        if k.isupper()
        and isinstance(v, str)
        and not k.startswith("ROUTER_")
        and v not in metric_names.CONDITIONAL
    ]
    names = samples(httpx.get(f"{live.url}/metrics").text)
    assert len(engine_names) > 20
    assert [n for n in engine_names if not exposes(names, n)] == []
