"""`chunkwise serve --tensor-parallel-size 2` as a real process (rank 0 serving, one spawned worker rank, gloo):
the official client's greedy tokens equal transformers' in float32 (Mistral with one KV head for two ranks,
Qwen3 with its per-head q/k norms; and `--pipeline-parallel-size 2` over a 3-layer Llama); SIGTERM drains a stream in flight, exits 0 and leaves no rank behind; a
worker rank killed while the server idles takes the server down at once (exit 1, the rank and its signal
named, no orphan); a size the heads do not divide over fails the start, naming the field."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.loop.test_tensor_parallel_engine import _gone
from tests.hf_models import hf_greedy, save_random_family
from tests.server.harness import wait_for

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    model: str

    def output(self) -> str:
        return self.log.read_text()

    def worker_pids(self) -> list[int]:
        found = re.search(r"parallel: \d+ ranks \(.*\), worker pids \[([\d, ]+)\]", self.output())
        assert found, self.output()
        return [int(p) for p in found.group(1).split(",")]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def _start(
    model: str, log: Path, *extra: str, parallel: tuple[str, ...] = ("--tensor-parallel-size", "2")
) -> Served:
    port = _free_port()
    cmd = [sys.executable, "-m", "chunkwise.cli", "serve", "--model", model, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--dtype", "float32", *parallel, "--log-level", "info"]
    cmd += ["--max-model-len", "256", "--num-blocks", "64", "--block-size", "4", "--swap-space-bytes", "0"]
    cmd += ["--max-num-batched-tokens", "16", *extra]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT}"}
    # A file, not a pipe: nobody reads a pipe while the test waits, and an orphan holding it would hang a read.
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: proc.poll() is not None or _health(url) == 200, timeout=START_TIMEOUT_S, interval=0.1)
    return Served(proc, url, log, model)


@pytest.fixture
def served_family(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Served]:
    """request.param: a family, or (family, layers, the parallel flags)."""
    family, layers, parallel = (
        request.param
        if isinstance(request.param, tuple)
        else (request.param, 2, ("--tensor-parallel-size", "2"))
    )
    path = save_random_family(tmp_path / "ckpt", family, num_hidden_layers=layers)
    served = _start(str(path), tmp_path / "serve.log", parallel=parallel)
    try:
        assert served.proc.poll() is None, served.output()
        yield served
    finally:
        pids = []
        with contextlib.suppress(AssertionError):
            pids = served.worker_pids()
        if served.proc.poll() is None:
            served.proc.kill()
        served.proc.wait(15)
        for pid in pids:  # an orphan is a failure (asserted in the tests), and is not left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "served_family",
    ["mistral", "qwen3", ("llama3-rope", 3, ("--pipeline-parallel-size", "2"))],
    ids=["mistral-tp2", "qwen3-tp2", "llama3-pp2"],
    indirect=True,
)
def test_greedy_equals_transformers_then_sigterm_drains_and_stops_every_rank(served_family: Served) -> None:
    served = served_family
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    max_new = [rng.randint(4, 9) for _ in prompts]
    expected = hf_greedy(Path(served.model), prompts, max_new)
    client = served.client()
    got = []
    for prompt, n in zip(prompts, max_new):
        whole = client.completions.create(
            model=served.model,
            prompt=prompt,
            max_tokens=n,
            temperature=0.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        got.append(whole.model_dump()["choices"][0]["token_ids"])
    assert got == expected

    # SIGTERM while a stream is in flight: it still gets every token, then the server and its rank exit.
    pids = served.worker_pids()
    assert len(pids) == 1
    stream = client.completions.create(
        model=served.model,
        prompt=prompts[0],
        max_tokens=120,
        temperature=0.0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tokens = []
    for i, chunk in enumerate(stream):
        if i == 2:
            served.proc.send_signal(signal.SIGTERM)
        tokens.extend(chunk.model_dump()["choices"][0]["token_ids"] or [])
    assert len(tokens) == 120
    assert tokens[: max_new[0]] == expected[0]
    assert served.proc.wait(60) == 0, served.output()
    assert _gone(pids), f"worker ranks {pids} outlived the server"
    assert "drained; shutting down" in served.output()


@pytest.mark.parametrize("served_family", ["llama3-rope"], indirect=True)
def test_a_killed_rank_takes_the_idle_server_down_naming_it(served_family: Served) -> None:
    served = served_family
    (pid,) = served.worker_pids()
    reply = served.client().completions.create(
        model=served.model, prompt=[5, 6, 7], max_tokens=3, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    os.kill(pid, signal.SIGKILL)
    # No request needed: the idle loop notices, the server stops without waiting for a probe.
    assert served.proc.wait(30) == 1, served.output()
    out = served.output()
    assert re.search(rf"the engine lost a rank: .*rank 1 \(pid {pid}\) died \(killed by signal 9\)", out), out
    assert _gone([pid])


def test_heads_that_do_not_divide_fail_the_start_naming_the_field(tmp_path: Path) -> None:
    served = _start("tiny", tmp_path / "serve.log", "--tensor-parallel-size", "3")
    assert served.proc.wait(60) == 1
    assert "num_attention_heads (4) does not divide over tensor_parallel_size 3" in served.output()
    assert "worker pids" not in served.output()  # refused before any rank started
