"""The tensor-parallel group's collectives over two real gloo ranks, and world size 1 touching no process
group at all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.distributed import SINGLE_RANK, ProcessGroupTP, RankGroups, backend_for, rank_device
from chunkwise.engine.loop.tp_ranks import check_devices
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


def _smallest(group: ProcessGroupTP, out: Path) -> None:
    groups = RankGroups(group.rank, group.world_size, 1, group, torch.device("cpu"))
    # Each rank's KV block count from its own memory profile: every rank must take the smallest.
    (out / f"rank{group.rank}").write_text(str(groups.min_over_ranks(1000 - 7 * group.rank)))


def test_every_rank_agrees_on_the_smallest_block_count(tmp_path: Path) -> None:
    run_ranks(_smallest, 2, tmp_path)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["993", "993"]


def test_each_rank_s_device_and_the_backend_it_uses() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert (backend_for(cuda), backend_for(cpu), backend_for(cuda, "gloo")) == ("nccl", "gloo", "gloo")
    # NCCL: a GPU per rank, from rank 0's on; gloo (and the CPU): every rank on rank 0's device.
    assert [rank_device("cuda:1", "nccl", r) for r in range(3)] == [
        torch.device("cuda", i) for i in (1, 2, 3)
    ]
    assert rank_device("cuda", "nccl", 1) == torch.device("cuda", 1)
    assert rank_device("cuda:0", "gloo", 1) == torch.device("cuda", 0) == rank_device("cuda", "gloo", 1)
    assert rank_device("cpu", "gloo", 1) == cpu


def test_too_few_gpus_for_nccl_are_refused_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices(engine_config_from_kwargs("tiny", device="cuda", tensor_parallel_size=2))
    check_devices(
        engine_config_from_kwargs("tiny", device="cuda:1", tensor_parallel_size=4, distributed_backend="gloo")
    )
    with pytest.raises(
        ValueError, match=r"needs one GPU per rank from cuda:1 on \(up to cuda:2\); this machine has 2"
    ):
        check_devices(engine_config_from_kwargs("tiny", device="cuda:1", tensor_parallel_size=2))
