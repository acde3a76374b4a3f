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
    """The adapter slot of each row of one activation (-1: the base model), the slots the step uses, and
    the column masks over those slots' rank columns."""

    def __init__(
        self,
        slots: torch.Tensor,
        num_slots: int,
        triton: bool = False,
        active: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        self.slots = slots  # [rows] on the model's device
        self.num_slots = num_slots
        self.triton = triton  # the update by lora/triton_lora.py's kernels (lora_kernel="triton")
        # The slots the step uses, when fewer than all (None: every slot's columns are computed), and each
        # row's place among them (-1: the base model).
        self.active = active
        self.positions = positions if positions is not None else slots
        self.num_columns_slots = len(active) if active is not None else num_slots
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, used slots x width]: 1 in the columns of the row's own slot, made once per width a step."""
        key = (width, dtype)
        m = self._masks.get(key)
        if m is None:
            cols = torch.arange(self.num_columns_slots * width, device=self.slots.device) // width
            m = (cols.unsqueeze(0) == self.positions.unsqueeze(1)).to(dtype)
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
        used = sorted({s for s in token_slots if s >= 0})
        if triton or len(used) == num_slots:
            rows = LoRARows(slots.to(device), num_slots, triton)
            if kept is None:
                return LoRAStep(rows, rows)
            return LoRAStep(rows, LoRARows(slots[kept].to(device), num_slots, triton))
        # Fewer adapters than slots in this step: only theirs are computed (lora/rows.py's add_lora).
        place = torch.full((num_slots + 1,), -1, dtype=torch.long)  # index num_slots stands for -1
        place[torch.tensor(used)] = torch.arange(len(used))
        positions = place[torch.where(slots >= 0, slots, num_slots)]
        active = torch.tensor(used, dtype=torch.long, device=device)

        def rows_of(index: list[int] | None) -> LoRARows:
            s, p = (slots, positions) if index is None else (slots[index], positions[index])
            return LoRARows(s.to(device), num_slots, False, active, p.to(device))

        rows = rows_of(None)
        return LoRAStep(rows, rows if kept is None else rows_of(kept))


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> None:
    """y += ((x a^T) * the rows' masks) b^T, in place. a: [slots x width, in], b: [out, slots x width] (the
    scaling folded into b). With lora_kernel="triton", Triton's kernels compute each row's own adapter instead
    (lora/triton_lora.py)."""
    if rows.triton:
        from chunkwise.engine.lora import triton_lora

        if triton_lora.supports(y, x, a, b):
            triton_lora.add_lora_triton(y, x, a, b, rows.slots, rows.num_slots)
            return
    width = a.shape[0] // rows.num_slots
    if rows.active is not None:
        # Only the step's adapters' rank columns: the others would be multiplied by zero.
        k = rows.num_columns_slots
        a = a.view(rows.num_slots, width, -1).index_select(0, rows.active).view(k * width, -1)
        b = b.view(b.shape[0], rows.num_slots, width).index_select(1, rows.active).view(b.shape[0], k * width)
    h = x @ a.t()
    h.mul_(rows.mask(width, h.dtype))
    y.addmm_(h, b.t())
