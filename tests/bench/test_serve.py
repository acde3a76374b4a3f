"""`chunkwise bench serve` against a real `chunkwise serve` process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

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


def test_metrics_gauges_parse() -> None:
    text = (
        "# HELP vllm:num_requests_waiting waiting\n"
        'vllm:num_requests_waiting{model_name="a"} 3.0\n'
        'vllm:num_requests_waiting{model_name="b"} 2.0\n'
        'vllm:kv_cache_usage_perc{model_name="a"} 0.25\n'
        "vllm:num_requests_running 7\n"
    )
    assert parse_gauges(text) == {"waiting": 5.0, "kv": 0.25, "running": 7.0}
