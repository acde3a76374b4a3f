"""Host-memory slots for swapped-out KV blocks. The model runner owns the host tensors; this owns the slots."""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_host_blocks: int) -> None:
        self.num_host_blocks = num_host_blocks
        self._free = list(range(num_host_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n host slots, or None when the space cannot hold them (the caller then recomputes instead)."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)
        assert len(self._free) <= self.num_host_blocks, "SwapSpace: double free"
