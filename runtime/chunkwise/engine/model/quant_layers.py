"""Which of a model's linear layers a QuantScheme quantizes, the checkpoint tensors each reads, and filling
them: the loader's side of quantization (loader.py calls these; the formats and kernels are engine/quant/).

The LM head and the embedding stay in full precision, as every format here leaves them (and as vLLM's
`--quantization` does); a fused projection (q/k/v, gate/up) is quantized only if all its parts are.
"""

from __future__ import annotations

from torch import nn

from chunkwise.engine.model.layers import Linear
from chunkwise.engine.quant.formats import QuantScheme
from chunkwise.engine.quant.weights import QuantizedWeight, quantize_fp8, quantize_int8


def projections(name: str, linear: Linear) -> list[tuple[str, int]]:
    """The Hugging Face modules whose rows fill `linear` ("model.layers.0.self_attn.q_proj", ...), with
    their row counts, in order."""
    if not linear.parts:
        return [(name, linear.out_features)]
    owner = name.rpartition(".")[0]
    return [(f"{owner}.{p.name}" if p.name else name, p.rows) for p in linear.parts]


def quantized_layers(model: nn.Module, scheme: QuantScheme) -> dict[str, Linear]:
    """The Linear modules `scheme` holds quantized, by name."""
    chosen: dict[str, Linear] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.endswith("lm_head"):
            continue
        skipped = {scheme.skips(hf) for hf, _ in projections(name, module)}
        if len(skipped) > 1:
            raise ValueError(
                f"{name}: the checkpoint quantizes some of the projections fused here but not all "
                f"({', '.join(hf for hf, _ in projections(name, module))}); chunkwise fuses them into one layer"
            )
        if not skipped.pop():
            chosen[name] = module
    return chosen


def group_k_for(scheme: QuantScheme, in_features: int) -> int:
    if scheme.block is not None:
        return scheme.block[1]
    if scheme.kind == "int4":
        return scheme.group_size or in_features
    return in_features


def quantize_structure(model: nn.Module, scheme: QuantScheme) -> None:
    """Give each quantized layer its quantized buffers (before weights are allocated or loaded)."""
    for module in quantized_layers(model, scheme).values():
        module.quantize(scheme.kind, group_k_for(scheme, module.in_features))


def checkpoint_tensors(
    model: nn.Module, scheme: QuantScheme
) -> tuple[dict[str, tuple[str, int, str]], set[str]]:
    """(each quantized tensor the checkpoint must hold -> (layer, part index, suffix), the optional ones)."""
    required: dict[str, tuple[str, int, str]] = {}
    optional: set[str] = set()
    for name, module in quantized_layers(model, scheme).items():
        for i, (hf, _) in enumerate(projections(name, module)):
            for suffix in scheme.tensors:
                required[f"{hf}.{suffix}"] = (name, i, suffix)
            for suffix in scheme.optional:
                optional.add(f"{hf}.{suffix}")
                required[f"{hf}.{suffix}"] = (name, i, suffix)
    return required, optional


def fill(linear: Linear, name: str, parts: dict[int, dict[str, object]], scheme: QuantScheme) -> None:
    """Convert each part's tensors and copy them into the layer's rows (in part order)."""
    qw = linear.quantized
    assert qw is not None
    row = 0
    for i, (hf, rows) in enumerate(projections(name, linear)):
        tensors = parts.get(i, {})
        part = scheme.convert(tensors, rows, linear.in_features, hf)
        _copy_rows(qw, part, row)
        row += rows


def _copy_rows(qw: QuantizedWeight, part: QuantizedWeight, row: int) -> None:
    stop = row + part.out_features
    if part.group_k != qw.group_k or part.scale.shape[1] != qw.scale.shape[1]:
        raise ValueError(f"a part's groups ({part.group_k}) differ from its layer's ({qw.group_k})")
    qw.data[row:stop].copy_(part.data)
    qw.scale[row:stop].copy_(part.scale)
    if qw.zero is not None and part.zero is not None:
        qw.zero[row:stop].copy_(part.zero)


def quantize_loaded(model: nn.Module, scheme: QuantScheme) -> int:
    """`--quantization`: quantize each loaded full-precision linear weight in place, freeing it. Returns the
    number of layers quantized."""
    layers = quantized_layers(model, scheme)
    for module in layers.values():
        weight = module.weight.detach()
        qw = quantize_int8(weight) if scheme.kind == "int8" else quantize_fp8(weight)
        module.quantize(scheme.kind, module.in_features)
        _copy_rows(module.quantized, qw, 0)  # type: ignore[arg-type]
    return len(layers)
