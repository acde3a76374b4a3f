"""Adapters for LoRA benchmarks: random PEFT adapters for a checkpoint, written in PEFT's own layout (no PEFT
needed), and a workload's requests spread over them by Zipf popularity, as fine-tunes are used."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from chunkwise.bench.workloads import WorkItem
from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.lora.adapter import PROJECTIONS, projection_shape
from chunkwise.engine.model.loader import read_checkpoint


def write_random_adapter(model: str | Path | ModelConfig, out: Path, rank: int, seed: int) -> Path:
    """A rank-`rank` adapter on every projection of every layer of `model`: a checkpoint directory, or the
    config of one (a built-in preset's)."""
    from safetensors.torch import save_file

    config = model if isinstance(model, ModelConfig) else read_checkpoint(Path(model))[0]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj in PROJECTIONS:
            fan_in, fan_out = projection_shape(config, proj)
            module = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(PROJECTIONS),
                "bias": "none",
                "base_model_name_or_path": "" if isinstance(model, ModelConfig) else str(model),
                "task_type": "CAUSAL_LM",
            }
        )
    )
    return out


def spread_over_adapters(
    items: Sequence[WorkItem], names: Sequence[str], zipf_s: float, seed: int
) -> list[WorkItem]:
    """Each request given an adapter, the k-th most popular with weight 1 / k^zipf_s."""
    if not names:
        return list(items)
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(len(names))]
    picks = rng.choices(list(names), weights=weights, k=len(items))
    return [dataclasses.replace(it, lora=name) for it, name in zip(items, picks)]
