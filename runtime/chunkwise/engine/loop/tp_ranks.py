"""Tensor and pipeline parallel's ranks, seen from rank 0 (the caller's process, which keeps the whole
EngineCore): the worker processes of ranks 1..N-1 (N = tensor_parallel_size * pipeline_parallel_size,
global rank = stage * tensor_parallel_size + tensor-parallel rank), started at engine build and stopped
with it.

- Start: each worker is a spawned process; every rank joins one gloo group (tcp rendezvous on 127.0.0.1, a
  port rank 0 picks; COLLECTIVE_TIMEOUT_S on each collective and point-to-point receive), and its stage's
  tensor-parallel subgroup (distributed/world.py), and loads its shard of its stage's layers; rank 0 then
  sends the KV sizes it worked out (num_blocks, host blocks, max_model_len), so every rank's cache has the
  same blocks (each over its own layers).
- Steps: ModelRunner.execute sends each step's StepMessage down a pipe per worker (a pipe, not a gloo
  broadcast: an idle engine waits on it for as long as it likes, where a collective would time out); the
  worker runs it (ModelRunner.follow), the forward's collectives and the stages' sends keeping the ranks in
  step.
- Other pods (pipeline parallel in a LeaderWorkerSet, one pod per stage: distributed/lws.py): rank 0 spawns
  only its own stage's ranks; the other stages' ranks run in their pods (loop/stage_worker.py), join the same
  group at the leader's address (distributed_port) and take their messages over a socket (the next port)
  instead of a pipe. A lost socket is a dead rank.
- Failure: workers die with rank 0 (a thread watching their parent pid, and EOF on their pipe); rank 0 watches their
  sentinels in a thread; a rank that died makes the next step raise an error naming it and its exit code,
  and the other ranks are stopped. Shutdown (EngineRanks.close, the engine garbage-collected, the process
  exiting) sends each worker a stop, joins under a deadline and kills what is left: no orphan.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from chunkwise.engine.attention import get_attention_backend
from chunkwise.engine.attention.backend import AttentionBackend
from chunkwise.engine.datatypes.config import EngineConfig, ModelConfig
from chunkwise.engine.distributed import (
    RankGroups,
    TPLayout,
    backend_for,
    join_world,
    rank_device,
    stage_layers,
)
from chunkwise.engine.distributed.lws import LWSPlace
from chunkwise.engine.loop.calibration import KVProfileRequest, profile_kv_blocks
from chunkwise.engine.model.loader import LoadedModel, load_model, read_checkpoint, resolve_model_path
from chunkwise.engine.model.presets import PRESETS
from chunkwise.engine.worker.model_runner import ModelRunner
from chunkwise.engine.worker.tp_stage import RankFailure, StepMessage

# builder.make_runner's signature (loaded, config, backend, num_blocks, num_host_blocks, dtype, device,
# max_model_len): passed in, since the builder imports this module.
MakeRunner = Callable[
    [LoadedModel, EngineConfig, AttentionBackend, int, int, torch.dtype, torch.device, int], ModelRunner
]

log = logging.getLogger("chunkwise.engine.loop.tp_ranks")

COLLECTIVE_TIMEOUT_S = 300.0  # a collective waiting longer for a peer raises (a peer that hangs)
STOP_DEADLINE_S = 10.0  # a worker that has not exited this long after its stop message is killed
ORPHAN_POLL_S = 0.2  # how often a worker checks that rank 0 is still its parent


@dataclass(frozen=True)
class RankSizes:
    """What rank 0 decided that each worker's runner needs."""

    num_blocks: int
    num_host_blocks: int
    max_model_len: int


CONNECT_TIMEOUT_S = 300.0  # how long another pod's rank retries the leader's address before giving up


def check_sizes(config: EngineConfig) -> int | None:
    """Refuse a tensor-parallel size the model's heads or columns do not divide over, or a pipeline size
    above its layer count, before any process starts; returns the model's layer count (None where the model
    cannot be read here: load_model refuses it; pipeline parallel needs it, and refuses at once)."""
    pp = config.pipeline_parallel_size
    place = LWSPlace.from_env() if pp > 1 else None
    if place is not None:
        place.check(pp)
    model_config: ModelConfig | None = PRESETS.get(config.model)
    if model_config is None:
        path = resolve_model_path(config.model)
        if path.is_dir():
            model_config = read_checkpoint(path)[0]
    if model_config is None:
        if pp > 1:
            raise ValueError(
                f"model {config.model!r} is neither a built-in preset nor an existing model directory"
            )
        return None
    TPLayout.of(model_config, 0, config.tensor_parallel_size)
    stage_layers(model_config.num_hidden_layers, pp)
    return model_config.num_hidden_layers


def distributed_backend(config: EngineConfig) -> str:
    """The torch.distributed backend the engine's ranks use (config.distributed_backend resolved)."""
    return backend_for(torch.device(config.device), config.distributed_backend)


def check_devices(config: EngineConfig) -> None:
    """Under NCCL each rank of this machine needs a GPU of its own, --device's and the next ones: refuse,
    before any process starts, a machine with fewer."""
    if distributed_backend(config) != "nccl":
        return
    last = rank_device(config.device, "nccl", config.world_size - 1)
    have = torch.cuda.device_count()
    if last.index is not None and last.index >= have:
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size} needs one GPU per rank from {config.device} "
            f"on (up to cuda:{last.index}); this machine has {have} (distributed_backend 'gloo' runs every "
            "rank on one GPU, slowly, for checking)"
        )


def cpu_shares(n: int) -> list[list[int]]:
    """The CPUs this process may use, in `n` consecutive equal shares (one per rank; the last gets any
    remainder). Fewer CPUs than ranks: every rank shares them all, with one thread each."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return [cpus] * n
    k = len(cpus) // n
    return [cpus[i * k : (i + 1) * k] if i < n - 1 else cpus[i * k :] for i in range(n)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _State:
    """What shutdown needs, apart from EngineRanks itself (so that its finalizer holds no reference to it)."""

    def __init__(self, tp_size: int, pp_size: int) -> None:
        self.procs: dict[int, BaseProcess] = {}  # the worker ranks this process spawned
        # Every worker rank's: a pipe to a rank spawned here, a socket to one in another pod (no process here).
        self.conns: dict[int, mpc.Connection] = {}
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.dead: int | None = None  # the first rank to die unasked
        self.error: str | None = None  # why the ranks were stopped, once they were
        self.group: RankGroups | None = None
        self.threads = 0  # rank 0's torch threads before the ranks split the cores (0: unchanged)
        # Rank 0's stepping thread (its native id) and its CPUs before it was pinned to its share (None: not).
        self.pinned: tuple[int, set[int]] | None = None
        self.lock = threading.Lock()

    def waitables(self) -> dict[Any, int]:
        """What becomes ready when a worker rank ends: a spawned rank's sentinel, another pod's socket (its
        ranks never write after their greeting, so a readable socket is a closed one)."""
        ready: dict[Any, int] = {p.sentinel: r for r, p in self.procs.items()}
        ready.update({c: r for r, c in self.conns.items() if r not in self.procs})
        return ready

    def dead_message(self) -> str:
        assert self.dead is not None
        proc = self.procs.get(self.dead)
        if proc is None:
            return (
                f"{self.describe(self.dead)} (in another pod) disconnected: its process or pod is gone; "
                "the engine stopped its other ranks"
            )
        proc.join(1.0)  # its sentinel fired: reaped at once, for its exit code
        # The watcher thread may be reaping it at the same moment: the loser of that race reads no status
        # until the winner has stored it on the shared Popen.
        deadline = time.monotonic() + 2.0
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"{self.describe(self.dead)} (pid {proc.pid}) died ({how}); the engine stopped its other ranks"

    def describe(self, rank: int) -> str:
        """A rank as its messages name it: its global rank, and its stage under pipeline parallel."""
        if self.pp_size == 1:
            return f"tensor-parallel rank {rank}"
        return f"pipeline stage {rank // self.tp_size}'s rank {rank}"

    def watch(self) -> None:
        """The watcher thread: the first worker to exit before a stop is recorded (and logged) at once."""
        pending = self.waitables()
        while pending:
            for sentinel in mpc.wait(list(pending)):
                rank = pending.pop(sentinel)
                if self.error is None and self.dead is None:
                    self.dead = rank
                    # The engine cannot step again: end a step that waits for the dead rank now, not at the
                    # collective timeout. Rank 0's own waits end by the abort; the other local ranks are
                    # killed, which also ends waits in other stages' groups (their sockets close).
                    if self.group is not None:
                        self.group.abort()
                    for other, p in self.procs.items():
                        if other != rank and p.is_alive():
                            p.kill()
                    log.error("%s", self.dead_message())

    def stop(self, why: str) -> None:
        """Stop every worker (a stop message, a deadline, then SIGKILL) and leave the group; idempotent."""
        with self.lock:
            if self.error is not None:
                return
            self.error = why
        conns = list(self.conns.values())  # a start that failed may still be accepting
        for conn in conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(pickle.dumps(None))
        for p in self.procs.values():
            p.join(STOP_DEADLINE_S)
            if p.is_alive():
                log.warning("worker rank pid %s did not stop in %.0fs: killed", p.pid, STOP_DEADLINE_S)
                p.kill()
                p.join()
        for conn in conns:
            conn.close()
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.destroy()
            self.group = None
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.pinned is not None:
            with contextlib.suppress(OSError):  # that thread may be gone
                os.sched_setaffinity(*self.pinned)
            self.pinned = None


def _stop(state: _State) -> None:
    state.stop("the engine was shut down")


class EngineRanks:
    """Rank 0's hold on ranks 1..N-1 (the runner's RankDriver)."""

    def __init__(self, config: EngineConfig, dtype: str, make_runner: MakeRunner) -> None:
        """`make_runner`: the builder's (a module-level function: it goes to each worker by name)."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        n = tp * pp
        self.world_size = n
        # How errors name what stopped (check()'s prefix).
        self.kind = "tensor parallel" if pp == 1 else "pipeline parallel"
        if torch.distributed.is_initialized():
            raise RuntimeError(
                "a tensor-parallel or pipeline-parallel engine is already running in this process (one "
                "process group each); close it first"
            )
        # One pod per stage (a LeaderWorkerSet): this is the leader's rank 0, its stage's ranks spawned here
        # and the others' connecting from their pods.
        place = LWSPlace.from_env() if pp > 1 else None
        if place is not None and place.worker_index != 0:
            raise ValueError(
                f"this pod is LeaderWorkerSet worker {place.worker_index}: it runs pipeline stage "
                f"{place.worker_index}'s ranks (`chunkwise serve`, loop/stage_worker.py), not an engine"
            )
        port = config.distributed_port if place is not None else _free_port()
        init_method = f"tcp://{place.leader_address if place is not None else '127.0.0.1'}:{port}"
        listener = mpc.Listener(("0.0.0.0", port + 1)) if place is not None else None
        ctx = mp.get_context("spawn")
        self._state = _State(tp, pp)
        procs, conns = self._state.procs, self._state.conns
        self._finalizer = weakref.finalize(self, _stop, self._state)
        local = tp if place is not None else n
        shares = cpu_shares(local)
        threads = max(1, len(os.sched_getaffinity(0)) // local)
        for rank in range(1, local):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, tp, pp, init_method, child, config, dtype, shares[rank], threads, make_runner),
                kwargs={"parent": os.getpid()},
                name=f"chunkwise-rank{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            procs[rank] = p
            conns[rank] = parent
        log.info(
            "%s: %d ranks (%d stages of %d), worker pids %s%s",
            self.kind,
            n,
            pp,
            tp,
            self.pids,
            f"; ranks {local}..{n - 1} in the other pods, meeting at {init_method}" if place else "",
        )
        self._state.threads = torch.get_num_threads()
        torch.set_num_threads(threads)  # the ranks share this machine's cores (restored at stop)
        # This thread steps rank 0 (the offline caller's; the server's engine thread is started from it and
        # inherits the mask): on its own share, as each worker is, so no two ranks' threads share a core.
        tid = threading.get_native_id()
        self._state.pinned = (tid, os.sched_getaffinity(tid))
        os.sched_setaffinity(tid, shares[0])
        try:
            accepted = self._accept(listener, range(local, n), (config, dtype)) if listener else None
            self._state.group = self._join(init_method, config)
            if accepted is not None:
                accepted.join(CONNECT_TIMEOUT_S)  # each pod's ranks greet before they join the group
                missing = [r for r in range(local, n) if r not in conns]
                if missing:
                    raise RuntimeError(
                        f"ranks {missing} joined the group but did not connect for their steps"
                    )
        except BaseException:
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()
        # The thread holds the state, not self: a dropped engine is still collected (and its ranks stopped).
        threading.Thread(target=self._state.watch, name="chunkwise-tp-watch", daemon=True).start()

    def _accept(
        self, listener: mpc.Listener, ranks: range, setup: tuple[EngineConfig, str]
    ) -> threading.Thread:
        """Another pod's ranks, each greeting with its global rank, answered with this engine's config and
        dtype (so every stage runs the leader's), in a thread: the rendezvous runs meanwhile."""
        conns = self._state.conns
        data = pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL)

        def accept() -> None:
            with contextlib.suppress(OSError):  # the listener closed: the start failed
                while any(r not in conns for r in ranks):
                    conn = listener.accept()
                    try:
                        # A number, not a pickle: anything on the network may connect.
                        rank = int(conn.recv_bytes(16).decode())
                    except (OSError, EOFError, ValueError):
                        rank = -1
                    if rank not in ranks or rank in conns:
                        log.warning("a connection greeting as rank %d was refused", rank)
                        conn.close()
                        continue
                    conn.send_bytes(data)
                    conns[rank] = conn

        thread = threading.Thread(target=accept, name="chunkwise-pp-accept", daemon=True)
        thread.start()
        return thread

    def _join(self, init_method: str, config: EngineConfig) -> RankGroups:
        """Rank 0's rendezvous, in a thread, so that a worker dying before it joins fails the start at once
        (naming it) instead of after the rendezvous timeout."""
        joined: list[RankGroups | BaseException] = []
        state = self._state
        backend = distributed_backend(config)

        def join() -> None:
            try:
                joined.append(
                    join_world(
                        0,
                        state.tp_size,
                        state.pp_size,
                        init_method=init_method,
                        timeout_s=COLLECTIVE_TIMEOUT_S,
                        device=rank_device(config.device, backend, 0),
                        backend=backend,
                    )
                )
            except BaseException as e:
                joined.append(e)

        thread = threading.Thread(target=join, name="chunkwise-tp-join", daemon=True)
        thread.start()
        procs = self._state.procs
        while thread.is_alive():
            thread.join(0.1)
            for r, p in procs.items():
                if not p.is_alive() and not joined:
                    self._state.dead = r
                    raise RuntimeError(f"{self._state.dead_message()} before joining the group")
        if isinstance(joined[0], BaseException):
            raise joined[0]
        return joined[0]

    @property
    def groups(self) -> RankGroups:
        """Rank 0's place: its tensor-parallel group, and its pipeline stage (RankGroups.stage)."""
        assert self._state.group is not None
        return self._state.group

    @property
    def pids(self) -> list[int]:
        """The worker ranks spawned by this process (not another pod's)."""
        return [p.pid for p in self._state.procs.values() if p.pid is not None]

    def setup(self, sizes: RankSizes | KVProfileRequest) -> None:
        self._send(sizes)

    def check(self) -> None:
        state = self._state
        if state.dead is not None:
            state.stop(self._state.dead_message())
        if state.error is not None:
            raise RankFailure(f"{self.kind}: {state.error}")

    def send(self, message: StepMessage) -> None:
        self._send(message)

    def _send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._state.conns.values():
            conn.send_bytes(data)

    def stop_after(self, error: BaseException) -> None:
        state = self._state
        # A rank that died: its sentinel fires within moments of the collective (or receive) failing on it.
        # The sentinel, not is_alive(): a dying process closes its sockets and its sentinel a moment before
        # it can be reaped, and is_alive() in that moment says True (the error would then name no rank).
        sentinels = state.waitables()
        if state.dead is None:
            ready = mpc.wait(list(sentinels), timeout=2.0)
            if ready and state.dead is None:
                state.dead = min(sentinels[s] for s in ready)
        if state.dead is not None:
            message = state.dead_message()
            state.stop(message)
            raise RankFailure(message) from error
        why = f"a step failed on rank 0 ({type(error).__name__}: {error}); every rank was stopped"
        state.stop(why)
        raise RankFailure(f"{self.kind}: {why}") from error

    def close(self) -> None:
        self._finalizer()


def _die_with(parent: int) -> None:
    """SIGKILL this worker as soon as rank 0 (`parent`) is gone, even mid-collective. Not PR_SET_PDEATHSIG:
    that fires when the *thread* that started the worker exits, and the server builds its engine on a thread
    that ends once the model is loaded."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="chunkwise-tp-orphan-watch", daemon=True).start()


def _worker_main(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    conn: mpc.Connection,
    config: EngineConfig,
    dtype_name: str,
    cpus: list[int],
    threads: int,
    make_runner: MakeRunner,
    parent: int | None = None,
    leader: str | None = None,
) -> None:
    """A worker rank: join the groups, load this rank's shard of its stage, build its runner, then follow
    rank 0's steps until a stop message (or rank 0's end). `parent`: the process that started this one
    (this one dies with it). `leader`: the leader pod's address, for a rank in another pod; losing it (its
    socket closed, or a step failing on a peer gone) ends this process with exit code 1 and a log line
    saying so."""
    if parent is not None:
        _die_with(parent)
    # A terminal's Ctrl-C and a SIGTERM to the whole process group (systemd, `timeout`) reach every rank: only
    # rank 0 acts on them (the server drains, then stops this rank with a message).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    collectives = distributed_backend(config)
    # Its place among this machine's ranks: all of them here, or its stage's in a pod of its own.
    device = rank_device(config.device, collectives, rank % tp_size if leader is not None else rank)
    groups = join_world(
        rank,
        tp_size,
        pp_size,
        init_method=init_method,
        timeout_s=COLLECTIVE_TIMEOUT_S,
        device=device,
        backend=collectives,
    )
    try:
        backend = get_attention_backend(config.attention_backend, device.type)
        dtype = getattr(torch, dtype_name)
        num_layers = check_sizes(config)  # None only where the model cannot be read: one stage, refused below
        stage = groups.stage(num_layers) if num_layers is not None else None
        loaded = load_model(
            config.model, dtype=dtype, device=device, backend=backend, tp_group=groups.tp, pp_stage=stage
        )
        sizes = _receive(conn)
        if isinstance(sizes, KVProfileRequest):  # CUDA: rank 0 profiles too, then the smallest count wins
            request = sizes

            def profile_runner(blocks: int) -> ModelRunner:
                return make_runner(loaded, config, backend, blocks, 0, dtype, device, request.profile_len)

            blocks = profile_kv_blocks(
                profile_runner, device, config, request.block_bytes, request.profile_len
            )
            groups.min_over_ranks(blocks)
            sizes = _receive(conn)
        if sizes is None or sizes is _GONE:
            _leader_lost(rank, leader, sizes)
            return
        assert isinstance(sizes, RankSizes)
        runner = make_runner(
            loaded,
            config,
            backend,
            sizes.num_blocks,
            sizes.num_host_blocks,
            dtype,
            device,
            sizes.max_model_len,
        )
        while (message := _receive(conn)) is not None and message is not _GONE:
            try:
                runner.follow(message)
            except Exception as e:
                if leader is None:
                    raise
                log.error(
                    "rank %d: a step failed (%s: %s); the leader or a peer is gone", rank, type(e).__name__, e
                )
                _leader_lost(rank, leader, _GONE)
        _leader_lost(rank, leader, message)
    finally:
        groups.destroy()


_GONE = object()  # what _receive returns once rank 0's end of the pipe or socket has closed


def _receive(conn: mpc.Connection) -> Any:
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return _GONE


def _leader_lost(rank: int, leader: str | None, message: Any) -> None:
    """After the last message: a stop returns; rank 0 gone returns too on its own machine (this process
    dies with it), and in another pod exits 1, saying so (no teardown: the group's peers are gone)."""
    if message is _GONE and leader is not None:
        log.error("rank %d: lost the leader at %s (its connection closed): exiting", rank, leader)
        logging.shutdown()
        os._exit(1)


def _connect(address: tuple[str, int]) -> mpc.Connection:
    """The leader's socket, retried until it listens (the pods of a group start in any order)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return mpc.Client(address)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def remote_rank_main(
    rank: int, tp_size: int, pp_size: int, leader: str, port: int, threads: int, make_runner: MakeRunner
) -> None:
    """A rank in another pod than rank 0's (loop/stage_worker.py spawns its stage's): greet the leader's
    rank 0 at `leader`:port + 1 with this rank, take the engine's config and dtype from it, then run as any
    worker rank, joining the group at `leader`:port."""
    parent = os.getppid()  # its pod's stage worker: this rank ends with it
    conn = _connect((leader, port + 1))
    conn.send_bytes(str(rank).encode())
    setup = _receive(conn)
    if setup is _GONE:
        _leader_lost(rank, leader, _GONE)
    config, dtype = setup
    if (config.tensor_parallel_size, config.pipeline_parallel_size) != (tp_size, pp_size):
        log.error(
            "rank %d: the leader runs tensor_parallel_size %d x pipeline_parallel_size %d, this pod %d x %d",
            rank,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            tp_size,
            pp_size,
        )
        os._exit(2)
    _worker_main(
        rank,
        tp_size,
        pp_size,
        f"tcp://{leader}:{port}",
        conn,
        config,
        dtype,
        sorted(os.sched_getaffinity(0)),
        threads,
        make_runner,
        parent=parent,
        leader=leader,
    )
