"""Markers of this folder, registered here too so that `--strict-markers` accepts them wherever pytest runs."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "e2e_kind: needs a kind cluster from e2e/kind/kind-up.sh and KIND_CLUSTER naming it (make e2e)",
    )
