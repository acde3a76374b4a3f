"""The loader: HF config mapping, and a clear error for every way a model directory can be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from chunkwise.engine.attention.torch_ref import TorchAttentionBackend
from chunkwise.engine.model import PRESETS, load_model, model_config_from_hf
from chunkwise.engine.model.loader import hf_state_dict
from chunkwise.engine.tokenizer import NoTokenizer

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def load(path: Path | str):
    # Unprepared, so the weights read as Hugging Face's tensors (hf_state_dict).
    return load_model(
        str(path), dtype=torch.float32, device="cpu", backend=TorchAttentionBackend(), prepare=False
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"}, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ---------------------------------------------------------------- config mapping


def test_config_defaults_follow_hf():
    c = model_config_from_hf(BASE)
    assert c.head_dim == 16
    assert c.num_key_value_heads == 4
    assert c.rope_theta == 10000.0
    assert c.tie_word_embeddings is False
    assert c.attention_bias is False
    assert c.eos_token_ids == ()
    assert c.bos_token_id is None


def test_config_fields_are_mapped():
    c = model_config_from_hf(
        {
            **BASE,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": [2, 7],
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        }
    )
    assert (c.num_key_value_heads, c.head_dim, c.max_position_embeddings) == (2, 32, 4096)
    assert c.rms_norm_eps == 1e-5
    assert c.rope_theta == 500000.0
    assert c.tie_word_embeddings is True
    assert c.bos_token_id == 1
    assert c.eos_token_ids == (2, 7)
    assert model_config_from_hf({**BASE, "eos_token_id": 5}).eos_token_ids == (5,)


def test_rope_theta_from_transformers4_layout():
    c = model_config_from_hf({**BASE, "rope_theta": 1e6, "rope_scaling": None})
    assert c.rope_theta == 1e6
    c = model_config_from_hf({**BASE, "rope_theta": 1e6, "rope_scaling": {"type": "default"}})
    assert c.rope_theta == 1e6


def test_what_transformers_writes_round_trips(llama_dir):
    raw = json.loads((llama_dir / "config.json").read_text())
    c = model_config_from_hf(raw)
    assert (c.vocab_size, c.hidden_size, c.num_key_value_heads, c.head_dim) == (300, 64, 2, 16)
    assert c.rope_theta == LlamaConfig().rope_parameters["rope_theta"]


def test_rope_scalings_are_read_from_either_layout():
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    c = model_config_from_hf(
        {**BASE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", **llama3}}
    )
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "llama3" and c.rope_theta == 5e5
    assert (c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (8.0, 64)
    # transformers 4's spelling: a top-level rope_theta and rope_scaling with "type".
    c = model_config_from_hf(
        {
            **BASE,
            "rope_theta": 1e6,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        }
    )
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "yarn" and c.rope_theta == 1e6
    c = model_config_from_hf({**BASE, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert c.rope_scaling is not None and c.rope_scaling.factor == 2.0


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "su"}, r"rope scaling type 'su' \(config.json rope_parameters.rope_type\)"),
        ({"rope_type": "llama3", "factor": 8.0}, r"needs config.json rope_parameters.low_freq_factor"),
        (
            {"rope_type": "yarn", "factor": 4.0},
            r"needs config.json rope_parameters.original_max_position_embeddings",
        ),
        ({"rope_type": "linear"}, r"needs config.json rope_parameters.factor"),
        ({"rope_type": "linear", "factor": "2"}, r"rope_parameters.factor must be a number"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0],
                "original_max_position_embeddings": 64,
            },
            r"short_factor must be a list of head_dim / 2 = 8",
        ),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
    ],
)
def test_rope_scalings_we_cannot_compute_are_refused_by_field(rope, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({**BASE, "rope_parameters": {"rope_theta": 1e4, **rope}})


def test_qwen2_has_qkv_bias_and_mistral_window_caps_length():
    q = model_config_from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64})
    assert q.attention_bias is True
    assert q.max_position_embeddings == 2048  # Qwen2's window is off unless use_sliding_window
    m = model_config_from_hf(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
        }
    )
    assert m.attention_bias is False
    assert m.max_position_embeddings == 4096
    m = model_config_from_hf(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "max_position_embeddings": 32768,
            "sliding_window": None,
        }
    )
    assert m.max_position_embeddings == 32768


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"architectures": []}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"vocab_size": None}, "missing the required field 'vocab_size'"),
        ({"hidden_size": "64"}, "'hidden_size' must be an integer"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of"),
        ({"eos_token_id": "x"}, "eos_token_id"),
    ],
)
def test_bad_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({**BASE, **change})


# ---------------------------------------------------------------- loading


def test_a_dir_without_tokenizer_takes_and_gives_token_ids(llama_dir):
    loaded = load(llama_dir)
    assert loaded.name == str(llama_dir)
    # No guessed tokenizer (a byte one would serve wrong text): ids in and out, text prompts refused.
    assert isinstance(loaded.tokenizer, NoTokenizer)
    assert loaded.tokenizer.decode([5, 6, 7]) == ""
    with pytest.raises(ValueError, match=r"no tokenizer.*token ids"):
        loaded.tokenizer.encode("hello")
    assert loaded.config.eos_token_ids == (2,)
    assert loaded.eos_token_ids == (2,)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in loaded.model.parameters())
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_sharded_checkpoint_and_ignored_keys(tmp_path, llama_dir):
    torch.manual_seed(1)
    cfg = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"}, tie_word_embeddings=True)
    hf = LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    # Older checkpoints carry rotary tables, and some tied ones store lm_head anyway: both are ignored.
    first = load_file(shards[0])
    first["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    first["lm_head.weight"] = torch.zeros(300, 64)
    save_file(first, shards[0], metadata={"format": "pt"})
    loaded = load(tmp_path)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    expected = hf.state_dict()
    got = hf_state_dict(loaded.model)
    assert got.keys() == expected.keys() - {"lm_head.weight"}
    for name, p in got.items():
        assert torch.equal(p, expected[name]), name


def test_unknown_name_lists_presets():
    with pytest.raises(ValueError, match="neither a built-in preset") as e:
        load("no-such-model-anywhere")
    for name in [*PRESETS, "pylm"]:
        assert name in str(e.value)


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in preset"):
        load(tmp_path / "absent")


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        load(tmp_path)


def test_malformed_config(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed JSON"):
        load(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load(d)


def test_missing_weights(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "m")
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load(d)
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not supported"):
        load(d)


def test_missing_and_unexpected_tensors_are_named(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load(d)
    msg = str(e.value)
    assert "missing weights: model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected weights: model.layers.1.mlp.extra.weight" in msg


def test_wrong_shape_is_named(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(65)
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.norm.weight' .* shape \(65,\).*\(64,\)"):
        load(d)


def test_corrupt_safetensors(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read safetensors"):
        load(d)


def test_an_index_names_the_shards_and_bf16_weights_load(tmp_path):
    """What a real checkpoint directory holds: bf16 shards under model.safetensors.index.json beside a stray
    consolidated.safetensors (Mistral's repos carry one), and generation_config.json's list of EOS ids."""
    torch.manual_seed(3)
    cfg = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"}, num_key_value_heads=2)
    hf = LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, tmp_path / "consolidated.safetensors")
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7, 9]}))
    loaded = load(tmp_path)
    assert loaded.eos_token_ids == (2, 7, 9)
    expected = hf.state_dict()
    for name, p in hf_state_dict(loaded.model).items():
        assert p.dtype == torch.float32 and torch.equal(p, expected[name].float()), name
    # A shard the index names must be there.
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / first).unlink()
    with pytest.raises(ValueError, match="names shards that are not in"):
        load(tmp_path)
