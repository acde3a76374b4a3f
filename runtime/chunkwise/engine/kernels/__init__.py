"""chunkwise's CPU kernels (csrc/*.cpp): built once per machine with the system C++ compiler, cached,
and loaded as torch ops (torch.ops.chunkwise.*).

The build is keyed by the source, the torch version and the instruction set it targets, so a cache shared
between machines (a container image, a home directory) never hands one machine another's build. Where to
cache: $CHUNKWISE_KERNEL_CACHE, else $XDG_CACHE_HOME/chunkwise/kernels (~/.cache/...); a matching build in
$CHUNKWISE_KERNEL_DIR (what an image bakes in) is used as it is, with no compiler needed at run time.

    python -m chunkwise.engine.kernels      # build now (make's install step does), print where it went

`load()` raises KernelUnavailable with the reason (no compiler, a failed build); the attention backend
selection turns that into a logged choice of the torch reference, never a silent one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# cpu_ops.cpp: decode attention, norms, rotary, activations, small-row linears, sampling; on AVX512-BF16 (an
# empty op or a declined call elsewhere) prefill_attention.cpp, bf16 and fp32 prefill attention, and
# paged_attention_bf16.cpp, the bf16 case of cpu_ops.cpp's decode attention; prefill_attention_amx.cpp and
# paged_attention_amx.cpp, bf16 prefill and decode attention on AMX tiles (ops of their own, each saying
# whether the tiles are usable here); shm_all_reduce.cpp, tensor
# parallel's all-reduce between processes on one machine; quant_linear.cpp, linear layers over int8, fp8 and
# int4 weights, and quant_linear_amx.cpp, the same in bf16 on AMX tiles.
SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "cpu_ops.cpp",
        "prefill_attention.cpp",
        "prefill_attention_amx.cpp",
        "paged_attention_bf16.cpp",
        "paged_attention_amx.cpp",
        "shm_all_reduce.cpp",
        "quant_linear.cpp",
        "quant_linear_amx.cpp",
    )
)
# Included by the sources: part of what a build is keyed by.
HEADERS = tuple(
    Path(__file__).parent / "csrc" / name
    for name in ("avx512_math.h", "amx.h", "paged_operands.h", "quant_weights.h")
)
# The head sizes csrc/cpu_ops.cpp instantiates its attention kernel for.
ATTENTION_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
ATTENTION_MAX_HEADS = 128
# Those of the AMX prefill kernel (whole 32-dim tiles, at most four held for a query row).
AMX_ATTENTION_HEAD_DIMS = (32, 64, 96, 128)


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here; the message says why."""


AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
# AMX machines get this build too: the tiles are oneDNN's business; these kernels are elementwise or
# bound by memory, where 512-bit vectors are what the CPU adds.
AVX512_FLAGS = [
    *AVX2_FLAGS,
    *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"),
    "-mprefer-vector-width=512",
]


def _isa_flags() -> tuple[str, list[str]]:
    """A name for the instruction set and the flags that target it: AVX-512 (with bf16) or AVX2+FMA on x86
    machines, as chunkwise.engine.hardware.cpu_isa() says (never above what the machine executes), the compiler's
    baseline elsewhere."""
    from chunkwise.engine.hardware import cpu_isa

    target = cpu_isa().kernels
    if target == "avx2":
        return "avx2", AVX2_FLAGS
    if target in ("avx512", "amx"):
        return "avx512", AVX512_FLAGS
    return target or platform.machine().lower() or "generic", []


def isa() -> str:
    """The instruction set this machine's build targets ("avx512", "avx2", else the machine's name)."""
    return _isa_flags()[0]


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise KernelUnavailable(
            f"no C++ compiler ({cxx!r} is not on PATH; install g++ or set CXX) to build chunkwise's CPU kernels"
        )
    return path


def _build_command(cxx: str, isa_flags: list[str], out: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [
        cxx,
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp-simd",
        # No code here reads floating-point exception flags or errno: these let clamps and sqrt vectorise.
        "-fno-trapping-math",
        "-fno-math-errno",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *isa_flags,
        "-I",
        str(torch_dir / "include"),
        *(str(s) for s in SOURCES),
        "-L",
        str(torch_dir / "lib"),
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-o",
        str(out),
    ]


def _library_name(isa: str, isa_flags: list[str]) -> str:
    key = hashlib.sha256()
    for part in (
        *(f.read_bytes() for f in (*SOURCES, *HEADERS)),
        torch.__version__.encode(),
        " ".join(isa_flags).encode(),
    ):
        key.update(part)
        key.update(b"\0")
    return f"chunkwise_cpu_ops-{isa}-{key.hexdigest()[:16]}.so"


def _cache_dir() -> Path:
    explicit = os.environ.get("CHUNKWISE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chunkwise" / "kernels"


def _writable_dir(preferred: Path) -> Path:
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        probe = preferred / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return preferred
    except OSError:
        # A read-only home (containers): the temp dir is the one place left to write.
        fallback = Path(tempfile.gettempdir()) / "chunkwise-kernels"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def build(force: bool = False) -> Path:
    """Build the library if this machine has no build of the current source yet; returns its path."""
    missing = [f for f in (*SOURCES, *HEADERS) if not f.is_file()]
    if missing:
        raise KernelUnavailable(f"the kernel source {missing[0]} is missing from this installation")
    isa, isa_flags = _isa_flags()
    name = _library_name(isa, isa_flags)
    prebuilt = os.environ.get("CHUNKWISE_KERNEL_DIR")
    if prebuilt and (Path(prebuilt) / name).is_file() and not force:
        return Path(prebuilt) / name
    directory = _writable_dir(_cache_dir())
    target = directory / name
    if target.is_file() and not force:
        return target
    cxx = _compiler()
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    log.info("building chunkwise's CPU kernels for %s (once per machine, about 30 s) into %s", isa, directory)
    t0 = time.monotonic()
    try:
        result = subprocess.run(
            _build_command(cxx, isa_flags, tmp), capture_output=True, text=True, timeout=600
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C++ compiler failed to run: {e}") from e
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise KernelUnavailable(f"building the CPU kernels failed (exit {result.returncode}):\n{tail}")
    # Atomic: a process loading concurrently sees the old state or the whole library, never a partial file.
    os.replace(tmp, target)
    log.info("built chunkwise's CPU kernels in %.1fs", time.monotonic() - t0)
    return target


@functools.cache
def load() -> Path:
    """Build if needed and load the ops into torch.ops.chunkwise (once per process)."""
    path = build()
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e
    return path


def available() -> bool:
    try:
        load()
    except KernelUnavailable:
        return False
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a [rows, vocab] float32 tensor, the same answer (first index of the largest
    value; the first NaN where there is one). On CPU it runs chunkwise's kernel: torch's argmax over logits
    runs about 1 ns an element there, 6x slower (bench/cpu/elementwise.py)."""
    if (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] > 0
        and x.shape[1] > 0
        and x.stride(-1) == 1
        and available()
    ):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        torch.ops.chunkwise.argmax(out, x)
        return out
    return x.argmax(dim=-1)


def exponential_race_available(x: torch.Tensor) -> bool:
    """Whether exponential_race runs for logits like `x` (CPU float32 rows, and the kernels load)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and available()


def exponential_race(x: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row of `x` [rows, vocab], drawn from softmax(x * inv_temperature[row]) by the
    exponential race with uniforms hashed from seeds[row] (int64): the same seed and row give the same token.
    CPU only (exponential_race_available)."""
    if x.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    torch.ops.chunkwise.exponential_race(
        out, x, inv_temperature.to(torch.float32).contiguous(), seeds.to(torch.int64).contiguous()
    )
    return out


def prefill_attention_available(query: torch.Tensor) -> bool:
    """Whether prefill_attention runs for a query like `query` [n, H, D]: bf16 or fp32 on CPU, a head size
    it is built for, and a build with AVX512-BF16 for bf16, AVX-512 for fp32 (the kernels built for an
    AVX-512 level)."""
    if not (
        query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float32)
        and query.dim() == 3
        and query.shape[-1] in ATTENTION_HEAD_DIMS
        and available()
    ):
        return False
    if query.dtype == torch.float32:
        return bool(torch.ops.chunkwise.has_prefill_attention_fp32())
    return bool(torch.ops.chunkwise.has_prefill_attention())


def prefill_attention_amx_available(query: torch.Tensor) -> bool:
    """Whether prefill_attention_amx runs for a query like `query` [n, H, D]: bf16 on CPU, head size 32, 64, 96
    or 128, and a CPU whose AMX tiles this process may use (the kernels built for an AVX-512 level)."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and query.dim() == 3
        and query.shape[-1] in AMX_ATTENTION_HEAD_DIMS
        and available()
        and bool(torch.ops.chunkwise.has_prefill_attention_amx())
    )


def prefill_attention_amx(
    out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> None:
    """prefill_attention's operands and result in bf16, on AMX tiles (csrc/prefill_attention_amx.cpp)."""
    torch.ops.chunkwise.prefill_attention_amx(out, query, key, value, scale)


def paged_attention_amx_available(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> bool:
    """Whether paged_attention_amx runs for these shapes: bf16, head size 32, 64, 96 or 128, at most 16 query
    heads per KV head, blocks of a multiple of 16 tokens, and a CPU whose AMX tiles this process may use."""
    return (
        dtype == torch.bfloat16
        and head_dim in AMX_ATTENTION_HEAD_DIMS
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 16
        and block_size % 16 == 0
        and available()
        and bool(torch.ops.chunkwise.has_paged_attention_amx())
    )


def prefill_attention(
    out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> None:
    """Causal attention of a chunk whose queries are the last n positions of the context, into `out`
    [n, H, D]: query [n, H, D], key and value [ctx, KV, D], all bf16 or all fp32
    (csrc/prefill_attention.cpp). CPU with AVX512-BF16 for bf16, AVX-512 for fp32 only
    (prefill_attention_available)."""
    torch.ops.chunkwise.prefill_attention(out, query, key, value, scale)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    force = "--force" in (argv if argv is not None else sys.argv[1:])
    try:
        path = build(force=force)
        torch.ops.load_library(str(path))
    except KernelUnavailable as e:
        print(f"chunkwise CPU kernels unavailable: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
