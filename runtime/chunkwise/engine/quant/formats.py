"""config.json's `quantization_config` -> a QuantScheme: which linear layers a checkpoint stores quantized,
under which tensor names, and how each converts into chunkwise's QuantizedWeight (weights.py).

Read from each format's documentation and its reference implementations:
- "fp8" (DeepSeek-V3, Qwen3-*-FP8): float8_e4m3fn `weight` [out, in] and `weight_scale_inv` float32
  [ceil(out / 128), ceil(in / 128)] per `weight_block_size` block (multiplied, despite the name), dynamic
  activations; without a block size, one `weight_scale` per tensor (vLLM's serialized fp8).
- "compressed-tensors" (llm-compressor): `weight` (float8_e4m3fn or int8) and `weight_scale` per tensor,
  per channel ([out, 1]) or per block, symmetric; activations dynamic per token or none (weight-only).
- "awq" (AutoAWQ, version "gemm"): int32 `qweight` [in, out / 8] and `qzeros` [in / group, out / 8], eight
  4-bit values a word along the output dimension in the order 0 2 4 6 1 3 5 7; fp16 `scales` [in / group,
  out]; w = (q - zero) * scale.
- "gptq" (AutoGPTQ / GPTQModel, desc_act false): int32 `qweight` [in / 8, out] packed along the input
  dimension in order, `qzeros` [in / group, out / 8] packed along the output in order and stored minus one
  (checkpoint_format "gptq"; "gptq_v2" stores them as they are), fp16 `scales` [in / group, out], `g_idx`
  [in] (each input row's group: with desc_act false, row // group, which is checked).

Anything else is refused at load naming `quant_method` or the config field it cannot serve: a checkpoint is
never served with wrong output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from chunkwise.engine.quant.weights import (
    INT4_BLOCK,
    QuantizedWeight,
    check_int4_shape,
    group_scales,
    pack_int4,
)

CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
# `--quantization`: quantize a full-precision checkpoint's linear weights at load.
ONLINE_METHODS = ("int8", "fp8")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output column 8j + AWQ_ORDER[i]


@dataclass(frozen=True)
class QuantScheme:
    method: str  # a quant_method, or an ONLINE_METHODS entry for --quantization
    kind: str  # the QuantizedWeight kind every quantized layer gets
    # The checkpoint's tensors for one linear layer, and those it may carry or not (GPTQ's g_idx).
    tensors: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    block: tuple[int, int] | None = None  # fp8 weight_block_size
    group_size: int = 0  # awq/gptq input columns a scale; 0: every column of the row
    gptq_zero_offset: int = 0  # GPTQ v1 stores zero points minus one
    skip_substrings: tuple[str, ...] = ()
    skip_exact: tuple[str, ...] = ()
    skip_patterns: tuple[str, ...] = ()
    online: bool = False

    @property
    def description(self) -> str:
        """What runs, for the start-up log, /v1/models and `chunkwise inspect`."""
        if self.online:
            return f"{self.method} (weights quantized at load, a scale per output channel)"
        detail = {
            "fp8": f"fp8 e4m3, {'block ' + 'x'.join(map(str, self.block)) if self.block else 'per-tensor'} scales",
            "int8": "int8, per-channel scales",
            "int4": f"4-bit, groups of {self.group_size or 'all'} input columns",
        }[self.kind]
        return f"{self.method} ({detail})"

    def skips(self, module: str) -> bool:
        """Whether the checkpoint keeps `module` ("model.layers.0.self_attn.q_proj") in full precision."""
        if module in self.skip_exact or any(s in module for s in self.skip_substrings):
            return True
        return any(re.fullmatch(p, module) for p in self.skip_patterns)

    def convert(self, tensors: dict[str, torch.Tensor], rows: int, cols: int, name: str) -> QuantizedWeight:
        """One HF projection's tensors (by suffix) -> its QuantizedWeight [rows, cols]; ValueError naming the
        tensor whose shape or dtype does not fit."""
        if self.method in ("awq", "gptq"):
            return _convert_int4(self, tensors, rows, cols, name)
        return _convert_8bit(self, tensors, rows, cols, name)


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
    return value


def _names(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of module names, got {value!r}")
    return tuple(value)


def scheme_from_config(raw: dict[str, Any]) -> QuantScheme | None:
    """The scheme config.json's quantization_config describes (None: a full-precision checkpoint)."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    where = "config.json quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{where} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"{where}.quant_method {method!r} is not supported; chunkwise loads {', '.join(CHECKPOINT_METHODS)} "
            "checkpoints (and quantizes full-precision ones at load with --quantization int8|fp8)"
        )
    if method == "fp8":
        return _fp8_scheme(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    return _int4_scheme(method, qc, where)


def _fp8_scheme(qc: dict[str, Any], where: str) -> QuantScheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"{where}.activation_scheme {scheme!r} is not supported (only 'dynamic': static input scales are not "
            "applied)"
        )
    block = qc.get("weight_block_size")
    skip = _names(
        qc.get("modules_to_not_convert") or qc.get("ignored_layers"), f"{where}.modules_to_not_convert"
    )
    if block is None:
        return QuantScheme("fp8", "fp8", ("weight", "weight_scale"), skip_substrings=skip)
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"{where}.weight_block_size must be two positive integers, got {block!r}")
    if block[1] % 16:
        raise ValueError(f"{where}.weight_block_size {block}: the input block must be a multiple of 16")
    return QuantScheme(
        "fp8", "fp8", ("weight", "weight_scale_inv"), block=(block[0], block[1]), skip_substrings=skip
    )


def _compressed_tensors_scheme(qc: dict[str, Any], where: str) -> QuantScheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "int-quantized", "naive-quantized"):
        raise ValueError(
            f"{where}.format {fmt!r} is not supported; chunkwise loads compressed-tensors 'float-quantized', "
            "'int-quantized' and 'naive-quantized' (8-bit) checkpoints"
        )
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise ValueError(f"{where}.quantization_status {status!r} is not supported (only 'compressed')")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"{where}.config_groups must hold exactly one group (got {groups!r})")
    gname, group = next(iter(groups.items()))
    gwhere = f"{where}.config_groups.{gname}"
    if not isinstance(group, dict):
        raise ValueError(f"{gwhere} must be an object")
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{gwhere}.targets {group.get('targets')!r} is not supported (only ['Linear'])")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"{gwhere}.weights must be an object")
    wwhere = f"{gwhere}.weights"
    if _int(w, "num_bits", wwhere) != 8:
        raise ValueError(f"{wwhere}.num_bits {w.get('num_bits')!r} is not supported (only 8)")
    wtype = w.get("type")
    if wtype not in ("float", "int"):
        raise ValueError(f"{wwhere}.type {wtype!r} is not supported ('float' or 'int')")
    if not w.get("symmetric", True):
        raise ValueError(f"{wwhere}.symmetric false is not supported (zero points are not read)")
    if w.get("dynamic", False):
        raise ValueError(f"{wwhere}.dynamic true is not supported (weights carry their scales)")
    strategy = w.get("strategy")
    block: tuple[int, int] | None = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise ValueError(f"{wwhere}.block_structure must be two positive integers, got {bs!r}")
        if bs[1] % 16:
            raise ValueError(f"{wwhere}.block_structure {bs}: the input block must be a multiple of 16")
        block = (bs[0], bs[1])
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"{wwhere}.strategy {strategy!r} is not supported ('tensor', 'channel' or 'block')")
    act = group.get("input_activations")
    if act is not None:
        if not isinstance(act, dict):
            raise ValueError(f"{gwhere}.input_activations must be an object or null")
        if not act.get("dynamic", False):
            raise ValueError(
                f"{gwhere}.input_activations.dynamic false is not supported (static input scales are not applied)"
            )
    ignore = _names(qc.get("ignore"), f"{where}.ignore")
    return QuantScheme(
        "compressed-tensors",
        "fp8" if wtype == "float" else "int8",
        ("weight", "weight_scale"),
        block=block,
        skip_exact=tuple(i for i in ignore if not i.startswith("re:")),
        skip_patterns=tuple(i[3:] for i in ignore if i.startswith("re:")),
    )


def _int4_scheme(method: str, qc: dict[str, Any], where: str) -> QuantScheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}.bits {bits!r} is not supported for {method} (only 4)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if isinstance(group, bool) or not isinstance(group, int) or (group <= 0 and group != -1):
        raise ValueError(f"{where}.group_size must be a positive integer or -1, got {group!r}")
    skip = _names(qc.get("modules_to_not_convert"), f"{where}.modules_to_not_convert")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}.version {qc.get('version')!r} is not supported (only 'gemm')")
        if not qc.get("zero_point", True):
            raise ValueError(f"{where}.zero_point false is not supported (only AWQ with zero points)")
        return QuantScheme(
            "awq", "int4", ("qweight", "qzeros", "scales"), group_size=max(group, 0), skip_substrings=skip
        )
    if qc.get("desc_act"):
        raise ValueError(
            f"{where}.desc_act true is not supported (act-order GPTQ reorders input rows by g_idx; quantize with "
            "desc_act false)"
        )
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}.checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2')")
    return QuantScheme(
        "gptq",
        "int4",
        ("qweight", "qzeros", "scales"),
        optional=("g_idx",),
        group_size=max(group, 0),
        gptq_zero_offset=1 if fmt == "gptq" else 0,
        skip_substrings=skip,
    )


def online_scheme(method: str, device: torch.device) -> QuantScheme:
    """`--quantization METHOD` for a full-precision checkpoint."""
    if method not in ONLINE_METHODS:
        raise ValueError(f"--quantization {method!r} is not supported (one of {', '.join(ONLINE_METHODS)})")
    if method == "fp8" and device.type != "cuda":
        raise ValueError(
            "--quantization fp8 runs on CUDA (fp8 tensor cores); on a CPU use --quantization int8, which reads as "
            "many bytes a weight"
        )
    return QuantScheme(method, method, online=True)


def _expect(
    t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], name: str
) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, but config.json implies {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"weight {name!r} is {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    return t


def _convert_8bit(
    scheme: QuantScheme, tensors: dict[str, torch.Tensor], rows: int, cols: int, name: str
) -> QuantizedWeight:
    wdtype = torch.float8_e4m3fn if scheme.kind == "fp8" else torch.int8
    data = _expect(tensors["weight"], (rows, cols), (wdtype,), f"{name}.weight")
    scale_name = scheme.tensors[1]
    scale = tensors[scale_name].float()
    if scheme.block is not None:
        bn, bk = scheme.block
        scale = group_scales(scale, rows, cols, bn, bk)
        return QuantizedWeight(scheme.kind, data.contiguous(), scale, None, bk, cols)
    if scale.numel() == 1:  # per tensor
        return QuantizedWeight(
            scheme.kind, data.contiguous(), scale.reshape(1, 1).expand(rows, 1).contiguous(), None, cols, cols
        )
    if scale.numel() == rows:  # per channel
        return QuantizedWeight(
            scheme.kind, data.contiguous(), scale.reshape(rows, 1).contiguous(), None, cols, cols
        )
    raise ValueError(
        f"weight {name}.{scale_name!s} has shape {tuple(scale.shape)}: neither one scale nor one per output row "
        f"({rows})"
    )


def _unpack_words(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [a, b] -> [a, b * 8] 4-bit values, nibble order[i] of each word becoming value 8j + i."""
    shifts = torch.tensor([4 * o for o in order], dtype=torch.int32)
    nibbles = (words.to(torch.int32)[:, :, None] >> shifts) & 0xF
    return nibbles.reshape(words.shape[0], words.shape[1] * 8)


def _convert_int4(
    scheme: QuantScheme, tensors: dict[str, torch.Tensor], rows: int, cols: int, name: str
) -> QuantizedWeight:
    group = scheme.group_size or cols
    check_int4_shape(cols, group)
    groups = cols // group
    if rows % 8:
        raise ValueError(f"{name}: {rows} output rows are not a multiple of 8, as 4-bit packing needs")
    int32 = (torch.int32,)
    scales = _expect(
        tensors["scales"], (groups, rows), (torch.float16, torch.bfloat16, torch.float32), f"{name}.scales"
    )
    qzeros = _expect(tensors["qzeros"], (groups, rows // 8), int32, f"{name}.qzeros")
    if scheme.method == "awq":
        inverse = tuple(AWQ_ORDER.index(i) for i in range(8))
        qweight = _expect(tensors["qweight"], (cols, rows // 8), int32, f"{name}.qweight")
        q = _unpack_words(qweight, inverse).t()  # [rows, cols]
        zeros = _unpack_words(qzeros, inverse).t().float()  # [rows, groups]
    else:
        qweight = _expect(tensors["qweight"], (cols // 8, rows), int32, f"{name}.qweight")
        q = _unpack_words(qweight.t().contiguous())  # [rows, cols]: word i of a row holds inputs 8i..8i+7
        zeros = _unpack_words(qzeros).t().float() + scheme.gptq_zero_offset
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            expected = torch.arange(cols, dtype=torch.int64) // group
            if tuple(g_idx.shape) != (cols,) or not torch.equal(g_idx.to(torch.int64), expected):
                raise ValueError(
                    f"weight {name}.g_idx is not input row // group_size: an act-order (desc_act) checkpoint, "
                    "which is not supported"
                )
    assert cols % INT4_BLOCK == 0
    return QuantizedWeight(
        "int4", pack_int4(q.contiguous()), scales.float().t().contiguous(), zeros.contiguous(), group, cols
    )
