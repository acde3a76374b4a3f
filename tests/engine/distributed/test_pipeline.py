"""Which layers each pipeline stage holds (vLLM's split), refused below one layer a stage; and what a stage
loads: its layers' weights only (the embedding on the first stage, the final norm and LM head on the last,
the embedding there too when the LM head is tied to it), equal to the whole model's same tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkwise.engine.attention import get_attention_backend
from chunkwise.engine.distributed import PipelineStage, stage_layers
from chunkwise.engine.model.loader import hf_state_dict, load_model
from tests.hf_models import save_random_family


@pytest.mark.parametrize(
    ("layers", "stages", "sizes"),
    [(2, 2, [1, 1]), (3, 2, [2, 1]), (5, 2, [3, 2]), (7, 4, [2, 2, 2, 1]), (6, 4, [1, 2, 2, 1]), (4, 1, [4])],
)
def test_stages_hold_consecutive_layers_as_even_as_possible(
    layers: int, stages: int, sizes: list[int]
) -> None:
    split = stage_layers(layers, stages)
    assert [len(r) for r in split] == sizes
    assert [i for r in split for i in r] == list(range(layers))  # consecutive, each layer once


def test_fewer_layers_than_stages_is_refused_naming_both_fields() -> None:
    with pytest.raises(ValueError, match=r"num_hidden_layers \(3\) is fewer than pipeline_parallel_size 4"):
        stage_layers(3, 4)


def test_global_ranks_map_to_stages_and_their_peers() -> None:
    # tensor_parallel_size 2, pipeline_parallel_size 2: ranks 0, 1 are stage 0; 2, 3 stage 1.
    first = PipelineStage.of(1, 2, 2, 4)
    assert (first.stage, first.layers, first.prev_rank, first.next_rank) == (0, range(0, 2), None, 3)
    assert first.logits_to is None and first.logits_from is None
    assert PipelineStage.of(0, 2, 2, 4).logits_from == 2  # rank 0 samples from the last stage's rank 0
    last = PipelineStage.of(2, 2, 2, 4)
    assert (last.stage, last.layers, last.prev_rank, last.next_rank, last.logits_to) == (
        1,
        range(2, 4),
        0,
        None,
        0,
    )
    assert PipelineStage.of(3, 2, 2, 4).logits_to is None  # one sender


@pytest.mark.parametrize("family", ["qwen3", "mistral"])  # tied and untied LM heads
def test_a_stage_loads_its_layers_only(family: str, tmp_path: Path) -> None:
    path = save_random_family(tmp_path, family, num_hidden_layers=3)
    backend = get_attention_backend("torch", "cpu")

    def load(stage: PipelineStage | None) -> dict[str, torch.Tensor]:
        loaded = load_model(
            str(path), dtype=torch.float32, device="cpu", backend=backend, prepare=False, pp_stage=stage
        )
        return hf_state_dict(loaded.model)

    whole = load(None)
    first = load(PipelineStage(stage=0, num_stages=2, layers=range(0, 2)))
    last = load(PipelineStage(stage=1, num_stages=2, layers=range(2, 3)))
    assert {k.split(".")[2] for k in first if k.startswith("model.layers.")} == {"0", "1"}
    assert {k.split(".")[2] for k in last if k.startswith("model.layers.")} == {"2"}
    assert "model.embed_tokens.weight" in first and "model.norm.weight" not in first
    assert "lm_head.weight" not in first
    assert "model.norm.weight" in last
    tied = family == "qwen3"
    assert ("model.embed_tokens.weight" in last) == tied and ("lm_head.weight" in last) != tied
    for part in (first, last):
        for name, tensor in part.items():
            assert torch.equal(tensor, whole[name]), name
