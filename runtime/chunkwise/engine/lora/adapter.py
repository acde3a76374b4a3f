"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a base model: what is
supported is read, what is not is refused naming the config field or tensor, never served with wrong output.

Each targeted projection's update is W + scaling * B A, with A [r, in] and B [out, r] as PEFT saves them and
scaling lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA). The scaling is folded into B once here."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from chunkwise.engine.datatypes.config import ModelConfig

# The projections an adapter may target, by their Hugging Face names, with the module holding each.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS

_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


def projection_shape(config: ModelConfig, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of the base model (unsharded)."""
    hd, h, i = config.head_dim, config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[proj]


@dataclass
class LoRAAdapter:
    """An adapter read and checked against its base model, on the host in float32."""

    name: str
    path: str
    rank: int
    scaling: float
    # (layer, HF projection) -> (A [r, in], scaling * B [out, r]).
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> set[str]:
        return {proj for _, proj in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


def _refuse(path: Path, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {why}")


def read_adapter(name: str, path: str | Path, base: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at `path` for a model of config `base`; ValueError naming what is wrong or unsupported."""
    from safetensors.torch import load_file

    root = Path(path)
    config_file = root / "adapter_config.json"
    if not config_file.is_file():
        raise _refuse(root, "no adapter_config.json there (a PEFT LoRA adapter directory is expected)")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(root, f"adapter_config.json is not readable JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise _refuse(root, "adapter_config.json is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(root, f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    # Each a field whose other values would change the computation: refused rather than ignored.
    unsupported = {
        "use_dora": (cfg.get("use_dora") or False, "DoRA (use_dora: true) is not supported"),
        "bias": (cfg.get("bias", "none") not in ("none", None), f"bias {cfg.get('bias')!r} is not supported"),
        "fan_in_fan_out": (cfg.get("fan_in_fan_out") or False, "fan_in_fan_out: true is not supported"),
        "modules_to_save": (bool(cfg.get("modules_to_save")), "modules_to_save (whole trained modules)"),
        "rank_pattern": (bool(cfg.get("rank_pattern")), "per-module ranks (rank_pattern) are not supported"),
        "alpha_pattern": (
            bool(cfg.get("alpha_pattern")),
            "per-module alphas (alpha_pattern) are not supported",
        ),
        "use_qalora": (cfg.get("use_qalora") or False, "QALoRA (use_qalora: true) is not supported"),
    }
    for field_name, (bad, why) in unsupported.items():
        if bad:
            raise _refuse(root, f"{field_name}: {why}")
    r = cfg.get("r")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _refuse(root, f"r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _refuse(root, f"lora_alpha must be a number, got {alpha!r}")
    if r > max_lora_rank:
        raise _refuse(root, f"r {r} is above max_lora_rank {max_lora_rank} (raise --max-lora-rank)")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r

    weights_file = root / "adapter_model.safetensors"
    if not weights_file.is_file():
        also = " (adapter_model.bin, a pickle, is not read)" if (root / "adapter_model.bin").exists() else ""
        raise _refuse(root, f"no adapter_model.safetensors there{also}")
    tensors = load_file(str(weights_file))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _TENSOR.match(key)
        if m is None or m.group(3) not in PROJECTIONS:
            raise _refuse(
                root,
                f"tensor {key!r} is not a LoRA A/B weight of {', '.join(PROJECTIONS)} "
                "(embedding, LM-head and DoRA weights are not supported)",
            )
        layer, module, proj, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if (module == "self_attn") != (proj in ATTENTION_PROJECTIONS):
            raise _refuse(root, f"tensor {key!r}: {proj} is not under {module}")
        if layer >= base.num_hidden_layers:
            raise _refuse(root, f"tensor {key!r}: the base model has {base.num_hidden_layers} layers")
        halves.setdefault((layer, proj), {})[half] = t
    if not halves:
        raise _refuse(root, "adapter_model.safetensors holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), pair in sorted(halves.items()):
        where = f"layer {layer} {proj}"
        if set(pair) != {"A", "B"}:
            raise _refuse(root, f"{where} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = projection_shape(base, proj)
        if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise _refuse(
                root,
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit r {r} and the base "
                f"model's {proj} ({fan_in} in, {fan_out} out): an adapter for another model?",
            )
        weights[(layer, proj)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoRAAdapter(name, str(root), r, scaling, weights)
