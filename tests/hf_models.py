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


# Families and rotary scalings beyond the plain Llama above: (transformers config class, model class, config
# overrides). Small contexts so that test prompts run past each scaling's original context.
FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
        ),
    ),
    "llama-dynamic": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    "llama-longrope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    "qwen2-bias-yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        # head_dim 32 where hidden / heads is 16: Qwen3 sets it on its own.
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
    ),
}


def save_random_family(
    path: Path, name: str, seed: int = 0, vocab_size: int = 320, num_hidden_layers: int = 2
) -> Path:
    """A random checkpoint of one of FAMILIES, saved with save_pretrained. Norms and biases are randomised too
    (so loading them is tested), and q/k are sharpened as the built-in presets are: with transformers' init
    attention is nearly uniform and the rotation (and any scaling of it) would not change a greedy token."""
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    model = getattr(transformers, model_cls)(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / cfg.hidden_size**0.5)
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


LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = [
    "The scheduler decides which requests run this iteration, how much prompt to process, and when to shed load.",
    "Chunked prefill splits a long prompt into pieces and schedules one piece per iteration beside decode work.",
    "def step(state):\n    finished = [s for s in state.running if s.done]\n    return tokens\n",
    "Admission reserves blocks for the prompt and the expected output; preemption is the backstop.",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def save_byte_fallback_tokenizer(path: Path, vocab_size: int = 600) -> int:
    """A SentencePiece-style BPE (Llama 2's decoder; byte fallback for what training never saw, so emoji and
    CJK decode from <0xXX> pieces), Llama 3's special tokens and chat template, trained offline on CORPUS.
    Writes tokenizer.json and tokenizer_config.json into `path`; returns the vocabulary size."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_pieces = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer=trainer)
    # The byte pieces are ordinary vocabulary (not special: skip_special_tokens must not drop them).
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for piece in byte_pieces:
        vocab.setdefault(piece, len(vocab))
    (path / "tokenizer.json").write_text(json.dumps(spec))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "<|eot_id|>",
                "chat_template": LLAMA3_STYLE_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return len(vocab)


def save_random_lora(
    base: Path,
    out: Path,
    *,
    r: int,
    targets: list[str],
    alpha: float = 16.0,
    use_rslora: bool = False,
    seed: int = 0,
    **config: object,
) -> Path:
    """A PEFT LoRA adapter for the checkpoint at `base`, saved with PEFT's own save_pretrained. PEFT starts B
    at zero (a no-op adapter), so A and B are drawn here, large enough to change greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, **config)  # type: ignore[arg-type]
    peft_model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(out)
    return out


def peft_merged_greedy(
    base: Path, adapter: Path | None, prompts: list[list[int]], max_new: list[int], tmp: Path
) -> list[list[int]]:
    """transformers' greedy output of `base` with `adapter` merged into it by PEFT (merge_and_unload)."""
    if adapter is None:
        return hf_greedy(base, prompts, max_new)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = tmp / f"merged-{adapter.name}"
    merged.save_pretrained(out)
    return hf_greedy(out, prompts, max_new)
