"""Engine configuration: frozen dataclasses, validated on construction. Every default lives here.

Each engine option is declared once, as a field made by `option()`: its default, its help line, and the name
it goes by as a keyword of `LLM(model, **engine_args)` and as a flag (`--name-with-dashes`). The kwarg routing
below and the CLI (engine_args.py) are walked from these fields; nothing else lists the options.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_args, get_type_hints

Batching = Literal["continuous", "static"]
PreemptionMode = Literal["auto", "swap", "recompute"]
SpecMethod = Literal["ngram", "draft"]
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Estimator = Literal["quantile", "mean"]
AttentionBackend = Literal["auto", "torch", "cpu", "triton"]
DistributedBackend = Literal["auto", "nccl", "gloo"]
LoRAKernel = Literal["torch", "triton"]
Quantization = Literal["int8", "fp8"]
SchedulingPolicy = Literal["fcfs", "priority"]
Fairness = Literal["none", "vtc"]

# The step token budget B = decode rows + prefill chunk. docs/scheduling.md puts the usual knee at 512-2048; on the
# CPU presets 1024 keeps a step under ~100 ms with `small` while amortising per-step overhead.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_BLOCK_SIZE = 16


def option(
    default: Any = MISSING,
    *,
    help: str,
    arg: str | None = None,
    unset: str | None = None,
    flag: bool = True,
) -> Any:
    """A config field that is an engine option. `help`: its --help line, without the default (derived).
    `arg`: its kwarg and flag name where that is not the field's (vLLM's names for the speculative ones).
    `unset`: what a None default means, for --help. `flag=False`: no shared engine flag, because a command
    declares its own of the same name, with that command's default (engine_args.py reads it from there)."""
    return field(default=default, metadata={"help": help, "arg": arg, "unset": unset, "flag": flag})


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def _one_of(name: str, value: object, choices: Sequence[object], show: Any = repr) -> None:
    if value not in choices:
        *rest, last = [show(c) for c in choices]
        raise ValueError(f"{name} must be {', '.join(rest)} or {last}, got {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling, with the fields of transformers' rope_parameters that its type reads (see
    model/rope.py; the loader checks each type has what it needs)."""

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn, longrope: the factor cos/sin are scaled by (None: derived from factor, as transformers does)
    attention_factor: float | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family model (Llama, Mistral, Qwen2 and Qwen3 share this shape)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Qwen3: RMSNorm over each head's query and key before the rotation.
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            _positive(name, getattr(self, name))
        _positive("num_attention_heads", self.num_attention_heads)
        _positive("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. Capacity is given in blocks or in bytes; with neither, a default byte budget."""

    block_size: int = option(DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    num_blocks: int | None = option(
        None, help="KV cache capacity in blocks", unset="from --kv-cache-memory-bytes"
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        help="KV cache capacity in bytes",
        unset="1 GiB on CPU; on CUDA what --gpu-memory-utilization leaves after the weights and a profiled "
        "step",
    )
    # vLLM's name, default and meaning (a fraction of the device's total, not of what is free), so that a
    # deployment moved from vLLM keeps its setting. Sized in engine/loop/calibration.py.
    gpu_memory_utilization: float = option(
        0.9,
        help="on CUDA, the fraction of the device's total memory this engine may use: weights, the activation "
        "peak of the largest step (profiled at start-up), memory outside torch, and the KV cache in what is "
        "left; --num-blocks or --kv-cache-memory-bytes override it",
    )
    enable_prefix_caching: bool = option(True, help="reuse the KV blocks of a prompt prefix already computed")
    swap_space_bytes: int = option(1 << 30, help="host memory for KV blocks swapped out by preemption")
    # vLLM's name and unit (GiB), so that a deployment moved from vLLM keeps its setting.
    kv_offloading_size: float = option(
        0.0,
        help="GiB of host memory for a second tier of the prefix cache: blocks evicted from the device cache "
        "are copied there (an LRU) and copied back on a later hit instead of prefilled again; 0 turns it off",
    )
    kv_events_buffer: int = option(
        4096,
        help="steps of prefix-cache changes kept for readers of /v1/kv_events (the router's exact prefix "
        "index); 0 publishes none",
    )

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_blocks", self.num_blocks)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                "gpu_memory_utilization (--gpu-memory-utilization) is a fraction of the device's memory, in "
                f"(0, 1]; got {self.gpu_memory_utilization!r}"
            )
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give the KV cache capacity as num_blocks or kv_cache_memory_bytes, not both")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.kv_events_buffer < 0:
            raise ValueError(f"kv_events_buffer must be >= 0, got {self.kv_events_buffer}")
        if not self.kv_offloading_size >= 0:
            raise ValueError(
                f"kv_offloading_size (--kv-offloading-size) is GiB of host memory, >= 0; got "
                f"{self.kv_offloading_size!r}"
            )
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size (--kv-offloading-size) is a tier of the prefix cache: it needs "
                "enable_prefix_caching"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(256, help="most requests running at once")
    max_num_batched_tokens: int = option(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, help="the step token budget: decode rows + prefill chunk"
    )
    # None is resolved when the engine loads the model.
    max_model_len: int | None = option(
        None,
        help="longest prompt + output of one request",
        unset="the model's max positions, or what the KV cache holds if that is less",
    )
    enable_chunked_prefill: bool = option(
        True, help="split long prompts into chunks that share steps with decode rows"
    )
    batching: Batching = option(
        "continuous",
        help="static: the baseline continuous batching is measured against, a batch runs until its last request ends",
    )
    preemption_mode: PreemptionMode = option(
        "auto", help="how a running request gives up its KV blocks; auto: whichever costs less"
    )
    output_length_quantile: float = option(
        0.9,
        help="admission reserves this quantile of observed output lengths when max_tokens is not given",
    )
    output_length_estimator: Estimator = option(
        "quantile", help="how admission estimates output lengths; mean is here to show why it is wrong"
    )
    cold_start_output_tokens: int = option(
        256, help="output tokens admission assumes until enough requests have finished to estimate them"
    )
    # FIFO with a cap on concurrent long prompts.
    long_prompt_threshold: int = option(2048, help="prompts of at least this many tokens are 'long'")
    max_long_prefills: int = option(1, help="long prompts prefilling at once")
    # A number also bounds the step time decode rows see; None is what keeps short requests' time to first
    # token bounded while long prompts prefill.
    max_long_prefill_chunk: int | None = option(
        None,
        help="a long prompt's chunk per step, a hard cap in every step",
        unset="half the step budget while another prompt could use the rest, all of it alone",
    )
    # Prefix-aware admission: the bypass bound is what keeps reuse from starving anyone.
    prefix_lookahead: int = option(
        16, help="when the queue's head does not fit, how far behind it to look for a cached prompt"
    )
    prefix_reuse_min_fraction: float = option(
        0.5, help="the cached fraction of its prompt that lets a request go before the head"
    )
    max_prefix_bypass: int = option(4, help="most times one head is passed over for prefix reuse")
    # Enforced by the server's load shedding (sched/shedding.py), whose --max-waiting bounds it by default;
    # the offline LLM API queues everything it is given.
    max_waiting: int | None = option(None, help="bound of the waiting queue", unset="unbounded", flag=False)
    # vLLM's names: a request's `priority` (lower first) orders the queue, the victim choice and shedding.
    scheduling_policy: SchedulingPolicy = option(
        "fcfs",
        help="fcfs: arrival order; priority: by each request's priority field (lower first), then arrival, "
        "preempting lower-priority running requests for a higher one and shedding the lowest first",
    )
    fairness: Fairness = option(
        "none",
        help="vtc: within a priority, admit the waiting tenant with the least service counted (Virtual Token "
        "Counter: prefill and decode tokens), so one tenant's burst cannot starve another's stream",
    )

    def resolved_max_model_len(self) -> int:
        """max_model_len once the engine has resolved it (from the model's context and the cache's size);
        a scheduler, real or simulated, cannot be built before."""
        if self.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be resolved before building a Scheduler")
        return self.max_model_len

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("max_long_prefills", self.max_long_prefills)
        _positive("long_prompt_threshold", self.long_prompt_threshold)
        _positive("max_waiting", self.max_waiting)
        _positive("max_long_prefill_chunk", self.max_long_prefill_chunk)
        _one_of("batching", self.batching, get_args(Batching))
        _one_of("preemption_mode", self.preemption_mode, get_args(PreemptionMode))
        _one_of("output_length_estimator", self.output_length_estimator, get_args(Estimator))
        _one_of("scheduling_policy", self.scheduling_policy, get_args(SchedulingPolicy))
        _one_of("fairness", self.fairness, get_args(Fairness))
        if not 0.0 <= self.prefix_reuse_min_fraction <= 1.0:
            raise ValueError(
                f"prefix_reuse_min_fraction must be in [0, 1], got {self.prefix_reuse_min_fraction}"
            )
        if self.prefix_lookahead < 0 or self.max_prefix_bypass < 0:
            raise ValueError("prefix_lookahead and max_prefix_bypass must be >= 0")
        if not 0.0 < self.output_length_quantile <= 1.0:
            raise ValueError(f"output_length_quantile must be in (0, 1], got {self.output_length_quantile}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            # Without chunking a whole prompt must fit in one step.
            raise ValueError(
                "with enable_chunked_prefill=False, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class SpecConfig:
    method: SpecMethod | None = option(
        None, help="speculative decoding", arg="speculative_method", unset="off"
    )
    num_speculative_tokens: int = option(4, help="most draft tokens per step")
    # False is the fixed-depth baseline.
    adaptive: bool = option(
        True,
        help="adapt the draft length to load; off: always draft --num-speculative-tokens (capped by the budget)",
        arg="adaptive_speculation",
    )
    draft_model: str | None = option(
        None,
        help="draft model for --speculative-method draft: a built-in preset or a local Hugging Face directory",
        arg="speculative_model",
        unset="none",
    )

    def __post_init__(self) -> None:
        _one_of("speculative_method", self.method, (None, *get_args(SpecMethod)))
        _positive("num_speculative_tokens", self.num_speculative_tokens)


@dataclass(frozen=True)
class EngineConfig:
    model: str = option(
        "tiny",
        help="built-in model (tiny, small: random weights; pylm: trained) or a local Hugging Face directory",
    )
    # "auto" is resolved by chunkwise.engine.hardware.resolve_dtype.
    dtype: Dtype = option(
        "auto",
        help="auto: bfloat16 where the hardware has bf16 matmuls (CUDA, CPUs with bf16 matrix units), else "
        "float32",
    )
    device: str = option("cpu", help="cpu or cuda[:N]")
    seed: int = option(0, help="global seed")
    attention_backend: AttentionBackend = option(
        "auto",
        help="auto: Triton on CUDA, chunkwise's C++ kernels on CPU (the torch reference where they cannot be "
        "built)",
    )
    # vLLM's flag and default. The first H200 run (docs/benchmarks.md) showed graphs give the torch
    # reference's float32 log-probs within 1.2e-4 nats, and decode 2-4.5x faster than eager.
    enforce_eager: bool = option(
        False,
        help="run every step eagerly: no CUDA graphs (on a GPU, decode steps otherwise replay graphs captured "
        "at start-up; no effect on CPU)",
    )
    # oneDNN builds a kernel per row count of a packed layer (model/layers.py: about 4 ms each on an AMX
    # Xeon, a second or two for a small model's every count). The server builds them while it loads
    # (its own --warm-up-kernels, on); elsewhere the first step that needs each pays for it.
    warm_up_kernels: bool = option(
        False,
        help="on CPU, build oneDNN's kernel for every row count a step can run its layers at during start-up, "
        "rather than in the first step that needs each",
        flag=False,
    )
    # vLLM's flag. One process per rank, rank 0 the caller's (loop/tp_ranks.py).
    tensor_parallel_size: int = option(
        1,
        help="ranks the model is sharded over (tensor parallel): one process each; on CUDA one GPU each, "
        "--device's and the next ones",
    )
    # NCCL refuses two ranks on one GPU; gloo takes CUDA tensors (through host copies), which is how several
    # ranks are tested on a one-GPU machine (bench/gpu/tp_check.py).
    distributed_backend: DistributedBackend = option(
        "auto",
        help="the collectives between ranks: auto is NCCL on CUDA and gloo on CPU; gloo on CUDA puts every "
        "rank on --device's one GPU (slow: for checking several ranks without several GPUs)",
    )
    # vLLM's flag. Stages of consecutive layers, each tensor_parallel_size ranks, every rank a process of this
    # machine (loop/tp_ranks.py), or one pod per stage in a LeaderWorkerSet (loop/stage_worker.py).
    pipeline_parallel_size: int = option(
        1,
        help="stages the model's layers are split over (pipeline parallel), each of tensor_parallel_size ranks",
    )
    # torch's default MASTER_PORT. Only a LeaderWorkerSet group (one pod per stage) uses it: one machine's
    # ranks meet on a free loopback port rank 0 picks.
    distributed_port: int = option(
        29500,
        help="the port the leader pod's rank 0 listens on for the other pods' ranks (pipeline parallel in a "
        "LeaderWorkerSet, one pod per stage; LWS_LEADER_ADDRESS the address): the process group's "
        "rendezvous there, each step's message on the next port",
    )
    # vLLM's LoRA flags and defaults (lora/: adapters in PEFT's format, batched per step by slot).
    enable_lora: bool = option(
        False, help="serve LoRA adapters of the base model (requests name one, or run the base model)"
    )
    max_loras: int = option(
        1, help="adapters resident on the device at once: most distinct adapters in a step"
    )
    max_lora_rank: int = option(16, help="the largest adapter rank (r) accepted; slots are sized for it")
    max_cpu_loras: int | None = option(
        None, help="adapters kept read in host memory (least recently used dropped)", unset="--max-loras"
    )
    # torch's masked form ran on an H200 (docs/benchmarks.md); the Triton kernels have run only in the
    # interpreter so far, so they are asked for, not chosen.
    lora_kernel: LoRAKernel = option(
        "torch",
        help="the LoRA update: torch (every slot's rank columns, masked per row; CPU and GPU) or triton (each "
        "row's own adapter, on CUDA; tested in Triton's interpreter, not yet run on a GPU)",
    )
    # vLLM's flag, for a full-precision checkpoint; a quantized checkpoint (config.json quantization_config:
    # fp8, compressed-tensors, awq, gptq) loads quantized without it (engine/quant/).
    quantization: Quantization | None = option(
        None,
        help="quantize the linear weights at load: int8 (a scale per output channel, weight-only; CPU and "
        "GPU) or fp8 (e4m3 with per-token activation scales; CUDA)",
        unset="as the checkpoint stores them",
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, get_args(Dtype), show=str)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _one_of("distributed_backend", self.distributed_backend, get_args(DistributedBackend))
        if self.distributed_backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(f"distributed_backend 'nccl' needs a CUDA device, not {self.device!r}")
        if not 0 < self.distributed_port < 65535:
            raise ValueError(
                f"distributed_port must be a port below 65535 (two are used), got {self.distributed_port}"
            )
        if self.quantization is not None:
            _one_of("quantization", self.quantization, get_args(Quantization))
            if self.quantization == "fp8" and not self.device.startswith("cuda"):
                raise ValueError(
                    "quantization 'fp8' runs on CUDA (fp8 tensor cores); on a CPU use 'int8', which reads as "
                    "many bytes a weight"
                )
            if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
                raise ValueError("quantization is not supported with tensor or pipeline parallelism yet")
        _positive("max_loras", self.max_loras)
        _one_of("lora_kernel", self.lora_kernel, get_args(LoRAKernel))
        if self.lora_kernel == "triton" and not self.device.startswith("cuda"):
            raise ValueError(f"lora_kernel 'triton' needs a CUDA device, not {self.device!r}")
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        if self.enable_lora and self.world_size > 1:
            raise ValueError(
                "enable_lora with tensor or pipeline parallel is not supported yet (issue 34): one rank only"
            )
        if self.pipeline_parallel_size > 1:
            if not self.device.startswith("cpu"):
                raise ValueError(
                    f"pipeline_parallel_size {self.pipeline_parallel_size} runs on CPU only: on {self.device} "
                    "the stages' sends are untested (issue 33); tensor_parallel_size runs there"
                )
            if self.spec.method == "draft":
                # Under tensor parallel alone the draft runs whole on rank 0 (tested); not across stages yet.
                raise ValueError(
                    "pipeline_parallel_size > 1 with speculative_method='draft' is not supported yet "
                    "(issue 33): use speculative_method='ngram' or one stage"
                )

    @property
    def world_size(self) -> int:
        """The engine's ranks: tensor_parallel_size ranks in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineArg:
    """One engine option as option() declared it: the kwarg `name` and where its field lives (`section`, an
    EngineConfig attribute; None for EngineConfig's own fields)."""

    name: str
    section: str | None
    field_name: str
    type: Any
    default: Any
    help: str
    unset: str | None
    has_engine_flag: bool

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.cache
def _sections() -> dict[str, type]:
    hints = get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in fields(EngineConfig) if is_dataclass(hints[f.name])}


@functools.cache
def engine_args() -> dict[str, EngineArg]:
    """Every engine option, in declaration order: EngineConfig's own fields, then each section's."""
    sections = _sections()
    owners: list[tuple[str | None, type]] = [(None, EngineConfig), *sections.items()]
    found: dict[str, EngineArg] = {}
    for section, cls in owners:
        hints = get_type_hints(cls)
        for f in fields(cls):
            if f.name in sections and cls is EngineConfig:
                continue
            if "help" not in f.metadata:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with option()")
            m = f.metadata
            name = m["arg"] or f.name
            if name in found:
                raise TypeError(f"engine option {name!r} is declared twice")
            found[name] = EngineArg(
                name, section, f.name, hints[f.name], f.default, m["help"], m["unset"], m["flag"]
            )
    return found


def engine_config_from_kwargs(model: str, **kwargs: object) -> EngineConfig:
    """Map vLLM-named engine args (LLM(model, **engine_args), the CLI flags) onto the config tree. None
    means not given: the field's default."""
    known = {name: a for name, a in engine_args().items() if name != "model"}
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        near = [c[0] for u in unknown if (c := difflib.get_close_matches(u, known, 1))]
        hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
        raise ValueError(f"unknown engine argument(s) {unknown}{hint}; known: {sorted(known)}")
    given = {k: v for k, v in kwargs.items() if v is not None}
    if given.get("enable_chunked_prefill") is False and "max_num_batched_tokens" not in given:
        # Unchunked, a whole prompt must fit in one step: the budget becomes max_model_len.
        mml = given.get("max_model_len")
        given["max_num_batched_tokens"] = max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, mml if isinstance(mml, int) else 0
        )
    parts: dict[str | None, dict[str, Any]] = {}
    for name, value in given.items():
        a = known[name]
        parts.setdefault(a.section, {})[a.field_name] = value
    # Sections are built in EngineConfig's field order, so the first invalid value reported is the same
    # whichever order the kwargs came in.
    sections = {s: cls(**parts.get(s, {})) for s, cls in _sections().items()}
    return EngineConfig(model=model, **parts.get(None, {}), **sections)
