"""The servers of the online modes (convoy.py, served.py): chunkwise's and vLLM's OpenAI-compatible servers,
each a process pinned to the CPUs and up once /health answers, both answering to the same model name; and the
few requests that warm one up before the measured runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from chunkwise.bench.peer.base import (
    START_TIMEOUT_S,
    EngineName,
    Peer,
    PeerError,
    PeerSettings,
    _chunkwise_env,
    _Process,
    _tail,
    _vllm_env,
)
from chunkwise.bench.workloads import WorkItem

# The name both servers answer to, so the client sends the same body to each.
SERVED_MODEL_NAME = "bench"


class Server(Peer, Protocol):
    url: str
    ready: dict[str, Any]


ServerFactory = Callable[[EngineName, str], Server]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(engine: EngineName, dtype: str, settings: PeerSettings, port: int) -> list[str]:
    common = [
        *("--model", settings.model, "--dtype", dtype, "--seed", "0"),
        *("--max-num-seqs", str(settings.max_num_seqs)),
        *("--max-num-batched-tokens", str(settings.max_num_batched_tokens)),
        *("--max-model-len", str(settings.max_model_len)),
        *("--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_MODEL_NAME),
    ]
    if engine == "chunkwise":
        return [
            *(settings.chunkwise_python, "-m", "chunkwise.cli", "serve", *common),
            *("--kv-cache-memory-bytes", str(int(settings.kv_cache_gib * (1 << 30)))),
            # vLLM sheds no load: neither may chunkwise, or a refused long prompt would look like a win.
            *("--queue-delay-slo-seconds", "0", "--log-level", "warning"),
        ]
    return [
        *(settings.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *common),
        "--disable-uvicorn-access-log",
    ]


def server_env(engine: EngineName, settings: PeerSettings) -> dict[str, str]:
    threads = str(len(settings.cpu_list()))
    if engine == "chunkwise":
        return {**_chunkwise_env(), "OMP_NUM_THREADS": threads}
    return _vllm_env(
        VLLM_CPU_KVCACHE_SPACE=f"{settings.kv_cache_gib:g}", VLLM_CPU_OMP_THREADS_BIND=settings.cpus
    )


class ServerProcess(_Process):
    """An OpenAI-compatible server pinned to the CPUs (taskset, which its children inherit), up until
    /health answers 200."""

    def __init__(
        self, engine: EngineName, dtype: str, settings: PeerSettings, log_path: Path, start_timeout_s: float
    ) -> None:
        import httpx

        self.name = f"{engine} server ({dtype})"
        self.log_path = log_path
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = server_command(engine, dtype, settings, port)
        preexec: Callable[[], None] | None = None
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", settings.cpus, *cmd]
        else:
            cpus = settings.cpu_list()

            def preexec() -> None:
                os.sched_setaffinity(0, cpus)

        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in close())
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=server_env(engine, settings),
            preexec_fn=preexec,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise PeerError(
                        f"{self.name} exited with status {self.proc.returncode}; the end of its log "
                        f"({log_path}):\n{_tail(log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise PeerError(
                        f"{self.name} not healthy after {start_timeout_s:.0f} s; its log: {log_path}"
                    )
                time.sleep(0.5)
        except BaseException:
            self.close()
            raise
        self.ready = {"startup_seconds": time.perf_counter() - t0, "url": self.url}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()  # a stopped process would not act on SIGTERM
            # The whole session: vLLM's server has an engine-core child that must go with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(OSError):
            self._log.close()


def process_servers(settings: PeerSettings, logdir: Path, log: Callable[[str], None]) -> ServerFactory:
    def start(engine: EngineName, dtype: str) -> Server:
        log_path = logdir / f"{engine}-{dtype}-server.log"
        log(f"starting the {engine} server ({dtype}, CPUs {settings.cpus}); its log: {log_path}")
        s = ServerProcess(engine, dtype, settings, log_path, START_TIMEOUT_S)
        log(f"{engine} server ({dtype}) healthy at {s.url} after {s.ready['startup_seconds']:.1f} s")
        return s

    return start


def _warmup_items() -> list[WorkItem]:
    return [WorkItem(tuple(3 + (i * 7 + j) % 200 for j in range(32)), 4) for i in range(4)]
