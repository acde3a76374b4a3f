"""The fence a fill of InputBatch waits on before rewriting a set of host buffers (worker/inputs.py): the
device's copies out of them must have run. None on the CPU, whose copies are synchronous."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class CopyFence(Protocol):
    """Marks the host-to-device copies issued from one set of buffers."""

    def record(self) -> None:
        """After a fill's copies are issued: mark them (on the stream they were issued on)."""
        ...

    def wait(self) -> None:
        """Block the host until the copies last marked have run (at once if none were)."""
        ...


class NoFence:
    """Nothing to wait for: on the CPU a step's tensors are the buffers' own views and the work synchronous."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass


class CudaFence:
    """An event on the device's current stream, the one `.to(device, non_blocking=True)` copies on."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def wait(self) -> None:
        self._event.synchronize()  # an event never recorded is complete


def default_fence(device: torch.device) -> Callable[[], CopyFence]:
    if device.type == "cuda":
        return lambda: CudaFence(device)
    return NoFence
