"""Write a full-precision Llama checkpoint's linear weights as a compressed-tensors INT8 W8A8 checkpoint
(llm-compressor's layout: int8 `weight` and a float32 `weight_scale` [out, 1] per projection, symmetric per
channel; activations dynamic per token), the rest unchanged: one checkpoint both chunkwise and vLLM's CPU
build load, for `chunkwise bench compare vllm --model DST`. The weights are chunkwise's `--quantization
int8` (absmax / 127 per output row), so chunkwise serves the same numbers either way.

    PYTHONPATH=runtime .venv/bin/python bench/quant/write_ct_int8.py ~/.cache/chunkwise/bench/llama-57m /tmp/llama-57m-int8
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from chunkwise.engine.quant.weights import quantize_int8

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            owner, _, kind = name.rpartition(".")
            if kind == "weight" and owner.rpartition(".")[2] in PROJECTIONS:
                qw = quantize_int8(t.float())
                out[name] = qw.data
                out[f"{owner}.weight_scale"] = qw.scale
            else:
                out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    print(dst)


if __name__ == "__main__":
    main(Path(sys.argv[1]).expanduser(), Path(sys.argv[2]).expanduser())
