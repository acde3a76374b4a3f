"""EngineCore: one engine's step loop (the seed's), built from a config.

release finished -> admit -> compose    (Scheduler.schedule)
forward -> sample                       (ModelRunner.execute)
emit                                    (Scheduler.update_from_output, OutputProcessor)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from chunkwise.attention import get_attention_backend
from chunkwise.attention.backend import AttentionBackend
from chunkwise.cache.events import KVEventLog
from chunkwise.cache.kv_cache_manager import KVCacheManager
from chunkwise.config import Dtype, EngineConfig
from chunkwise.engine.calibration import (
    DEFAULT_CPU_KV_BYTES,
    CudaMemoryStats,
    StartupProbe,
    kv_blocks_on_device,
)
from chunkwise.engine.output_processor import OutputProcessor
from chunkwise.engine.step import StepStats, StepUpdate
from chunkwise.hardware import cpu_has_bf16_matmul, cpu_isa, resolve_dtype
from chunkwise.model.loader import LoadedModel, checkpoint_dtype, load_model
from chunkwise.outputs import RequestOutput
from chunkwise.request import Request, RequestStatus, resolve_max_tokens
from chunkwise.sampling_params import SamplingParams
from chunkwise.sched.output import SchedulerStats
from chunkwise.sched.preemption import PreemptionCostModel
from chunkwise.sched.scheduler import Scheduler
from chunkwise.speculative.adaptive import AdaptiveDraftLength, StepCostModel
from chunkwise.speculative.draft import DraftModelProposer
from chunkwise.speculative.ngram import NgramProposer
from chunkwise.structured.compiler import GrammarCompiler
from chunkwise.tokenizer import Tokenizer
from chunkwise.worker.cuda_graphs import bucket_sizes
from chunkwise.worker.model_runner import ModelRunner, Proposer, kv_bytes_per_token

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the server and metrics need to know about the loaded engine, without reaching into it."""

    model: str  # what was loaded: a preset name or a checkpoint directory
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    max_waiting: int | None  # the scheduler's load-shedding bound (None: unbounded)
    dtype: str
    max_num_seqs: int  # a request's n choices run side by side, so n is bounded by this too


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)
        device = torch.device(config.device)
        choice = resolve_dtype(config.dtype, device, checkpoint_dtype(config.model))
        dtype = choice.dtype
        if device.type == "cpu":
            log.info("cpu %s", cpu_isa().describe())
        log.info("dtype %s (%s)", choice.name, choice.reason)
        if dtype != torch.float32 and device.type == "cpu" and not cpu_has_bf16_matmul():
            log.info(
                "this CPU has no %s matrix units: linear layers keep %s numerics but run as float32 matmuls "
                "over weights widened once (twice the weights' %s memory); float32 is as fast and more exact",
                choice.name,
                choice.name,
                choice.name,
            )
        backend = get_attention_backend(config.attention_backend, device.type)
        log.info("attention backend %s", backend.name)
        self.loaded: LoadedModel = load_model(config.model, dtype=dtype, device=device, backend=backend)
        mcfg = self.loaded.config
        cache = config.cache
        # Loaded before the KV cache is sized: its weights and its KV blocks take device memory too.
        draft = self._load_draft(config, dtype, device, backend)
        per_token = kv_bytes_per_token(mcfg, dtype)
        block_bytes = per_token * cache.block_size
        sched_cfg = config.scheduler
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        elif cache.kv_cache_memory_bytes is not None:
            num_blocks = cache.kv_cache_memory_bytes // block_bytes
        elif device.type == "cuda":
            # Each block id is a block of the target's cache and one of the draft's (speculative/draft.py).
            draft_bytes = kv_bytes_per_token(draft.config, dtype) * cache.block_size if draft else 0
            profile_len = sched_cfg.max_model_len or mcfg.max_position_embeddings

            def profile_runner(blocks: int) -> ModelRunner:
                return self._runner(config, backend, blocks, 0, dtype, device, profile_len)

            num_blocks = kv_blocks_on_device(
                profile_runner,
                CudaMemoryStats(device),
                utilization=cache.gpu_memory_utilization,
                block_bytes=block_bytes + draft_bytes,
                block_size=cache.block_size,
                max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                max_num_seqs=sched_cfg.max_num_seqs,
                max_model_len=sched_cfg.max_model_len,
                profile_len=profile_len,
            )
        else:
            num_blocks = DEFAULT_CPU_KV_BYTES // block_bytes
        if sched_cfg.max_model_len is None:
            # Unset, it is the model's context, cut to what the cache holds (a request must fit it alone);
            # set, it is the operator's word, and a cache too small for it is an error below.
            fits = num_blocks * cache.block_size
            max_model_len = min(mcfg.max_position_embeddings, fits)
            if max_model_len < mcfg.max_position_embeddings:
                log.warning(
                    "max_model_len %d: the KV cache (%d blocks of %d tokens) holds fewer tokens than the "
                    "model's %d positions; set --max-model-len, or give the cache more blocks or bytes",
                    max_model_len,
                    num_blocks,
                    cache.block_size,
                    mcfg.max_position_embeddings,
                )
            sched_cfg = dataclasses.replace(sched_cfg, max_model_len=max_model_len)
        elif sched_cfg.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {sched_cfg.max_model_len} exceeds the model's "
                f"max_position_embeddings {mcfg.max_position_embeddings}"
            )
        # The resolved dtype, so that what reads the config later (benchmarks, calibration) sees the real one.
        resolved = cast(Dtype, choice.name)  # resolve_dtype names one of the config's dtypes
        self.config = dataclasses.replace(config, scheduler=sched_cfg, dtype=resolved)
        self.max_model_len: int = sched_cfg.max_model_len  # type: ignore[assignment]
        self.tokenizer: Tokenizer = self.loaded.tokenizer
        # The checkpoint's own EOS ids and the tokenizer's: generation stops on either, as in transformers.
        self.eos_token_ids = self.loaded.eos_token_ids

        min_blocks = -(-self.max_model_len // cache.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {cache.block_size} tokens) cannot hold one request of "
                f"max_model_len {self.max_model_len} tokens; give it at least {min_blocks} blocks "
                f"({min_blocks * block_bytes} bytes) or lower max_model_len"
            )
        num_host_blocks = cache.swap_space_bytes // block_bytes
        # Structured outputs: the engine's one llguidance tokenizer (built on first use) and grammar cache.
        self.structured = GrammarCompiler(self.tokenizer, mcfg.vocab_size, self.eos_token_ids)
        proposer = self._make_proposer(config, draft, num_blocks, dtype, device)
        # What enters and leaves the prefix cache, for the router's exact index (GET /v1/kv_events).
        self.kv_events = (
            KVEventLog(cache.kv_events_buffer)
            if cache.enable_prefix_caching and cache.kv_events_buffer
            else None
        )
        self.kv = KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, num_host_blocks, self.kv_events
        )
        self.runner = self._runner(
            config,
            backend,
            num_blocks,
            num_host_blocks,
            dtype,
            device,
            self.max_model_len,
            proposer=proposer,
            grammars=self.structured,
        )
        probe = StartupProbe(self.runner, self.kv, self.max_model_len)
        fixed_transfer_s, host_copy_bytes_per_s = probe.swap_cost(num_blocks, num_host_blocks, block_bytes)
        self.cost_model = PreemptionCostModel(
            kv_bytes_per_token=per_token,
            host_copy_bytes_per_s=host_copy_bytes_per_s,
            prefill_tokens_per_s=probe.prefill_rate(),
            fixed_transfer_s=fixed_transfer_s,
        )
        if num_host_blocks:
            log.info("preemption cost model: %s", self.cost_model.describe())
        else:
            log.info(
                "preemption cost model: no swap space (swap_space_bytes %d < one block of %d bytes), every "
                "preemption recomputes; recompute = %.0f tokens/s",
                cache.swap_space_bytes,
                block_bytes,
                self.cost_model.prefill_tokens_per_s,
            )
        self.draft_length: AdaptiveDraftLength | None = None
        if proposer is not None:
            self.draft_length = AdaptiveDraftLength(
                config.spec.num_speculative_tokens,
                StepCostModel(*probe.step_cost()),
                adaptive=config.spec.adaptive,
            )
        self._set_up_graphs(config, device, backend)
        self.scheduler = Scheduler.from_config(
            sched_cfg, self.kv, self.cost_model, draft_length=self.draft_length
        )
        self.outputs: OutputProcessor | None = OutputProcessor(self.tokenizer)
        self.num_blocks = num_blocks
        self.last_step: StepStats | None = None
        self.model_info = ModelInfo(
            model=config.model,
            vocab_size=mcfg.vocab_size,
            max_model_len=self.max_model_len,
            block_size=cache.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            max_waiting=sched_cfg.max_waiting,
            dtype=choice.name,
            max_num_seqs=sched_cfg.max_num_seqs,
        )

    def _set_up_graphs(self, config: EngineConfig, device: torch.device, backend: AttentionBackend) -> None:
        if config.enforce_eager:
            if device.type == "cuda":
                log.info(
                    "CUDA graphs off (enforce_eager): they stay off by default until a GPU run has shown them "
                    "to give identical tokens; --no-enforce-eager replays decode steps from graphs"
                )
            return
        if device.type != "cuda":
            log.info("enforce_eager=False has no effect on %s: CUDA graphs need a CUDA device", device.type)
            return
        if not getattr(backend, "graph_safe", False):
            log.warning(
                "CUDA graphs off: the %s attention backend plans from host-side lengths, which a replayed "
                "graph would not see; use the triton backend",
                backend.name,
            )
            return
        sizes = bucket_sizes(config.scheduler.max_num_seqs)
        t0 = time.perf_counter()
        self.runner.use_decode_graphs(sizes, capture=True)
        log.info("CUDA graph capture took %.1fs", time.perf_counter() - t0)

    def _runner(
        self,
        config: EngineConfig,
        backend: AttentionBackend,
        num_blocks: int,
        num_host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        proposer: Proposer | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> ModelRunner:
        """The model runner: the engine's own, or one with a few blocks for the start-up memory profile."""
        return ModelRunner(
            self.loaded.model,
            self.loaded.config,
            backend,
            num_blocks=num_blocks,
            block_size=config.cache.block_size,
            num_host_blocks=num_host_blocks,
            dtype=dtype,
            device=device,
            max_num_tokens=config.scheduler.max_num_batched_tokens,
            max_num_reqs=config.scheduler.max_num_seqs,
            max_model_len=max_model_len,
            proposer=proposer,
            grammars=grammars,
        )

    def _load_draft(
        self, config: EngineConfig, dtype: torch.dtype, device: torch.device, backend: AttentionBackend
    ) -> LoadedModel | None:
        spec = config.spec
        if spec.method != "draft":
            return None
        if not spec.draft_model:
            raise ValueError(
                "speculative_method='draft' needs speculative_model (a preset or a HF directory)"
            )
        draft = load_model(spec.draft_model, dtype=dtype, device=device, backend=backend)
        target_vocab = self.loaded.config.vocab_size
        if draft.config.vocab_size != target_vocab:
            raise ValueError(
                f"the draft model {spec.draft_model!r} has vocab_size {draft.config.vocab_size}, "
                f"the target {target_vocab}: they must share a tokenizer"
            )
        return draft

    def _make_proposer(
        self,
        config: EngineConfig,
        draft: LoadedModel | None,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Proposer | None:
        spec = config.spec
        if spec.method is None:
            return None
        if spec.method == "ngram":
            return NgramProposer()
        assert draft is not None  # _load_draft loaded it for the method "draft"
        if draft.config.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"the draft model supports {draft.config.max_position_embeddings} positions, "
                f"fewer than max_model_len {self.max_model_len}"
            )
        return DraftModelProposer(
            draft.model, num_blocks=num_blocks, block_size=config.cache.block_size, dtype=dtype, device=device
        )

    # -- requests ---------------------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        route: str = "",
        cache_salt: str | None = None,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize; raises ValueError with a clear message for bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
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
    ) -> Request:
        req, text = self.make_request(request_id, prompt, params, arrival_time, route, cache_salt)
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
