"""EngineCore.step() (the seed's step loop), the AsyncEngine that streams it, and the offline LLM API.

release finished -> admit -> compose    (Scheduler.schedule)
forward -> sample                       (ModelRunner.execute)
emit                                    (Scheduler.update_from_output, OutputProcessor)
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch

from chunkwise.attention import get_attention_backend
from chunkwise.attention.backend import AttentionBackend
from chunkwise.cache.kv_cache_manager import KVCacheManager
from chunkwise.config import EngineConfig, engine_config_from_kwargs
from chunkwise.model.loader import LoadedModel, checkpoint_dtype, load_model
from chunkwise.outputs import CompletionOutput, RequestOutput, TokenLogprob
from chunkwise.platform import cpu_has_bf16_matmul, resolve_dtype
from chunkwise.request import Request, RequestStatus
from chunkwise.sampling_params import SamplingParams
from chunkwise.sched.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from chunkwise.sched.preemption import PreemptionCostModel
from chunkwise.sched.scheduler import Scheduler
from chunkwise.sched.shedding import LoadSnapshot, Overloaded, ServiceRate, SheddingPolicy, decide
from chunkwise.speculative.adaptive import AdaptiveDraftLength, StepCostModel
from chunkwise.speculative.draft import DraftModelProposer
from chunkwise.speculative.ngram import NgramProposer
from chunkwise.tokenizer import Tokenizer, make_detokenizer
from chunkwise.worker.cuda_graphs import bucket_sizes
from chunkwise.worker.model_runner import ModelRunner, Proposer, kv_bytes_per_token

# KV memory when neither blocks nor bytes are given: modest on CPU, most of a GPU's free memory on CUDA.
_DEFAULT_CPU_KV_BYTES = 1 << 30
_DEFAULT_GPU_KV_FRACTION = 0.8
# Steps in a row that may fail (each failing its requests) before the engine thread gives up.
_MAX_CONSECUTIVE_FAILURES = 3

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """One step's timings, for metrics, the cost model and the host-overhead benchmark.

    step = schedule + prepare + forward + sample + update + output (+ the little between them): the forward is
    the device's share (the model, logits and sampler up to the sampled ids on the host); the rest is host
    work, which on a GPU is time the device may sit idle."""

    step_seconds: float
    schedule_seconds: float
    forward_seconds: float
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_rows: int
    prepare_seconds: float = 0.0
    sample_seconds: float = 0.0
    update_seconds: float = 0.0
    output_seconds: float = 0.0
    # Static batching's padding rows in this step (held slots of finished requests), on top of the real rows.
    num_padding_rows: int = 0

    @property
    def host_seconds(self) -> float:
        """Everything in the step outside the forward."""
        return self.step_seconds - self.forward_seconds


Logprobs = list[tuple[float, list[tuple[int, float]]]]


@dataclass(slots=True)
class StepUpdate:
    """What one step did to its requests, as of the end of that step: the output side reads this snapshot
    (and a finished request's finish fields, which never change again), not the live requests, which the
    step loop may already be advancing on another thread. Parallel lists, not an object per request: at
    hundreds of rows a step, the snapshot is a few list passes."""

    reqs: list[Request]
    num_tokens: list[int]  # len(req.token_ids) when the step ended: the new tokens are the ones before it
    finished: list[bool]
    # Per request id, per new token: (chosen logprob, top alternatives); None when no row asked for them.
    logprobs: dict[str, Logprobs] | None = None

    @classmethod
    def of(cls, reqs: list[Request], logprobs: dict[str, Logprobs] | None = None) -> StepUpdate:
        # finish() sets finish_reason: whether it is set is whether the request is finished.
        return cls(
            reqs,
            [len(r.token_ids) for r in reqs],
            [r.finish_reason is not None for r in reqs],
            logprobs or None,
        )


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # Requests whose output ended in this batch (by the step or by a stop string).
    finished: list[Request]
    # Requests whose text reached a stop string: their output ended here, and the caller releases them
    # from the scheduler (at once in the step loop's thread; through the inbox from AsyncEngine's output
    # thread). The output processor never calls into the scheduler itself.
    stopped: list[tuple[Request, str]]


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


class _OutputState:
    """Per-request emission state: incremental detokenization and stop strings."""

    # Text kept behind what was sent, for stop strings straddling steps, is trimmed past this many characters.
    TRIM_TEXT_AT = 4096

    def __init__(self, req: Request, prompt: str | None, tokenizer: Tokenizer) -> None:
        self.req = req
        self.prompt = prompt
        self.num_prompt_tokens = req.num_prompt_tokens
        params = req.sampling_params
        self.detok = make_detokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = tuple(params.stop)
        self.max_stop = max((len(s) for s in self.stops), default=0)
        # Hold back this many characters while running: they could be the start of a stop string.
        self.holdback = max(self.max_stop - 1, 0)
        # Only with stop strings: the text not yet sent plus enough before it to find a straddling match.
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _OutputState] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        self.states[req.request_id] = _OutputState(req, prompt, self.tokenizer)

    def process(self, update: StepUpdate) -> ProcessedOutputs:
        """Detokenize each request's new tokens and look for stop strings; a match ends the request's
        output here and is reported in `stopped` for the caller to release."""
        outs: list[RequestOutput] = []
        finished_reqs: list[Request] = []
        stopped: list[tuple[Request, str]] = []
        states = self.states
        logprobs = update.logprobs
        for req, num_tokens, finished in zip(update.reqs, update.num_tokens, update.finished):
            st = states.get(req.request_id)
            if st is None:
                continue  # already finished here (a stop string), the step loop not yet told
            new_tokens = req.token_ids[st.num_prompt_tokens + st.sent_tokens : num_tokens]
            step = st.detok.step
            piece = step(new_tokens[0]) if len(new_tokens) == 1 else "".join([step(t) for t in new_tokens])
            if finished:
                piece += st.detok.flush()
            stop = None
            if st.stops:
                delta, stop = self._stop_strings(st, finished, piece)
                if stop is not None:
                    finished = True
                    stopped.append((req, stop))
            else:
                delta = piece
            lp = logprobs.get(req.request_id) if logprobs is not None else None
            outs.append(self._emit(st, req, finished, stop, new_tokens, delta, lp))
            if finished:
                finished_reqs.append(req)
        return ProcessedOutputs(outs, finished_reqs, stopped)

    @staticmethod
    def _stop_strings(st: _OutputState, finished: bool, piece: str) -> tuple[str, str | None]:
        """Append `piece` and look for the first stop string: what may be sent, and the stop string that
        ended the output (None if none did)."""
        st.text += piece
        stop = None
        if not finished:
            # Only the tail can hold a new match: the new text plus a stop string's length before it.
            window_start = max(0, st.sent_chars - st.max_stop)
            best: tuple[int, str] | None = None
            for s in st.stops:
                idx = st.text.find(s, window_start)
                if idx != -1 and (best is None or idx < best[0]):
                    best = (idx, s)
            if best is not None:
                idx, stop = best
                keep = idx + len(stop) if st.req.sampling_params.include_stop_str_in_output else idx
                st.text = st.text[:keep]
                finished = True
        upto = len(st.text) if finished else max(st.sent_chars, len(st.text) - st.holdback)
        delta = st.text[st.sent_chars : upto]
        st.sent_chars = upto
        drop = st.sent_chars - st.max_stop
        if drop > st.TRIM_TEXT_AT:
            st.text = st.text[drop:]
            st.sent_chars -= drop
        return delta, stop

    def _emit(
        self,
        st: _OutputState,
        req: Request,
        finished: bool,
        stop: str | None,
        new_tokens: list[int],
        delta: str,
        logprobs: Logprobs | None,
    ) -> RequestOutput:
        st.sent_tokens += len(new_tokens)
        lp = None
        if logprobs is not None:
            lp = [TokenLogprob(t, v, top) for t, (v, top) in zip(new_tokens, logprobs)]
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        finished_time: float | None = None
        if finished:
            self.states.pop(req.request_id, None)
            if stop is not None:
                finish_reason, stop_reason, finished_time = (
                    RequestStatus.FINISHED_STOPPED.value,
                    stop,
                    time.monotonic(),
                )
            else:
                finish_reason, stop_reason, finished_time = (
                    req.finish_reason,
                    req.stop_reason,
                    req.finished_time,
                )
        return RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=delta,
                    token_ids=new_tokens,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    logprobs=lp,
                )
            ],
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=finished_time,
        )

    def aborted(self, req: Request) -> RequestOutput:
        st = self.states.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt if st else None,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
            finished=True,
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
        )


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)
        device = torch.device(config.device)
        choice = resolve_dtype(config.dtype, device, checkpoint_dtype(config.model))
        dtype = choice.dtype
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
        sched_cfg = config.scheduler
        if sched_cfg.max_model_len is None:
            sched_cfg = dataclasses.replace(sched_cfg, max_model_len=mcfg.max_position_embeddings)
        elif sched_cfg.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {sched_cfg.max_model_len} exceeds the model's "
                f"max_position_embeddings {mcfg.max_position_embeddings}"
            )
        # The resolved dtype, so that what reads the config later (benchmarks, calibration) sees the real one.
        self.config = dataclasses.replace(config, scheduler=sched_cfg, dtype=choice.name)
        self.max_model_len: int = sched_cfg.max_model_len  # type: ignore[assignment]
        self.tokenizer: Tokenizer = self.loaded.tokenizer
        # The checkpoint's own EOS ids and the tokenizer's: generation stops on either, as in transformers.
        self.eos_token_ids = self.loaded.eos_token_ids

        cache = config.cache
        per_token = kv_bytes_per_token(mcfg, dtype)
        block_bytes = per_token * cache.block_size
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        else:
            num_blocks = (cache.kv_cache_memory_bytes or self._default_kv_bytes(device)) // block_bytes
        min_blocks = -(-self.max_model_len // cache.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {cache.block_size} tokens) cannot hold one request of "
                f"max_model_len {self.max_model_len} tokens; give it at least {min_blocks} blocks "
                f"({min_blocks * block_bytes} bytes) or lower max_model_len"
            )
        num_host_blocks = cache.swap_space_bytes // block_bytes
        proposer = self._make_proposer(config, num_blocks, dtype, device, backend)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, num_host_blocks)
        self.runner = ModelRunner(
            self.loaded.model,
            mcfg,
            backend,
            num_blocks=num_blocks,
            block_size=cache.block_size,
            num_host_blocks=num_host_blocks,
            dtype=dtype,
            device=device,
            max_num_tokens=sched_cfg.max_num_batched_tokens,
            max_num_reqs=sched_cfg.max_num_seqs,
            max_model_len=self.max_model_len,
            proposer=proposer,
        )
        fixed_transfer_s, host_copy_bytes_per_s = self._measure_swap_cost(
            num_blocks, num_host_blocks, block_bytes
        )
        self.cost_model = PreemptionCostModel(
            kv_bytes_per_token=per_token,
            host_copy_bytes_per_s=host_copy_bytes_per_s,
            prefill_tokens_per_s=self._measure_prefill_rate(),
            forced=sched_cfg.preemption_mode,
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
            self.step_cost = StepCostModel(*self._measure_step_cost())
            self.draft_length = AdaptiveDraftLength(
                config.spec.num_speculative_tokens, self.step_cost, adaptive=config.spec.adaptive
            )
        self._set_up_graphs(config, device, backend)
        self.scheduler = Scheduler(sched_cfg, self.kv, self.cost_model, draft_length=self.draft_length)
        self.outputs = OutputProcessor(self.tokenizer)
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

    def _make_proposer(
        self,
        config: EngineConfig,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
    ) -> Proposer | None:
        spec = config.spec
        if spec.method is None:
            return None
        if spec.method == "ngram":
            return NgramProposer()
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
        if draft.config.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"the draft model supports {draft.config.max_position_embeddings} positions, "
                f"fewer than max_model_len {self.max_model_len}"
            )
        return DraftModelProposer(
            draft.model, num_blocks=num_blocks, block_size=config.cache.block_size, dtype=dtype, device=device
        )

    def _time_forward(self, num_tokens: int) -> float:
        """Seconds of one warm prefill of num_tokens tokens through the first blocks.

        Used at start-up only, while every block is free; what it writes there is overwritten later."""
        n = min(num_tokens, self.max_model_len, self.kv.block_size * self.kv.pool.num_blocks)
        table = list(range(-(-n // self.kv.block_size)))
        sr = ScheduledRequest(
            "__warmup__", [0] * n, 0, table, samples=False, sampling_params=SamplingParams()
        )
        so = SchedulerOutput(scheduled=[sr], num_batched_tokens=n)
        self.runner.execute(so)  # warm-up
        t0 = time.perf_counter()
        self.runner.execute(so)
        elapsed = time.perf_counter() - t0
        # The runner keeps per-request state (a block-table row) until told the request is gone.
        self.runner.execute(SchedulerOutput(scheduled=[], num_batched_tokens=0, finished_req_ids={sr.req_id}))
        return elapsed

    def _measure_step_cost(self) -> tuple[float, float]:
        """(fixed seconds per step, seconds per token) from two timed forwards, to seed the adaptive draft length."""
        large = min(64, self.max_model_len)
        t_small, t_large = self._time_forward(1), self._time_forward(large)
        per_token = max((t_large - t_small) / max(large - 1, 1), 1e-9)
        return max(t_small - per_token, 1e-6), per_token

    @staticmethod
    def _default_kv_bytes(device: torch.device) -> int:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * _DEFAULT_GPU_KV_FRACTION)
        return _DEFAULT_CPU_KV_BYTES

    def _measure_swap_cost(
        self,
        num_blocks: int,
        num_host_blocks: int,
        block_bytes: int,
        max_blocks: int = 16,
        repeats: int = 5,
        budget_s: float = 0.15,
    ) -> tuple[float, float]:
        """(fixed seconds per transfer, bytes/s) of swap's copies, the preemption cost model's swap constants.

        Times device->host->device round trips of 1, a quarter of max_blocks and max_blocks blocks through
        the runner's own swap path (a step with only swap_out, then one with only swap_in), the best of up to
        `repeats` passes (fewer when a pass would overrun budget_s), and fits round trip = 2 * (fixed + bytes
        / bandwidth) by least squares. At start-up only, while nothing is swapped: the host slots' contents
        do not matter and the device blocks get their own bytes back."""
        n_max = min(max_blocks, num_blocks, num_host_blocks)
        if n_max == 0:
            return 0.0, 1.0  # no swap space: swap never happens, recompute is the only choice
        sizes = sorted({1, max(1, n_max // 4), n_max})
        sync = torch.cuda.synchronize if self.runner.device.type == "cuda" else (lambda: None)

        def round_trip(n: int) -> float:
            pairs = [(i, i) for i in range(n)]
            out = SchedulerOutput(scheduled=[], num_batched_tokens=0, swap_out=pairs)
            back = SchedulerOutput(scheduled=[], num_batched_tokens=0, swap_in=pairs)
            sync()
            t0 = time.perf_counter()
            self.runner.execute(out)
            self.runner.execute(back)
            sync()
            return time.perf_counter() - t0

        deadline = time.perf_counter() + budget_s
        round_trip(1)  # warm-up: first-call overheads
        best = dict.fromkeys(sizes, float("inf"))
        for _ in range(repeats):
            t0 = time.perf_counter()
            for n in sizes:
                best[n] = min(best[n], round_trip(n))
            now = time.perf_counter()
            if now + (now - t0) > deadline:
                break
        xs = [float(n * block_bytes) for n in sizes]
        ys = [best[n] / 2 for n in sizes]  # one transfer
        if len(sizes) == 1:
            return 0.0, xs[0] / max(ys[0], 1e-9)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 1e-15)  # seconds per byte: no faster than 1 PB/s, whatever the noise says
        return max(my - slope * mx, 0.0), 1 / slope

    def _measure_prefill_rate(self, num_tokens: int = 128) -> float:
        """Tokens/s of one prefill, the starting point of the preemption cost model's recompute rate."""
        n = min(num_tokens, self.max_model_len)
        return n / max(self._time_forward(n), 1e-9)

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
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            max_tokens=params.max_tokens if params.max_tokens is not None else room,
            eos_token_ids=self.eos_token_ids,
            route=route,
            cache_salt=cache_salt,
        )
        return req, text

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
        self.scheduler.add_request(req)
        self.outputs.add(req, text)
        return req

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        return [self.outputs.aborted(r) for r in self.scheduler.abort(request_ids)]

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
        processed = self.outputs.process(update)
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
        updated = self.scheduler.update_from_output(so, result.sampled, result.drafted, result.row_tokens)
        if self.draft_length is not None and so.num_batched_tokens:
            self.step_cost.observe(so.num_batched_tokens, result.forward_seconds)
            drafted = sum(result.drafted.values())
            accepted = sum(len(result.sampled[r]) - 1 for r in result.drafted)
            self.draft_length.observe_acceptance(drafted, accepted)
        update = StepUpdate.of(updated, result.logprobs)
        t3 = time.perf_counter()
        if so.num_prefill_tokens >= so.num_batched_tokens // 2 and so.num_prefill_tokens > 0:
            self.cost_model.observe_prefill(so.num_batched_tokens, result.forward_seconds)
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


def _merge(acc: RequestOutput, delta: RequestOutput) -> None:
    a, d = acc.outputs[0], delta.outputs[0]
    a.text += d.text
    a.token_ids.extend(d.token_ids)
    if d.logprobs is not None:
        a.logprobs = (a.logprobs or []) + d.logprobs
    a.finish_reason, a.stop_reason = d.finish_reason, d.stop_reason
    acc.finished = delta.finished
    acc.first_token_time = delta.first_token_time
    acc.finished_time = delta.finished_time


class LLM:
    """The offline API: `LLM(model="tiny", **engine_args).generate(prompts, sampling_params)`."""

    def __init__(self, model: str = "tiny", **engine_args: object) -> None:
        self.engine = EngineCore(engine_config_from_kwargs(model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompt_list: list[str | Sequence[int]] = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(params)} sampling params")
        # Validate everything before queueing anything, so one bad prompt leaves no half-run batch.
        reqs = [
            self.engine.make_request(f"offline-{next(self._ids)}", p, sp)
            for p, sp in zip(prompt_list, params)
        ]
        results: dict[str, RequestOutput] = {}
        for req, text in reqs:
            self.engine.scheduler.add_request(req)
            self.engine.outputs.add(req, text)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id in results:
                    _merge(results[out.request_id], out)
                else:
                    results[out.request_id] = out
        return [results[req.request_id] for req, _ in reqs]


class RequestStream:
    """One request's deltas from AsyncEngine, as an async iterator.

    `close()` aborts the request unless it already finished (its KV blocks are freed within a step); it is
    idempotent, and callers call it in a `finally` so that a client disconnect, a cancelled task or an error
    anywhere in between never leaves a request generating for nobody.
    """

    def __init__(
        self, engine: AsyncEngine, request: Request, q: asyncio.Queue[RequestOutput | Exception]
    ) -> None:
        self.engine = engine
        self.request_id = request.request_id
        self.prompt_token_ids: list[int] = request.prompt_token_ids
        self._q = q
        self.finished = False
        self._closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.finished:
                self.engine.abort(self.request_id)


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

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        # An add is (request, prompt text); an abort is the request id; a stop string found by the output
        # thread is (request, the stop string).
        self._inbox: queue.SimpleQueue[tuple[Request, str | _StopString | None] | str] = queue.SimpleQueue()
        # To the output thread, in step order: requests to track, each step's updates, aborts; None ends it.
        self._out_q: queue.SimpleQueue[_OutputEvent | None] = queue.SimpleQueue()
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]
        ] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="chunkwise-engine", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="chunkwise-output", daemon=True)
        self.error: BaseException | None = None
        self._ids = itertools.count()
        self._consecutive_failures = 0
        self._observers: list[Callable[[StepStats | None, list[RequestOutput], list[Request]], None]] = []
        # Loop-thread state: the routes seen, the service rate.
        self._routes: set[str] = {""}
        self._drained: list[str] = []
        self._rate = ServiceRate(self.core.cost_model.prefill_tokens_per_s)
        self._cold_start_output_tokens = self.core.config.scheduler.cold_start_output_tokens
        # Published by the loop thread, read by HTTP handlers; all under _lock.
        self._load = LoadSnapshot(service_tokens_per_s=self._rate.tokens_per_s)
        self._stats = copy.copy(self.core.stats)
        self._estimates: dict[str, int] = {}
        # Accepted by add_request, not yet drained by the loop: request id -> (prompt tokens, output estimate).
        self._pending: dict[str, tuple[int, int]] = {}
        self._pending_prefill = 0
        self._pending_decode = 0

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

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.core.model_info

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    def add_observer(
        self, observer: Callable[[StepStats | None, list[RequestOutput], list[Request]], None]
    ) -> None:
        """Call `observer(step, outputs, finished_requests)` on the loop thread after each step. It must be
        quick and must not block; an exception it raises is logged and otherwise ignored."""
        self._observers = [*self._observers, observer]

    def load(self) -> LoadSnapshot:
        """The load an admission check sees now: the loop's last snapshot plus requests not yet drained."""
        with self._lock:
            return self._load_locked()

    def _load_locked(self) -> LoadSnapshot:
        return self._load.plus(len(self._pending), self._pending_prefill, self._pending_decode)

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
    ) -> RequestStream:
        """Validate, check admission and queue one request; never blocks on the step loop.

        Raises ValueError for bad input and `Overloaded` when `shedding` refuses it, in both cases before
        anything is queued; RuntimeError when the engine is not running."""
        if self.error is not None or self._stopping:
            raise RuntimeError("the engine is not running")
        rid = request_id or f"req-{next(self._ids)}"
        req, text = self.core.make_request(rid, prompt, params, route=route, cache_salt=cache_salt)
        q: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if rid in self._streams or rid in self._pending:
                raise ValueError(f"request id {rid!r} is already in use")
            if params.max_tokens is not None:
                decode = req.max_tokens
            else:
                decode = min(req.max_tokens, self._estimates.get(route, self._cold_start_output_tokens))
            if shedding is not None:
                decision = decide(shedding, self._load_locked())
                if not decision.admitted:
                    raise Overloaded(decision)
            self._streams[rid] = (loop, q)
            self._pending[rid] = (req.num_prompt_tokens, decode)
            self._pending_prefill += req.num_prompt_tokens
            self._pending_decode += decode
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
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas for one request. Raises ValueError for bad input before anything is queued.
        Leaving the iterator early (a client disconnect) aborts the request."""
        stream = self.add_request(prompt, params, request_id, route=route, cache_salt=cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)
        self._wake.set()

    def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def _deliver(self, out: RequestOutput | Exception, rid: str) -> None:
        with self._lock:
            entry = self._streams.get(rid)
            if entry is not None and (isinstance(out, Exception) or out.finished):
                del self._streams[rid]
        if entry is not None:
            loop, q = entry
            # A closed event loop raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(q.put_nowait, out)

    def _deliver_all(self, outs: Sequence[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop, not one per request."""
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput | Exception], RequestOutput]]
        ]
        by_loop = {}
        with self._lock:
            streams = self._streams
            for out in outs:
                entry = streams.get(out.request_id)
                if entry is None:
                    continue
                if out.finished:
                    del streams[out.request_id]
                loop, q = entry
                by_loop.setdefault(loop, []).append((q, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_streams(self, error: Exception) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._pending.clear()
            self._pending_prefill = self._pending_decode = 0
        for loop, q in streams:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(q.put_nowait, error)

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
                aborted.extend(core.scheduler.abort([item]))
                continue
            req, extra = item
            if isinstance(extra, _StopString):
                core.finish_by_stop(req, extra.text)
                continue
            self._drained.append(req.request_id)
            try:
                core.scheduler.add_request(req)
            except ValueError as e:
                self._deliver(e, req.request_id)
                continue
            self._out_q.put(_OutputEvent(added=[(req, extra)]))
            self._routes.add(req.route)
        if aborted:
            self._out_q.put(_OutputEvent(aborted=aborted))
        return any_item

    def _publish(self) -> None:
        core = self.core
        sched = core.scheduler
        num = prefill = decode = 0
        for r in itertools.chain(sched.waiting, sched.swapped):
            num += 1
            prefill += r.num_tokens - r.num_computed_tokens
            decode += max(0, r.output_length_estimate - r.num_output_tokens)
        stats = copy.copy(sched.stats)
        stats.num_running = len(sched.running)
        stats.num_waiting = len(sched.waiting)
        stats.num_swapped = len(sched.swapped)
        stats.kv_usage = core.kv.pool.usage
        estimates = {route: sched.estimator.estimate(route) for route in self._routes}
        load = LoadSnapshot(num, prefill, decode, self._rate.tokens_per_s)
        drained, self._drained = self._drained, []
        with self._lock:
            for rid in drained:
                p = self._pending.pop(rid, None)
                if p is not None:
                    self._pending_prefill -= p[0]
                    self._pending_decode -= p[1]
            self._load = load
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
        only if aborting them leaves the block pool whole. Otherwise (or on repeated failures) it re-raises and
        the thread dies as before: /health turns 503 and the pod is restarted.
        """
        self._consecutive_failures += 1
        logging.getLogger(__name__).exception("engine step failed; aborting the requests in flight")
        core = self.core
        aborted = core.scheduler.abort(list(core.scheduler.requests))
        failure = RuntimeError(f"the engine step failed and this request was aborted: {error!r}")
        for req in aborted:
            self._deliver(failure, req.request_id)
        self._publish()
        # The output side forgets them (their streams are gone: nothing more is delivered) and observers
        # count them as aborted.
        self._out_q.put(_OutputEvent(aborted=aborted))
        core.kv.pool.check_invariants()
        if (
            core.kv.num_free_blocks != core.num_blocks
            or self._consecutive_failures >= _MAX_CONSECUTIVE_FAILURES
        ):
            raise error

    def _finish_by_stop(self, req: Request, stop: str) -> None:
        """On the output thread: a stop string ended req's output; the scheduler frees it next drain."""
        self._inbox.put((req, _StopString(stop)))
        self._wake.set()

    def _output_loop(self) -> None:
        """The output thread: detokenize, find stop strings, deliver, observe; in the order steps ran."""
        outputs = self.core.outputs
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
                    for req in event.aborted:
                        if req.request_id in outputs.states:
                            outs.append(outputs.aborted(req))
                            finished.append(req)
                if outs:
                    self._deliver_all(outs)
                self._notify(event.step, outs, finished)
            except Exception:  # one bad event must not end every stream's output
                logging.getLogger(__name__).exception("engine output processing failed")

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if self._drain_inbox():
                    self._publish()
                if not self.core.has_unfinished():
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


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput | Exception], RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
