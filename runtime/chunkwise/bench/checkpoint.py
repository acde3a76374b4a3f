"""The random Llama checkpoint that `chunkwise bench compare vllm` runs on both engines, written in Hugging Face
format without transformers (torch, safetensors and tokenizers only).

Both engines must load the same weights from disk, so the checkpoint is a real HF directory: config.json,
generation_config.json, model.safetensors under HF's parameter names, and a word-level tokenizer.json (ids
3.. are the words "w3", "w4", ...; decoding joins words with spaces) that `tokenizers`, transformers and vLLM
all load. The default shape is 57M parameters: large enough that on a CPU the forward pass, not either
engine's Python, dominates a step.

A directory written here carries a marker file naming its spec; `ensure_checkpoint` reuses a directory
whose marker matches and rewrites one that does not, so a cached checkpoint never silently differs from
the one asked for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bumped whenever what write_checkpoint produces changes, so cached directories are rewritten.
FORMAT_VERSION = 1
MARKER = "chunkwise_bench_checkpoint.json"
DEFAULT_NAME = "llama-57m"
SPECIALS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
INIT_STD = 0.02


@dataclass(frozen=True)
class CheckpointSpec:
    """A Llama shape and the seed of its weights. The defaults are the benchmark's 57M-parameter model."""

    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1536
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "seed" and value < 1:
                raise ValueError(f"{f.name} must be positive, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.vocab_size <= len(SPECIALS):
            raise ValueError(f"vocab_size must exceed the {len(SPECIALS)} special tokens")

    @property
    def num_parameters(self) -> int:
        return sum(_numel(shape) for _, shape in weight_shapes(self))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_shapes(spec: CheckpointSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint under its Hugging Face name, in a fixed order (the draw order)."""
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    q = spec.num_attention_heads * spec.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab_size, h))]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (spec.intermediate_size, h)),
            (f"{p}.mlp.up_proj.weight", (spec.intermediate_size, h)),
            (f"{p}.mlp.down_proj.weight", (h, spec.intermediate_size)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (spec.vocab_size, h))]
    return out


def hf_config(spec: CheckpointSpec) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def vocabulary(vocab_size: int) -> dict[str, int]:
    words = {tok: i for i, tok in enumerate(SPECIALS)}
    words.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    return words


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    """A word-level tokenizer.json: whitespace-split words, BOS prepended, decoded with spaces between words.

    The WordPiece decoder (with cleanup off and a "##" prefix no word has) is the stock decoder that puts
    a space between tokens; a real-looking text stream matters because an HTTP server streams decoded
    text, and a token that decodes to nothing would be a missing chunk to the client.
    """
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIALS)
    ]
    bos = SPECIALS[BOS_ID]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocabulary(vocab_size), "unk_token": SPECIALS[UNK_ID]},
    }


def tokenizer_config(spec: CheckpointSpec) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[BOS_ID],
        "eos_token": SPECIALS[EOS_ID],
        "unk_token": SPECIALS[UNK_ID],
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIALS)
        },
    }


def _marker(spec: CheckpointSpec) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "spec": dataclasses.asdict(spec)}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def write_checkpoint(spec: CheckpointSpec, out_dir: str | Path) -> Path:
    """Write the checkpoint into `out_dir` (created; existing files of the same names are replaced)."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(spec.seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(spec):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        else:
            state[name] = torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", hf_config(spec))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False},
    )
    _write_json(out / "tokenizer.json", tokenizer_json(spec.vocab_size))
    _write_json(out / "tokenizer_config.json", tokenizer_config(spec))
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": SPECIALS[BOS_ID], "eos_token": SPECIALS[EOS_ID], "unk_token": SPECIALS[UNK_ID]},
    )
    # Last, so a directory whose writing was interrupted is never taken for a complete one.
    _write_json(out / MARKER, _marker(spec))
    return out


def is_current(spec: CheckpointSpec, path: str | Path) -> bool:
    """Whether `path` holds a complete checkpoint written for exactly `spec`."""
    p = Path(path)
    try:
        marker = json.loads((p / MARKER).read_text(encoding="utf-8"))
        config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    files = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    return marker == _marker(spec) and config == hf_config(spec) and all((p / f).is_file() for f in files)


def default_dir(name: str = DEFAULT_NAME) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chunkwise" / "bench" / name


def ensure_checkpoint(
    spec: CheckpointSpec, path: str | Path | None = None, log: Any = None
) -> tuple[Path, bool]:
    """The checkpoint for `spec` at `path` (default: the cache directory), written if missing or stale.
    Returns (directory, whether it was written now)."""
    target = Path(path) if path is not None else default_dir()
    if is_current(spec, target):
        return target, False
    if target.exists() and not (target / MARKER).is_file() and any(target.iterdir()):
        # Never overwrite a directory this module did not write: it may be someone's real model.
        raise ValueError(
            f"{target} exists and is not a benchmark checkpoint (no {MARKER}); give another "
            "--checkpoint-dir, or --model to use it as it is"
        )
    if log is not None:
        log(f"writing the benchmark checkpoint ({spec.num_parameters / 1e6:.1f}M parameters) to {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place, so a concurrent or interrupted run never sees
    # half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_checkpoint(spec, tmp)
        # mkdtemp makes the directory private; a cache is as readable as anything else the user writes.
        umask = os.umask(0)
        os.umask(umask)
        for p in (tmp, *tmp.iterdir()):
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target, True
