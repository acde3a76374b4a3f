"""Fixtures for the server tests (helpers live in harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.server.harness import LiveServer, start_server


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # On a small CPU box, torch's intra-op pool fights the event loop and the test client for cores and
    # makes every step an order of magnitude slower; one thread is plenty for the tiny model.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def live() -> Iterator[LiveServer]:
    """One shared server (no load shedding limits tests would trip over)."""
    server = start_server(max_waiting=64)
    yield server
    server.stop()
