"""A Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3) -> ModelConfig, refusing with the field named
whatever chunkwise cannot run exactly (activations, biases, rotary scalings it does not compute)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from chunkwise.engine.datatypes.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Rotary scalings computed as transformers does (model/rope.py); "default" is no scaling.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

log = logging.getLogger(__name__)


def eos_ids(value: Any, source: Path | str) -> tuple[int, ...]:
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
        eos_token_ids=eos_ids(cfg.get("eos_token_id"), "config.json"),
    )
