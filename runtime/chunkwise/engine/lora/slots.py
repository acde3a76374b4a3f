"""The adapters resident on the device: max_loras slots, each target projection holding every slot's A and
B stacked (zeros where a slot's adapter does not target it), filled when a step needs an adapter that is not
resident, in place of the least recently used one that the step does not need.

A fused projection (q/k/v, gate/up) stacks its parts' A along the rank and gives each part's B its own rank
columns and output rows, so that an adapter on q but not on k adds nothing to k's rows."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from chunkwise.engine.lora.store import AdapterStore


@dataclass(frozen=True)
class Target:
    """A projection adapters may target: its layer, its input width, and its parts (HF projection, first
    output row, rows), one for an unfused projection."""

    layer: int
    in_features: int
    parts: tuple[tuple[str, int, int], ...]

    @property
    def out_features(self) -> int:
        return sum(rows for _, _, rows in self.parts)


class LoRASlots:
    def __init__(
        self,
        targets: dict[str, Target],
        store: AdapterStore,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: str = "torch",
    ) -> None:
        self.targets = targets
        self.kernel = kernel  # EngineConfig.lora_kernel
        self.store = store
        self.max_loras = max_loras
        self.max_rank = max_rank
        # Per target: A [slots x width, in] (slot s's rows s*width ..), B [out, slots x width] (its columns),
        # width = max_rank x parts (lora/rows.py multiplies by both at once).
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for name, t in targets.items():
            width = max_rank * len(t.parts)
            self.a[name] = torch.zeros(max_loras * width, t.in_features, dtype=dtype, device=device)
            self.b[name] = torch.zeros(t.out_features, max_loras * width, dtype=dtype, device=device)
        self._resident: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.loads = 0  # adapters copied into a slot since start, and the time it took (the metrics')
        self.load_seconds = 0.0

    @property
    def resident(self) -> list[str]:
        return list(self._resident)

    def activate(self, names: Iterable[str]) -> dict[str, int]:
        """Each of `names` (at most max_loras: the scheduler's bound) in a slot; returns name -> slot."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras {self.max_loras}")
        for name in wanted:
            if name in self._resident:
                self._resident.move_to_end(name)
        for name in wanted:
            if name in self._resident:
                continue
            taken = set(self._resident.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self._resident if n not in wanted)
                slot = self._resident.pop(victim)
            self._fill(slot, name)
            self._resident[name] = slot
        return {name: self._resident[name] for name in wanted}

    def evict(self, name: str) -> None:
        """An unloaded adapter's slot is free for another (its weights are overwritten when reused)."""
        self._resident.pop(name, None)

    def _fill(self, slot: int, name: str) -> None:
        t0 = time.perf_counter()
        adapter = self.store.get(name)  # read again from its directory if pushed out of host memory
        r = adapter.rank
        for target_name, t in self.targets.items():
            width = self.max_rank * len(t.parts)
            own = slice(slot * width, (slot + 1) * width)
            a, b = self.a[target_name][own], self.b[target_name][:, own]
            a.zero_()
            b.zero_()
            for j, (proj, row, rows) in enumerate(t.parts):
                pair = adapter.weights.get((t.layer, proj))
                if pair is None:
                    continue
                wa, wb = pair
                cols = slice(j * self.max_rank, j * self.max_rank + r)
                a[cols].copy_(wa)
                b[row : row + rows, cols].copy_(wb)
        self.loads += 1
        self.load_seconds += time.perf_counter() - t0
