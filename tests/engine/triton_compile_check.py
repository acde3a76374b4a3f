"""Compile the Triton backend's kernels for NVIDIA GPUs on a machine without one (a script, not collected).

The interpreter runs kernels as numpy and accepts code that the GPU compiler rejects (a non-constexpr
global, a type that changes across a loop, a shape tl.dot cannot tile), and it binds launch arguments its
own way. So this drives the real backend (TritonAttentionBackend.write_kv / attend, on CPU tensors) through
Triton's real JIT launcher against a stand-in driver that reports an sm_90 or sm_80 GPU, and turns each
launch into a warmup: argument binding, specialisation and the full compile down to a cubin (with the ptxas
that ships in the triton wheel) all run; only the launch itself does not. Prints one line per compiled
kernel; exits non-zero on the first failure.

With --variants [steps] it compiles nothing and instead counts the variants a serving engine would compile
(see serve()), printed as JSON.

Must run without TRITON_INTERPRET (triton.jit picks interpreted kernels at import time):

    PYTHONPATH=runtime TRITON_INTERPRET=0 python tests/engine/triton_compile_check.py [--variants [steps]]
    PYTHONPATH=runtime TRITON_INTERPRET=0 python tests/engine/triton_compile_check.py --model-ops

--model-ops compiles the model's own kernels (RMSNorm, rotary: chunkwise/engine/model/triton_ops.py) instead.
"""

from __future__ import annotations

import json
import random
import re
import sys
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from chunkwise.engine.attention import triton_kernels as K
from chunkwise.engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig


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
    """Stands in for a kernel: kernel[grid](...) and kernel.warmup(...) both compile (Triton's warmup) and
    never launch. Each new variant is logged once, saying whether the backend's warmup or a launch compiled
    it, with what its sm_90/sm_80 code shows of the K/V pipelining."""

    def __init__(self, fn: Any, log: list[str]) -> None:
        self.fn = fn
        self.log = log

    def warmup(self, *args: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
        self._compile(args, grid, kwargs, "warmup")

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self._compile(args, grid, kwargs, "launch")

        return launch

    def _compile(
        self, args: tuple[Any, ...], grid: tuple[int, ...], kwargs: dict[str, Any], where: str
    ) -> None:
        cache = self.fn.device_caches[StandInDriver.arch][0]
        before = len(cache)
        compiled = self.fn.warmup(*args, grid=grid, **kwargs)
        if len(cache) == before:
            return  # a variant compiled before: what a step costs when nothing is left to compile
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"], "no cubin"
        mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "no mma"
        mode = ""
        pipeline = ""
        if "LONG" in kwargs:
            mode = " long" if kwargs["LONG"] else " short+split" if kwargs["SPLIT"] else " short"
            ttgir = compiled.asm["ttgir"]
            # Multi-buffering: the K/V tiles' shared buffers (memdesc<N x rows x cols>) and how many copy
            # groups the loop lets stay in flight while it computes (async_wait's num; 0 waits for all).
            buffers = max(
                (int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+", ttgir)),
                default=0,
            )
            waits = [int(n) for n in re.findall(r"async_wait[^\n]*\{num = (\d+)", ttgir)]
            pipeline = f", {buffers} K/V buffers, async_wait num<={max(waits, default=0)}"
        self.log.append(
            f"{self.fn.__name__}{mode} sm_{StandInDriver.arch}: ok ({mma}, {compiled.metadata.shared} B shared"
            f"{pipeline}) [{where}]"
        )


def metadata(requests: list[tuple[int, int]], block_size: int, table_width: int | None = None) -> Any:
    """A step's metadata for requests given as (tokens cached, tokens in this step), on CPU. Block tables are
    [rows, table_width] views (the step's own width by default, as a GPU step copies them; a graph's static
    buffer is wider) of distinct blocks numbered from 1."""
    from chunkwise.engine.attention.backend import AttentionMetadata

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
    padded = torch.tensor([t + [0] * ((table_width or width) - len(t)) for t in tables])
    query_lens = [n for _, n in requests]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor([c + n for c, n in requests]),
        block_tables=padded[:, :width],
        slot_mapping=torch.tensor(slots),
        query_lens_host=query_lens,
        seq_lens_host=[c + n for c, n in requests],
        max_query_len=max(query_lens),
        max_seq_len=max(c + n for c, n in requests),
        block_size=block_size,
    )


def batch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, Any]:
    """A mixed step (prefill chunks and decode rows) over a small paged cache, on CPU."""
    from chunkwise.engine.attention.backend import kv_cache_shape

    meta = metadata([(0, 40), (31, 1), (100, 1), (7, 3)], block_size=16)
    t = meta.num_tokens
    num_blocks = int(meta.block_tables.max()) + 1
    return {
        "cache": torch.zeros(kv_cache_shape(num_blocks, 16, num_kv_heads, head_dim), dtype=dtype),
        "query": torch.zeros(t, num_heads, head_dim, dtype=dtype),
        "key": torch.zeros(t, num_kv_heads, head_dim, dtype=dtype),
        "meta": meta,
    }


def serve(steps: int) -> dict[str, dict[str, int]]:
    """The variants a serving engine would compile: its first forward (which warms the backend up), then
    `steps` steps whose batch sizes, block-table widths, contexts and KV splits vary as serving makes them,
    on a 132-SM sm_90 GPU. Compiling is skipped (jit_cache_hook): Triton's own variant keys are what count.
    Per kernel: variants seen in the first forward, in the steps after it, and new in those steps."""
    from triton import knobs

    from chunkwise.engine.attention import triton_backend
    from chunkwise.engine.attention.backend import kv_cache_shape

    phase = "first forward"
    keys: dict[str, dict[str, set[str]]] = {}

    def record(*, key: Any, fn: Any, **_: Any) -> bool:
        keys.setdefault(fn.name, {}).setdefault(phase, set()).add(str(key))
        return True  # skip the compile

    knobs.runtime.jit_cache_hook = record
    triton_backend._sm_count = lambda device: 132  # type: ignore[assignment]
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    backend = TritonAttentionBackend()
    backend._check_device = lambda tensor: None  # type: ignore[method-assign]
    cache = torch.zeros(kv_cache_shape(4, block_size, num_kv_heads, head_dim), dtype=torch.bfloat16)
    rng = random.Random(0)

    def step(requests: list[tuple[int, int]], table_width: int | None = None) -> None:
        meta = metadata(requests, block_size, table_width)
        t = meta.num_tokens
        # The model's layout: q and k are views of one rotated [T, heads + KV heads, D] tensor, v of the
        # fused projection.
        qk = torch.zeros(t, num_heads + num_kv_heads, head_dim, dtype=torch.bfloat16)
        v = torch.zeros(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16)
        v = v[:, (num_heads + num_kv_heads) * head_dim :].view(t, num_kv_heads, head_dim)
        # Slots into the small cache: nothing runs, only the arguments' types and values matter.
        meta.slot_mapping = meta.slot_mapping % (4 * block_size)
        backend.write_kv(qk[:, num_heads:], v, cache, meta.slot_mapping)
        plan = backend.plan(meta, num_heads, num_kv_heads, head_dim)
        backend.attend(qk[:, :num_heads], cache, plan, head_dim**-0.5)

    # The engine's start-up probe: a prefill.
    step([(0, 64)])
    phase = "serving"
    for i in range(steps):
        rows = []
        for _ in range(rng.choice([1, 1, 2, 3, 5, 8, 17, 32, 64])):
            kind = rng.random()
            q_len = 1 if kind < 0.7 else rng.randint(2, 4) if kind < 0.8 else rng.randint(5, 300)
            rows.append((rng.choice([0, 1, 15, 16, 31, rng.randint(0, 20000)]), q_len))
        # Every fourth step as a decode graph's static buffers hold it: a wide table, several rows.
        step(rows, -(-20304 // block_size) if i % 4 == 3 else None)
    return {
        name: {
            "first_forward": len(by_phase.get("first forward", set())),
            "serving": len(by_phase.get("serving", set())),
            "new_in_serving": len(by_phase.get("serving", set()) - by_phase.get("first forward", set())),
        }
        for name, by_phase in keys.items()
    }


def main() -> int:
    if K.is_interpreted():
        print("unset TRITON_INTERPRET to compile for a GPU", file=sys.stderr)
        return 2
    stand_in = StandInDriver()
    driver.set_active(stand_in)
    if sys.argv[1:2] == ["--variants"]:
        print(json.dumps(serve(int(sys.argv[2]) if len(sys.argv) > 2 else 200)), flush=True)
        return 0
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


def compile_model_ops() -> int:
    """The model's RMSNorm (plain, per head, with the residual add) and rotary kernels
    (chunkwise/engine/model/triton_ops.py) for sm_90, at a Llama-3-8B layer's shapes in bf16 (with the
    per-head q/k norm Qwen3 adds) and a small model's rotary. Run with --model-ops; one line per kernel."""
    from chunkwise.engine.model import triton_ops as M

    if M.rms_norm_kernel.__class__.__name__ == "InterpretedFunction":
        print("unset TRITON_INTERPRET to compile for a GPU", file=sys.stderr)
        return 2
    driver.set_active(StandInDriver())
    StandInDriver.arch = 90
    log: list[str] = []
    norm, rotary = M.rms_norm_kernel, M.rotary_kernel

    class Named:
        """Compiles for sm_90 in place of a launch and logs one line (not CompileOnly: that one logs each
        variant once, and speaks of attention's modes)."""

        def __init__(self, fn: Any, label: str) -> None:
            self.fn = fn
            self.label = label

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                compiled = self.fn.warmup(*args, grid=grid, **kwargs)
                assert compiled.asm["cubin"], "no cubin"
                log.append(
                    f"{self.label} {self.fn.__name__} sm_{StandInDriver.arch}: ok "
                    f"({compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared)"
                )

            return launch

    bf16 = torch.bfloat16
    hidden, heads, kv_heads, head_dim, t = 4096, 32, 8, 128, 3
    weight = torch.zeros(hidden, dtype=bf16)
    x = torch.zeros(t, hidden, dtype=bf16)
    qkv = torch.zeros(t, (heads + 2 * kv_heads) * head_dim, dtype=bf16)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    table = torch.zeros(64, 2, head_dim // 2)
    positions = torch.zeros(t, dtype=torch.int64)
    M.rms_norm_kernel = Named(norm, "rms_norm")
    M.rms_norm(x, weight, 1e-5)
    M.rms_norm_kernel = Named(norm, "add_rms_norm")
    M.add_rms_norm(x, torch.zeros_like(x), weight, 1e-5)
    M.rms_norm_kernel = Named(norm, "qk_rms_norm")
    M.rms_norm(qk[:, :heads], torch.zeros(head_dim, dtype=bf16), 1e-6)
    M.rotary_kernel = Named(rotary, "rotary")
    M.rotary(qk, table, positions)
    # A small model's 12 heads of 64: one head block, a narrower half.
    M.rotary(torch.zeros(t, 12, 64, dtype=bf16), torch.zeros(64, 2, 32), positions)
    M.rms_norm_kernel, M.rotary_kernel = norm, rotary
    print("\n".join(log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(compile_model_ops() if "--model-ops" in sys.argv else main())
