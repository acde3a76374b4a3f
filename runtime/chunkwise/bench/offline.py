"""Drive an in-process EngineCore through a workload, honouring arrival times, and record what a client sees.

A request is added when its arrival offset comes (between steps, as the server's engine loop adds them), and
its TTFT, ITL and latency are measured from that offset to the end of the step that emitted each token. When
the engine is idle and the next request is still in the future the clock jumps ahead instead of sleeping: an
idle engine does nothing, so this changes no timing a client would see and keeps runs short.

One engine serves many runs (comparisons repeat configurations in turn); each run gets its own cache salt so
that no run hits the prefix cache with another run's blocks, and counters are reported as deltas.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chunkwise.bench.clock import ClockName, Recorder, RunClock
from chunkwise.bench.results import COUNTERS, RunResult, StepRecord
from chunkwise.bench.workloads import WorkItem
from chunkwise.engine.datatypes.sampling_params import SamplingParams

if TYPE_CHECKING:
    from chunkwise.engine import EngineCore
    from chunkwise.engine.datatypes.request import Request


def build_engine(model: str, engine_args: dict[str, Any]) -> EngineCore:
    from chunkwise.engine import EngineCore
    from chunkwise.engine.datatypes.config import engine_config_from_kwargs

    return EngineCore(engine_config_from_kwargs(model, **engine_args))


def sampling_params(item: WorkItem) -> SamplingParams:
    """Greedy; with the client's max_tokens the output runs to exactly that length (EOS ignored), as the
    benchmark's long-tailed lengths require."""
    if item.max_tokens is None:
        raise ValueError(
            "the real engine cannot end a request at a hidden target length; give max_tokens (or use "
            "`chunkwise replay`, whose simulated model ends it there)"
        )
    return SamplingParams(
        max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True, priority=item.priority
    )


class EngineRun:
    """One workload on one engine, advanced a step at a time (so runs can take turns, see run_interleaved)."""

    def __init__(
        self,
        engine: EngineCore,
        items: Sequence[WorkItem],
        name: str,
        salt: str = "",
        progress: bool = False,
        outputs: list[list[int]] | None = None,
        clock: ClockName = "wall",
    ) -> None:
        from chunkwise.bench.progress import Progress

        self.engine = engine
        self.items = items
        self.name = name
        self.salt = salt
        self.clock: ClockName = clock
        self.outputs = outputs
        if outputs is not None:
            outputs[:] = [[] for _ in items]
        self.pending = deque(sorted(range(len(items)), key=lambda i: items[i].arrival_s))
        self.reqs: dict[str, tuple[int, Request]] = {}
        self.before = {k: getattr(engine.stats, k) for k in COUNTERS}
        self.steps: list[StepRecord] = []
        self.bar = Progress(len(items), name) if progress else None
        self.rc = RunClock()
        self.rec = Recorder(len(items), self.rc)

    @property
    def done(self) -> bool:
        # Its own requests, not the engine's: the next run in a lane may already be using the engine.
        return not self.pending and not self.reqs

    def _admit_arrivals(self) -> None:
        rc, clock, items = self.rc, self.clock, self.items
        t = rc.now(clock)
        while self.pending and items[self.pending[0]].arrival_s <= t:
            i = self.pending.popleft()
            it = items[i]
            rid = f"{self.name}-{self.salt}-{i}"
            # A request arrives at its offset on the run's clock; on the other clock, at the same lag.
            now = rc.snapshot()
            lag = now[clock] - it.arrival_s
            try:
                ids = it.token_ids(self.engine.tokenizer.encode)
                self.rec.start(i, {c: v - lag for c, v in now.items()}, len(ids))
                req = self.engine.add_request(
                    rid, ids, sampling_params(it), cache_salt=self.salt or None, tenant=it.tenant
                )
            except ValueError as e:
                self.rec.fail(i, str(e))
                if self.bar:
                    self.bar.update()
                continue
            self.reqs[rid] = (i, req)

    def advance(self) -> None:
        """Admit what has arrived and run one step (or, idle, jump to the next arrival)."""
        engine, rc, clock = self.engine, self.rc, self.clock
        self._admit_arrivals()
        while not self.reqs:
            if not self.pending:
                return
            rc.skip(self.items[self.pending[0]].arrival_s - rc.now(clock))
            self._admit_arrivals()
        t_before = rc.now(clock)
        outs = engine.step()
        at = rc.snapshot()
        for out in outs:
            i, req = self.reqs[out.request_id]
            new = out.outputs[0].token_ids
            if self.outputs is not None:
                self.outputs[i].extend(new)
            ok = out.outputs[0].finish_reason != "abort"
            self.rec.emit(i, len(new), out.finished, at, req.preempt_count, ok)
            if out.finished:
                del self.reqs[out.request_id]
                if self.bar:
                    self.bar.update()
        st = engine.last_step
        s = engine.stats
        if st is not None:
            self.steps.append(
                StepRecord(
                    t=at[clock],
                    step_s=at[clock] - t_before,
                    schedule_s=st.schedule_seconds,
                    forward_s=st.forward_seconds,
                    engine_step_s=st.step_seconds,
                    prepare_s=st.prepare_seconds,
                    sample_s=st.sample_seconds,
                    update_s=st.update_seconds,
                    output_s=st.output_seconds,
                    num_batched_tokens=st.num_batched_tokens,
                    num_prefill_tokens=st.num_prefill_tokens,
                    num_decode_rows=st.num_decode_rows,
                    num_running=s.num_running,
                    num_waiting=s.num_waiting + s.num_swapped,
                    kv_usage=s.kv_usage,
                )
            )

    def result(self) -> RunResult:
        if self.bar:
            self.bar.close()
        counters = {k: getattr(self.engine.stats, k) - self.before[k] for k in COUNTERS}
        return two_readings(self.name, self.rec, self.clock, self.steps, counters)


def run_engine(
    engine: EngineCore,
    items: Sequence[WorkItem],
    name: str,
    salt: str = "",
    progress: bool = False,
    outputs: list[list[int]] | None = None,
    clock: ClockName = "wall",
) -> RunResult:
    """Run items through the engine, timed on both clocks; returns the run on `clock`, with the other
    reading in `.other`. `outputs`, when given, receives each item's generated token ids."""
    run = EngineRun(engine, items, name, salt, progress, outputs, clock)
    while not run.done:
        run.advance()
    return run.result()


def run_interleaved(lanes: Sequence[Sequence[EngineRun]]) -> list[list[RunResult]]:
    """Advance several lanes in turn, one step each (A B A B ...); a lane is a sequence of runs on one
    engine, taken in order. Each run's clocks stand still during every other step. Configurations compared
    this way see the same machine at the same moments, so a burst of load from other processes lands on all
    of them instead of on whichever happened to be running."""
    engines = [id(run.engine) for lane in lanes for run in lane[:1]]
    if len(set(engines)) != len(engines):
        raise ValueError("each lane needs its own engine: runs sharing an engine would share its batches")
    for lane in lanes:
        for run in lane:
            run.rc.pause()
    while True:
        active = [next((r for r in lane if not r.done), None) for lane in lanes]
        if all(r is None for r in active):
            break
        for r in active:
            if r is not None:
                r.rc.resume()
                r.advance()
                r.rc.pause()
    return [[r.result() for r in lane] for lane in lanes]


def two_readings(
    name: str, rec: Recorder, clock: ClockName, steps: list[StepRecord], counters: dict[str, int]
) -> RunResult:
    other: ClockName = "wall" if clock == "cpu" else "cpu"
    alt = RunResult(name, rec.records[other], [], max(rec.end[other], 1e-9), counters, clock=other)
    return RunResult(
        name, rec.records[clock], steps, max(rec.end[clock], 1e-9), counters, clock=clock, other=alt
    )


def warm_up(engine: EngineCore, num_requests: int = 4, prompt_len: int = 32, max_tokens: int = 4) -> None:
    """A few short requests, so the first measured run does not pay for first-touch allocations."""
    items = [WorkItem(tuple(range(3, 3 + prompt_len)), max_tokens) for _ in range(num_requests)]
    run_engine(engine, items, "warmup", salt="warmup")


def run_engine_outputs(engine: EngineCore, items: Sequence[WorkItem], name: str) -> list[list[int]]:
    outputs: list[list[int]] = []
    run_engine(engine, items, name, salt=name, outputs=outputs)
    return outputs
