"""`chunkwise inspect`: what the loader understands of a checkpoint, or why it refuses it."""

from __future__ import annotations

import json
import subprocess
import sys

from chunkwise.checkpoint_report import inspect_model
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
