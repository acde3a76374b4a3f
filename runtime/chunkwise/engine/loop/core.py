"""EngineCore: one engine's step loop (docs/scheduling.md), built from a config.

release finished -> admit -> compose    (Scheduler.schedule)
forward -> sample                       (ModelRunner.execute)
emit                                    (Scheduler.update_from_output, OutputProcessor)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import EngineConfig
from chunkwise.engine.datatypes.lora import LoRARequest
from chunkwise.engine.datatypes.outputs import RequestOutput
from chunkwise.engine.datatypes.request import Request, RequestStatus, resolve_max_tokens
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.loop.builder import ModelInfo, build_engine
from chunkwise.engine.loop.output_processor import OutputProcessor
from chunkwise.engine.loop.step import StepStats, StepUpdate
from chunkwise.engine.lora.store import AdapterStore
from chunkwise.engine.model.loader import LoadedModel
from chunkwise.engine.sampling.structured.compiler import GrammarCompiler
from chunkwise.engine.sched.draft_length import AdaptiveDraftLength
from chunkwise.engine.sched.output import SchedulerSnapshot, SchedulerStats
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler
from chunkwise.engine.tokenizer import Tokenizer
from chunkwise.engine.worker.model_runner import ModelRunner

__all__ = ["EngineCore", "ModelInfo"]


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)  # loop/builder.py: model, KV cache, runner, probes, scheduler
        self.loaded: LoadedModel = parts.loaded
        # Resolved: the real dtype and max_model_len, so that what reads the config later sees them.
        self.config: EngineConfig = parts.config
        self.max_model_len: int = parts.max_model_len
        self.tokenizer: Tokenizer = self.loaded.tokenizer
        # The checkpoint's own EOS ids and the tokenizer's: generation stops on either, as in transformers.
        self.eos_token_ids = self.loaded.eos_token_ids
        self.structured: GrammarCompiler = parts.structured
        self.kv_events: KVEventLog | None = parts.kv_events
        self.kv: KVCacheManager = parts.kv
        self.runner: ModelRunner = parts.runner
        self.cost_model: PreemptionCostModel = parts.cost_model
        self.draft_length: AdaptiveDraftLength | None = parts.draft_length
        self.scheduler: Scheduler = parts.scheduler
        self.outputs: OutputProcessor | None = OutputProcessor(self.tokenizer)
        self.num_blocks: int = parts.num_blocks
        self.last_step: StepStats | None = None
        self.model_info: ModelInfo = parts.model_info
        self.adapters: AdapterStore | None = parts.adapters

    def close(self) -> None:
        """Stop the engine's other processes (tensor and pipeline parallel's worker ranks; none at one rank). Idempotent;
        an engine garbage-collected or a process exiting does the same."""
        if self.runner.ranks is not None:
            self.runner.ranks.close()

    def check_ranks(self) -> None:
        """Raise RankFailure if tensor parallel's other ranks are gone (a rank died, or they were stopped)."""
        if self.runner.ranks is not None:
            self.runner.ranks.check()

    # -- what AsyncEngine reads -------------------------------------------------------------------------
    @property
    def prefill_tokens_per_s(self) -> float:
        """The start-up probe's prefill rate (the preemption cost model's recompute rate)."""
        return self.cost_model.prefill_tokens_per_s

    @property
    def cold_start_output_tokens(self) -> int:
        return self.config.scheduler.cold_start_output_tokens

    def snapshot(self, routes: Iterable[str] = ()) -> SchedulerSnapshot:
        """The scheduler's queues and stats as of now (for load shedding and metrics)."""
        snap = self.scheduler.snapshot(routes)
        slots = self.runner.lora
        if slots is not None and self.adapters is not None:
            s = snap.stats  # a copy: the adapters' side of it is the runner's and the store's
            s.served_lora_adapters = tuple(sorted(self.adapters.known()))
            s.resident_lora_adapters = tuple(sorted({self.adapters.name_of(k) for k in slots.resident}))
            s.lora_loads, s.lora_load_seconds = slots.loads, slots.load_seconds
        return snap

    # -- requests ---------------------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        route: str = "",
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize; raises ValueError with a clear message for bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        lora_key: str | None = None
        if lora_request is not None:
            if self.adapters is None:
                raise ValueError(
                    f"request names LoRA adapter {lora_request.lora_name!r} but the engine serves none "
                    "(start it with enable_lora / --enable-lora)"
                )
            # Read and checked here: a bad adapter is the caller's error, never the step loop's.
            lora_key = self.adapters.register(lora_request)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text = None
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty")
            vocab = self.loaded.config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        max_tokens = resolve_max_tokens(len(ids), params.max_tokens, self.max_model_len)
        if params.structured is not None:
            # Compiled here (and cached), so a bad schema is the caller's error, never the step loop's.
            self.structured.check(params.structured)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            route=route,
            cache_salt=cache_salt,
            lora_name=lora_request.lora_name if lora_request is not None else None,
            lora_key=lora_key,
            tenant=tenant,
        )
        # n past the batch, or more KV than the whole cache: refused here, never left waiting forever.
        self.scheduler.prepare(req)
        return req, text

    def add(self, req: Request, prompt_text: str | None) -> None:
        """Queue a request built by make_request (the one way into the scheduler). Raises ValueError, with
        nothing queued, when the scheduler refuses it."""
        self.scheduler.add_request(req)
        if self.outputs is not None:
            self.outputs.add(req, prompt_text)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        route: str = "",
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> Request:
        req, text = self.make_request(
            request_id, prompt, params, arrival_time, route, cache_salt, lora_request, tenant
        )
        self.add(req, text)
        return req

    def cancel(self, request_ids: Sequence[str]) -> list[Request]:
        """End these requests now (their blocks are free for the next step); returns the ones that had not
        finished. Their streams' last outputs are the output side's to make (OutputProcessor.aborted)."""
        cancelled = self.scheduler.abort(request_ids)
        self._flush_kv_events()
        return cancelled

    def cancel_all(self) -> list[Request]:
        return self.cancel(list(self.scheduler.requests))

    def _flush_kv_events(self) -> None:
        # After a step, and after what changes the cache between steps (aborts, stop strings).
        if self.kv_events is not None:
            self.kv_events.flush()

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """cancel(), with each request's last output ("abort"), when this core processes its outputs."""
        outputs = self._own_outputs()
        return outputs.aborted_all(self.cancel(request_ids))[0]

    def detach_outputs(self) -> OutputProcessor:
        """Hand output processing to a caller that runs it elsewhere (AsyncEngine's output thread): from
        now on this core only runs steps (run_step) and add() tracks no output state."""
        outputs = self._own_outputs()
        self.outputs = None
        return outputs

    def _own_outputs(self) -> OutputProcessor:
        if self.outputs is None:
            raise RuntimeError("this engine's outputs are processed elsewhere (detach_outputs)")
        return self.outputs

    def all_blocks_free(self) -> bool:
        """Whether every KV block is free, the pool's invariants checked (raises if they do not hold)."""
        self.kv.pool.check_invariants()
        return self.kv.num_free_blocks == self.num_blocks

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    # -- the step loop ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step and its outputs (text, stop strings), in this thread."""
        update = self.run_step()
        t0 = time.perf_counter()
        processed = self._own_outputs().process(update)
        for req, stop in processed.stopped:
            self.finish_by_stop(req, stop)
        if self.last_step is not None:
            self.last_step.output_seconds = time.perf_counter() - t0
            self.last_step.step_seconds += self.last_step.output_seconds
        return processed.outputs

    def run_step(self) -> StepUpdate:
        """The step loop's part of a step (schedule, forward and sample, update): what changed, as
        snapshots for the output side (OutputProcessor.process), which may run on another thread."""
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.execute(so)
        t2 = time.perf_counter()
        # What a draft length costs is the whole step, host work included (drafts, inputs, verification and
        # an update of several tokens a row), not its forward alone: this step's schedule and runner, and
        # the last step's update (this one's runs inside the call that learns from it).
        last_update = self.last_step.update_seconds if self.last_step is not None else 0.0
        updated = self.scheduler.update_from_output(
            so,
            result.sampled,
            result.drafted,
            result.row_tokens,
            forward_seconds=result.forward_seconds,
            step_seconds=t2 - t0 + last_update,
        )
        self._flush_kv_events()  # the step's KV is written: its cache changes are now true
        update = StepUpdate.of(updated, result.logprobs, result.prompt_logprobs)
        t3 = time.perf_counter()
        self.last_step = StepStats(
            step_seconds=t3 - t0,
            schedule_seconds=t1 - t0,
            forward_seconds=result.forward_seconds,
            num_batched_tokens=so.num_batched_tokens,
            num_prefill_tokens=so.num_prefill_tokens,
            num_decode_rows=len(so.scheduled)
            if so.decode_only
            else sum(1 for s in so.scheduled if len(s.token_ids) == 1),
            # The runner's own host work, and what it spent outside its three phases (swaps, cleanup).
            prepare_seconds=result.prepare_seconds
            + (t2 - t1 - result.prepare_seconds - result.forward_seconds - result.sample_seconds),
            sample_seconds=result.sample_seconds,
            update_seconds=t3 - t2,
            num_padding_rows=len(so.padding_positions),
        )
        return update

    def finish_by_stop(self, req: Request, stop: str) -> None:
        """End a request at a stop string its text reached (no-op if it has already ended)."""
        if not req.is_finished and req.request_id in self.scheduler.requests:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop)
            self._flush_kv_events()
