"""`chunkwise bench serve` against a real `chunkwise serve` process on 127.0.0.1, and its concurrency cap and
its cut against a scripted SSE server on loopback (real HTTP, uvicorn in a thread) that counts what it sees."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from chunkwise.bench.serve import parse_gauges, run_serve
from chunkwise.bench.workloads import WorkItem, arrival_times, long_tailed, with_arrivals
from chunkwise.cli import main

START_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = _free_port()
    cmd = [
        *(sys.executable, "-m", "chunkwise.cli", "serve", "--model", "tiny"),
        *("--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--num-blocks", "256"),
        *("--swap-space-bytes", "0"),
        *("--log-level", "warning"),
    ]
    # One torch thread: the server shares a small machine with the client and the rest of the suite.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"chunkwise serve exited: {proc.stderr.read().decode() if proc.stderr else ''}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chunkwise serve did not become healthy")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_serve_measures_a_real_server(server: str) -> None:
    items = long_tailed(8, vocab_size=258, median_output=6, sigma=0.5, max_output=12, seed=1)
    items = with_arrivals(items, arrival_times(len(items), 20.0, seed=1))
    result = run_serve(server, items, model="tiny", max_concurrency=4, progress=False)
    report = result.report({"ttft": 60_000.0})
    assert report["completed"] == 8 and report["failed"] == 0
    # ignore_eos: every request produces exactly its max_tokens, counted by the server's usage.
    assert report["total_output_tokens"] == sum(it.output_len for it in items)
    assert report["total_input_tokens"] == sum(len(it.prompt_token_ids or ()) for it in items)
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])
    for rec in result.records:
        assert 0 < rec.ttft <= rec.latency
        assert len(rec.itl) >= 1 and all(g >= 0 for g in rec.itl)
        assert rec.tpot is not None and rec.tpot > 0
    assert report["p99_ttft_ms"] >= report["p50_ttft_ms"] > 0
    # The server's /metrics was sampled for the queue and KV timeline.
    assert result.timeline and all(0.0 <= kv <= 1.0 for *_, kv in result.timeline)


def test_bench_serve_cli_writes_json_and_reports_refusals(server: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    code = main(
        [
            *("bench", "serve", "--base-url", server, "--num-requests", "4", "--median-output", "4"),
            *("--max-output", "6", "--request-rate", "50", "--json", str(out), "--no-progress"),
            *("--plot-dir", str(tmp_path / "plots")),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["model"] == "tiny"
    assert (tmp_path / "plots" / "serve_itl_cdf.png").exists()
    # A request the server refuses (prompt past max_model_len) is a failure with the server's reason.
    bad = run_serve(server, [WorkItem(tuple([5] * 600), 4)], model="tiny", progress=False)
    rec = bad.records[0]
    assert not rec.success and rec.error.startswith("HTTP 400")


def _aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
    )


def test_a_cut_run_leaves_nothing_running_on_a_real_server(server: str) -> None:
    # Three streams that would run for hundreds of tokens, cut once a prompt of 200 tokens arriving at 0.3 s
    # has its first token: the server aborts what the client cancelled.
    before = _aborted(server)
    items = [WorkItem(tuple(range(10 + i, 18 + i)), 480) for i in range(3)]
    items.append(WorkItem(tuple(range(3, 203)), 4, arrival_s=0.3))
    result = run_serve(
        server, items, model="tiny", progress=False, scrape_metrics=False, cut_after_first_token_of=[3]
    )
    streams = result.records[:3]
    assert all(r.cut and r.success and 1 < r.output_len < 480 for r in streams)
    deadline = time.monotonic() + 10
    while _aborted(server) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) >= before + 3
    assert parse_gauges(httpx.get(f"{server}/metrics", timeout=10).text)["running"] == 0


def test_metrics_gauges_parse() -> None:
    text = (
        "# HELP vllm:num_requests_waiting waiting\n"
        'vllm:num_requests_waiting{model_name="a"} 3.0\n'
        'vllm:num_requests_waiting{model_name="b"} 2.0\n'
        'vllm:kv_cache_usage_perc{model_name="a"} 0.25\n'
        "vllm:num_requests_running 7\n"
    )
    assert parse_gauges(text) == {"waiting": 5.0, "kv": 0.25, "running": 7.0}


# -- a scripted server on loopback ---------------------------------------------------------------------------
# A request whose prompt has at least LONG tokens waits LONG_DELAY_S before its first token; every token
# takes TOKEN_S. The server counts requests in flight and the ones whose client went away.
LONG = 100
LONG_DELAY_S = 0.3
TOKEN_S = 0.005


@dataclass
class Scripted:
    url: str = ""
    in_flight: int = 0
    max_in_flight: int = 0
    started: int = 0
    disconnected: int = 0
    tokens_sent: list[int] = field(default_factory=list)

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        req = json.loads(body)
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        self.started += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        sent = 0
        try:
            start = {"type": "http.response.start", "status": 200}
            await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
            if len(req["prompt"]) >= LONG:
                await asyncio.sleep(LONG_DELAY_S)
            for _ in range(req["max_tokens"]):
                await asyncio.sleep(TOKEN_S)
                if gone.is_set():
                    self.disconnected += 1
                    return
                chunk = {"choices": [{"index": 0, "text": " w"}]}
                await send(
                    {
                        "type": "http.response.body",
                        "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True,
                    }
                )
                sent += 1
            usage = {"choices": [], "usage": {"completion_tokens": sent, "prompt_tokens": len(req["prompt"])}}
            tail = f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            self.tokens_sent.append(sent)
            self.in_flight -= 1
            watcher.cancel()


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    import uvicorn

    state = Scripted()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(state.app, log_level="warning", lifespan="off", interface="asgi3"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the scripted server did not start"
        time.sleep(0.01)
    try:
        yield state
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_max_concurrency_caps_the_requests_in_flight(scripted: Scripted) -> None:
    items = [WorkItem((5, 6, 7), 4) for _ in range(12)]
    capped = run_serve(
        scripted.url, items, model="m", max_concurrency=3, progress=False, scrape_metrics=False
    )
    assert scripted.max_in_flight == 3 and scripted.started == 12
    assert all(r.success and r.output_len == 4 for r in capped.records)
    # A request is sent when it has a slot: the last wave went after three waves of four tokens each.
    assert max(r.start_s for r in capped.records) >= 3 * 4 * TOKEN_S
    # Without the cap all twelve go at once: the cap, not the server, is what held them to three.
    scripted.max_in_flight = 0
    run_serve(scripted.url, items, model="m", progress=False, scrape_metrics=False)
    assert scripted.max_in_flight == 12


def test_a_cut_run_ends_once_the_watched_requests_have_a_first_token(scripted: Scripted) -> None:
    streams = [WorkItem((5, 6, 7), 5000) for _ in range(3)]
    longs = [WorkItem(tuple([9] * LONG), 8, arrival_s=0.2)]
    items = [*streams, *longs]
    result = run_serve(
        scripted.url, items, model="m", progress=False, scrape_metrics=False, cut_after_first_token_of=[3]
    )
    *recs, long = result.records
    first_token = long.start_s + long.ttft
    assert long.success and long.start_s >= 0.2 and long.ttft >= LONG_DELAY_S
    assert result.extra["cut_s"] >= first_token and result.duration_s < 5
    for r in recs:
        # Cut while streaming, each with a chunk after the long prompt's first token; what came is kept.
        assert r.cut and r.success and r.output_len == len(r.itl) + 1 < 5000
        assert r.chunk_times()[-1] >= first_token
        assert r.latency == pytest.approx(r.chunk_times()[-1] - r.start_s)
    # The server saw every cut client go away.
    deadline = time.monotonic() + 5
    while scripted.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scripted.in_flight == 0 and scripted.disconnected >= 3
    assert result.report()["cut"] >= 3


def test_the_request_body_carries_the_workloads_length_and_the_asked_temperature() -> None:
    from chunkwise.bench.serve import payload

    item = WorkItem((3, 4, 5), 7)
    body = payload(item, "m")
    assert (body["prompt"], body["max_tokens"], body["temperature"], body["ignore_eos"]) == (
        [3, 4, 5],
        7,
        0.0,
        True,
    )
    assert payload(item, "m", temperature=1.0)["temperature"] == 1.0
    assert "ignore_eos" not in payload(item, "m", ignore_eos=False)
