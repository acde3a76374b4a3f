"""Built-in models: Llama-shaped, byte-level vocabulary, weights drawn from a fixed seed (no download).

`tiny` is for tests and `make serve`; `small` (~55M parameters) is big enough that on CPU the forward
pass, not engine overhead, dominates a step, so benchmarks measure the scheduler against real work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from chunkwise.config import ModelConfig
from chunkwise.tokenizer import ByteTokenizer

_BYTE = ByteTokenizer()

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=_BYTE.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        bos_token_id=_BYTE.bos_token_id,
        eos_token_ids=_BYTE.eos_token_ids,
    ),
    "small": ModelConfig(
        vocab_size=_BYTE.vocab_size,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=14,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        bos_token_id=_BYTE.bos_token_id,
        eos_token_ids=_BYTE.eos_token_ids,
    ),
}

PRESET_SEEDS = {"tiny": 1234, "small": 5678}

INIT_STD = 0.02
# HF's init (std 0.02 everywhere) leaves a deep random model's attention nearly uniform: every position
# averages the same context, hidden states collapse, and greedy decoding repeats one token forever. Sharper
# q/k (scores with std ~3, whatever the width) keep attention content-specific and greedy output varied;
# an output projection giving logits of std ~3 keeps sampling at temperature 1 from being uniform noise.
# tests/runtime/test_model.py checks that greedy output does not get stuck.
QK_STD_TIMES_SQRT_HIDDEN = 1.7
LM_HEAD_STD_TIMES_SQRT_HIDDEN = 3.0


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int, hidden_size: int) -> None:
    """Fill every parameter from one CPU generator in name order: the same model on every machine,
    whatever the target device or dtype."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.device.type != "cpu" or param.dtype != torch.float32:
            raise ValueError("init_random_weights fills fp32 CPU parameters; move the model afterwards")
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                std = QK_STD_TIMES_SQRT_HIDDEN / math.sqrt(hidden_size)
            elif name.endswith("lm_head.weight"):
                std = LM_HEAD_STD_TIMES_SQRT_HIDDEN / math.sqrt(hidden_size)
            else:
                std = INIT_STD
            param.normal_(0.0, std, generator=gen)
