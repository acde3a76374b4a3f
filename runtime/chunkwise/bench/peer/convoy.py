"""The convoy mode: both OpenAI-compatible servers up and pinned, driven in turn by the same streaming
client, decoding streams with long prompts injected while they decode."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from chunkwise.bench.compare import Ratio
from chunkwise.bench.peer.base import (
    ENGINES,
    IDLE_CPU_NOTE_FRACTION,
    PAUSE_NOTE,
    START_TIMEOUT_S,
    EngineName,
    Peer,
    PeerError,
    PeerReport,
    PeerSettings,
    _chunkwise_env,
    _peer_cpu,
    _Process,
    _tail,
    _vllm_env,
    alternation,
    paused,
)
from chunkwise.bench.workloads import WorkItem

if TYPE_CHECKING:
    from chunkwise.bench.results import RunResult

# The name both servers answer to, so the client sends the same body to each.
SERVED_MODEL_NAME = "bench"


def convoy_metrics(result: RunResult, items: Sequence[WorkItem], long_len: int) -> dict[str, Any]:
    """What a convoy does to a client: inter-token latency of the decoding streams (pooled, as vLLM pools
    ITL) and the long prompts' time to first token. A request of at least `long_len` prompt tokens is one
    of the injected long prompts."""
    import numpy as np

    if len(result.records) != len(items):
        raise ValueError(f"{len(result.records)} records for {len(items)} requests")
    streams = [r for r, it in zip(result.records, items) if len(it.prompt_token_ids or ()) < long_len]
    longs = [r for r, it in zip(result.records, items) if len(it.prompt_token_ids or ()) >= long_len]
    failed = [r.error for r in result.records if not r.success]
    if failed:
        raise PeerError(f"{result.name}: {len(failed)} request(s) failed: {sorted(set(failed))[:3]}")
    itl = np.asarray([g for r in streams for g in r.itl], dtype=float) * 1000
    ttft = [r.ttft * 1000 for r in longs]
    return {
        "num_streams": len(streams),
        "num_long": len(longs),
        "p99_itl_ms": float(np.percentile(itl, 99)) if itl.size else 0.0,
        "max_itl_ms": float(itl.max()) if itl.size else 0.0,
        "median_itl_ms": float(np.median(itl)) if itl.size else 0.0,
        "long_ttft_ms": ttft,
        "mean_long_ttft_ms": statistics.fmean(ttft) if ttft else 0.0,
        "output_throughput": sum(r.output_len for r in result.records) / result.duration_s,
    }


class Server(Peer, Protocol):
    url: str
    ready: dict[str, Any]


ServerFactory = Callable[[EngineName, str], Server]
# (base URL, items, name) -> the client's record of the run.
ServeFn = Callable[[str, Sequence[WorkItem], str], "RunResult"]


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


def http_serve(progress: bool) -> ServeFn:
    def serve(url: str, items: Sequence[WorkItem], name: str) -> RunResult:
        from chunkwise.bench.serve import run_serve

        # No /metrics scraping: both servers see nothing but the workload's requests.
        return run_serve(
            url, items, model=SERVED_MODEL_NAME, progress=progress, name=name, scrape_metrics=False
        )

    return serve


def _warmup_items() -> list[WorkItem]:
    return [WorkItem(tuple(3 + (i * 7 + j) % 200 for j in range(32)), 4) for i in range(4)]


def compare_convoy(
    make_workload: Callable[[int], list[WorkItem]],
    dtypes: Sequence[str],
    repeats: int,
    long_len: int,
    start_server: ServerFactory,
    serve: ServeFn,
    log: Callable[[str], None] = print,
) -> PeerReport:
    """Both servers up (one dtype at a time), warmed up, then the convoy workload against each in
    alternating order; ratios of the streams' p99 and max ITL and of the long prompts' mean TTFT."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    workloads = [make_workload(rep) for rep in range(repeats)]
    for items in workloads:
        if not any(len(it.prompt_token_ids or ()) >= long_len for it in items):
            raise ValueError(f"the convoy workload has no prompt of {long_len} tokens or more")
    runs: list[dict[str, Any]] = []
    ratios: list[Ratio] = []
    info: dict[str, Any] = {"startup_seconds": {}, "long_len": long_len}
    notes: list[str] = []
    t0 = time.monotonic()
    for dtype in dtypes:
        servers: dict[EngineName, Server] = {}
        try:
            for engine in ENGINES:
                servers[engine] = start_server(engine, dtype)
                info["startup_seconds"][f"{engine}/{dtype}"] = servers[engine].ready.get("startup_seconds")
                serve(servers[engine].url, _warmup_items(), f"{engine} warm-up")
            metrics: dict[EngineName, list[dict[str, Any]]] = {e: [] for e in ENGINES}
            for rep, order in enumerate(alternation(repeats)):
                items = workloads[rep]
                for engine in order:
                    (peer,) = [e for e in ENGINES if e != engine]
                    log(
                        f"[{time.monotonic() - t0:6.0f} s] repeat {rep + 1}/{repeats}, {dtype}: {engine} serving the convoy"
                    )
                    with paused(servers[peer]):
                        before = servers[peer].cpu_seconds()
                        result = serve(servers[engine].url, items, f"{engine} {dtype}")
                        peer_cpu = _peer_cpu(before, servers[peer].cpu_seconds())
                    m = convoy_metrics(result, items, long_len)
                    metrics[engine].append(m)
                    runs.append(
                        {
                            "engine": engine,
                            "dtype": dtype,
                            "repeat": rep,
                            **m,
                            "peer_cpu_seconds": peer_cpu,
                            "report": result.report(),
                        }
                    )
                    ttfts = ", ".join(f"{t:.0f}" for t in m["long_ttft_ms"])
                    log(
                        f"  {engine} {dtype}: streams' p99 ITL {m['p99_itl_ms']:.1f} ms, max {m['max_itl_ms']:.1f} ms; "
                        f"long prompts' TTFT {ttfts} ms"
                    )
                    if peer_cpu is not None and peer_cpu > IDLE_CPU_NOTE_FRACTION * result.duration_s:
                        notes.append(
                            f"the idle {peer} server, paused, still used {peer_cpu:.2f} s of CPU during {engine}'s "
                            f"{result.duration_s:.1f} s run (repeat {rep + 1}, {dtype})"
                        )

            def values(key: str, m: dict[EngineName, list[dict[str, Any]]] = metrics) -> list[float]:
                return [c[key] / max(v[key], 1e-12) for c, v in zip(m["chunkwise"], m["vllm"])]

            n = metrics["chunkwise"][0]["num_streams"]
            ratios += [
                Ratio(
                    f"chunkwise/vLLM p99 ITL of the {n} streams, {dtype}", values("p99_itl_ms"), clock="wall"
                ),
                Ratio(
                    f"chunkwise/vLLM max ITL of the {n} streams, {dtype}", values("max_itl_ms"), clock="wall"
                ),
                Ratio(
                    f"chunkwise/vLLM mean TTFT of the long prompts, {dtype}",
                    values("mean_long_ttft_ms"),
                    clock="wall",
                ),
            ]
        finally:
            for s in servers.values():
                s.close()
    notes.append(PAUSE_NOTE)
    notes.append("ratios are chunkwise over vLLM on client-side latencies: below 1 means chunkwise is faster")
    return PeerReport("convoy", ratios, runs, info, notes)
