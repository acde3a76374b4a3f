"""Engine flags for every command that builds an engine: vLLM's names, with dashes."""

from __future__ import annotations

import argparse

from chunkwise.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
    engine_config_from_kwargs,
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", default="tiny", help="built-in preset (tiny, small) or a local Hugging Face directory"
    )
    g.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "float16", "bfloat16"],
        help="default: auto (bfloat16 on CUDA and on CPUs with bf16 matrix units, else float32)",
    )
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cpu)")
    g.add_argument("--seed", type=int, default=None, help="global seed (default 0)")
    g.add_argument(
        "--max-num-seqs", type=int, default=None, help="most requests running at once (default 256)"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"the step token budget: decode rows + prefill chunk (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's max positions")
    g.add_argument(
        "--block-size", type=int, default=None, help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})"
    )
    g.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache capacity in blocks (default: from the bytes below)",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache capacity in bytes (default 1 GiB on CPU)",
    )
    g.add_argument(
        "--swap-space-bytes", type=int, default=None, help="host memory for swapped KV (default 1 GiB)"
    )
    g.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None, help="default: on"
    )
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None, help="default: on"
    )
    g.add_argument("--batching", choices=["continuous", "static"], default=None, help="default: continuous")
    g.add_argument(
        "--preemption-mode", choices=["auto", "swap", "recompute"], default=None, help="default: auto"
    )
    g.add_argument(
        "--output-length-quantile",
        type=float,
        default=None,
        help="admission reserves this quantile of observed output lengths when max_tokens is not given (default 0.9)",
    )
    g.add_argument(
        "--long-prompt-threshold", type=int, default=None, help="prompts this long are 'long' (2048)"
    )
    g.add_argument("--max-long-prefills", type=int, default=None, help="long prompts prefilling at once (1)")
    g.add_argument(
        "--speculative-method",
        choices=["ngram", "draft"],
        default=None,
        help="speculative decoding (default: off)",
    )
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="most draft tokens per step (4)")
    g.add_argument(
        "--speculative-model",
        default=None,
        help="draft model for --speculative-method draft (preset or HF dir)",
    )
    g.add_argument(
        "--adaptive-speculation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="adapt the draft length to load (default: on; off drafts a fixed k)",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every step eagerly (default: on, until CUDA graphs are verified on a GPU); "
        "--no-enforce-eager replays decode steps from CUDA graphs on a GPU",
    )
    g.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "cpu", "triton"],
        default=None,
        help="auto (default): Triton on CUDA, chunkwise's C++ kernels on CPU (the torch reference where they "
        "cannot be built)",
    )


_FLAGS = (
    "dtype",
    "device",
    "seed",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "block_size",
    "num_blocks",
    "kv_cache_memory_bytes",
    "swap_space_bytes",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "batching",
    "preemption_mode",
    "output_length_quantile",
    "long_prompt_threshold",
    "max_long_prefills",
    "speculative_method",
    "num_speculative_tokens",
    "speculative_model",
    "adaptive_speculation",
    "attention_backend",
    "enforce_eager",
)


def engine_config_from_args(ns: argparse.Namespace, **overrides: object) -> EngineConfig:
    kwargs = {name: getattr(ns, name) for name in _FLAGS}
    kwargs.update(overrides)
    return engine_config_from_kwargs(ns.model, **kwargs)
