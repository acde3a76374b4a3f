"""`chunkwise inspect MODEL`: what the loader understands of a checkpoint, or why it refuses it, and the
memory one replica needs, without loading a weight.

    chunkwise inspect /models/Llama-3.1-8B-Instruct --max-model-len 8192 --max-num-seqs 16
    chunkwise inspect /models/Llama-3.1-70B-Instruct --tensor-parallel-size 4   # what each GPU holds
    chunkwise inspect /models/Llama-3.1-8B-Instruct --quantization int8          # what --quantization holds

A quantized checkpoint (config.json's quantization_config) or `--quantization` is reported as the loader
would hold it: each quantized linear layer at its quantized size (8 or 4 bits a weight, float32 scales and
zero points), the embedding, the LM head and the norms in the dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from chunkwise.engine.distributed import TPGroup

GIB = 1 << 30
MIB = 1 << 20


def _size(nbytes: int) -> str:
    """GiB, or MiB below one GiB (a small model's weights, quantized or not, would all read 0.00 GiB)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"


@dataclass
class ModelReport:
    model: str
    family: str
    checkpoint_dtype: str | None
    dtype: str
    dtype_reason: str
    parameters: int
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope: dict[str, Any]
    eos_token_ids: list[int]
    tokenizer: str
    chat_template: bool
    kv_bytes_per_token: int
    weight_bytes: int
    max_model_len: int
    max_num_seqs: int
    # How the linear weights are held (QuantScheme.description; None: full precision in `dtype`), and how
    # many of the model's linear layers (a fused projection counted once) that quantizes.
    quantization: str | None = None
    quantized_layers: int = 0
    # Tensor parallel: the two byte counts above are one rank's (its shard of the weights, its KV heads); the
    # largest rank's where the vocabulary does not split evenly.
    tensor_parallel_size: int = 1

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.max_model_len * self.max_num_seqs

    def lines(self) -> list[str]:
        rope = self.rope.get("rope_type", "default")
        extras = ", ".join(
            f"{k}={v}" for k, v in self.rope.items() if k != "rope_type" and v not in (None, ())
        )
        per = (
            f" on each of {self.tensor_parallel_size} tensor-parallel ranks"
            if self.tensor_parallel_size > 1
            else ""
        )
        return [
            f"model:          {self.model}",
            f"family:         {self.family} ({self.layers} layers, hidden {self.hidden_size}, {self.heads} heads "
            f"over {self.kv_heads} KV heads of {self.head_dim})",
            f"parameters:     {self.parameters:,} ({self.parameters / 1e9:.2f}B)",
            f"dtype:          {self.dtype} ({self.dtype_reason}); the checkpoint stores {self.checkpoint_dtype or 'unknown'}",
            f"rope:           {rope}"
            + (f" ({extras})" if extras else "")
            + f", context {self.context} tokens",
            f"EOS ids:        {self.eos_token_ids}",
            f"tokenizer:      {self.tokenizer}; chat template: {'yes' if self.chat_template else 'no'}",
            "quantization:   "
            + (
                f"{self.quantization}: {self.quantized_layers} linear layers; the embedding, LM head and norms in "
                f"{self.dtype}"
                if self.quantization
                else "none"
            ),
            f"KV per token:   {self.kv_bytes_per_token:,} bytes{per}",
            f"{'memory/rank:' if per else 'memory:':<16}weights {_size(self.weight_bytes)} + KV {_size(self.kv_bytes)} "
            f"({self.max_num_seqs} x {self.max_model_len} tokens) = {_size(self.weight_bytes + self.kv_bytes)}",
        ]


def inspect_model(
    name_or_path: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    max_model_len: int | None = None,
    max_num_seqs: int = 1,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
) -> ModelReport:
    """Raises ValueError with the loader's reason for a checkpoint it refuses (or for a tensor-parallel size
    its heads or columns do not divide over, naming the field; or for a quantization_config or
    `quantization` ("int8", "fp8": --quantization) it cannot serve there)."""
    from itertools import chain

    import torch

    from chunkwise.engine.attention.torch_ref import TorchAttentionBackend
    from chunkwise.engine.distributed import SINGLE_RANK, TPLayout
    from chunkwise.engine.hardware import cpu_has_bf16_matmul, resolve_dtype
    from chunkwise.engine.model.bundled import resolve_model_path
    from chunkwise.engine.model.layers import Linear
    from chunkwise.engine.model.llama import LlamaForCausalLM
    from chunkwise.engine.model.loader import (
        SUPPORTED_ARCHITECTURES,
        checkpoint_dtype,
        hf_weight_names,
        read_checkpoint,
    )
    from chunkwise.engine.model.loader import _refuse_parallel as refuse_parallel
    from chunkwise.engine.model.presets import PRESETS
    from chunkwise.engine.model.quant_layers import quantize_structure, quantized_layers
    from chunkwise.engine.quant.formats import QuantScheme, online_scheme, scheme_from_config
    from chunkwise.engine.tokenizer import NoTokenizer
    from chunkwise.engine.worker.kv_tensors import kv_bytes_per_token

    if name_or_path in PRESETS:
        config = PRESETS[name_or_path]
        family = "llama (built-in preset)"
        tokenizer = "byte-level (built in)"
        chat_template = True
        eos = config.eos_token_ids
        scheme: QuantScheme | None = None
    else:
        path = resolve_model_path(name_or_path)
        config, tok = read_checkpoint(path)
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        family = next(
            (f for a, f in SUPPORTED_ARCHITECTURES.items() if a in (raw.get("architectures") or [])),
            str(raw.get("model_type", "?")),
        )
        if isinstance(tok, NoTokenizer):
            tokenizer = "none (no tokenizer.json: token ids in and out)"
        else:
            tokenizer = f"tokenizer.json ({tok.vocab_size} ids, {len(tok.special_token_ids)} special)"
        chat_template = tok.chat_template is not None
        # The ids that end generation: the config's and the tokenizer's (LoadedModel.eos_token_ids).
        eos = tuple(dict.fromkeys((*config.eos_token_ids, *tok.eos_token_ids)))
        scheme = scheme_from_config(raw)  # ValueError naming what it cannot serve, as at load
    if quantization is not None:  # as load_model resolves --quantization
        online = online_scheme(quantization, torch.device(device))
        if scheme is None:
            scheme = online
        elif scheme.kind != online.kind:
            raise ValueError(
                f"--quantization {quantization} on a checkpoint already quantized as {scheme.description}: "
                "drop the flag"
            )
    choice = resolve_dtype(dtype, torch.device(device), checkpoint_dtype(name_or_path))
    elem = torch.empty((), dtype=choice.dtype).element_size()
    widen = device == "cpu" and choice.dtype != torch.float32 and not cpu_has_bf16_matmul()

    def weights(rank: TPGroup) -> int:
        """The bytes of weights one rank holds (the whole model at world size 1), built as the loader's
        _empty_model builds it: cast to the dtype, then the quantized layers given their buffers (so the
        scales stay float32; each such layer's plain weight is an empty placeholder)."""
        with torch.device("meta"):
            model = LlamaForCausalLM(config, TorchAttentionBackend(), rank)
        model = model.to(dtype=choice.dtype)
        if scheme is not None:
            quantize_structure(model, scheme)
        # A tied head counted once; the buffers are the quantized layers' data, scales and zero points.
        nbytes = sum(t.numel() * t.element_size() for t in chain(model.parameters(), model.buffers()))
        if widen:
            # Full-precision Linear weights widened to float32 for the CPU's matmul library
            # (model/layers.Linear; a quantized layer keeps its quantized form).
            linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
            nbytes += linear * (4 - elem)
        return nbytes

    with torch.device("meta"):
        whole = LlamaForCausalLM(config, TorchAttentionBackend())
    parameters = sum(int(torch.Size(slot.shape).numel()) for slot in hf_weight_names(whole).values())
    n_quantized = 0
    if scheme is not None:
        refuse_parallel(scheme, _ShapeRank(0, tensor_parallel_size), whole)  # the loader's refusal
        # Which layers the scheme quantizes (ValueError for a fused projection it quantizes only in part).
        n_quantized = len(quantized_layers(whole, scheme))
    weight_bytes = weights(SINGLE_RANK)
    if tensor_parallel_size > 1:
        TPLayout.of(config, 0, tensor_parallel_size)  # sizes that do not divide: refused, naming the field
        weight_bytes = max(weights(_ShapeRank(r, tensor_parallel_size)) for r in range(tensor_parallel_size))
    context = config.max_position_embeddings
    rope = {"rope_type": "default"} if config.rope_scaling is None else asdict(config.rope_scaling)
    return ModelReport(
        model=name_or_path,
        family=family,
        checkpoint_dtype=checkpoint_dtype(name_or_path),
        dtype=choice.name,
        dtype_reason=choice.reason,
        parameters=parameters,
        layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        context=context,
        rope={"rope_theta": config.rope_theta, **rope},
        eos_token_ids=list(eos),
        tokenizer=tokenizer,
        chat_template=chat_template,
        kv_bytes_per_token=kv_bytes_per_token(config, choice.dtype, tensor_parallel_size),
        weight_bytes=weight_bytes,
        max_model_len=min(max_model_len or context, context),
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        quantization=scheme.description if scheme is not None else None,
        quantized_layers=n_quantized,
    )


class _ShapeRank:
    """One of `world_size` ranks, for building a shard's model on the meta device: its layers take their
    shapes from it; nothing runs, so its collectives are never called."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a shape-only rank runs no collective")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise RuntimeError("a shape-only rank runs no collective")


def add_inspect_args(p: argparse.ArgumentParser) -> None:
    from typing import get_args

    from chunkwise.engine.datatypes.config import Quantization

    p.add_argument("model", help="a Hugging Face model directory or a built-in preset")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="(auto)"
    )
    p.add_argument("--device", default="cpu", help="the device the dtype is resolved for (cpu)")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context to size the KV cache for (the model's)"
    )
    p.add_argument("--max-num-seqs", type=int, default=1, help="requests of that length held at once (1)")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is sharded over: the memory shown is each rank's (GPU's) (1)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=list(get_args(Quantization)),
        help="report what serving's --quantization would hold: linear weights quantized at load (fp8 needs "
        "--device cuda) (a quantized checkpoint is reported as it stores them)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run_inspect(args: argparse.Namespace) -> int:
    try:
        report = inspect_model(
            args.model,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            tensor_parallel_size=args.tensor_parallel_size,
            quantization=args.quantization,
        )
    except (ValueError, OSError, json.JSONDecodeError) as e:
        print(f"chunkwise cannot serve {args.model}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**asdict(report), "kv_bytes": report.kv_bytes}, indent=2))
    else:
        print("\n".join(report.lines()))
    return 0
