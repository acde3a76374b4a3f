"""The throughput mode: one persistent worker process per (engine, dtype), each running peer_worker.py
under its own interpreter, and the offline runs of both engines in alternating order."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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
    agreement,
    alternation,
    paused,
)
from chunkwise.bench.workloads import WorkItem, save_jsonl

# peer_worker.py stays beside this package, in chunkwise/bench/: vLLM's interpreter runs it as a file.
WORKER_PATH = Path(__file__).parent.with_name("peer_worker.py")
RUN_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class RunReply:
    """A worker's answer to one "run" command."""

    output_tokens: int
    prompt_tokens: int
    seconds: float
    cpu_seconds: float
    tokens: list[list[int]] | None = None

    @classmethod
    def from_json(cls, obj: dict[str, Any], who: str) -> RunReply:
        try:
            reply = cls(
                int(obj["output_tokens"]),
                int(obj["prompt_tokens"]),
                float(obj["seconds"]),
                float(obj["cpu_seconds"]),
                obj.get("tokens"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PeerError(f"{who}: malformed run reply {str(obj)[:200]}: {e}") from None
        if not reply.seconds > 0:
            raise PeerError(f"{who}: a run took {reply.seconds} s")
        return reply


@dataclass
class ThroughputRun:
    engine: EngineName
    dtype: str
    repeat: int
    reply: RunReply
    # CPU seconds the other engine's idle worker used during this run (None where it cannot be read).
    peer_cpu_seconds: float | None = None

    @property
    def output_throughput(self) -> float:
        return self.reply.output_tokens / self.reply.seconds

    @property
    def cpu_output_throughput(self) -> float:
        return self.reply.output_tokens / max(self.reply.cpu_seconds, 1e-9)

    def as_dict(self) -> dict[str, Any]:
        r = self.reply
        return {
            "engine": self.engine,
            "dtype": self.dtype,
            "repeat": self.repeat,
            "output_tokens": r.output_tokens,
            "prompt_tokens": r.prompt_tokens,
            "seconds": r.seconds,
            "cpu_seconds": r.cpu_seconds,
            "output_throughput": self.output_throughput,
            "cpu_output_throughput": self.cpu_output_throughput,
            "peer_cpu_seconds": self.peer_cpu_seconds,
        }


class Worker(Peer, Protocol):
    ready: dict[str, Any]

    def run(self, workload: Path) -> RunReply: ...


# (engine, dtype) -> a started worker, ready to run.
WorkerFactory = Callable[[EngineName, str], Worker]


class WorkerProcess(_Process):
    """peer_worker.py in a subprocess: commands on its stdin, one JSON reply per line on its stdout, its
    stderr (all the engine's own logging) in a log file."""

    def __init__(
        self, engine: EngineName, dtype: str, settings: PeerSettings, log_path: Path, start_timeout_s: float
    ) -> None:
        self.name = f"{engine} ({dtype})"
        self.log_path = log_path
        cmd = [
            settings.python(engine),
            str(WORKER_PATH),
            *("--engine", engine, "--model", settings.model, "--dtype", dtype, "--cpus", settings.cpus),
            *("--max-num-seqs", str(settings.max_num_seqs)),
            *("--max-num-batched-tokens", str(settings.max_num_batched_tokens)),
            *("--max-model-len", str(settings.max_model_len)),
            *("--kv-cache-gib", str(settings.kv_cache_gib)),
            *("--tensor-parallel-size", str(settings.tensor_parallel_size)),
        ]
        if settings.lora_modules:
            cmd += ["--lora-modules", *(f"{name}={path}" for name, path in settings.lora_modules)]
            cmd += ["--max-loras", str(settings.max_loras), "--max-lora-rank", str(settings.max_lora_rank)]
        env = _vllm_env() if engine == "vllm" else _chunkwise_env()
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"peer-{engine}-{dtype}").start()
        try:
            self.ready = self._reply(start_timeout_s)
            if not self.ready.get("ready"):
                raise PeerError(f"{self.name} did not start: {self.ready.get('error', self.ready)}")
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerError(
                f"{self.name}: no answer within {timeout_s:.0f} s; its log: {self.log_path}"
            ) from None
        if line is None:
            rc = self.proc.wait()
            raise PeerError(
                f"{self.name} exited with status {rc}; the end of its log ({self.log_path}):\n{_tail(self.log_path)}"
            )
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise PeerError(f"{self.name}: not a protocol line: {line[:200]!r}") from None
        if not isinstance(obj, dict):
            raise PeerError(f"{self.name}: not a protocol line: {line[:200]!r}")
        return obj

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def run(self, workload: Path, timeout_s: float = RUN_TIMEOUT_S) -> RunReply:
        self._send({"cmd": "run", "workload": str(workload)})
        obj = self._reply(timeout_s)
        if "error" in obj:
            raise PeerError(f"{self.name}: run failed: {obj['error']} (log: {self.log_path})")
        return RunReply.from_json(obj, self.name)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()  # a stopped process would not read its quit command
            with contextlib.suppress(OSError, ValueError):
                self._send({"cmd": "quit"})
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            self._log.close()


def process_workers(settings: PeerSettings, logdir: Path, log: Callable[[str], None]) -> WorkerFactory:
    def start(engine: EngineName, dtype: str) -> Worker:
        log_path = logdir / f"{engine}-{dtype}.log"
        log(f"starting the {engine} worker ({dtype}, CPUs {settings.cpus}); its log: {log_path}")
        w = WorkerProcess(engine, dtype, settings, log_path, START_TIMEOUT_S)
        r = w.ready
        log(
            f"{engine} {r.get('version', '?')} ({dtype}) ready: start-up {r.get('startup_seconds', 0):.1f} s, "
            f"warm-up {r.get('warmup_seconds', 0):.1f} s, pinned to CPUs {r.get('cpus')}, {r.get('threads')} thread(s)"
        )
        return w

    return start


def compare_throughput(
    make_workload: Callable[[int], list[WorkItem]],
    dtypes: Sequence[str],
    repeats: int,
    start_worker: WorkerFactory,
    workdir: Path,
    log: Callable[[str], None] = print,
) -> PeerReport:
    """Offline output throughput of both engines, per dtype: both workers started (one at a time, so each
    start-up time means something), then the repeats in alternating order, then both closed before the
    next dtype (two engines' KV caches at a time, not four)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    workloads: list[tuple[Path, list[WorkItem]]] = []
    for rep in range(repeats):
        items = make_workload(rep)
        if any(it.max_tokens is None for it in items):
            raise ValueError("offline runs need every request's max_tokens (no --hide-lengths)")
        path = workdir / f"workload-{rep}.jsonl"
        save_jsonl(items, path)
        workloads.append((path, items))
    runs: list[ThroughputRun] = []
    ratios: list[Ratio] = []
    info: dict[str, Any] = {"startup_seconds": {}, "versions": {}, "greedy_agreement": {}, "pinned_cpus": {}}
    notes: list[str] = []
    t0 = time.monotonic()
    for dtype in dtypes:
        workers: dict[EngineName, Worker] = {}
        try:
            for engine in ENGINES:
                workers[engine] = start_worker(engine, dtype)
                ready = workers[engine].ready
                info["startup_seconds"][f"{engine}/{dtype}"] = ready.get("startup_seconds")
                info["versions"][engine] = ready.get("version")
                info["pinned_cpus"][f"{engine}/{dtype}"] = ready.get("cpus")
            by_engine: dict[EngineName, list[ThroughputRun]] = {e: [] for e in ENGINES}
            agree: list[dict[str, Any]] = []
            for rep, order in enumerate(alternation(repeats)):
                path, items = workloads[rep]
                expected = sum(it.output_len for it in items)
                for engine in order:
                    (peer,) = [e for e in ENGINES if e != engine]
                    log(
                        f"[{time.monotonic() - t0:6.0f} s] repeat {rep + 1}/{repeats}, {dtype}: {engine} "
                        f"generating {len(items)} requests ({expected} output tokens)"
                    )
                    with paused(workers[peer]):
                        before = workers[peer].cpu_seconds()
                        reply = workers[engine].run(path)
                        peer_cpu = _peer_cpu(before, workers[peer].cpu_seconds())
                    if reply.output_tokens != expected:
                        raise PeerError(
                            f"{engine} ({dtype}) produced {reply.output_tokens} output tokens, expected {expected}: "
                            "it did not run every request to max_tokens, so its throughput is not comparable"
                        )
                    run = ThroughputRun(engine, dtype, rep, reply, peer_cpu)
                    by_engine[engine].append(run)
                    runs.append(run)
                    log(
                        f"  {engine} {dtype}: {run.output_throughput:.1f} output tok/s "
                        f"({reply.seconds:.1f} s wall, {reply.cpu_seconds:.1f} s CPU)"
                    )
                    if peer_cpu is not None and peer_cpu > IDLE_CPU_NOTE_FRACTION * reply.seconds:
                        notes.append(
                            f"the idle {peer} worker, paused, still used {peer_cpu:.2f} s of CPU during {engine}'s "
                            f"{reply.seconds:.1f} s run (repeat {rep + 1}, {dtype})"
                        )
                cw, vl = by_engine["chunkwise"][-1].reply.tokens, by_engine["vllm"][-1].reply.tokens
                if cw is not None and vl is not None:
                    agree.append(agreement(cw, vl))
            info["greedy_agreement"][dtype] = agree
            ratios.append(
                Ratio(
                    f"chunkwise/vLLM output throughput, {dtype}",
                    [
                        c.output_throughput / v.output_throughput
                        for c, v in zip(by_engine["chunkwise"], by_engine["vllm"])
                    ],
                    clock="wall",
                    other_values=[
                        c.cpu_output_throughput / v.cpu_output_throughput
                        for c, v in zip(by_engine["chunkwise"], by_engine["vllm"])
                    ],
                    other_clock="cpu",
                )
            )
        finally:
            for w in workers.values():
                w.close()
    if any(it.arrival_s > 0 for _, items in workloads for it in items):
        notes.append("offline runs ignore arrival times: every request is given to generate at once")
    notes.append(PAUSE_NOTE)
    notes.append(
        "chunkwise's offline generate detokenizes every output (it has no switch to skip it); vLLM runs with "
        "skip_tokenizer_init and detokenize=False, so chunkwise's figure includes work vLLM's does not"
    )
    return PeerReport("throughput", ratios, [r.as_dict() for r in runs], info, notes)
