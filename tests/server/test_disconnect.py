"""A client that goes away aborts its request: the engine frees its KV blocks within a step."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import MODEL, LiveServer, start_server, wait_for

# Long enough that only an abort can end it while the test watches (ignore_eos: no early stop). The shared
# server's 512-token context was not: the tiny model writes 480 tokens in well under a second, and on a loaded
# CI machine the client read its second event after the request had finished.
MAX_MODEL_LEN = 8192
LONG = {
    "model": MODEL,
    "prompt": "Keep talking",
    "max_tokens": MAX_MODEL_LEN - 64,
    "ignore_eos": True,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    # Enough blocks for one request at the full context (16-token blocks), so admission never sheds it.
    server = start_server(
        {"max_model_len": MAX_MODEL_LEN, "num_blocks": MAX_MODEL_LEN // 16 + 8}, max_waiting=64
    )
    yield server
    server.stop()


def scrape(live: LiveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{live.url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def abort_count(live: LiveServer) -> float:
    key = ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))
    return scrape(live)[key]


def engine_idle(live: LiveServer) -> bool:
    core = live.engine.core
    return live.engine.num_unfinished == 0 and core.kv.num_free_blocks == core.num_blocks


def assert_idle_in_metrics(live: LiveServer) -> None:
    m = scrape(live)
    labels = (("model_name", MODEL),)
    assert m[("vllm:num_requests_running", labels)] == 0
    assert m[("vllm:num_requests_waiting", labels)] == 0
    assert m[("vllm:kv_cache_usage_perc", labels)] == 0


def test_stream_disconnect_aborts_and_frees_blocks(live: LiveServer) -> None:
    wait_for(lambda: engine_idle(live))
    before = abort_count(live)
    with (
        httpx.Client(base_url=live.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status_code == 200
        events: list[str] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 2:
                    break
        # Mid-generation: the request holds KV blocks now.
        assert live.engine.num_unfinished == 1, events
        assert live.engine.core.kv.num_free_blocks < live.engine.core.num_blocks
    # Leaving the block closed the connection.
    wait_for(lambda: engine_idle(live))
    wait_for(lambda: abort_count(live) == before + 1)
    assert_idle_in_metrics(live)


def test_non_streaming_disconnect_aborts(live: LiveServer) -> None:
    wait_for(lambda: engine_idle(live))
    before = abort_count(live)
    host, port = live.url.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        # Running in the engine, holding blocks; then the client hangs up without reading the answer.
        wait_for(lambda: live.engine.num_unfinished == 1)
        wait_for(lambda: live.engine.core.kv.num_free_blocks < live.engine.core.num_blocks)
    wait_for(lambda: engine_idle(live))
    wait_for(lambda: abort_count(live) == before + 1)
    assert_idle_in_metrics(live)
