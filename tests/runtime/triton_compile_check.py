"""Compile the Triton backend's kernels for NVIDIA GPUs on a machine without one (a script, not collected).

The interpreter runs kernels as numpy and accepts code that the GPU compiler rejects (a non-constexpr
global, a type that changes across a loop, a shape tl.dot cannot tile), and it binds launch arguments its
own way. So this drives the real backend (TritonAttentionBackend.write_kv / attend, on CPU tensors) through
Triton's real JIT launcher against a stand-in driver that reports an sm_90 or sm_80 GPU, and turns each
launch into a warmup: argument binding, specialisation and the full compile down to a cubin (with the ptxas
that ships in the triton wheel) all run; only the launch itself does not. Prints one line per compiled
kernel; exits non-zero on the first failure.

Must run without TRITON_INTERPRET (triton.jit picks interpreted kernels at import time):

    PYTHONPATH=runtime TRITON_INTERPRET=0 python tests/runtime/triton_compile_check.py
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from chunkwise.attention import triton_kernels as K
from chunkwise.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig


class StandInDriver:
    """The few driver calls the JIT launcher makes before it would launch."""

    arch = 90

    def get_current_device(self) -> int:
        # One device id per architecture, so each gets its own kernel cache.
        return self.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class CompileOnly:
    """Stands in for a kernel: kernel[grid](...) compiles (Triton's warmup) and records, never launches."""

    def __init__(self, fn: Any, log: list[str]) -> None:
        self.fn = fn
        self.log = log

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            compiled = self.fn.warmup(*args, grid=grid, **kwargs)
            ptx = compiled.asm["ptx"]
            assert compiled.asm["cubin"], "no cubin"
            mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "no mma"
            mode = ""
            if "LONG" in kwargs:
                mode = " long" if kwargs["LONG"] else " short+split" if kwargs["SPLIT"] else " short"
            self.log.append(
                f"{self.fn.__name__}{mode} sm_{StandInDriver.arch}: ok ({mma}, {compiled.metadata.shared} B shared)"
            )

        return launch


def batch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, Any]:
    """A mixed step (prefill chunks and decode rows) over a small paged cache, on CPU."""
    from chunkwise.attention.backend import AttentionMetadata, kv_cache_shape

    block_size = 16
    requests = [(0, 40), (31, 1), (100, 1), (7, 3)]
    tables, slots = [], []
    next_block = 1
    for computed, new in requests:
        nb = -(-(computed + new) // block_size)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
        slots += [
            tables[-1][p // block_size] * block_size + p % block_size for p in range(computed, computed + new)
        ]
    width = max(len(t) for t in tables)
    query_lens = [n for _, n in requests]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor([c + n for c, n in requests]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        query_lens_host=query_lens,
        seq_lens_host=[c + n for c, n in requests],
        max_query_len=max(query_lens),
        max_seq_len=max(c + n for c, n in requests),
        block_size=block_size,
    )
    t = qsl[-1]
    return {
        "cache": torch.zeros(kv_cache_shape(next_block, block_size, num_kv_heads, head_dim), dtype=dtype),
        "query": torch.zeros(t, num_heads, head_dim, dtype=dtype),
        "key": torch.zeros(t, num_kv_heads, head_dim, dtype=dtype),
        "meta": meta,
    }


def main() -> int:
    if K.is_interpreted():
        print("unset TRITON_INTERPRET to compile for a GPU", file=sys.stderr)
        return 2
    stand_in = StandInDriver()
    driver.set_active(stand_in)
    log: list[str] = []
    for name in ("paged_attention_kernel", "merge_splits_kernel", "write_kv_kernel"):
        setattr(K, name, CompileOnly(getattr(K, name), log))

    jobs = [
        # A Llama-3-8B-like layer on Hopper: decode rows split across programs, and a prefill chunk.
        (90, (32, 8, 128), torch.bfloat16, TritonAttentionConfig(num_splits=2)),
        # Bigger prefill tiles (the benchmark's sweep tries them).
        (90, (32, 8, 128), torch.bfloat16, TritonAttentionConfig(long_block_m=128, long_num_warps=8)),
        # Ampere, fp16, MHA with head_dim 64. (fp32 caches compile too, slowly: without tensor cores the
        # dots unroll into FMAs; the interpreter tests cover their logic.)
        (80, (8, 8, 64), torch.float16, TritonAttentionConfig()),
        # A padded query group of 3 with head_dim 80.
        (90, (6, 2, 80), torch.bfloat16, TritonAttentionConfig()),
    ]
    for arch, (num_heads, num_kv_heads, head_dim), dtype, config in jobs:
        StandInDriver.arch = arch
        backend = TritonAttentionBackend(config)
        # The CPU tensors stand for GPU memory here; nothing reads them.
        backend._check_device = lambda tensor: None  # type: ignore[method-assign]
        b = batch(num_heads, num_kv_heads, head_dim, dtype)
        backend.write_kv(b["key"], b["key"], b["cache"], b["meta"].slot_mapping)
        plan = backend.plan(b["meta"], num_heads, num_kv_heads, head_dim)
        backend.attend(b["query"], b["cache"], plan, head_dim**-0.5)
    print("\n".join(log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
