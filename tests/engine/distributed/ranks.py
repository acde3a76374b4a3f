"""Run a function on N real gloo ranks: processes spawned with torch.multiprocessing, joined under a
deadline (a rank that hangs or dies fails the test; none outlives it)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from chunkwise.engine.distributed import init_tp_group


def _rank_main(
    rank: int, fn: Callable[..., None], world_size: int, init_method: str, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)  # the ranks share the test machine's cores
    group = init_tp_group(rank, world_size, init_method=init_method, timeout_s=60.0)
    try:
        fn(group, *args)
    finally:
        group.destroy()


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, timeout_s: float = 60.0) -> None:
    """fn(group: ProcessGroupTP, *args) on each of `world_size` spawned ranks (fn and args picklable: fn a
    module-level function); raises the first rank's exception, or TimeoutError past `timeout_s`."""
    with tempfile.TemporaryDirectory() as rendezvous:
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, world_size, f"file://{rendezvous}/init", args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{world_size} ranks still running after {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
