"""What the machine can do, asked once: the CPU's instruction set, bf16 matrix units, and which dtype
`dtype="auto"` means.

Everything here is a question about the hardware, answered by torch, so that the loader, the linear layers,
the kernels' build and the start-up log agree on one answer. Every choice that depends on the CPU follows
`cpu_isa()`, which CHUNKWISE_CPU_ISA overrides (avx2, avx512 or amx): the suite runs each choice's paths on
any machine that way (oneDNN computes bf16 correctly without bf16 units, only slower), and a deployment can
pin what it measured.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("chunkwise.engine.hardware")

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


# The instruction-set levels chunkwise's choices distinguish, lowest first. "avx512" means AVX-512 with its
# bf16 dot products (Zen 4, Cooper Lake); an AVX-512 CPU without them (Skylake) is treated as "avx2", whose
# choices (float32, 256-bit kernels) are the right ones there. "amx" adds the tile units (Sapphire Rapids on).
ISAS = ("avx2", "avx512", "amx")
ISA_ENV = "CHUNKWISE_CPU_ISA"


@dataclass(frozen=True)
class CpuIsa:
    """The level chunkwise's CPU choices follow, and the one its C++ kernels are built for.

    `kernels` never exceeds what the machine executes: with CHUNKWISE_CPU_ISA=amx on an AVX2 machine the
    choices are AMX's (bf16, oneDNN's prepacked layout) while the kernels stay AVX2 builds."""

    name: str  # one of ISAS, or the machine's name where none applies (Arm, an x86 without AVX2)
    detected: str
    source: str  # "detected", or "CHUNKWISE_CPU_ISA=..."

    @property
    def kernels(self) -> str:
        if self.name in ISAS and self.detected in ISAS:
            return ISAS[min(ISAS.index(self.name), ISAS.index(self.detected))]
        return self.detected

    @property
    def bf16_matmul(self) -> bool:
        return self.name in ("avx512", "amx") or (self.name not in ISAS and _arm_bf16())

    def describe(self) -> str:
        kernels = "" if self.kernels == self.name else f", kernels built for {self.kernels}"
        return f"{self.name} ({self.source}{kernels})"


def _arm_bf16() -> bool:
    caps = cpu_capabilities()
    return bool(caps.get("bf16") or caps.get("sve_bf16"))


def detect_isa() -> str:
    """The highest level in ISAS this CPU executes, else the machine's name."""
    import platform as _platform

    caps = cpu_capabilities()
    machine = _platform.machine().lower()
    if machine not in ("x86_64", "amd64") or not (caps.get("avx2") and caps.get("fma3")):
        return machine or "generic"
    avx512 = all(caps.get(f) for f in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_bf16"))
    if avx512 and caps.get("amx_bf16") and caps.get("amx_tile"):
        return "amx"
    return "avx512" if avx512 else "avx2"


@functools.cache
def cpu_isa() -> CpuIsa:
    detected = detect_isa()
    asked = os.environ.get(ISA_ENV, "").strip().lower()
    if not asked:
        return CpuIsa(detected, detected, "detected")
    if asked not in ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISAS)}, got {asked!r}")
    isa = CpuIsa(asked, detected, f"{ISA_ENV}={asked}")
    if detected not in ISAS or ISAS.index(asked) > ISAS.index(detected):
        logger.warning(
            "%s=%s on a CPU that has %s: chunkwise's choices follow %s (correct, but not what is fast here); "
            "its kernels are built for %s",
            ISA_ENV,
            asked,
            detected,
            asked,
            isa.kernels,
        )
    return isa


def cpu_has_bf16_matmul() -> bool:
    """True when chunkwise treats the CPU as multiplying bf16 matrices in hardware (AVX512-BF16, AMX-BF16,
    Arm BF16; or CHUNKWISE_CPU_ISA says so).

    Without them torch's bf16 matmul runs in a scalar fallback: measured on an AVX2 EPYC at 5 GFLOP/s
    against 30 for float32, which is why `auto` picks float32 on such a CPU."""
    return cpu_isa().bf16_matmul


def cpu_has_avx512() -> bool:
    """True when torch's CPU libraries (oneDNN, SDPA) run 512-bit vectors for chunkwise's choices: twice the
    FLOPs per cycle of an AVX2 build."""
    return cpu_isa().name in ("avx512", "amx")


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
