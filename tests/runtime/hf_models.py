"""Random Hugging Face models saved to disk, and transformers' greedy output as the numerical reference."""

from __future__ import annotations

from pathlib import Path

import torch

CONFIGS: dict[str, dict[str, object]] = {
    # Grouped-query attention, untied embeddings, default rope_theta.
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0),
    # Multi-head attention, tied embeddings, a non-default rope_theta.
    "mha_tied": dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0
    ),
    # Multi-query attention (one KV head), non-default rope_theta.
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False, rope_theta=1234.0),
}


def save_random_llama(path: Path, name: str, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        **CONFIGS[name],  # type: ignore[arg-type]
    )
    model = LlamaForCausalLM(cfg).eval()
    out = path / name
    model.save_pretrained(out)
    return out


def hf_greedy(path: Path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p, n in zip(prompts, max_new):
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p) :].tolist())
    return outs
