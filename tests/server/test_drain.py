"""`chunkwise serve` as a real process: SIGTERM drains (in-flight requests finish, new ones get 503), then
the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.server.harness import MODEL, wait_for

MAX_TOKENS = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


@pytest.fixture
def served() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "chunkwise.cli",
        "serve",
        "--model",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--num-blocks",
        "128",
        "--swap-space-bytes",
        "0",
        "--drain-timeout-seconds",
        "60",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        # 503 "loading" (or not yet listening) until the engine is up.
        wait_for(lambda: proc.poll() is not None or _status(f"{url}/health") == 200, timeout=60, interval=0.1)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_sigterm_drains_in_flight_then_exits_zero(served: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = served
    body = {
        "model": MODEL,
        "prompt": "Drain me",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None

        proc.send_signal(signal.SIGTERM)
        # Draining: health and new requests answer 503 with Retry-After while the stream goes on.
        wait_for(lambda: _status(f"{url}/health") == 503, timeout=10)
        with httpx.Client(base_url=url, timeout=10) as other:
            refused = other.post("/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "draining"
        assert proc.poll() is None

        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(30) == 0
