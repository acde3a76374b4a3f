"""AsyncEngine: EngineCore's step loop on its own thread, each request's deltas streamed to asyncio."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.datatypes.config import EngineConfig
from chunkwise.engine.datatypes.lora import LoRARequest
from chunkwise.engine.datatypes.outputs import RequestOutput
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.datatypes.sampling_params import MAX_PRIORITY, SamplingParams
from chunkwise.engine.loop.core import EngineCore, ModelInfo
from chunkwise.engine.loop.step import StepStats, StepUpdate
from chunkwise.engine.loop.stream import RequestStream, StreamRegistry
from chunkwise.engine.sampling.structured.compiler import GrammarCompiler
from chunkwise.engine.sched.output import QueuedWork, SchedulerStats, work_ahead_of
from chunkwise.engine.sched.shedding import LoadSnapshot, Overloaded, ServiceRate, SheddingPolicy, decide
from chunkwise.engine.tokenizer import Tokenizer
from chunkwise.engine.worker.tp_stage import RankFailure

# Steps in a row that may fail (each failing its requests) before the engine thread gives up.
_MAX_CONSECUTIVE_FAILURES = 3


class AsyncEngine:
    """Runs EngineCore's step loop on its own thread and streams each request's deltas to asyncio.

    The step loop never waits on HTTP work: requests and aborts reach it through a thread-safe inbox that it
    drains between steps. Nor does it wait on output work: each step's StepUpdate goes to an output thread,
    which detokenizes, finds stop strings, delivers to each request's asyncio queue (one call_soon_threadsafe
    per event loop per step) and runs the observers, while the loop runs the next step (torch releases the
    GIL while it computes). A stop string found there ends the request's output at once and reaches the
    scheduler through the inbox, so at most one more step computes a token nobody sees, as in vLLM.
    HTTP handlers never wait on a step either: `add_request` validates, runs the admission (load-shedding)
    check and queues without blocking.

    After each step (and after draining the inbox) the loop publishes, under one lock:
    - a `LoadSnapshot` for load shedding: requests waiting in the scheduler (waiting + swapped), their
      uncomputed tokens and estimated remaining outputs, and the measured service rate (tokens/s, an EMA).
      `load()` adds the requests accepted but not yet seen by the loop, so a burst cannot overshoot the bound;
    - a copy of the scheduler's stats with the gauges (running, waiting, swapped, KV usage) refreshed, so an
      abort while idle shows at once (`scheduler_stats()`).
    Observers (`add_observer`, e.g. metrics) are called on the output thread with each step's StepStats
    (None for outputs produced between steps, such as aborts), its outputs, and the requests that finished.
    """

    def __init__(self, config: EngineConfig, on_death: Callable[[BaseException], None] | None = None) -> None:
        """`on_death(error)`: called on the engine thread when it dies (its streams already failed), e.g.
        for the server to exit when a tensor-parallel rank is lost (RankFailure) rather than wait for a
        probe to restart it."""
        self.core = EngineCore(config)
        # The output thread's: it alone detokenizes and tracks each request's emission state.
        self._outputs = self.core.detach_outputs()
        # An add is (request, prompt text); an abort is the request id; a stop string found by the output
        # thread is (request, the stop string).
        self._inbox: queue.SimpleQueue[tuple[Request, str | _StopString | None] | str] = queue.SimpleQueue()
        # To the output thread, in step order: requests to track, each step's updates, aborts; None ends it.
        self._out_q: queue.SimpleQueue[_OutputEvent | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Each live request's stream, under the same lock as the pending counts below.
        self._streams = StreamRegistry(self._lock)
        self._wake = threading.Event()
        self._stopping = False
        # Set under _lock by _fail_streams: from then on add_request registers no stream, so none can be
        # registered after the last one was failed and wait forever.
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="chunkwise-engine", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="chunkwise-output", daemon=True)
        self.error: BaseException | None = None
        self._on_death = on_death
        self._ids = itertools.count()
        self._consecutive_failures = 0
        self._observers: list[Callable[[StepStats | None, list[RequestOutput], list[Request]], None]] = []
        # Loop-thread state: the routes seen, the service rate.
        self._routes: set[str] = {""}
        self._drained: list[str] = []
        self._rate = ServiceRate(self.core.prefill_tokens_per_s)
        self._cold_start_output_tokens = self.core.cold_start_output_tokens
        # Published by the loop thread, read by HTTP handlers; all under _lock.
        self._bands: dict[int, QueuedWork] = {}
        self._service_tokens_per_s = self._rate.tokens_per_s
        self._stats = self.core.snapshot().stats
        self._estimates: dict[str, int] = {}
        # Accepted by add_request, not yet drained by the loop: request id -> (prompt tokens, output estimate,
        # priority). Few at a time: the loop drains them every step.
        self._pending: dict[str, tuple[int, int, int]] = {}

    def start(self) -> None:
        self._output_thread.start()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._out_q.put(None)
        if self._output_thread.is_alive():
            self._output_thread.join(timeout)
        # Whoever still waits on a stream hears that no more output will come.
        self._fail_streams(RuntimeError("the engine was shut down"))
        if not self._thread.is_alive():  # tensor parallel's other ranks stop once no step can reach them
            self.core.close()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def structured(self) -> GrammarCompiler:
        """The engine's structured-output compiler (to check a spec before queueing)."""
        return self.core.structured

    @property
    def model_info(self) -> ModelInfo:
        return self.core.model_info

    @property
    def kv_events(self) -> KVEventLog | None:
        """The prefix cache's changes, step by step (None when prefix caching or events are off)."""
        return self.core.kv_events

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def add_observer(
        self, observer: Callable[[StepStats | None, list[RequestOutput], list[Request]], None]
    ) -> None:
        """Call `observer(step, outputs, finished_requests)` on the output thread after each step's outputs
        are delivered. It must be quick and must not block (the next step's outputs wait behind it); an
        exception it raises is logged and otherwise ignored."""
        self._observers = [*self._observers, observer]

    def load(self, priority: int = MAX_PRIORITY) -> LoadSnapshot:
        """The load an admission check sees now for a newcomer of `priority` (by default: everything
        queued): the loop's last snapshot plus the requests not yet drained, of the bands served before or
        with it."""
        with self._lock:
            return self._load_locked(priority)

    def _load_locked(self, priority: int) -> LoadSnapshot:
        w = work_ahead_of(self._bands, priority)
        for prefill, decode, p in self._pending.values():
            if p <= priority:
                w = w.plus(1, prefill, decode)
        return LoadSnapshot(w.num, w.prefill_tokens, w.decode_tokens, self._service_tokens_per_s)

    def scheduler_stats(self) -> SchedulerStats:
        """A copy of the scheduler's counters and gauges as of the loop's last step (or inbox drain)."""
        with self._lock:
            return copy.copy(self._stats)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        route: str = "",
        cache_salt: str | None = None,
        shedding: SheddingPolicy | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> RequestStream:
        """Validate, check admission and queue one request; never blocks on the step loop.

        Raises ValueError for bad input and `Overloaded` when `shedding` refuses it, in both cases before
        anything is queued; RuntimeError when the engine is not running."""
        if not self._accepting():
            raise RuntimeError("the engine is not running")
        rid = request_id or f"req-{next(self._ids)}"
        req, text = self.core.make_request(
            rid, prompt, params, route=route, cache_salt=cache_salt, lora_request=lora_request, tenant=tenant
        )
        q: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            # Again under the lock _fail_streams takes: the engine may have died or shut down since, its
            # streams already failed; a stream registered now would never be answered.
            if not self._accepting():
                raise RuntimeError("the engine is not running")
            if self._streams.has_locked(rid) or rid in self._pending:
                raise ValueError(f"request id {rid!r} is already in use")
            if params.max_tokens is not None:
                decode = req.max_tokens
            else:
                decode = min(req.max_tokens, self._estimates.get(route, self._cold_start_output_tokens))
            decode *= params.n  # n completions, one prompt
            if shedding is not None:
                decision = decide(shedding, self._load_locked(req.priority))
                if not decision.admitted:
                    raise Overloaded(decision)
            self._streams.add_locked(rid, loop, q)
            self._pending[rid] = (req.num_prompt_tokens, decode, req.priority)
            # Queued under the lock, so the loop cannot drain it before it is counted as pending.
            self._inbox.put((req, text))
        self._wake.set()
        return RequestStream(self, req, q)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        route: str = "",
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas for one request. Raises ValueError for bad input before anything is queued.
        Leaving the iterator early (a client disconnect) aborts the request."""
        stream = self.add_request(
            prompt,
            params,
            request_id,
            route=route,
            cache_salt=cache_salt,
            lora_request=lora_request,
            tenant=tenant,
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def register_adapter(self, lora: LoRARequest) -> None:
        """Serve a LoRA adapter (read and checked now: ValueError for a bad one)."""
        if self.core.adapters is None:
            raise ValueError("the engine serves no LoRA adapters (start it with --enable-lora)")
        self.core.adapters.register(lora)

    def remove_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter; requests in flight on it finish."""
        if self.core.adapters is not None:
            self.core.adapters.remove(name)

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)
        self._wake.set()

    def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        rids = self._streams.ids()
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def _accepting(self) -> bool:
        return not self._closed and not self._stopping and self.error is None

    def _fail_streams(self, error: Exception) -> None:
        """Answer every stream with `error` and accept no more: the engine has died or shut down."""
        with self._lock:
            self._closed = True
            entries = self._streams.take_all_locked()
            self._pending.clear()
        StreamRegistry.send(entries, error)

    def _drain_inbox(self) -> bool:
        """Apply queued adds, aborts and stop strings; returns whether there were any."""
        core = self.core
        any_item = False
        aborted: list[Request] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            any_item = True
            if isinstance(item, str):
                # Its stream ends with the "abort" output the output thread sends (or, if it had already
                # finished, with its last output, which may still be on its way there).
                aborted.extend(core.cancel([item]))
                continue
            req, extra = item
            if isinstance(extra, _StopString):
                core.finish_by_stop(req, extra.text)
                continue
            self._drained.append(req.request_id)
            try:
                core.add(req, extra)
            except ValueError as e:
                self._streams.deliver(e, req.request_id)
                continue
            self._out_q.put(_OutputEvent(added=[(req, extra)]))
            self._routes.add(req.route)
        if aborted:
            self._out_q.put(_OutputEvent(aborted=aborted))
        return any_item

    def _publish(self) -> None:
        snap = self.core.snapshot(self._routes)
        stats, estimates = snap.stats, snap.estimates
        drained, self._drained = self._drained, []
        with self._lock:
            for rid in drained:
                self._pending.pop(rid, None)
            self._bands = snap.bands
            self._service_tokens_per_s = self._rate.tokens_per_s
            self._stats = stats
            self._estimates = estimates

    def _notify(self, step: StepStats | None, outs: list[RequestOutput], finished: list[Request]) -> None:
        for observer in self._observers:
            try:
                observer(step, outs, finished)
            except Exception:
                logging.getLogger(__name__).exception("engine observer %r failed", observer)

    def _recover(self, error: Exception) -> None:
        """A step raised: fail the requests in flight, free their blocks, keep serving the next ones.

        What was in the step cannot be trusted, so every unfinished request gets the error; the engine survives
        only if aborting them leaves the block pool whole. Otherwise (or on repeated failures, or when the
        other ranks are gone: RankFailure) it re-raises and the thread dies: /health turns 503, and `on_death`
        hears of it (the server exits on a RankFailure).
        """
        self._consecutive_failures += 1
        # The other ranks are gone: the requests are answered below, then the thread dies (no step can run).
        fatal = isinstance(error, RankFailure)
        logging.getLogger(__name__).exception(
            "engine step failed; aborting the requests in flight%s", " and stopping" if fatal else ""
        )
        core = self.core
        aborted = core.cancel_all()
        failure = RuntimeError(f"the engine step failed and this request was aborted: {error!r}")
        # A forked request's children are aborted one by one; its stream is the parent's id.
        for rid in dict.fromkeys(r.parent_id or r.request_id for r in aborted):
            self._streams.deliver(failure, rid)
        self._publish()
        # The output side forgets them (their streams are gone: nothing more is delivered) and observers
        # count them as aborted.
        self._out_q.put(_OutputEvent(aborted=aborted))
        if fatal or not core.all_blocks_free() or self._consecutive_failures >= _MAX_CONSECUTIVE_FAILURES:
            raise error

    def _finish_by_stop(self, req: Request, stop: str) -> None:
        """On the output thread: a stop string ended req's output; the scheduler frees it next drain."""
        self._inbox.put((req, _StopString(stop)))
        self._wake.set()

    def _output_loop(self) -> None:
        """The output thread: detokenize, find stop strings, deliver, observe; in the order steps ran."""
        outputs = self._outputs
        while True:
            event = self._out_q.get()
            if event is None:
                return
            try:
                for req, text in event.added:
                    outputs.add(req, text)
                outs: list[RequestOutput] = []
                finished: list[Request] = []
                if event.update is not None:
                    processed = outputs.process(event.update)
                    outs, finished = processed.outputs, processed.finished
                    for req, stop in processed.stopped:
                        self._finish_by_stop(req, stop)
                if event.aborted:
                    aborted_outs, aborted_reqs = outputs.aborted_all(event.aborted)
                    outs.extend(aborted_outs)
                    finished.extend(aborted_reqs)
                if outs:
                    self._streams.deliver_all(outs)
                self._notify(event.step, outs, finished)
            except Exception:  # one bad event must not end every stream's output
                logging.getLogger(__name__).exception("engine output processing failed")

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if self._drain_inbox():
                    self._publish()
                if not self.core.has_unfinished():
                    self.core.check_ranks()  # a rank lost while idle ends the engine now, not at the next request
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                try:
                    update = self.core.run_step()
                except Exception as e:
                    self._recover(e)
                    continue
                self._consecutive_failures = 0
                step = self.core.last_step
                if step is not None:
                    self._rate.observe(step.num_batched_tokens, step.step_seconds)
                # Publish before the outputs go out: a client that sees its first token must never find
                # itself still counted as waiting by the next admission check.
                self._publish()
                self._out_q.put(_OutputEvent(step=step, update=update))
        except BaseException as e:  # the engine thread must not die silently
            self.error = e
            self._fail_streams(RuntimeError(f"engine failed: {e!r}"))
            if self._on_death is not None:
                self._on_death(e)
            raise


@dataclass
class _StopString:
    text: str


@dataclass
class _OutputEvent:
    """One batch of work for AsyncEngine's output thread, applied in this order."""

    added: list[tuple[Request, str | None]] = dataclasses.field(default_factory=list)
    step: StepStats | None = None
    update: StepUpdate | None = None
    aborted: list[Request] = dataclasses.field(default_factory=list)
