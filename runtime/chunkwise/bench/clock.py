"""The clocks an offline run is timed on.

- "wall": time.perf_counter, what a client on this machine waits;
- "cpu": time.thread_time of the thread driving the engine. With torch on one intra-op thread every model
  operation runs on that thread, so this is the run's wall time on a machine where nothing else competes
  for the core: other processes cannot inflate it (except through shared caches and memory bandwidth).
  It counts nothing a GPU does, and misses work on other threads, so it is only offered with one torch
  thread on a CPU device.

Every offline run records both; comparisons report ratios on the chosen one and the other beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

ClockName = Literal["wall", "cpu"]
CLOCKS: dict[ClockName, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


class RunClock:
    """Both clocks from one start, with idle time skipped on both alike, and pausable: while runs take
    turns step by step, each run's clocks stand still during the others' steps."""

    def __init__(self) -> None:
        self._t0 = {name: fn() for name, fn in CLOCKS.items()}
        self._offset = dict.fromkeys(CLOCKS, 0.0)
        self._paused: dict[ClockName, float] | None = None

    def now(self, name: ClockName) -> float:
        raw = self._paused[name] if self._paused is not None else CLOCKS[name]()
        return raw - self._t0[name] + self._offset[name]

    def snapshot(self) -> dict[ClockName, float]:
        return {name: self.now(name) for name in CLOCKS}

    def skip(self, seconds: float) -> None:
        """Jump ahead (an idle engine waiting for the next arrival): both clocks move by the same amount."""
        if seconds > 0:
            for name in self._offset:
                self._offset[name] += seconds

    def pause(self) -> None:
        if self._paused is None:
            self._paused = {name: fn() for name, fn in CLOCKS.items()}

    def resume(self) -> None:
        if self._paused is not None:
            for name, fn in CLOCKS.items():
                self._offset[name] -= fn() - self._paused[name]
            self._paused = None


def check_clock(name: str, threads: int, device: str = "cpu") -> ClockName:
    if name == "wall":
        return "wall"
    if name != "cpu":
        raise ValueError(f"clock must be 'wall' or 'cpu', got {name!r}")
    if threads != 1 or not device.startswith("cpu"):
        raise ValueError(
            "the cpu clock needs torch on one thread (--threads 1) and a CPU device; use --clock wall"
        )
    return "cpu"


class Recorder:
    """Per-request timings on both clocks at once: the run is one, its two readings are two RunResults."""

    def __init__(self, num_requests: int, clock: RunClock) -> None:
        from chunkwise.bench.metrics import RequestRecord

        self.clock = clock
        self.records: dict[ClockName, list[RequestRecord]] = {
            name: [RequestRecord(prompt_len=0) for _ in range(num_requests)] for name in CLOCKS
        }
        self._last: dict[ClockName, dict[int, float]] = {name: {} for name in CLOCKS}
        self.end: dict[ClockName, float] = {name: 0.0 for name in CLOCKS}

    def start(self, i: int, start_s: dict[ClockName, float], prompt_len: int) -> None:
        for name, recs in self.records.items():
            recs[i].start_s = start_s[name]
            recs[i].prompt_len = prompt_len

    def fail(self, i: int, error: str) -> None:
        for recs in self.records.values():
            recs[i].success, recs[i].error = False, error

    def emit(
        self,
        i: int,
        num_tokens: int,
        finished: bool,
        at: dict[ClockName, float],
        num_preemptions: int = 0,
        success: bool = True,
    ) -> None:
        for name, recs in self.records.items():
            rec = recs[i]
            t = at[name]
            if num_tokens:
                if rec.output_len == 0:
                    rec.ttft = t - rec.start_s
                else:
                    rec.itl.append(t - self._last[name][i])
                self._last[name][i] = t
                rec.output_len += num_tokens
            if finished:
                rec.latency = t - rec.start_s
                rec.num_preemptions = num_preemptions
                rec.success = success
                self._last[name].pop(i, None)
                self.end[name] = max(self.end[name], t)
