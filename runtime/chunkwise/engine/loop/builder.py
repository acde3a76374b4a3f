"""build_engine: an EngineConfig -> the parts of an engine (model, KV cache, runner, cost models,
scheduler), in the order their sizes depend on each other. EngineCore keeps the parts and runs the loop.

dtype -> attention backend -> model (and draft model) -> KV blocks (given, from bytes, or profiled on a
GPU) -> max_model_len -> KV cache manager and runner -> start-up probes (swap and prefill costs, the draft
length's step cost) -> CUDA graphs -> scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import cast

import torch

from chunkwise.engine.attention import get_attention_backend
from chunkwise.engine.attention.backend import AttentionBackend
from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import Dtype, EngineConfig
from chunkwise.engine.distributed import SINGLE_RANK, stage_layers
from chunkwise.engine.hardware import DtypeChoice, cpu_has_bf16_matmul, cpu_isa, resolve_dtype
from chunkwise.engine.loop.calibration import (
    DEFAULT_CPU_KV_BYTES,
    KVProfileRequest,
    StartupProbe,
    profile_kv_blocks,
)
from chunkwise.engine.loop.tp_ranks import EngineRanks, RankSizes, check_devices, check_sizes
from chunkwise.engine.lora.slots import LoRASlots
from chunkwise.engine.lora.store import AdapterStore
from chunkwise.engine.model.layers import warm_up_onednn
from chunkwise.engine.model.loader import LoadedModel, checkpoint_dtype, load_model
from chunkwise.engine.sampling.structured.compiler import GrammarCompiler
from chunkwise.engine.sched.draft_length import AdaptiveDraftLength, StepCostModel
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler
from chunkwise.engine.worker.cuda_graphs import bucket_sizes
from chunkwise.engine.worker.draft_model import DraftModelProposer
from chunkwise.engine.worker.kv_tensors import kv_bytes_per_token
from chunkwise.engine.worker.model_runner import ModelRunner
from chunkwise.engine.worker.ngram import NgramProposer
from chunkwise.engine.worker.step import Proposer

log = logging.getLogger("chunkwise.engine.loop.core")  # the core's log lines, under the name they always had


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
    # How the linear weights are held (QuantScheme.description: the checkpoint's format or --quantization);
    # None: full precision, in `dtype`.
    quantization: str | None = None
    # --scheduling-policy: under priority, metrics keep their per-band series.
    scheduling_policy: str = "fcfs"


@dataclass
class EngineParts:
    """An engine's parts, built and wired; EngineCore runs the loop over them."""

    config: EngineConfig  # resolved: the real dtype and max_model_len
    loaded: LoadedModel
    max_model_len: int
    structured: GrammarCompiler
    kv_events: KVEventLog | None
    kv: KVCacheManager
    runner: ModelRunner
    cost_model: PreemptionCostModel
    draft_length: AdaptiveDraftLength | None
    scheduler: Scheduler
    num_blocks: int
    model_info: ModelInfo
    adapters: AdapterStore | None = None  # the LoRA adapters it knows (None: enable_lora off)


def build_engine(config: EngineConfig) -> EngineParts:
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
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return _build(config, choice, backend, None)
    check_sizes(config)  # before any process starts
    check_devices(config)
    ranks = EngineRanks(config, choice.name, make_runner)  # the other ranks started, and the group joined
    try:
        return _build(config, choice, backend, ranks)
    except BaseException:
        ranks.close()
        raise


def _build(
    config: EngineConfig, choice: DtypeChoice, backend: AttentionBackend, ranks: EngineRanks | None
) -> EngineParts:
    """The rest of build_engine, on rank 0 of `ranks` when tensor or pipeline parallel."""
    device = torch.device(config.device)
    dtype = choice.dtype
    tp_group = ranks.groups.tp if ranks is not None else SINGLE_RANK
    num_layers = check_sizes(config) if config.pipeline_parallel_size > 1 else None
    stage = ranks.groups.stage(num_layers) if ranks is not None and num_layers is not None else None
    loaded = load_model(
        config.model,
        dtype=dtype,
        device=device,
        backend=backend,
        tp_group=tp_group,
        pp_stage=stage,
        quantization=config.quantization,
    )
    mcfg = loaded.config
    cache = config.cache
    if config.warm_up_kernels and device.type == "cpu":
        sched = config.scheduler
        calls, seconds = warm_up_onednn(loaded.model, sched.max_num_batched_tokens, sched.max_num_seqs)
        log.info(
            "warm-up: built oneDNN's kernels for %d layer shapes and row counts in %.1f s", calls, seconds
        )
    # Loaded before the KV cache is sized: its weights and its KV blocks take device memory too.
    draft = _load_draft(config, loaded, dtype, device, backend)
    adapters, lora_slots = _lora(config, loaded, dtype, device)
    # On each rank, over its stage's layers; every rank has the same number of blocks (the block ids the
    # scheduler hands out are every rank's), so the largest stage's size them.
    stage_layers_max = max(map(len, stage_layers(mcfg.num_hidden_layers, config.pipeline_parallel_size)))
    per_token = kv_bytes_per_token(mcfg, dtype, config.tensor_parallel_size, stage_layers_max)
    block_bytes = per_token * cache.block_size
    sched_cfg = config.scheduler
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif cache.kv_cache_memory_bytes is not None:
        num_blocks = cache.kv_cache_memory_bytes // block_bytes
    elif device.type == "cuda":
        # Each block id is a block of the target's cache and one of the draft's (worker/draft_model.py).
        draft_bytes = kv_bytes_per_token(draft.config, dtype) * cache.block_size if draft else 0
        profile_len = sched_cfg.max_model_len or mcfg.max_position_embeddings

        def profile_runner(blocks: int) -> ModelRunner:
            return make_runner(loaded, config, backend, blocks, 0, dtype, device, profile_len)

        if ranks is not None:  # every rank runs the profile step's collectives, on its own GPU
            ranks.setup(KVProfileRequest(block_bytes, profile_len))
        num_blocks = profile_kv_blocks(profile_runner, device, config, block_bytes + draft_bytes, profile_len)
        if ranks is not None:
            num_blocks = ranks.groups.min_over_ranks(num_blocks)
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
    resolved_config = dataclasses.replace(config, scheduler=sched_cfg, dtype=resolved)
    max_model_len_: int = sched_cfg.max_model_len  # type: ignore[assignment]

    min_blocks = -(-max_model_len_ // cache.block_size)
    if num_blocks < min_blocks:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {cache.block_size} tokens) cannot hold one request of "
            f"max_model_len {max_model_len_} tokens; give it at least {min_blocks} blocks "
            f"({min_blocks * block_bytes} bytes) or lower max_model_len"
        )
    num_host_blocks = cache.swap_space_bytes // block_bytes
    # The prefix cache's host tier: its slots follow the swap space's in the same host tensors, so that every
    # rank and stage makes its copies on the swap path. Its size is vLLM's: GiB over all of a replica's ranks.
    num_tier_blocks = int(cache.kv_offloading_size * (1 << 30)) // (block_bytes * config.world_size)
    if cache.kv_offloading_size and not num_tier_blocks:
        raise ValueError(
            f"kv_offloading_size {cache.kv_offloading_size} GiB holds no KV block of {block_bytes} bytes "
            f"(per rank, {config.world_size} ranks)"
        )
    # Structured outputs: the engine's one llguidance tokenizer (built on first use) and grammar cache.
    structured = GrammarCompiler(loaded.tokenizer, mcfg.vocab_size, loaded.eos_token_ids)
    proposer = _make_proposer(config, draft, num_blocks, dtype, device, max_model_len_)
    # What enters and leaves the prefix cache, for the router's exact index (GET /v1/kv_events).
    kv_events = (
        KVEventLog(cache.kv_events_buffer) if cache.enable_prefix_caching and cache.kv_events_buffer else None
    )
    kv = KVCacheManager(
        num_blocks, cache.block_size, cache.enable_prefix_caching, num_host_blocks, kv_events, num_tier_blocks
    )
    if num_tier_blocks:
        log.info(
            "prefix cache host tier: %d blocks (%.2f GiB per rank) after the swap space's %d",
            num_tier_blocks,
            num_tier_blocks * block_bytes / (1 << 30),
            num_host_blocks,
        )
    runner = make_runner(
        loaded,
        config,
        backend,
        num_blocks,
        num_host_blocks + num_tier_blocks,
        dtype,
        device,
        max_model_len_,
        proposer=proposer,
        grammars=structured,
    )
    runner.lora = lora_slots
    if ranks is not None:
        # Every rank's cache has the same blocks (the block ids the scheduler hands out are every rank's).
        ranks.setup(RankSizes(num_blocks, num_host_blocks + num_tier_blocks, max_model_len_))
        runner.ranks = ranks  # from here on (the start-up probes first), each step drives the other ranks
    probe = StartupProbe(runner, kv, max_model_len_)
    fixed_transfer_s, host_copy_bytes_per_s = probe.swap_cost(num_blocks, num_host_blocks, block_bytes)
    cost_model = PreemptionCostModel(
        kv_bytes_per_token=per_token,
        host_copy_bytes_per_s=host_copy_bytes_per_s,
        prefill_tokens_per_s=probe.prefill_rate(),
        fixed_transfer_s=fixed_transfer_s,
    )
    if num_host_blocks:
        log.info("preemption cost model: %s", cost_model.describe())
    else:
        log.info(
            "preemption cost model: no swap space (swap_space_bytes %d < one block of %d bytes), every "
            "preemption recomputes; recompute = %.0f tokens/s",
            cache.swap_space_bytes,
            block_bytes,
            cost_model.prefill_tokens_per_s,
        )
    draft_length: AdaptiveDraftLength | None = None
    if proposer is not None:
        draft_length = AdaptiveDraftLength(
            config.spec.num_speculative_tokens,
            StepCostModel(*probe.step_cost()),
            adaptive=config.spec.adaptive,
        )
    _set_up_graphs(runner, config, device, backend)
    scheduler = Scheduler.from_config(
        sched_cfg,
        kv,
        cost_model,
        draft_length=draft_length,
        max_loras=config.max_loras if config.enable_lora else None,
    )
    model_info = ModelInfo(
        model=config.model,
        vocab_size=mcfg.vocab_size,
        max_model_len=max_model_len_,
        block_size=cache.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=cache.enable_prefix_caching,
        max_waiting=sched_cfg.max_waiting,
        dtype=choice.name,
        max_num_seqs=sched_cfg.max_num_seqs,
        quantization=loaded.quantization.description if loaded.quantization is not None else None,
        scheduling_policy=sched_cfg.scheduling_policy,
    )
    return EngineParts(
        config=resolved_config,
        loaded=loaded,
        max_model_len=max_model_len_,
        structured=structured,
        kv_events=kv_events,
        kv=kv,
        runner=runner,
        cost_model=cost_model,
        draft_length=draft_length,
        scheduler=scheduler,
        num_blocks=num_blocks,
        model_info=model_info,
        adapters=adapters,
    )


def _lora(
    config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device
) -> tuple[AdapterStore | None, LoRASlots | None]:
    """With enable_lora: the adapter store and the device's slots, their weights attached to the model's
    projections (allocated before the KV cache is sized, whose memory they share)."""
    if not config.enable_lora:
        return None, None
    store = AdapterStore(loaded.config, config.max_lora_rank, config.max_cpu_loras or config.max_loras)
    slots = LoRASlots(
        loaded.model.lora_targets(),
        store,
        config.max_loras,
        config.max_lora_rank,
        dtype,
        device,
        kernel=config.lora_kernel,
    )
    loaded.model.attach_lora(slots)
    mib = sum(t.numel() * t.element_size() for t in (*slots.a.values(), *slots.b.values())) / (1 << 20)
    log.info(
        "LoRA: %d adapter slots of rank up to %d, %.1f MiB (%d adapters kept in host memory)",
        config.max_loras,
        config.max_lora_rank,
        mib,
        store.max_cpu_loras,
    )
    return store, slots


def _set_up_graphs(
    runner: ModelRunner, config: EngineConfig, device: torch.device, backend: AttentionBackend
) -> None:
    if device.type != "cuda":
        return  # graphs are CUDA's; the flag's help says it does nothing elsewhere
    if config.enforce_eager:
        log.info("CUDA graphs off (--enforce-eager): every step runs eagerly")
        return
    if config.enable_lora:
        # A step's adapter rows change from step to step, and their gathers are not captured.
        log.info("CUDA graphs off with LoRA adapters (their per-row matmuls are not captured yet; issue 34)")
        return
    if config.world_size > 1:
        # Every rank would have to capture, in step, with its collectives inside: not built yet.
        log.info("CUDA graphs off under tensor parallel (not captured with the collectives yet; issue 33)")
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
    runner.use_decode_graphs(sizes, capture=True)
    log.info("CUDA graph capture took %.1fs", time.perf_counter() - t0)


def make_runner(
    loaded: LoadedModel,
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
        loaded.model,
        loaded.config,
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
    config: EngineConfig,
    target: LoadedModel,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
) -> LoadedModel | None:
    spec = config.spec
    if spec.method != "draft":
        return None
    if not spec.draft_model:
        raise ValueError("speculative_method='draft' needs speculative_model (a preset or a HF directory)")
    draft = load_model(spec.draft_model, dtype=dtype, device=device, backend=backend)
    target_vocab = target.config.vocab_size
    if draft.config.vocab_size != target_vocab:
        raise ValueError(
            f"the draft model {spec.draft_model!r} has vocab_size {draft.config.vocab_size}, "
            f"the target {target_vocab}: they must share a tokenizer"
        )
    return draft


def _make_proposer(
    config: EngineConfig,
    draft: LoadedModel | None,
    num_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> Proposer | None:
    spec = config.spec
    if spec.method is None:
        return None
    if spec.method == "ngram":
        return NgramProposer()
    assert draft is not None  # _load_draft loaded it for the method "draft"
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model supports {draft.config.max_position_embeddings} positions, "
            f"fewer than max_model_len {max_model_len}"
        )
    return DraftModelProposer(
        draft.model, num_blocks=num_blocks, block_size=config.cache.block_size, dtype=dtype, device=device
    )
