"""Fixtures for the benchmark tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    # The timing tests compare two measurements taken seconds apart; on a small shared CPU one intra-op
    # thread keeps each step's time steadiest (the benchmarks' own default, see docs/benchmarks.md).
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
