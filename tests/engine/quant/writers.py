"""Quantized checkpoints written by the tests from a random transformers model, each format's packing
written out here from its documentation (not from chunkwise's reader), beside a full-precision copy holding
the dequantized weights: transformers on that copy is the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column 8j + order[i]


def save_llama(path: Path, hidden: int = 128, intermediate: int = 256, family: str = "llama") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(11)
    common = dict(
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common)).eval()  # q/k/v biases
    else:
        model = LlamaForCausalLM(LlamaConfig(**common)).eval()
    with torch.no_grad():  # weights large enough that greedy tokens do not hang on rounding
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(torch.randn(p.shape) * 2.0 / p.shape[1] ** 0.5)
    out = path / "fp"
    model.save_pretrained(out)
    return out


def _words(nibbles: np.ndarray) -> torch.Tensor:
    """[..., 8] values in [0, 15] -> int32 words, value i at bits 4i."""
    words = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        words |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32).copy())


def _quantize(
    method: str, w: torch.Tensor, gen: torch.Generator, group: int, block: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's weight [out, in] -> (its tensors by suffix, the dequantized weight)."""
    out_f, in_f = w.shape
    if method == "fp8-block":
        rb, cb = -(-out_f // block), -(-in_f // block)
        padded = torch.zeros(rb * block, cb * block)
        padded[:out_f, :in_f] = w
        amax = padded.reshape(rb, block, cb, block).abs().amax(dim=(1, 3))
        scale = amax / 448.0
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
        q = (w / full).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale}, q.float() * full
    if method in ("ct-fp8", "ct-int8", "fp8-tensor"):
        per_tensor = method == "fp8-tensor"
        amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
        if method == "ct-int8":
            scale = amax / 127.0
            q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        else:
            scale = amax / 448.0
            q = (w / scale).to(torch.float8_e4m3fn)
        name = "weight_scale"
        return {"weight": q, name: scale.reshape(()) if per_tensor else scale}, q.float() * scale
    # 4-bit: asymmetric groups along the input dimension.
    groups = in_f // group
    wg = w.reshape(out_f, groups, group)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(1, 15)  # GPTQ v1 cannot store a zero point of 0
    q = torch.round(wg / scale.float()[:, :, None] + zero[:, :, None]).clamp(0, 15)
    deq = ((q - zero[:, :, None]) * scale.float()[:, :, None]).reshape(out_f, in_f)
    q = q.reshape(out_f, in_f).to(torch.int64).numpy()
    z = zero.to(torch.int64).numpy()  # [out, groups]
    if method == "awq":
        # qweight [in, out / 8]: for input row r and word j, nibble i is column 8j + AWQ_PACK_ORDER[i].
        qt = q.T.reshape(in_f, out_f // 8, 8)[:, :, list(AWQ_PACK_ORDER)]
        zt = z.T.reshape(groups, out_f // 8, 8)[:, :, list(AWQ_PACK_ORDER)]
        tensors = {"qweight": _words(qt), "qzeros": _words(zt), "scales": scale.t().contiguous()}
    else:
        # qweight [in / 8, out]: word r of column c holds input rows 8r..8r+7 in order; zeros stored minus one.
        qt = q.T.reshape(in_f // 8, 8, out_f).transpose(0, 2, 1)
        zt = (z.T - 1).reshape(groups, out_f // 8, 8)
        g_idx = torch.arange(in_f, dtype=torch.int32) // group
        tensors = {
            "qweight": _words(qt),
            "qzeros": _words(zt),
            "scales": scale.t().contiguous(),
            "g_idx": g_idx,
        }
    return tensors, deq


def quantization_config(method: str, group: int, block: int) -> dict[str, object]:
    if method == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
        }
    if method == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if method in ("ct-fp8", "ct-int8"):
        fp = method == "ct-fp8"
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized" if fp else "int-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float" if fp else "int",
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float" if fp else "int",
                        "strategy": "token",
                        "dynamic": True,
                        "symmetric": True,
                    },
                }
            },
        }
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
    }


def write_quantized(
    fp_dir: Path, out: Path, method: str, group: int = 32, block: int = 128
) -> tuple[Path, Path]:
    """(the quantized checkpoint, a full-precision copy holding its dequantized weights)."""
    gen = torch.Generator().manual_seed(5)
    state = load_file(str(fp_dir / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        owner, _, kind = name.rpartition(".")
        if kind == "weight" and owner.rpartition(".")[2] in PROJECTIONS:
            tensors, deq = _quantize(method, t.float(), gen, group, block)
            for suffix, value in tensors.items():
                quantized[f"{owner}.{suffix}"] = value.contiguous()
            reference[name] = deq.contiguous()
        else:
            quantized[name] = t
            reference[name] = t
    q_dir, ref_dir = out / method, out / f"{method}-reference"
    for d, tensors in ((q_dir, quantized), (ref_dir, reference)):
        shutil.copytree(fp_dir, d)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(method, group, block)
    (q_dir / "config.json").write_text(json.dumps(cfg))
    return q_dir, ref_dir
