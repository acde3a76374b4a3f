"""The LoRA update's Triton kernels (lora/triton_lora.py), under TRITON_INTERPRET=1 on CPU tensors, against the
masked form the CPU runs (lora/rows.py): rows of several slots and of the base model, a fused projection's
width, a width and sizes that are not powers of two."""

from __future__ import annotations

import pytest
import torch

from chunkwise.engine.lora.rows import LoRARows, LoRAStep, add_lora
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


def test_a_step_using_fewer_adapters_than_slots_computes_only_theirs_with_the_same_result() -> None:
    gen = torch.Generator().manual_seed(1)
    slots, width, rows = 4, 8, 6
    x = torch.randn(rows, 32, generator=gen)
    a = torch.randn(slots * width, 32, generator=gen) / 32**0.5
    b = torch.randn(40, slots * width, generator=gen)
    token_slots = [2, -1, 0, 2, -1, 0]  # slots 1 and 3 resident but unused this step
    step = LoRAStep.of(token_slots, [0, 2, 3], slots, torch.device("cpu"))
    assert step is not None and step.rows.active is not None and step.rows.num_columns_slots == 2
    for lora, index in ((step.rows, list(range(rows))), (step.kept, [0, 2, 3])):
        expected, got = torch.zeros(len(index), 40), torch.zeros(len(index), 40)
        add_lora_triton(expected, x[index], a, b, torch.tensor(token_slots)[index], slots)  # each row's own
        add_lora(got, x[index], a, b, lora)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
