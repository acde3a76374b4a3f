"""Which rows of a step run which adapter, and the update the adapters add to a projection's output.

A step mixes rows of several adapters and of the base model. Each projection an adapter may target holds
every slot's A stacked along the rank ([slots x width, in]) and every slot's B side by side ([out, slots x
width]), width being the rank times the projection's parts (lora/slots.py). One step's update is then three
operations whatever the number of adapters: every row through every slot's A, the columns of the slots that
are not the row's zeroed by a mask (a base-model row's are all zeroed), and the result through B added to the
output. The extra work is the few rank columns of every slot; vLLM's punica kernels compute only the row's
own on a GPU, in one launch. The shapes do not depend on which rows run which adapter."""

from __future__ import annotations

import torch


class LoRARows:
    """The adapter slot of each row of one activation (-1: the base model), and its column masks."""

    def __init__(self, slots: torch.Tensor, num_slots: int, triton: bool = False) -> None:
        self.slots = slots  # [rows] on the model's device
        self.num_slots = num_slots
        self.triton = triton  # the update by lora/triton_lora.py's kernels (lora_kernel="triton")
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, slots x width]: 1 in the columns of the row's own slot, made once per width a step."""
        key = (width, dtype)
        m = self._masks.get(key)
        if m is None:
            cols = torch.arange(self.num_slots * width, device=self.slots.device) // width
            m = (cols.unsqueeze(0) == self.slots.unsqueeze(1)).to(dtype)
            self._masks[key] = m
        return m


class LoRAStep:
    """A step's rows: every token (`rows`), and the rows kept past the last layer's attention (`kept`: the
    same object as `rows` when the step keeps every row)."""

    def __init__(self, rows: LoRARows, kept: LoRARows) -> None:
        self.rows = rows
        self.kept = kept

    @staticmethod
    def of(
        token_slots: list[int],
        kept: list[int] | None,
        num_slots: int,
        device: torch.device,
        triton: bool = False,
    ) -> LoRAStep | None:
        """From each token's slot (-1: the base model) and the token rows the step keeps past its last
        attention (None: all); None when no token runs an adapter (the model then runs as without LoRA)."""
        if max(token_slots, default=-1) < 0:
            return None
        slots = torch.tensor(token_slots, dtype=torch.long)
        rows = LoRARows(slots.to(device), num_slots, triton)
        if kept is None:
            return LoRAStep(rows, rows)
        return LoRAStep(rows, LoRARows(slots[kept].to(device), num_slots, triton))


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> None:
    """y += ((x a^T) * the rows' masks) b^T, in place. a: [slots x width, in], b: [out, slots x width] (the
    scaling folded into b). With lora_kernel="triton", Triton's kernels compute each row's own adapter instead
    (lora/triton_lora.py)."""
    if rows.triton:
        from chunkwise.engine.lora import triton_lora

        if triton_lora.supports(y, x, a, b):
            triton_lora.add_lora_triton(y, x, a, b, rows.slots, rows.num_slots)
            return
    h = x @ a.t()
    h.mul_(rows.mask(a.shape[0] // rows.num_slots, h.dtype))
    y.addmm_(h, b.t())
