"""A LeaderWorkerSet worker pod's process (LWS_WORKER_INDEX i > 0; `chunkwise serve` with the leader's
arguments): pipeline stage i's tensor-parallel ranks, spawned here, each joining the leader's group
(loop/tp_ranks.py, remote_rank_main) and following its steps. No HTTP: the leader's engine is the one that
answers requests (offline only, so far).

It runs until the leader stops the engine (every rank exits 0: this process exits 0) or is lost (a rank
exits non-zero, saying why in its log line: this process stops the other ranks and exits 1, so that the
LeaderWorkerSet restarts the group)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
from multiprocessing.process import BaseProcess
from typing import Any

from chunkwise.engine.datatypes.config import EngineConfig
from chunkwise.engine.distributed.lws import LWSPlace
from chunkwise.engine.loop.builder import make_runner
from chunkwise.engine.loop.tp_ranks import remote_rank_main

log = logging.getLogger("chunkwise.engine.loop.stage_worker")


def run_stage_worker(config: EngineConfig, place: LWSPlace) -> int:
    """Stage place.worker_index's ranks, until they end: 0 when the leader stopped the engine, 1 otherwise."""
    place.check(config.pipeline_parallel_size)
    tp = config.tensor_parallel_size
    stage = place.worker_index
    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // tp)
    procs: dict[int, BaseProcess] = {}
    for rank in range(stage * tp, (stage + 1) * tp):
        p = ctx.Process(
            target=remote_rank_main,
            args=(
                rank,
                tp,
                config.pipeline_parallel_size,
                place.leader_address,
                config.distributed_port,
                threads,
                make_runner,
            ),
            name=f"chunkwise-rank{rank}",
            daemon=True,
        )
        p.start()
        procs[rank] = p
    log.info(
        "pipeline stage %d of %d: ranks %s (pids %s), joining the leader at %s:%d",
        stage,
        config.pipeline_parallel_size,
        list(procs),
        [p.pid for p in procs.values()],
        place.leader_address,
        config.distributed_port,
    )
    pending: dict[Any, int] = {p.sentinel: r for r, p in procs.items()}
    while pending:
        for sentinel in mpc.wait(list(pending)):
            rank = pending.pop(sentinel)
            proc = procs[rank]
            proc.join()
            if proc.exitcode != 0:
                log.error(
                    "pipeline stage %d's rank %d exited with code %s (the leader at %s lost, or a peer): "
                    "stopping this pod's other ranks",
                    stage,
                    rank,
                    proc.exitcode,
                    place.leader_address,
                )
                for q in procs.values():
                    if q.is_alive():
                        q.kill()
                    q.join()
                return 1
    log.info("pipeline stage %d: the leader stopped the engine", stage)
    return 0
