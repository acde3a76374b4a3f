"""Build a model from a preset name or a Hugging Face directory. Nothing is ever downloaded.

An HF directory holds config.json, one or more *.safetensors files and (usually) tokenizer.json. Every
mismatch between what the config describes and what the weights hold is an error naming the tensors, so
a wrong checkpoint fails at start-up rather than serving noise.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from chunkwise.attention.backend import AttentionBackend
from chunkwise.config import ModelConfig, RopeScaling
from chunkwise.model.layers import Linear
from chunkwise.model.llama import LlamaForCausalLM
from chunkwise.model.presets import (
    DEVICE_DRAWN_PRESETS,
    PRESET_SEEDS,
    PRESETS,
    hf_parameter_shapes,
    preset_state_dict,
    random_tensors,
)
from chunkwise.platform import cpu_has_bf16_matmul
from chunkwise.tokenizer import ByteTokenizer, HFTokenizer, NoTokenizer, Tokenizer

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Rotary scalings computed as transformers does (model/rope.py); "default" is no scaling.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# Checkpoints saved by older transformers versions carry the rotary table; we compute it.
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
# How many names an error lists before it summarises.
MAX_NAMES_IN_ERROR = 10

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    chat_template: str | None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end generation: the model config's and the tokenizer's, as HF's generate uses."""
        return tuple(dict.fromkeys((*self.config.eos_token_ids, *self.tokenizer.eos_token_ids)))


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    backend: AttentionBackend,
    prepare: bool = True,
) -> LoadedModel:
    """The model, its tokenizer and chat template, with weights in `dtype` on `device`.

    With prepare=True (serving) the linear weights are then laid out for the device's matmul library
    (Linear.prepare) and no longer read as plain tensors; prepare=False keeps them inspectable."""
    if name_or_path in PRESETS:
        loaded = _load_preset(name_or_path, dtype=dtype, device=device, backend=backend)
    else:
        path = Path(name_or_path)
        if not path.is_dir():
            raise ValueError(
                f"model {name_or_path!r} is neither a built-in preset ({', '.join(sorted(PRESETS))}) nor an "
                "existing directory (chunkwise never downloads; give the path of a Hugging Face model directory)"
            )
        loaded = _load_hf_dir(path, name=name_or_path, dtype=dtype, device=device, backend=backend)
    if prepare:
        loaded.model.prepare(widen_half_on_cpu=not cpu_has_bf16_matmul())
    return loaded


def checkpoint_dtype(name_or_path: str) -> str | None:
    """The dtype a checkpoint stores its weights in (config.json's torch_dtype, or dtype as transformers 5
    writes it); None for a preset or when the config does not say."""
    config_path = Path(name_or_path) / "config.json"
    if name_or_path in PRESETS or not config_path.is_file():
        return None
    raw = _read_json(config_path)
    value = raw.get("torch_dtype", raw.get("dtype")) if isinstance(raw, dict) else None
    return value if isinstance(value, str) else None


def _load_preset(
    name: str, *, dtype: torch.dtype, device: str | torch.device, backend: AttentionBackend
) -> LoadedModel:
    config = PRESETS[name]
    model = _empty_model(config, backend, dtype, device)
    if name in DEVICE_DRAWN_PRESETS:
        tensors = random_tensors(
            hf_parameter_shapes(config), PRESET_SEEDS[name], config.hidden_size, torch.device(device)
        )
    else:
        tensors = iter(preset_state_dict(name).items())
    _copy_weights(model, tensors, dtype)
    tokenizer = ByteTokenizer()
    return LoadedModel(name, config, model, tokenizer, tokenizer.chat_template)


def _empty_model(
    config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device: str | torch.device
) -> LlamaForCausalLM:
    # Built on the meta device and allocated once in the target dtype: no throwaway fp32 init on the device.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    return model


def hf_weight_names(model: LlamaForCausalLM) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Each Hugging Face tensor the model reads -> (its parameter, first row there, HF shape).

    Fused projections (Linear.stacked) read several HF tensors into consecutive rows of one parameter."""
    names: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    stacked = {
        f"{prefix}.{kind}": module.stacked
        for prefix, module in model.named_modules()
        if isinstance(module, Linear) and module.stacked
        for kind in ("weight", "bias")
    }
    # named_parameters() lists a tied weight once, under the embedding's name.
    for name, p in model.named_parameters():
        parts = stacked.get(name)
        if parts is None:
            names[name] = (name, 0, tuple(p.shape))
            continue
        prefix, _, kind = name.rpartition(".")
        owner = prefix.rpartition(".")[0]
        row = 0
        for hf_proj, rows in parts:
            names[f"{owner}.{hf_proj}.{kind}"] = (name, row, (rows, *p.shape[1:]))
            row += rows
    return names


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's names and shapes (views; before prepare())."""
    params = dict(model.named_parameters())
    return {
        hf: params[name].detach()[row : row + shape[0]].view(shape)
        for hf, (name, row, shape) in hf_weight_names(model).items()
    }


def _copy_weights(
    model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> None:
    """Copy HF-named tensors into the model (converting to its dtype), one at a time."""
    params = dict(model.named_parameters())
    expected = hf_weight_names(model)
    with torch.no_grad():
        for hf, tensor in tensors:
            name, row, shape = expected.pop(hf)
            params[name][row : row + shape[0]].copy_(tensor.view(shape))
    if expected:
        raise ValueError(f"weights missing from the preset: {_name_list(set(expected))}")
    _freeze(model)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON in {path}: {e}") from e
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from e


def read_checkpoint(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """What a model directory says of itself, weights aside: its config (with generation_config.json's stop
    ids), its tokenizer and chat template. Raises ValueError naming what it cannot use."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} has no config.json; it is not a Hugging Face model directory")
    raw = _read_json(config_path)
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    config = model_config_from_hf(raw)

    # generation_config.json may name more stop ids than config.json (Llama 3 instruct does).
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        gen = _read_json(gen_path)
        if isinstance(gen, dict):
            extra = _eos_ids(gen.get("eos_token_id"), gen_path)
            if extra:
                merged = tuple(dict.fromkeys((*config.eos_token_ids, *extra)))
                config = replace(config, eos_token_ids=merged)

    tokenizer: Tokenizer
    if (path / "tokenizer.json").is_file():
        tokenizer = HFTokenizer.from_dir(path, extra_eos_token_ids=config.eos_token_ids)
    else:
        tokenizer = NoTokenizer(config.vocab_size, config.bos_token_id, config.eos_token_ids)
    return config, tokenizer


def _load_hf_dir(
    path: Path, *, name: str, dtype: torch.dtype, device: str | torch.device, backend: AttentionBackend
) -> LoadedModel:
    config, tokenizer = read_checkpoint(path)
    if isinstance(tokenizer, NoTokenizer):
        log.warning("%s has no tokenizer.json: prompts must be token ids, and outputs have no text", path)
    weight_files = _weight_files(path)

    with torch.device("meta"):
        expected = hf_weight_names(LlamaForCausalLM(config, backend))
    where = _locate_weights(weight_files, expected, config)
    model = _empty_model(config, backend, dtype, device)
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for key, f in where.items():
        by_file.setdefault(f, []).append(key)
    from safetensors import safe_open

    with torch.no_grad():
        for f, keys in by_file.items():
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for key in keys:
                    tensor = st.get_tensor(key)
                    param, row, shape = expected[key]
                    if tuple(tensor.shape) != shape:
                        raise ValueError(
                            f"weight {key!r} in {f.name} has shape {tuple(tensor.shape)}, but config.json "
                            f"implies {shape}"
                        )
                    params[param][row : row + shape[0]].copy_(tensor)
    _freeze(model)
    return LoadedModel(name, config, model, tokenizer, tokenizer.chat_template)


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors shards: those its index names (model.safetensors.index.json), else
    model.safetensors, else every *.safetensors file. With an index, other files (a consolidated.safetensors
    in the original format, say) are left alone; a shard it names but the directory lacks is an error."""
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        names = sorted({str(v) for v in weight_map.values()})
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{index_path} names shards that are not in {path}: {', '.join(missing[:5])}")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = (
            " (PyTorch .bin checkpoints are not supported; convert to safetensors)"
            if any(path.glob("*.bin"))
            else ""
        )
        raise ValueError(f"{path} has no *.safetensors weight files{hint}")
    return files


def _freeze(model: torch.nn.Module) -> None:
    model.eval()
    model.requires_grad_(False)


def _name_list(names: set[str]) -> str:
    ordered = sorted(names)
    shown = ", ".join(ordered[:MAX_NAMES_IN_ERROR])
    more = len(ordered) - MAX_NAMES_IN_ERROR
    return shown + (f" and {more} more" if more > 0 else "")


def _locate_weights(
    files: list[Path], expected: dict[str, tuple[str, int, tuple[int, ...]]], config: ModelConfig
) -> dict[str, Path]:
    """Which file holds each expected tensor; every missing, unexpected or duplicated name is an error."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                keys = list(st.keys())
        except Exception as e:
            raise ValueError(f"cannot read safetensors file {f}: {e}") from e
        for key in keys:
            if key.endswith(IGNORED_WEIGHT_SUFFIXES) or (
                config.tie_word_embeddings and key == "lm_head.weight"
            ):
                continue
            if key in where:
                raise ValueError(f"weight {key!r} appears in both {where[key].name} and {f.name}")
            where[key] = f
    missing = expected.keys() - where.keys()
    unexpected = where.keys() - expected.keys()
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing weights: {_name_list(set(missing))}")
        if unexpected:
            parts.append(f"unexpected weights: {_name_list(set(unexpected))}")
        raise ValueError(f"checkpoint does not match its config.json ({'; '.join(parts)})")
    return where


def _eos_ids(value: Any, source: Path | str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ValueError(f"eos_token_id in {source} must be an int or a list of ints, got {value!r}")


def _int_field(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"config.json is missing the required field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def _float_field(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json field {key!r} must be a number, got {value!r}")
    return float(value)


def _rope_params(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The rope parameters dict and the config.json key it came from.

    transformers 5 writes {"rope_parameters": {"rope_theta": ..., "rope_type": ...}}; earlier versions write a
    top-level rope_theta and an optional rope_scaling dict ("type" or "rope_type")."""
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"config.json field {key!r} must be an object, got {params!r}")
        return key, params
    return "rope_scaling", {}


def _rope(cfg: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None, int]:
    """(rope_theta, the scaling or None, the longest context served exactly), refusing what is not
    implemented with the config field named."""
    key, params = _rope_params(cfg)
    theta = _float_field(cfg, "rope_theta", 10000.0)
    if params.get("rope_theta") is not None:
        theta = _float_field(params, "rope_theta", theta)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    where = f"config.json {key}"
    if params.get("partial_rotary_factor", 1.0) != 1.0 or cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor ({where}) is not supported: every head dimension is rotated")
    if rope_type == "default":
        return theta, None, max_pos
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {rope_type!r} ({where}.rope_type) is not supported; chunkwise computes "
            f"{', '.join(ROPE_TYPES)}"
        )

    def number(name: str, default: float | None = None) -> float:
        value = params.get(name)
        if value is None:
            if default is None:
                raise ValueError(f"rope scaling {rope_type!r} needs {where}.{name}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}.{name} must be a number, got {value!r}")
        return float(value)

    def original() -> int:
        value = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"rope scaling {rope_type!r} needs {where}.original_max_position_embeddings (a positive integer)"
            )
        return value

    if rope_type == "linear":
        scaling = RopeScaling("linear", factor=number("factor"))
        if scaling.factor <= 0:
            raise ValueError(f"{where}.factor must be positive, got {scaling.factor}")
        return theta, scaling, max_pos
    if rope_type == "llama3":
        scaling = RopeScaling(
            "llama3",
            factor=number("factor"),
            low_freq_factor=number("low_freq_factor"),
            high_freq_factor=number("high_freq_factor"),
            original_max_position_embeddings=original(),
        )
        if scaling.high_freq_factor == scaling.low_freq_factor:
            raise ValueError(f"{where}: high_freq_factor must differ from low_freq_factor")
        return theta, scaling, max_pos
    if rope_type == "yarn":
        orig = original()
        factor = params.get("factor")
        scaling = RopeScaling(
            "yarn",
            factor=number("factor") if factor is not None else max_pos / orig,
            original_max_position_embeddings=orig,
            attention_factor=number("attention_factor")
            if params.get("attention_factor") is not None
            else None,
            beta_fast=number("beta_fast", 32.0) if params.get("beta_fast") else 32.0,
            beta_slow=number("beta_slow", 1.0) if params.get("beta_slow") else 1.0,
            mscale=number("mscale") if params.get("mscale") is not None else None,
            mscale_all_dim=number("mscale_all_dim") if params.get("mscale_all_dim") is not None else None,
            truncate=bool(params.get("truncate", True)),
        )
        return theta, scaling, max_pos
    if rope_type == "dynamic":
        number("factor")
        # Up to max_position_embeddings, transformers' dynamic NTK frequencies are the default ones; past it
        # they are recomputed from each forward pass's length, which chunked prefill cannot reproduce.
        log.info(
            "rope scaling 'dynamic' (%s): served up to max_position_embeddings (%d), where its frequencies are "
            "the default ones",
            where,
            max_pos,
        )
        return theta, RopeScaling("dynamic", factor=number("factor")), max_pos
    # longrope: short factors up to original_max_position_embeddings, long ones past it (chosen per forward
    # pass in transformers, so only the short regime is served).
    orig = original()
    head_dim = _int_field(
        cfg, "head_dim", _int_field(cfg, "hidden_size") // _int_field(cfg, "num_attention_heads")
    )
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = params.get(name)
        if not isinstance(value, list) or len(value) != head_dim // 2:
            raise ValueError(f"{where}.{name} must be a list of head_dim / 2 = {head_dim // 2} numbers")
        factors[name] = tuple(float(v) for v in value)
    factor = params.get("factor")
    scaling = RopeScaling(
        "longrope",
        factor=number("factor") if factor is not None else max_pos / orig,
        original_max_position_embeddings=orig,
        attention_factor=number("attention_factor") if params.get("attention_factor") is not None else None,
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
    )
    if orig < max_pos:
        log.info(
            "rope scaling 'longrope' (%s): context capped at original_max_position_embeddings (%d) of %d: past it "
            "transformers switches to the long factors for the whole sequence per forward pass, which "
            "chunked prefill cannot reproduce",
            where,
            orig,
            max_pos,
        )
    return theta, scaling, min(max_pos, orig)


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face config.json (Llama, Mistral, Qwen2 or Qwen3) onto ModelConfig; raise on what we
    cannot run exactly, naming the field."""
    architectures = cfg.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"config.json field 'architectures' must be a list, got {architectures!r}")
    families = [SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not architectures and cfg.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        families = [cfg["model_type"]]
    if not families:
        raise ValueError(
            f"unsupported architecture {architectures or cfg.get('model_type')!r}; chunkwise runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = families[0]

    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if family == "qwen2":
        # Qwen2 always has q/k/v biases; the config has no switch for them.
        attention_bias = True
    else:
        if cfg.get("attention_bias"):
            # Llama's and Qwen3's attention_bias also put a bias on o_proj, which ModelConfig cannot express.
            raise ValueError(
                "attention_bias=true (config.json) is not supported for Llama/Mistral/Qwen3 checkpoints"
            )
        attention_bias = False

    hidden = _int_field(cfg, "hidden_size")
    heads = _int_field(cfg, "num_attention_heads")
    if heads <= 0:
        raise ValueError(f"num_attention_heads must be positive, got {heads}")
    head_dim = _int_field(cfg, "head_dim", hidden // heads)
    max_pos = _int_field(cfg, "max_position_embeddings", 2048)
    # We attend over the full context. A sliding window changes nothing until the context outgrows it,
    # so cap the usable length there instead of refusing the checkpoint.
    # The defaults are those of the transformers config classes, which apply when the key is absent.
    uses_window = cfg.get("use_sliding_window", False) if family in ("qwen2", "qwen3") else True
    window = cfg.get("sliding_window", 4096 if family == "mistral" else None)
    if uses_window and isinstance(window, int) and not isinstance(window, bool) and 0 < window < max_pos:
        log.info(
            "config.json sliding_window %d: context capped there (max_position_embeddings %d): within the window "
            "sliding attention is full attention, which is what chunkwise computes",
            window,
            max_pos,
        )
        max_pos = window
    rope_theta, rope_scaling, max_pos = _rope(cfg, max_pos)

    bos = cfg.get("bos_token_id")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
        raise ValueError(f"config.json field 'bos_token_id' must be an integer, got {bos!r}")

    return ModelConfig(
        vocab_size=_int_field(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int_field(cfg, "intermediate_size"),
        num_hidden_layers=_int_field(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_int_field(cfg, "num_key_value_heads", heads),
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=_float_field(cfg, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        bos_token_id=bos,
        eos_token_ids=_eos_ids(cfg.get("eos_token_id"), "config.json"),
    )
