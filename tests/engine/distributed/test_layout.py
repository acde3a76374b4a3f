"""What each rank holds of a model: heads and KV heads (replicated where there are fewer KV heads than
ranks, each rank keeping the one its query heads read), MLP columns, vocabulary rows with padding; sizes that
do not divide refused naming the field and the tensor-parallel size."""

from __future__ import annotations

import re

import pytest

from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.distributed import TPLayout


def config(heads: int = 8, kv: int = 2, inter: int = 96, vocab: int = 301) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=8,
    )


@pytest.mark.parametrize(
    ("heads", "kv", "world"), [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 1, 2), (8, 8, 4), (4, 2, 4)]
)
def test_each_rank_s_query_heads_read_the_kv_heads_it_holds(heads: int, kv: int, world: int) -> None:
    """The unsharded model's grouping (query head h reads KV head h // (heads / kv)) is what each rank's
    local grouping computes over the KV heads it holds; every KV head is held by kv_replicas ranks."""
    cfg = config(heads, kv)
    held: dict[int, int] = {}
    for rank in range(world):
        lay = TPLayout.of(cfg, rank, world)
        assert lay.num_heads * world == heads and lay.head_start == rank * lay.num_heads
        local_group = lay.num_heads // lay.num_kv_heads
        for j in range(lay.num_heads):
            global_kv = (lay.head_start + j) // (heads // kv)
            assert lay.kv_head_start + j // local_group == global_kv
        for h in range(lay.kv_head_start, lay.kv_head_start + lay.num_kv_heads):
            held[h] = held.get(h, 0) + 1
        assert lay.kv_replicas == max(1, world // kv)
    assert held == dict.fromkeys(range(kv), max(1, world // kv))


def test_mlp_and_vocabulary_shares() -> None:
    cfg = config(vocab=301)
    layouts = [TPLayout.of(cfg, r, 4) for r in range(4)]
    assert [lay.intermediate_start for lay in layouts] == [0, 24, 48, 72]
    assert {lay.intermediate_size for lay in layouts} == {24}
    # ceil(301 / 4) = 76 rows each; the last rank's 76 rows hold 73 tokens and 3 rows of padding.
    assert [(lay.vocab_start, lay.vocab_shard, lay.vocab_rows) for lay in layouts] == [
        (0, 76, 76),
        (76, 76, 76),
        (152, 76, 76),
        (228, 76, 73),
    ]
    whole = TPLayout.of(cfg)
    shares = (whole.num_heads, whole.num_kv_heads, whole.intermediate_size, whole.vocab_shard)
    assert shares == (8, 2, 96, 301)


@pytest.mark.parametrize(
    ("cfg", "world", "field"),
    [
        (config(heads=8, kv=2), 3, "num_attention_heads (8)"),
        (config(heads=6, kv=3), 2, "num_key_value_heads (3)"),
        (config(heads=12, kv=3), 4, "num_key_value_heads (3)"),
        (config(inter=98), 4, "intermediate_size (98)"),
    ],
)
def test_sizes_that_do_not_divide_are_refused(cfg: ModelConfig, world: int, field: str) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"{field} does not divide over tensor_parallel_size {world}")
    ):
        TPLayout.of(cfg, 0, world)


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is not one of tensor_parallel_size 2 ranks"):
        TPLayout.of(config(), 2, 2)
