"""Progress lines on stderr through logging: an init container's log is all a user sees of a long fetch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("chunkwise.fetch")


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def human_seconds(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Bytes done of the current file and of the whole fetch; a line every `interval_s` while bytes flow.

    The rate is over the last interval (what the link does now, not since a slow start), and the ETA is the
    whole fetch's remaining bytes at that rate."""

    def __init__(
        self, interval_s: float, total_bytes: int | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.total_bytes = total_bytes
        self.clock = clock
        self.started = clock()
        self.done = 0  # bytes of the whole fetch on disk, including those present before this run
        self.transferred = 0  # bytes this run received
        self.files_fetched = 0
        self.files_present = 0
        self._name = ""
        self._file_size: int | None = None
        self._file_done = 0
        self._mark_t = self.started
        self._mark_bytes = 0

    def start_file(self, name: str, size: int | None, offset: int) -> None:
        self._name, self._file_size, self._file_done = name, size, offset
        self.done += offset
        self._mark_t, self._mark_bytes = self.clock(), self.transferred
        what = human_bytes(size) if size is not None else "size unknown"
        if offset:
            log.info("fetching %s (%s), resuming at %s", name, what, human_bytes(offset))
        else:
            log.info("fetching %s (%s)", name, what)

    def set_file_size(self, size: int) -> None:
        if self._file_size is None:
            self._file_size = size
            if self.total_bytes is None:
                self.total_bytes = self.done - self._file_done + size

    def advance(self, n: int) -> None:
        self._file_done += n
        self.done += n
        self.transferred += n
        now = self.clock()
        if now - self._mark_t >= self.interval_s:
            rate = (self.transferred - self._mark_bytes) / (now - self._mark_t)
            self._mark_t, self._mark_bytes = now, self.transferred
            log.info("%s", self._line(rate))

    def rewind(self, n: int) -> None:
        """The server ignored a range request: the bytes already counted for this file are fetched again."""
        self._file_done -= n
        self.done -= n

    def end_file(self) -> None:
        self.files_fetched += 1

    def present(self, name: str, size: int) -> None:
        self.files_present += 1
        self.done += size
        log.info("%s is already present and verified (%s)", name, human_bytes(size))

    def _line(self, rate: float) -> str:
        size = self._file_size
        pct = f" ({100 * self._file_done / size:.1f}%)" if size else ""
        of = f" of {human_bytes(size)}" if size is not None else ""
        line = f"{self._name}: {human_bytes(self._file_done)}{of}{pct} at {human_bytes(rate)}/s"
        if self.total_bytes is not None:
            line += f"; all files {human_bytes(self.done)} of {human_bytes(self.total_bytes)}"
            if rate > 0:
                line += f", ETA {human_seconds(max(0, self.total_bytes - self.done) / rate)}"
        return line

    def summary(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        line = (
            f"{self.files_fetched} file(s) fetched, {human_bytes(self.transferred)} in {human_seconds(elapsed)} "
            f"({human_bytes(self.transferred / elapsed)}/s)"
        )
        if self.files_present:
            line += f"; {self.files_present} already present"
        return line
