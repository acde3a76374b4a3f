"""What the machine can do, asked once: bf16 matrix units on the CPU, and which dtype `dtype="auto"` means.

Everything here is a question about the hardware, answered by torch, so that the loader, the linear layers and
the start-up log agree on one answer.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("chunkwise.platform")

# oneDNN makes one primitive per (weight shape, row count) and keeps ONEDNN_PRIMITIVE_CACHE_CAPACITY of them
# (1024 by default). A server meets hundreds of row counts (every decode batch size, every mixed prefill
# step) times five weight shapes, so at the default the cache thrashes and each miss costs about 1.3 ms a
# shape (bench/cpu/matmul_vs_vllm.py); a cached primitive is a few KiB.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 16384
_ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)


@functools.cache
def cpu_capabilities() -> dict[str, object]:
    caps = getattr(torch._C._cpu, "_get_cpu_capability", None)
    return dict(caps()) if caps is not None else {}


@functools.cache
def configure_onednn() -> str:
    """Size oneDNN's primitive cache for serving, unless the environment already says; oneDNN reads it when
    it makes its first primitive, so this runs before the first weight is laid out. Returns the capacity."""
    if _ONEDNN_CACHE_ENV in os.environ:
        logger.info(
            "oneDNN primitive cache: %s entries (from the environment)", os.environ[_ONEDNN_CACHE_ENV]
        )
    else:
        os.environ[_ONEDNN_CACHE_ENV] = str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    return os.environ[_ONEDNN_CACHE_ENV]


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """True when the CPU multiplies bf16 matrices in hardware (AVX512-BF16, AMX-BF16, Arm BF16).

    Without them torch's bf16 matmul runs in a scalar fallback: measured here (AVX2, no AVX-512) at 5 GFLOP/s
    against 30 for float32, which is why `auto` picks float32 on such a CPU."""
    caps = cpu_capabilities()
    return any(bool(caps.get(flag)) for flag in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))


def cpu_has_avx512() -> bool:
    """True when torch's CPU libraries (oneDNN, SDPA) run 512-bit vectors: twice the FLOPs per cycle of the
    AVX2 code chunkwise's kernels are built as, so where those kernels beat them was measured on AVX2 alone."""
    return bool(cpu_capabilities().get("avx512_f"))


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_dtype(requested: str, device: torch.device, checkpoint_dtype: str | None) -> DtypeChoice:
    """The engine's dtype for `requested` ("auto" or a dtype name) on `device`, with the reason, for the log.

    auto: bfloat16 on CUDA (float16 when the checkpoint is float16: converting it to bf16 would round what
    it stores) and on CPUs with bf16 matrix units; float32 on every other CPU, whatever the checkpoint holds.
    """
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
        return DtypeChoice(DTYPES[requested], "asked for")
    stored = f"the checkpoint stores {checkpoint_dtype}" if checkpoint_dtype else "a built-in model"
    if device.type == "cuda":
        if checkpoint_dtype == "float16":
            return DtypeChoice(torch.float16, f"auto: {stored}, kept on CUDA")
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16 on CUDA ({stored})")
    if device.type == "cpu":
        if cpu_has_bf16_matmul():
            return DtypeChoice(torch.bfloat16, f"auto: this CPU has bf16 matrix units ({stored})")
        return DtypeChoice(
            torch.float32,
            f"auto: this CPU has no bf16 matrix units (no AVX512-BF16/AMX), where float32 is the fast path "
            f"({stored})",
        )
    return DtypeChoice(torch.float32, f"auto: float32 on {device.type}")
