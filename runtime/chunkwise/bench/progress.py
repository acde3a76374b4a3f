"""A progress bar on stderr with no dependencies: redrawn in place on a terminal, a line per 10% otherwise
(so logs captured to a file stay readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30


class Progress:
    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, unit: str = "req") -> None:
        self.total = max(total, 0)
        self.label = label
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.t0 = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1
        self._closed = False
        self._draw()

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._draw()

    def _line(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * _WIDTH)
        elapsed = time.monotonic() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "." * (_WIDTH - filled)
        return f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s {rate:6.2f} {self.unit}/s"

    def _draw(self) -> None:
        if self._tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()
            return
        decile = int(10 * self.done / self.total) if self.total else 10
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
