"""Test harness: a real uvicorn on 127.0.0.1 serving a real (tiny) engine, in a thread of the test process, so tests can
look inside the engine (free KV blocks, requests in flight) while they drive it over HTTP."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from chunkwise.engine import AsyncEngine
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.server.app import build_app

MODEL = "tiny"
# Small engines: a short context and a small KV cache keep start-up and every test quick.
# float32: tests compare texts across requests (a prefix-cache hit, streamed against whole), which bf16, what
# "auto" picks on a CPU with bf16 matrix units, may legitimately change.
ENGINE_KWARGS: dict[str, Any] = {
    "max_model_len": 512,
    "num_blocks": 96,
    "swap_space_bytes": 0,
    "dtype": "float32",
}
MAX_REQUEST_BYTES = 64 * 1024


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> None:
    """Poll `cond` until it holds; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@dataclass
class LiveServer:
    url: str
    engine: AsyncEngine
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


def start_server(
    engine_kwargs: dict[str, Any] | None = None, model: str = MODEL, **app_kwargs: Any
) -> LiveServer:
    engine = AsyncEngine(engine_config_from_kwargs(model, **{**ENGINE_KWARGS, **(engine_kwargs or {})}))
    engine.start()
    app = build_app(engine, **{"max_request_bytes": MAX_REQUEST_BYTES, **app_kwargs})
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets it recognises as TCP (else Nagle adds ~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", engine, app, server, thread)
    try:
        wait_for(lambda: server.started, timeout=20)
    except AssertionError:
        live.stop()
        raise
    return live
