"""`chunkwise inspect`: what the loader understands of a checkpoint, or why it refuses it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from itertools import chain
from pathlib import Path

import pytest
import torch

from chunkwise.checkpoint_report import inspect_model
from chunkwise.engine.attention.torch_ref import TorchAttentionBackend
from chunkwise.engine.model.loader import load_model
from tests.engine.quant.writers import save_llama, write_quantized
from tests.hf_models import save_random_family


def test_report_of_a_llama3_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_random_family(tmp_path, "llama3-rope")
    report = inspect_model(str(path), dtype="float32", max_model_len=256, max_num_seqs=4)
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert report.parameters == sum(p.numel() for p in hf.parameters())
    assert report.family == "llama" and report.rope["rope_type"] == "llama3"
    assert report.rope["original_max_position_embeddings"] == 32 and report.context == 512
    assert report.eos_token_ids == [2]
    assert report.tokenizer.startswith("none")
    # 2 layers x 2 (K, V) x 2 KV heads x 16 dims x 4 bytes.
    assert report.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert report.kv_bytes == report.kv_bytes_per_token * 256 * 4
    assert report.weight_bytes == report.parameters * 4


def test_the_command_prints_the_report_or_the_reason(tmp_path):
    path = save_random_family(tmp_path, "qwen3")
    out = subprocess.run(
        [sys.executable, "-m", "chunkwise.cli", "inspect", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["family"] == "qwen3" and report["head_dim"] == 32
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": ["Gemma2ForCausalLM"]}))
    out = subprocess.run(
        [sys.executable, "-m", "chunkwise.cli", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "unsupported architecture ['Gemma2ForCausalLM']" in out.stderr


def test_tensor_parallel_report_is_one_ranks_share(tmp_path):
    """Every projection, the embedding and the LM head split over the ranks, the norms are replicated; KV
    heads split, or are replicated where there are fewer than ranks (Mistral's one KV head here)."""
    llama = save_random_family(tmp_path / "llama", "llama3-rope")
    one = inspect_model(str(llama), dtype="float32", max_model_len=256)
    two = inspect_model(str(llama), dtype="float32", max_model_len=256, tensor_parallel_size=2)
    norms = 2 * 2 * 64 + 64  # two layers' input and post-attention norms, and the final norm
    assert two.weight_bytes == (one.weight_bytes - 4 * norms) // 2 + 4 * norms
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert two.parameters == one.parameters  # the model's, not a rank's
    mistral = save_random_family(tmp_path / "mistral", "mistral")
    one = inspect_model(str(mistral), dtype="float32")
    assert one.kv_heads == 1
    assert inspect_model(str(mistral), dtype="float32", tensor_parallel_size=2).kv_bytes_per_token == (
        one.kv_bytes_per_token
    )
    out = subprocess.run(
        [sys.executable, "-m", "chunkwise.cli", "inspect", str(llama), "--tensor-parallel-size", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "num_attention_heads (4) does not divide over tensor_parallel_size 3" in out.stderr


# Quantized checkpoints (tests/engine/quant/writers.py): the weights as the loader holds them.

QUANTIZED = {
    # method: (family, its description, the bytes one projection [rows, cols] holds quantized)
    "ct-int8": (
        "llama",
        "compressed-tensors (int8, per-channel scales)",
        lambda rows, cols: rows * cols + rows * 4,  # an int8 a weight, a float32 scale a row
    ),
    "fp8-block": (
        "llama",
        "fp8 (fp8 e4m3, block 64x64 scales)",
        lambda rows, cols: rows * cols + rows * -(-cols // 64) * 4,  # a scale a row per 64 columns
    ),
    "gptq": (
        "llama",
        "gptq (4-bit, groups of 32 input columns)",
        # Half a byte a weight, a float32 scale and a float32 zero point a row per 32 columns.
        lambda rows, cols: rows * cols // 2 + rows * (cols // 32) * (4 + 4),
    ),
    "awq": (
        "qwen2",  # q/k/v biases, kept in the dtype
        "awq (4-bit, groups of 32 input columns)",
        lambda rows, cols: rows * cols // 2 + rows * (cols // 32) * (4 + 4),
    ),
}


@pytest.fixture(scope="module")
def fp_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp")
    return {f: save_llama(root / f, family=f) for f in ("llama", "qwen2")}


def _expected_bytes(
    fp_dir: Path, elem: int, projection_bytes: Callable[[int, int], int] | None
) -> tuple[int, int]:
    """(the full-precision weights' bytes at `elem` bytes a value, those bytes with every projection held as
    `projection_bytes` says), from the checkpoint's tensor shapes."""
    from safetensors import safe_open

    full = quantized = 0
    with safe_open(str(fp_dir / "model.safetensors"), framework="pt") as st:
        for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
            rows, *rest = st.get_slice(key).get_shape()
            numel = rows * (rest[0] if rest else 1)
            full += numel * elem
            if key.endswith("proj.weight") and projection_bytes is not None:
                quantized += projection_bytes(rows, rest[0])
            else:
                quantized += numel * elem
    return full, quantized


@pytest.mark.parametrize("method", sorted(QUANTIZED))
@pytest.mark.parametrize(("dtype", "device", "elem"), [("float32", "cpu", 4), ("bfloat16", "cuda", 2)])
def test_a_quantized_checkpoint_reports_its_quantized_bytes(
    method: str, dtype: str, device: str, elem: int, fp_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Each quantized projection at 8 or 4 bits a weight with float32 scales (and zero points), whatever the
    dtype (bfloat16 here: the scales are not cast with the rest); the embedding, head and norms in the dtype.
    On "cuda" no CPU widening applies, and nothing needs a GPU: the report only resolves the dtype for it."""
    family, description, projection_bytes = QUANTIZED[method]
    q_dir, _ = write_quantized(fp_dirs[family], tmp_path, method, group=32, block=64)
    full, expected = _expected_bytes(fp_dirs[family], elem, projection_bytes)
    fp = inspect_model(str(fp_dirs[family]), dtype=dtype, device=device)
    assert fp.weight_bytes == full and fp.quantization is None and fp.quantized_layers == 0
    report = inspect_model(str(q_dir), dtype=dtype, device=device)
    assert report.quantization == description
    assert report.quantized_layers == 2 * 4  # each layer's q/k/v, o, gate/up and down
    assert report.weight_bytes == expected < full
    assert report.parameters == fp.parameters  # the model's, not its storage
    # What the loader holds is what the report says.
    loaded = load_model(
        str(q_dir), dtype=getattr(torch, dtype), device="cpu", backend=TorchAttentionBackend(), prepare=False
    )
    held = chain(loaded.model.parameters(), loaded.model.buffers())
    assert sum(t.numel() * t.element_size() for t in held) == report.weight_bytes


def test_the_quantization_flag_reports_what_it_would_hold(fp_dirs: dict[str, Path], tmp_path: Path) -> None:
    """--quantization int8 on a full-precision checkpoint or a preset: every projection at a byte a weight and
    a float32 scale a row; fp8 (CUDA) the same bytes, refused for a CPU; a tensor-parallel report refused as
    the loader refuses it."""
    llama = fp_dirs["llama"]
    int8 = QUANTIZED["ct-int8"][2]
    full, expected = _expected_bytes(llama, 4, int8)
    report = inspect_model(str(llama), dtype="float32", quantization="int8")
    assert report.quantization == "int8 (weights quantized at load, a scale per output channel)"
    assert report.weight_bytes == expected < full
    fp8 = inspect_model(str(llama), dtype="float32", device="cuda", quantization="fp8")
    assert fp8.quantization is not None and fp8.quantization.startswith("fp8 ")
    assert fp8.weight_bytes == expected
    with pytest.raises(ValueError, match="fp8 runs on CUDA"):
        inspect_model(str(llama), dtype="float32", quantization="fp8")
    with pytest.raises(ValueError, match="not supported with tensor or pipeline parallelism"):
        inspect_model(str(llama), dtype="float32", quantization="int8", tensor_parallel_size=2)

    from chunkwise.engine.model.presets import PRESETS

    config = PRESETS["tiny"]
    linear = (
        config.hidden_size * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    )
    linear += config.num_attention_heads * config.head_dim * config.hidden_size  # o
    linear += 3 * config.hidden_size * config.intermediate_size  # gate, up, down
    rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    rows += config.hidden_size + 2 * config.intermediate_size + config.hidden_size
    tiny = inspect_model("tiny", dtype="float32")
    tiny8 = inspect_model("tiny", dtype="float32", quantization="int8")
    layers = config.num_hidden_layers
    assert tiny8.weight_bytes == tiny.weight_bytes - layers * (linear * (4 - 1) - rows * 4)
    assert tiny8.quantized_layers == 4 * layers

    # The command: the flag, and the report's JSON fields.
    out = _inspect(str(llama), "--dtype", "float32", "--quantization", "int8", "--json")
    assert out.returncode == 0, out.stderr
    fields = json.loads(out.stdout)
    assert fields["quantization"] == report.quantization and fields["weight_bytes"] == expected
    assert fields["quantized_layers"] == 8
    out = _inspect(str(llama), "--dtype", "float32", "--quantization", "int8")
    assert out.returncode == 0, out.stderr
    assert f"quantization:   {report.quantization}: 8 linear layers" in out.stdout


def test_inspect_refuses_what_the_loader_refuses_with_its_message(
    fp_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """An unsupported quantization_config, and --quantization int8 on an fp8 checkpoint: inspect fails with the
    message load_model raises."""
    q_dir, _ = write_quantized(fp_dirs["llama"], tmp_path, "fp8-block", block=64)
    bad = tmp_path / "bnb"
    shutil.copytree(q_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bad / "config.json").write_text(json.dumps(raw))
    cases = (
        (bad, None, "quantization_config.quant_method 'bitsandbytes' is not supported"),
        (
            q_dir,
            "int8",
            "--quantization int8 on a checkpoint already quantized as fp8 (fp8 e4m3, block 64x64",
        ),
    )
    for path, flag, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)) as loading:
            load_model(
                str(path),
                dtype=torch.float32,
                device="cpu",
                backend=TorchAttentionBackend(),
                prepare=False,
                quantization=flag,
            )
        with pytest.raises(ValueError) as inspecting:
            inspect_model(str(path), dtype="float32", quantization=flag)
        assert str(inspecting.value) == str(loading.value)
        out = _inspect(str(path), *(("--quantization", flag) if flag else ()))
        assert out.returncode == 1
        assert f"chunkwise cannot serve {path}: {loading.value}" in out.stderr


def _inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chunkwise.cli", "inspect", *args], capture_output=True, text=True, timeout=120
    )
