"""The tensor-parallel group's collectives over two real gloo ranks, and world size 1 touching no process
group at all."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from chunkwise.engine.distributed import SINGLE_RANK, ProcessGroupTP
from tests.engine.distributed.ranks import run_ranks


def _collectives(group: ProcessGroupTP, out: Path) -> None:
    r = group.rank
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r
    summed = group.all_reduce(x.clone())
    half = group.all_reduce(torch.full((4,), 0.5 + r, dtype=torch.bfloat16))
    gathered_last = group.all_gather(x, dim=-1)
    gathered_first = group.all_gather(x, dim=0)
    empty = group.all_reduce(torch.empty(0, 3))
    torch.save(
        {
            "rank": r,
            "world": group.world_size,
            "summed": summed,
            "half": half,
            "last": gathered_last,
            "first": gathered_first,
            "empty": tuple(empty.shape),
        },
        out / f"rank{r}.pt",
    )


def test_two_ranks_sum_and_gather(tmp_path: Path) -> None:
    run_ranks(_collectives, 2, tmp_path)
    x0 = torch.arange(6, dtype=torch.float32).view(2, 3)
    x1 = x0 + 10
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert (got["rank"], got["world"]) == (r, 2)
        assert torch.equal(got["summed"], x0 + x1)
        assert got["half"].dtype == torch.bfloat16 and torch.equal(
            got["half"], torch.full((4,), 2.0).bfloat16()
        )
        assert torch.equal(got["last"], torch.cat((x0, x1), dim=1))
        assert torch.equal(got["first"], torch.cat((x0, x1), dim=0))
        assert got["empty"] == (0, 3)


def test_world_size_one_is_the_identity_without_a_process_group() -> None:
    x = torch.randn(3, 4)
    assert (SINGLE_RANK.rank, SINGLE_RANK.world_size) == (0, 1)
    assert SINGLE_RANK.all_reduce(x) is x
    assert SINGLE_RANK.all_gather(x, dim=-1) is x
    assert not dist.is_initialized()
