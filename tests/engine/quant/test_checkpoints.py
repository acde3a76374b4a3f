"""Quantized checkpoints as people download them (FP8 block-scaled, compressed-tensors FP8 and INT8, AWQ,
GPTQ), written by tests/engine/quant/writers.py: in float32 chunkwise gives transformers' greedy tokens on
the dequantized weights, token for token, under chunked prefill and concurrent requests; what is not
supported is refused at load, naming the field."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from chunkwise import LLM, SamplingParams
from chunkwise.engine import EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.model.layers import Linear
from tests.engine.loop.test_engine_exact import run_staggered
from tests.engine.quant.writers import save_llama, write_quantized
from tests.hf_models import hf_greedy

METHODS = {
    "fp8-block": ("llama", "fp8"),
    "fp8-tensor": ("llama", "fp8"),
    "ct-fp8": ("qwen2", "fp8"),
    "ct-int8": ("llama", "int8"),
    "awq": ("qwen2", "int4"),
    "gptq": ("llama", "int4"),
}


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant-base")
    return {f: save_llama(root / f, family=f) for f in ("llama", "qwen2")}


def _prompts(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    return prompts, [rng.randint(2, 12) for _ in prompts]


# isa: the quantized linears run the CPU's own kernel (8 lanes under AVX2, 16 under AVX-512); `make isa` runs
# these again under each.
@pytest.mark.isa
@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_matches_transformers_on_the_dequantized_weights(
    method: str, base_dirs: dict[str, Path], tmp_path: Path
) -> None:
    family, kind = METHODS[method]
    # Blocks of 64 over 128/256-wide weights: several blocks a weight in both directions.
    q_dir, ref_dir = write_quantized(base_dirs[family], tmp_path, method, group=32, block=64)
    prompts, max_new = _prompts(3)
    expected = hf_greedy(ref_dir, prompts, max_new)
    engine = EngineCore(
        engine_config_from_kwargs(str(q_dir), dtype="float32", max_num_batched_tokens=16, block_size=4)
    )
    linears = [
        m for n, m in engine.loaded.model.named_modules() if isinstance(m, Linear) and "lm_head" not in n
    ]
    assert linears and all(m.quant_kind == kind for m in linears)
    assert engine.loaded.quantization is not None and engine.loaded.quantization.kind == kind
    # No full-precision copy of a quantized weight is held.
    assert all(m.weight.numel() == 0 for m in linears)
    assert run_staggered(engine, prompts, max_new) == expected


def test_the_reference_differs_from_the_full_precision_model(
    base_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The check above can fail: 4-bit weights change this model's greedy tokens."""
    _, ref_dir = write_quantized(base_dirs["llama"], tmp_path, "gptq", group=32)
    prompts, max_new = _prompts(3)
    assert hf_greedy(ref_dir, prompts, max_new) != hf_greedy(base_dirs["llama"], prompts, max_new)


@pytest.mark.isa
def test_online_int8_is_the_model_with_int8_weights(base_dirs: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from chunkwise.engine.quant.weights import dequantize, quantize_int8

    src = base_dirs["llama"]
    ref_dir = tmp_path / "int8-reference"
    shutil.copytree(src, ref_dir)
    state = load_file(str(src / "model.safetensors"))
    for name, t in state.items():
        if name.endswith("proj.weight"):
            state[name] = dequantize(quantize_int8(t.float())).contiguous()
    save_file(state, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts, max_new = _prompts(4)
    expected = hf_greedy(ref_dir, prompts, max_new)
    llm = LLM(str(src), dtype="float32", quantization="int8", max_num_batched_tokens=16, block_size=4)
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_new]
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert hf_greedy(src, prompts, max_new) != expected  # int8 changed something: the check could fail


def _with_config(src: Path, dst: Path, qc: dict[str, object] | None) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("method", "qc", "named"),
    [
        ("fp8-block", {"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ("fp8-block", {"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
        ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, "desc_act"),
        ("gptq", {"quant_method": "gptq", "bits": 8, "group_size": 32}, "bits 8"),
        ("awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version 'gemv'"),
        (
            "ct-fp8",
            {"quant_method": "compressed-tensors", "format": "pack-quantized"},
            "format 'pack-quantized'",
        ),
    ],
)
def test_unsupported_quantization_is_refused_naming_the_field(
    method: str, qc: dict[str, object], named: str, base_dirs: dict[str, Path], tmp_path: Path
) -> None:
    family = METHODS[method][0]
    q_dir, _ = write_quantized(base_dirs[family], tmp_path, method, group=32, block=64)
    bad = _with_config(q_dir, tmp_path / "bad", qc)
    with pytest.raises(ValueError, match=named) as e:
        LLM(str(bad), dtype="float32")
    assert "quantization_config" in str(e.value)


def test_quantized_tensors_without_a_quantization_config_are_refused_saying_so(
    base_dirs: dict[str, Path], tmp_path: Path
) -> None:
    q_dir, _ = write_quantized(base_dirs["llama"], tmp_path, "fp8-block", block=64)
    bad = _with_config(q_dir, tmp_path / "no-config", None)
    with pytest.raises(ValueError, match=r"weight_scale_inv.*no quantization_config"):
        LLM(str(bad), dtype="float32")


def test_an_act_order_gptq_checkpoint_is_refused_by_its_g_idx(
    base_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    q_dir, _ = write_quantized(base_dirs["llama"], tmp_path, "gptq", group=32)
    state = load_file(str(q_dir / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.g_idx"
    state[key] = torch.flip(state[key], (0,)).contiguous()
    save_file(state, str(q_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj\.g_idx.*desc_act"):
        LLM(str(q_dir), dtype="float32")


def test_fp8_quantization_on_cpu_points_to_int8(base_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="use 'int8'"):
        LLM(str(base_dirs["llama"]), dtype="float32", quantization="fp8")
