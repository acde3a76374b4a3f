"""Tensor parallelism in the model: the vocabulary-parallel embedding, and which shard of each Hugging Face
tensor a rank's parameters hold (what the loader reads, and nothing more: a rank never holds a whole tensor
it shards).

The layers that shard are the ordinary ones, holding smaller weights: a column-parallel Linear's output rows
and a row-parallel Linear's input columns say where they come from (layers.Part, Linear.columns); the model
sums the row-parallel outputs over the ranks (llama.py). distributed/layout.py says what each rank holds."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from chunkwise.engine.distributed import TPGroup, TPLayout
from chunkwise.engine.model.layers import Linear


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding over this rank's rows of the vocabulary (layout.vocab_shard, its last rows
    padding past vocab_size on the last rank): a token outside the shard looks up zeros, and the sum over the
    ranks (one all_reduce, exact: one rank's row plus zeros) is every token's row. At world size 1 it is
    nn.Embedding over the whole vocabulary."""

    def __init__(self, layout: TPLayout, hidden_size: int, tp: TPGroup) -> None:
        super().__init__(layout.vocab_shard, hidden_size)
        self.vocab_size = layout.vocab_size
        self.vocab_start = layout.vocab_start
        self.vocab_rows = layout.vocab_rows
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class Slot(NamedTuple):
    """Where one Hugging Face tensor goes: rows [row, row + n) of the parameter `param`, n the rows of this
    rank's shard of it. `shape` is the HF tensor's (what config.json implies); the shard is its range
    [start, start + size) along `dim` (size None: the whole tensor)."""

    param: str
    row: int
    shape: tuple[int, ...]
    dim: int = 0
    start: int = 0
    size: int | None = None

    @property
    def shard_shape(self) -> tuple[int, ...]:
        if self.size is None:
            return self.shape
        return (*self.shape[: self.dim], self.size, *self.shape[self.dim + 1 :])


def read_shard(source: Any, slot: Slot) -> torch.Tensor:
    """This rank's shard of an HF tensor: `source` a tensor, or a safetensors slice (which reads only the
    shard from the file)."""
    if slot.size is None:
        return source[:]
    return source[(slice(None),) * slot.dim + (slice(slot.start, slot.start + slot.size),)]


def hf_weight_names(model: nn.Module) -> dict[str, Slot]:
    """Each Hugging Face tensor the model reads -> its Slot (parameter, first row there, HF shape, shard).

    Fused projections (Linear.parts) read several HF tensors into consecutive rows of one parameter;
    at world size 1 every slot is a whole tensor."""
    slots: dict[str, Slot] = {}
    modules = dict(model.named_modules())
    # named_parameters() lists a tied weight once, under the embedding's name.
    for name, p in model.named_parameters():
        prefix, _, kind = name.rpartition(".")
        module = modules[prefix]
        if isinstance(module, Linear) and module.quant_kind is not None and kind == "weight":
            continue  # read by quant/apply.py under the format's own tensor names
        rest = tuple(p.shape[1:])
        if isinstance(module, VocabParallelEmbedding):
            whole = module.vocab_rows == module.vocab_size
            size = None if whole else module.vocab_rows
            slots[name] = Slot(name, 0, (module.vocab_size, *rest), 0, module.vocab_start, size)
        elif isinstance(module, Linear) and module.columns is not None:
            first, total = module.columns
            size = None if total == p.shape[1] else p.shape[1]
            slots[name] = Slot(name, 0, (p.shape[0], total), 1, first, size)
        elif isinstance(module, Linear) and module.parts:
            owner = prefix.rpartition(".")[0]
            row = 0
            for part in module.parts:
                hf = f"{owner}.{part.name}.{kind}" if part.name else name
                total = part.total or part.rows
                size = None if total == part.rows else part.rows
                slots[hf] = Slot(name, row, (total, *rest), 0, part.start, size)
                row += part.rows
        else:
            slots[name] = Slot(name, 0, tuple(p.shape))
    return slots
