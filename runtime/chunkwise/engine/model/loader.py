"""Build a model from a preset name or a Hugging Face directory. Nothing is ever downloaded.

An HF directory holds config.json, one or more *.safetensors files and (usually) tokenizer.json. Every
mismatch between what the config describes and what the weights hold is an error naming the tensors, so
a wrong checkpoint fails at start-up rather than serving noise. What config.json means is hf_config.py's.

Given a tensor-parallel group, each rank builds only its shard of the model and reads only its shard of each
tensor from the checkpoint (safetensors slices; model/parallel.py says which). Given a pipeline stage, it
builds and reads only that stage's layers (and the embedding, final norm and LM head where the stage holds
them); the other stages' tensors in the checkpoint are skipped, not refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from chunkwise.engine.attention.backend import AttentionBackend
from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.distributed import SINGLE_RANK, PipelineStage, TPGroup
from chunkwise.engine.hardware import cpu_has_bf16_matmul
from chunkwise.engine.model import quant_layers as quant
from chunkwise.engine.model.bundled import BUNDLED, resolve_model_path

# Re-exported: `chunkwise inspect` reads the supported architectures from here.
from chunkwise.engine.model.hf_config import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from chunkwise.engine.model.hf_config import eos_ids, model_config_from_hf
from chunkwise.engine.model.layers import Linear
from chunkwise.engine.model.llama import LlamaForCausalLM
from chunkwise.engine.model.parallel import Slot, read_shard

# Re-exported: `chunkwise inspect` counts the checkpoint's parameters from here.
from chunkwise.engine.model.parallel import hf_weight_names as hf_weight_names
from chunkwise.engine.model.presets import (
    DEVICE_DRAWN_PRESETS,
    PRESET_SEEDS,
    PRESETS,
    hf_parameter_shapes,
    preset_state_dict,
    random_tensors,
)
from chunkwise.engine.quant.formats import QuantScheme, online_scheme, scheme_from_config
from chunkwise.engine.tokenizer import ByteTokenizer, HFTokenizer, NoTokenizer, Tokenizer

# Checkpoints saved by older transformers versions carry the rotary table; we compute it.
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
# Tensors of a quantized checkpoint: named when config.json does not say it is one.
QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "qweight", "qzeros", "scales", "input_scale")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
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
    # How the linear weights are quantized (None: full precision): the checkpoint's format or --quantization.
    quantization: QuantScheme | None = None

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
    tp_group: TPGroup = SINGLE_RANK,
    pp_stage: PipelineStage | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """The model, its tokenizer and chat template, with weights in `dtype` on `device`.

    A checkpoint whose config.json has a quantization_config is loaded quantized (engine/quant/: its linear
    weights stay in 8 or 4 bits; anything not supported is refused naming the field); `quantization`
    ("int8", "fp8": --quantization) quantizes a full-precision checkpoint's linear weights at load.

    With prepare=True (serving) each layer then picks its kernels for the device (Linear.prepare), and a
    half-precision weight the CPU computes in fp32 is widened; prepare=False keeps the weights as loaded.
    With a tp_group of more than one rank, this rank's shard of the model (a size that does not divide over
    the ranks is a ValueError naming the config field); every rank of the group calls this. With a pipeline
    stage (None: the whole model), that stage's part of the model."""
    if name_or_path in PRESETS:
        loaded = _load_preset(
            name_or_path, dtype=dtype, device=device, backend=backend, tp=tp_group, pp=pp_stage
        )
    else:
        path = resolve_model_path(name_or_path)
        if not path.is_dir():
            raise ValueError(
                f"model {name_or_path!r} is neither a built-in preset ({', '.join(sorted(PRESETS))}), a bundled "
                f"model ({', '.join(BUNDLED)}) nor an existing directory (chunkwise never downloads; give the "
                "path of a Hugging Face model directory)"
            )
        loaded = _load_hf_dir(
            path, name=name_or_path, dtype=dtype, device=device, backend=backend, tp=tp_group, pp=pp_stage
        )
    if quantization is not None:
        online = online_scheme(quantization, torch.device(device))
        if loaded.quantization is not None:
            if loaded.quantization.kind != online.kind:
                raise ValueError(
                    f"--quantization {quantization} on a checkpoint already quantized as "
                    f"{loaded.quantization.description}: drop the flag"
                )
        else:
            _refuse_parallel(online, tp_group, loaded.model)
            layers = quant.quantize_loaded(loaded.model, online)
            log.info("quantized %d linear layers to %s at load", layers, quantization)
            loaded.quantization = online
    if loaded.quantization is not None:
        log.info("weights: %s", loaded.quantization.description)
    if prepare:
        # The torch attention backend is the reference other paths are checked against: its model keeps
        # the torch norms and rotation too.
        loaded.model.prepare(
            widen_half_on_cpu=not cpu_has_bf16_matmul(), triton_layers=backend.name != "torch"
        )
    return loaded


def checkpoint_dtype(name_or_path: str) -> str | None:
    """The dtype a checkpoint stores its weights in (config.json's torch_dtype, or dtype as transformers 5
    writes it); None for a preset or when the config does not say."""
    config_path = resolve_model_path(name_or_path) / "config.json"
    if name_or_path in PRESETS or not config_path.is_file():
        return None
    raw = _read_json(config_path)
    value = raw.get("torch_dtype", raw.get("dtype")) if isinstance(raw, dict) else None
    return value if isinstance(value, str) else None


def _load_preset(
    name: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    backend: AttentionBackend,
    tp: TPGroup,
    pp: PipelineStage | None,
) -> LoadedModel:
    config = PRESETS[name]
    model = _empty_model(config, backend, dtype, device, tp, pp)
    if name in DEVICE_DRAWN_PRESETS:
        tensors = random_tensors(
            hf_parameter_shapes(config), PRESET_SEEDS[name], config.hidden_size, torch.device(device)
        )
    else:
        tensors = iter(preset_state_dict(name).items())
    _copy_weights(model, tensors, dtype, _other_stages(config, backend, tp, model))
    tokenizer = ByteTokenizer()
    return LoadedModel(name, config, model, tokenizer, tokenizer.chat_template)


def _empty_model(
    config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: str | torch.device,
    tp: TPGroup = SINGLE_RANK,
    pp: PipelineStage | None = None,
    scheme: QuantScheme | None = None,
) -> LlamaForCausalLM:
    # Built on the meta device and allocated once in the target dtype: no throwaway fp32 init on the device.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, tp, pp)
    model = model.to(dtype=dtype)
    if scheme is not None:  # after the cast: the scales stay float32
        quant.quantize_structure(model, scheme)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's names and shapes (views; before prepare()); a rank of a
    tensor-parallel group gives its shard of each."""
    params = dict(model.named_parameters())
    return {
        hf: params[slot.param].detach()[slot.row : slot.row + slot.shard_shape[0]].view(slot.shard_shape)
        for hf, slot in hf_weight_names(model).items()
    }


def _fill(params: dict[str, torch.Tensor], slot: Slot, shard: torch.Tensor, filled: dict[str, int]) -> None:
    """Copy one tensor's shard into its rows of its parameter (converting to the parameter's dtype)."""
    rows = slot.shard_shape[0]
    params[slot.param][slot.row : slot.row + rows].copy_(shard)
    filled[slot.param] = filled.get(slot.param, 0) + rows


def _zero_padding(params: dict[str, torch.Tensor], filled: dict[str, int]) -> None:
    """Zero the rows no tensor filled: the padding of the last rank's vocabulary shard."""
    for name, rows in filled.items():
        if rows < params[name].shape[0]:
            params[name][rows:].zero_()


def _other_stages(
    config: ModelConfig, backend: AttentionBackend, tp: TPGroup, model: LlamaForCausalLM
) -> set[str]:
    """The Hugging Face tensors the whole model reads but this pipeline stage does not hold (none at one
    stage): the loader skips them."""
    if model.pp.num_stages == 1:
        return set()
    with torch.device("meta"):
        whole = hf_weight_names(LlamaForCausalLM(config, backend, tp))
    return whole.keys() - hf_weight_names(model).keys()


def _copy_weights(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    skip: Collection[str] = (),
) -> None:
    """Copy HF-named tensors (their shard, under tensor parallelism) into the model, one at a time; those in
    `skip` (other pipeline stages') are passed over."""
    params = dict(model.named_parameters())
    expected = hf_weight_names(model)
    filled: dict[str, int] = {}
    with torch.no_grad():
        for hf, tensor in tensors:
            if hf in skip:
                continue
            slot = expected.pop(hf)
            _fill(params, slot, read_shard(tensor.view(slot.shape), slot), filled)
        _zero_padding(params, filled)
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
            extra = eos_ids(gen.get("eos_token_id"), gen_path)
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
    path: Path,
    *,
    name: str,
    dtype: torch.dtype,
    device: str | torch.device,
    backend: AttentionBackend,
    tp: TPGroup,
    pp: PipelineStage | None,
) -> LoadedModel:
    config, tokenizer = read_checkpoint(path)
    if isinstance(tokenizer, NoTokenizer):
        log.warning("%s has no tokenizer.json: prompts must be token ids, and outputs have no text", path)
    weight_files = _weight_files(path)
    scheme = scheme_from_config(_read_json(path / "config.json"))

    with torch.device("meta"):
        meta = LlamaForCausalLM(config, backend, tp, pp)
    quantized: dict[str, tuple[str, int, str]] = {}
    optional: set[str] = set()
    if scheme is not None:
        _refuse_parallel(scheme, tp, meta)
        quant.quantize_structure(meta, scheme)
        quantized, optional = quant.checkpoint_tensors(meta, scheme)
    expected = hf_weight_names(meta)
    where = _locate_weights(
        weight_files, expected, config, _other_stages(config, backend, tp, meta), quantized.keys(), optional
    )
    model = _empty_model(config, backend, dtype, device, tp, pp, scheme)
    linears = dict(model.named_modules())
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    # Each quantized layer is converted as soon as the last of its tensors is read (its parts may sit in
    # different files), so that at most a layer's checkpoint tensors are held beside the model.
    unread: dict[str, int] = {}
    for key in where.keys() & quantized.keys():
        unread[quantized[key][0]] = unread.get(quantized[key][0], 0) + 1
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    by_file: dict[Path, list[str]] = {}
    for key, f in where.items():
        by_file.setdefault(f, []).append(key)
    from safetensors import safe_open

    with torch.no_grad():
        for f, keys in by_file.items():
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for key in keys:
                    if key in quantized:
                        layer, part, suffix = quantized[key]
                        parts.setdefault(layer, {}).setdefault(part, {})[suffix] = st.get_tensor(key)
                        unread[layer] -= 1
                        if unread[layer] == 0:
                            module = linears[layer]
                            assert isinstance(module, Linear) and scheme is not None
                            quant.fill(module, layer, parts.pop(layer), scheme)
                        continue
                    # A slice reads from the file only what is indexed: this rank's shard.
                    sliced = st.get_slice(key)
                    slot = expected[key]
                    if tuple(sliced.get_shape()) != slot.shape:
                        raise ValueError(
                            f"weight {key!r} in {f.name} has shape {tuple(sliced.get_shape())}, but "
                            f"config.json implies {slot.shape}"
                        )
                    shard = st.get_tensor(key) if slot.size is None else read_shard(sliced, slot)
                    if shard.dtype in FP8_DTYPES:
                        raise ValueError(
                            f"weight {key!r} is stored in {shard.dtype} but config.json has no quantization_config "
                            "that says how to scale it"
                        )
                    _fill(params, slot, shard, filled)
        _zero_padding(params, filled)
    assert not parts, f"quantized layers left unconverted: {sorted(parts)}"
    _freeze(model)
    return LoadedModel(name, config, model, tokenizer, tokenizer.chat_template, scheme)


def _refuse_parallel(scheme: QuantScheme, tp: TPGroup, model: LlamaForCausalLM) -> None:
    if tp.world_size > 1 or model.pp.num_stages > 1:
        raise ValueError(
            f"quantized weights ({scheme.description}) are not supported with tensor or pipeline parallelism yet: "
            "serve them on one device"
        )


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
    files: list[Path],
    expected: Collection[str],
    config: ModelConfig,
    skip: Collection[str],
    quantized: Collection[str] = (),
    optional: Collection[str] = (),
) -> dict[str, Path]:
    """Which file holds each expected tensor (the full-precision slots' and the quantized layers'); every
    missing, unexpected or duplicated name is an error (those in `skip`, other pipeline stages' tensors, are
    neither expected nor unexpected; those in `optional` may be absent)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                keys = list(st.keys())
        except Exception as e:
            raise ValueError(f"cannot read safetensors file {f}: {e}") from e
        for key in keys:
            if (
                key.endswith(IGNORED_WEIGHT_SUFFIXES)
                or (config.tie_word_embeddings and key == "lm_head.weight")
                or key in skip
            ):
                continue
            if key in where:
                raise ValueError(f"weight {key!r} appears in both {where[key].name} and {f.name}")
            where[key] = f
    wanted = set(expected) | set(quantized)
    missing = wanted - where.keys() - set(optional)
    unexpected = where.keys() - wanted
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing weights: {_name_list(set(missing))}")
        if unexpected:
            parts.append(f"unexpected weights: {_name_list(set(unexpected))}")
        hint = ""
        if any(k.endswith(QUANT_SUFFIXES) for k in unexpected):
            hint = " (its tensors look quantized, but config.json has no quantization_config that says how)"
        raise ValueError(f"checkpoint does not match its config.json ({'; '.join(parts)}){hint}")
    return where
