"""Which rows of a step run which adapter, and the update an adapter adds to a projection's output.

A step mixes rows of several adapters and of the base model. Each projection that an adapter may target
holds every resident adapter's A and B stacked by slot (lora/slots.py); per slot, its rows are gathered,
run through A then B, and added back: one pair of small matmuls per adapter in the step, whatever the number
of rows (vLLM's punica kernels do the same in one launch on a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRARows:
    """The rows of one activation that run an adapter, grouped by slot (rows of the base model are in none)."""

    groups: tuple[tuple[int, torch.Tensor], ...]

    @staticmethod
    def of(slots: torch.Tensor, device: torch.device) -> LoRARows:
        """From each row's slot on the host (-1: the base model), the row indices on `device`."""
        present = sorted(int(s) for s in torch.unique(slots).tolist() if s >= 0)
        return LoRARows(tuple((s, torch.nonzero(slots == s).squeeze(1).to(device)) for s in present))


@dataclass(frozen=True)
class LoRAStep:
    """A step's rows: every token (`rows`), and the rows kept past the last layer's attention (`kept`: the
    same as `rows` when the step keeps every row)."""

    rows: LoRARows
    kept: LoRARows

    @staticmethod
    def of(token_slots: list[int], kept: list[int] | None, device: torch.device) -> LoRAStep | None:
        """From each token's slot (-1: the base model) and the token rows the step keeps past its last
        attention (None: all); None when no token runs an adapter (the model then runs as without LoRA)."""
        if max(token_slots, default=-1) < 0:
            return None
        slots = torch.tensor(token_slots, dtype=torch.long)
        rows = LoRARows.of(slots, device)
        if kept is None:
            return LoRAStep(rows, rows)
        return LoRAStep(rows, LoRARows.of(slots[kept], device))


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> None:
    """y[rows of slot s] += x[those rows] a[s]^T b[s]^T for each slot in `rows`, in place.
    a: [slots, rank, in], b: [slots, out, rank] (the scaling folded into b)."""
    for slot, idx in rows.groups:
        xs = x.index_select(0, idx)
        delta = (xs @ a[slot].t()) @ b[slot].t()
        y.index_add_(0, idx, delta.to(y.dtype))
