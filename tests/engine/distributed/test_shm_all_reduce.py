"""The shared-memory all-reduce (distributed/shm.py over kernels/csrc/shm_all_reduce.cpp) on real spawned ranks:
every rank gets the same bits, the sum in rank order, over many calls of changing shapes and dtypes (the two
banks alternate); a tensor larger than a slot goes through gloo; a rank that does not arrive makes the others
raise, naming it, instead of spinning forever; no segment file is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkwise.engine import kernels
from chunkwise.engine.distributed import ProcessGroupTP
from chunkwise.engine.distributed.shm import SLOT_BYTES, ShmAllReduce, _segment_dir
from tests.engine.distributed.ranks import run_ranks

CALLS = 40


def _inputs(call: int, world: int) -> list[torch.Tensor]:
    """Call `call`'s tensor on each rank (every rank can make them all, to know the expected sum)."""
    gen = torch.Generator().manual_seed(call)
    rows = 1 + call % 7 * 9
    dtype = torch.bfloat16 if call % 3 == 0 else torch.float32
    return [torch.randn(rows, 96, generator=gen).to(dtype) for _ in range(world)]


def _expected(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def _many_calls(group: ProcessGroupTP, out: Path) -> None:
    world, rank = group.world_size, group.rank
    results = []
    for call in range(CALLS):
        mine = _inputs(call, world)[rank].clone()
        results.append(group.all_reduce(mine))
    assert isinstance(group._shm, ShmAllReduce), "the group did not set up the shared-memory all-reduce"
    (out / f"segment{rank}").write_text(group._shm.path)
    big = torch.full((SLOT_BYTES // 4 + 1,), float(rank + 1))  # a float more than a slot: gloo's path
    results.append(group.all_reduce(big))
    torch.save(results, out / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_bits_the_sum_in_rank_order(world: int, tmp_path: Path) -> None:
    assert kernels.available(), "the CPU kernels must build on the test machines"
    run_ranks(_many_calls, world, tmp_path, timeout_s=120.0)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for call in range(CALLS):
        expected = _expected(_inputs(call, world))
        for r in range(world):
            assert torch.equal(got[r][call], expected), (call, r)
    for r in range(world):
        assert torch.equal(got[r][CALLS], torch.full((SLOT_BYTES // 4 + 1,), float(sum(range(1, world + 1)))))
    paths = {(tmp_path / f"segment{r}").read_text() for r in range(world)}
    (path,) = paths  # one segment, every rank's
    assert Path(path).parent == _segment_dir()
    assert not Path(path).exists()  # unlinked once every rank had mapped it


def _one_rank_stays_away(group: ProcessGroupTP, out: Path) -> None:
    shm = ShmAllReduce.create(group.group, timeout_s=2.0)
    assert shm is not None
    x = torch.ones(8)
    shm.all_reduce(x)  # both ranks: call 1
    if group.rank == 1:
        (out / "rank1-away").write_text("")
        return  # rank 1 never makes call 2
    try:
        shm.all_reduce(x)
    except RuntimeError as e:
        (out / "rank0-error").write_text(str(e))


def test_a_rank_that_does_not_arrive_is_named_after_the_timeout(tmp_path: Path) -> None:
    run_ranks(_one_rank_stays_away, 2, tmp_path, timeout_s=60.0)
    assert (tmp_path / "rank1-away").exists()
    message = (tmp_path / "rank0-error").read_text()
    assert "rank 0 waited 2.0" in message and "for rank 1 at call 2" in message


def _aborted_while_waiting(group: ProcessGroupTP, out: Path) -> None:
    import threading
    import time

    shm = ShmAllReduce.create(group.group, timeout_s=60.0)
    assert shm is not None
    if group.rank == 1:
        return  # never arrives: rank 0 waits until its abort
    threading.Timer(0.5, shm.abort).start()
    t0 = time.monotonic()
    try:
        shm.all_reduce(torch.ones(8))
    except RuntimeError as e:
        (out / "rank0-error").write_text(f"{time.monotonic() - t0:.2f} {e}")


def test_an_abort_ends_the_wait_at_once_not_at_the_timeout(tmp_path: Path) -> None:
    run_ranks(_aborted_while_waiting, 2, tmp_path, timeout_s=60.0)
    seconds, message = (tmp_path / "rank0-error").read_text().split(" ", 1)
    assert "aborted while rank 0 waited for rank 1 (a rank died)" in message
    assert float(seconds) < 10.0  # the timeout was 60 s


def _gathers(group: ProcessGroupTP, out: Path) -> None:
    rank = group.rank
    group.all_reduce(torch.ones(4))  # sets the segment up
    results = []
    for call in range(12):
        x = torch.full((3 + call, 5), float(10 * rank + call))
        if call % 2:
            results.append(group.all_reduce(x.clone()))  # sums and gathers share the banks' alternation
        results.append(group.all_gather(x, dim=-1 if call % 3 else 0))
    assert isinstance(group._shm, ShmAllReduce)
    torch.save(results, out / f"rank{rank}.pt")


def test_all_gather_concatenates_every_ranks_part_in_rank_order(tmp_path: Path) -> None:
    run_ranks(_gathers, 3, tmp_path, timeout_s=120.0)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    expected = []
    for call in range(12):
        parts = [torch.full((3 + call, 5), float(10 * r + call)) for r in range(3)]
        if call % 2:
            expected.append(sum(parts[1:], parts[0]))
        expected.append(torch.cat(parts, dim=-1 if call % 3 else 0))
    for r in range(3):
        assert len(got[r]) == len(expected)
        for g, e in zip(got[r], expected):
            assert torch.equal(g, e)
