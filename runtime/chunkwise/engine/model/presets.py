"""Built-in models: Llama-shaped, byte-level vocabulary, weights drawn from a fixed seed (no download).

`tiny` is for tests and `make serve`; `small` (~55M parameters) is big enough that on CPU the forward
pass, not engine overhead, dominates a step, so benchmarks measure the scheduler against real work.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.tokenizer import ByteTokenizer

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

# For GPU benchmarks (bench/gpu/run_engine_bench.py): Llama-3-8B's shape, random weights, the byte
# tokenizer (prompts are token ids; ids past 257 have no text).
PRESETS["llama3-8b"] = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    bos_token_id=_BYTE.bos_token_id,
    eos_token_ids=_BYTE.eos_token_ids,
)

PRESET_SEEDS = {"tiny": 1234, "small": 5678, "llama3-8b": 8008}
# Presets too large to draw on the host in fp32 and copy (32 GB for 8B parameters): their weights are drawn
# tensor by tensor on the target device, so they are the same on every machine of one device type only.
DEVICE_DRAWN_PRESETS = frozenset({"llama3-8b"})

INIT_STD = 0.02
# HF's init (std 0.02 everywhere) leaves a deep random model's attention nearly uniform: every position
# averages the same context, hidden states collapse, and greedy decoding repeats one token forever. Sharper
# q/k (scores with std ~3, whatever the width) keep attention content-specific and greedy output varied;
# an output projection giving logits of std ~3 keeps sampling at temperature 1 from being uniform noise.
# tests/engine/model/test_model.py checks that greedy output does not get stuck.
QK_STD_TIMES_SQRT_HIDDEN = 1.7
LM_HEAD_STD_TIMES_SQRT_HIDDEN = 3.0


def hf_parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a Hugging Face Llama with this config, by name (a tied lm_head is not listed)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
        if config.attention_bias:
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[f"{p}self_attn.{proj}.bias"] = (rows,)
    return shapes


def preset_state_dict(name: str) -> dict[str, torch.Tensor]:
    """A preset's weights under Hugging Face's names, fp32 on the CPU: the same on every machine, whatever
    the target device or dtype (the loader converts them as it copies)."""
    config = PRESETS[name]
    return random_state_dict(hf_parameter_shapes(config), PRESET_SEEDS[name], config.hidden_size)


def random_state_dict(
    shapes: dict[str, tuple[int, ...]], seed: int, hidden_size: int
) -> dict[str, torch.Tensor]:
    """Fill every tensor from one CPU generator in name order."""
    return dict(random_tensors(shapes, seed, hidden_size, torch.device("cpu")))


def random_tensors(
    shapes: dict[str, tuple[int, ...]], seed: int, hidden_size: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor in name order, fp32, drawn from one generator on `device` (one at a time)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name in sorted(shapes):
        t = torch.empty(shapes[name], device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                std = QK_STD_TIMES_SQRT_HIDDEN / math.sqrt(hidden_size)
            elif name.endswith("lm_head.weight"):
                std = LM_HEAD_STD_TIMES_SQRT_HIDDEN / math.sqrt(hidden_size)
            else:
                std = INIT_STD
            t.normal_(0.0, std, generator=gen)
        yield name, t
