"""The LoRA update's Triton kernels (lora/triton_lora.py), under TRITON_INTERPRET=1 on CPU tensors, against the
masked form the CPU runs (lora/rows.py): rows of several slots and of the base model, a fused projection's
width, a width and sizes that are not powers of two."""

from __future__ import annotations

import pytest
import torch

from chunkwise.engine.lora.rows import LoRARows, add_lora
from chunkwise.engine.lora.triton_lora import add_lora_triton


@pytest.mark.parametrize(
    ("in_features", "out_features", "width", "slots"), [(64, 96, 12, 3), (200, 130, 48, 2)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_own_adapter_and_the_base_rows_nothing(
    in_features: int, out_features: int, width: int, slots: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(7, in_features, generator=gen).to(dtype)
    a = (torch.randn(slots * width, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, slots * width, generator=gen).to(dtype)
    row_slots = torch.tensor([0, -1, slots - 1, 1, 0, -1, slots - 1])
    y0 = torch.randn(7, out_features, generator=gen).to(dtype)
    expected, got = y0.clone(), y0.clone()
    add_lora(expected, x, a, b, LoRARows(row_slots, slots))
    add_lora_triton(got, x, a, b, row_slots, slots)
    assert torch.equal(got[1], y0[1]) and torch.equal(got[5], y0[5])  # the base model's rows untouched
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * 4)
