"""Engine configuration: frozen dataclasses, validated on construction. Every default lives here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Batching = Literal["continuous", "static"]
PreemptionMode = Literal["auto", "swap", "recompute"]
SpecMethod = Literal["ngram", "draft"]

# The step token budget B = decode rows + prefill chunk. The seed puts the knee at 512-2048; on the
# CPU presets 1024 keeps a step under ~100 ms with `small` while amortising per-step overhead.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_BLOCK_SIZE = 16


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


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

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # Host memory for swapped-out KV blocks (preemption by swap).
    swap_space_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_blocks", self.num_blocks)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give the KV cache capacity as num_blocks or kv_cache_memory_bytes, not both")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # None: the model's max_position_embeddings (resolved when the engine loads the model).
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    batching: Batching = "continuous"
    preemption_mode: PreemptionMode = "auto"
    # Admission reserves prompt blocks plus blocks for this quantile of observed output lengths.
    output_length_quantile: float = 0.9
    # "quantile" (default) or "mean": the mean is here to show why it is the wrong choice (benchmarks).
    output_length_estimator: Literal["quantile", "mean"] = "quantile"
    # Until enough requests have finished to estimate a quantile, admission assumes this many output tokens.
    cold_start_output_tokens: int = 256
    # FIFO with a cap on concurrent long prompts: a prompt of at least this many tokens is "long", and at
    # most `max_long_prefills` long prompts may be prefilling at once.
    long_prompt_threshold: int = 2048
    max_long_prefills: int = 1
    # A long prompt's chunk per step. None: half the step budget while another prompt could use the rest
    # (what keeps short requests' time to first token bounded while long prompts prefill), the whole
    # budget when it prefills alone beside decode rows. A number: a hard cap in every step, which also
    # bounds the step time decode rows see.
    max_long_prefill_chunk: int | None = None
    # Prefix-aware admission: when the head of the queue does not fit, a request behind it (within
    # `prefix_lookahead`) whose prompt is at least `prefix_reuse_min_fraction` cached may go first; one
    # head is passed over at most `max_prefix_bypass` times, so reuse never starves anyone.
    prefix_lookahead: int = 16
    prefix_reuse_min_fraction: float = 0.5
    max_prefix_bypass: int = 4
    # Bound on the waiting queue, enforced by the server's load shedding (sched/shedding.py); None means
    # unbounded (the offline LLM API queues everything it is given).
    max_waiting: int | None = None

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("max_long_prefills", self.max_long_prefills)
        _positive("long_prompt_threshold", self.long_prompt_threshold)
        _positive("max_waiting", self.max_waiting)
        _positive("max_long_prefill_chunk", self.max_long_prefill_chunk)
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be 'auto', 'swap' or 'recompute', got {self.preemption_mode!r}"
            )
        if self.output_length_estimator not in ("quantile", "mean"):
            raise ValueError(
                f"output_length_estimator must be 'quantile' or 'mean', got {self.output_length_estimator!r}"
            )
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
    method: SpecMethod | None = None
    num_speculative_tokens: int = 4
    # False: always draft num_speculative_tokens (capped by the budget); the fixed-depth baseline.
    adaptive: bool = True
    # The draft model for method "draft": a built-in preset or a local Hugging Face directory.
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be None, 'ngram' or 'draft', got {self.method!r}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    # "auto": see chunkwise.platform.resolve_dtype (bf16 where the hardware has bf16 matmuls, else fp32).
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    # vLLM's flag. True (the default until a GPU run here has shown graphs give identical tokens; see
    # docs/benchmarks.md): every step eager. False on CUDA: decode steps replayed from captured graphs.
    enforce_eager: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")


_SCHEDULER_ARGS = {
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_chunked_prefill",
    "batching",
    "preemption_mode",
    "output_length_quantile",
    "cold_start_output_tokens",
    "output_length_estimator",
    "prefix_lookahead",
    "prefix_reuse_min_fraction",
    "max_prefix_bypass",
    "long_prompt_threshold",
    "max_long_prefills",
    "max_long_prefill_chunk",
    "max_waiting",
}
_CACHE_ARGS = {
    "block_size",
    "num_blocks",
    "kv_cache_memory_bytes",
    "enable_prefix_caching",
    "swap_space_bytes",
}
_ENGINE_ARGS = {"dtype", "device", "seed", "attention_backend", "enforce_eager"}
_SPEC_ARGS = {
    "speculative_method": "method",
    "num_speculative_tokens": "num_speculative_tokens",
    "adaptive_speculation": "adaptive",
    "speculative_model": "draft_model",
}


def engine_config_from_kwargs(model: str, **kwargs: object) -> EngineConfig:
    """Map vLLM-named engine args (LLM(model, **engine_args), the CLI flags) onto the config tree."""
    known = _SCHEDULER_ARGS | _CACHE_ARGS | _ENGINE_ARGS | set(_SPEC_ARGS)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
    given = {k: v for k, v in kwargs.items() if v is not None}
    sched = {k: v for k, v in given.items() if k in _SCHEDULER_ARGS}
    if given.get("enable_chunked_prefill") is False and "max_num_batched_tokens" not in given:
        # Unchunked, a whole prompt must fit in one step: the budget becomes max_model_len.
        mml = given.get("max_model_len")
        sched["max_num_batched_tokens"] = max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, mml if isinstance(mml, int) else 0
        )
    return EngineConfig(
        model=model,
        cache=CacheConfig(**{k: v for k, v in given.items() if k in _CACHE_ARGS}),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(**sched),  # type: ignore[arg-type]
        spec=SpecConfig(**{_SPEC_ARGS[k]: v for k, v in given.items() if k in _SPEC_ARGS}),  # type: ignore[arg-type]
        **{k: v for k, v in given.items() if k in _ENGINE_ARGS},  # type: ignore[arg-type]
    )
