"""The engine, as layers: each sub-package imports only the ones below it (tests/test_import_graph.py
checks it, TYPE_CHECKING imports included). Top to bottom:

args.py      EngineArgs: the engine's command-line flags over the config dataclasses
loop/        EngineCore (the step loop), its builder, the output processor, AsyncEngine, LLM, metrics
worker/      the model runner's stages: inputs, forward, sampling, verification, prompt scores; KV tensors;
             draft proposers (n-gram, draft model) and rejection sampling
sched/       the Scheduler and its collaborators (admission, composition, forks, applying a step) and
             policies: queue, reservation, preemption, shedding, batching, draft length
cache/       paged KV blocks: the pool, prefix hashing, per-request block tables, swap, KV events
sampling/    the batched sampler and structured outputs' token masks
model/       Llama-family models, presets, the checkpoint loader, the bundled checkpoints
lora/        LoRA adapters: PEFT adapters read and checked, the device's slots, the per-row update
attention/   one backend interface over paged KV: torch reference, CPU kernels, Triton
distributed/ tensor parallelism's group of ranks (all_reduce, all_gather; none at world size 1; on CPU a
             shared-memory all-reduce) and what each rank holds of a model (heads, KV heads, MLP columns, vocabulary)
kernels/     the C++ CPU kernels, built once per machine
tokenizer/   byte-level and Hugging Face tokenizers, incremental detokenization
datatypes/   what crosses layers: Request, SamplingParams, outputs, config dataclasses
hardware.py  the CPU's kernel and dtype level (CHUNKWISE_CPU_ISA), below everything that chooses by it

Importing this package is cheap (no torch): the names below load from loop/ on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkwise.engine.loop import (
        LLM,
        AsyncEngine,
        EngineCore,
        ModelInfo,
        OutputProcessor,
        ProcessedOutputs,
        RequestStream,
        StepStats,
        StepUpdate,
    )

__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineCore",
    "ModelInfo",
    "OutputProcessor",
    "ProcessedOutputs",
    "RequestStream",
    "StepStats",
    "StepUpdate",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'chunkwise.engine' has no attribute {name!r}")
    return getattr(importlib.import_module("chunkwise.engine.loop"), name)
