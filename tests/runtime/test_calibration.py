"""The start-up probe's timings wait for the device: a step that samples nothing never synchronises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chunkwise.engine.calibration import StartupProbe


class RecordingRunner:
    """A runner on a (pretend) CUDA device whose steps only enqueue work, as a GPU runner's do."""

    def __init__(self, events: list[str]) -> None:
        self.device = torch.device("cuda")
        self.events = events

    def execute(self, so: object) -> None:
        scheduled = getattr(so, "scheduled", [])
        self.events.append("execute" if scheduled else "cleanup")


def test_time_forward_waits_for_the_device_before_and_after_the_timed_step(monkeypatch: pytest.MonkeyPatch):
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    kv = SimpleNamespace(block_size=16, pool=SimpleNamespace(num_blocks=8))
    probe = StartupProbe(RecordingRunner(events), kv, max_model_len=64)  # type: ignore[arg-type]
    assert probe.time_forward(20) >= 0
    # The warm-up, then the timed forward between two waits, then the runner forgets the request.
    assert events == ["execute", "sync", "execute", "sync", "cleanup"]
