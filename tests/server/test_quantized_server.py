"""`chunkwise serve --quantization int8` as a real process on the built-in models: the start-up log line and
/v1/models (read with the official client) say how the weights are held, and the served greedy text is the
offline engine's with the same flag."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from chunkwise import LLM, SamplingParams
from tests.server.harness import wait_for

INT8 = "int8 (weights quantized at load, a scale per output channel)"
PROMPT = "def main("
MAX_TOKENS = 12
ENGINE_FLAGS: dict[str, object] = {
    "max_model_len": 512,
    "num_blocks": 64,
    "swap_space_bytes": 0,
    "dtype": "float32",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(params=["tiny", "pylm"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """(the model, the server's URL, its log file), served with --quantization int8."""
    model = request.param
    port = _free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    cmd = [sys.executable, "-m", "chunkwise.cli", "serve", "--model", model, "--quantization", "int8"]
    cmd += [*flags, "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(url), timeout=90, interval=0.1)
        assert proc.poll() is None, log.read_text()
        yield model, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_serve_quantization_int8_says_so_and_serves(served: tuple[str, str, Path]) -> None:
    model, url, log = served
    # The line naming the model is written once it is ready (/health answers 200 just before).
    wait_for(lambda: "ready in" in log.read_text(), timeout=10, interval=0.05)
    ready = next(line for line in log.read_text().splitlines() if "ready in" in line)
    assert f"model {model} ready in " in ready and ready.endswith(f": float32, linear layers {INT8}"), ready
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        card = client.models.list().data[0]
        assert card.id == model and (card.model_extra or {})["quantization"] == INT8
        served_text = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        ).choices[0]
    assert served_text.finish_reason == "length"
    offline = LLM(model, quantization="int8", **ENGINE_FLAGS)
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert served_text.text == expected[0].outputs[0].text
