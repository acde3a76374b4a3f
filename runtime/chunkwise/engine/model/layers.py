"""The layers the model file is built from: a linear layer that lays its weight out once for the device's
matmul library, RMSNorm, SiluAndMul and the rotary embedding with its cos/sin table.

Each layer holds Hugging Face's numerics (tests compare against transformers token for token); what differs
per device is only how it runs, chosen once by `prepare()` after the weights are loaded: on CPU, chunkwise's
C++ kernels (chunkwise.engine.kernels) do a norm, a rotation or a gated activation in one pass where torch takes
four to six (each a full read and write of the activations, and a dispatch); on CUDA, Triton kernels
(model/triton_ops.py) do a norm (with the residual add before it) or a rotation in one launch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from chunkwise.engine.datatypes.config import RopeScaling
from chunkwise.engine.hardware import configure_onednn, cpu_has_avx512
from chunkwise.engine.lora.rows import LoRARows, add_lora
from chunkwise.engine.model.rope import rope_frequencies
from chunkwise.engine.quant.compute import quantized_linear
from chunkwise.engine.quant.weights import QuantizedWeight, empty_like_shape

log = logging.getLogger(__name__)


def triton_kernels_for(t: torch.Tensor) -> ModuleType | None:
    """model/triton_ops.py when a layer holding `t` runs its kernels (a CUDA tensor, and triton installed;
    imported only then), else None. Kept by the layer: a per-call import is host time on every step."""
    if t.device.type != "cuda":
        return None
    try:
        from chunkwise.engine.model import triton_ops
    except ImportError:
        log.warning("triton is not installed: RMSNorm and rotary run as torch ops on %s", t.device)
        return None
    return triton_ops


def cpu_kernels_for(t: torch.Tensor) -> bool:
    """Whether a layer holding `t` runs chunkwise's CPU kernels (a CPU tensor, and the kernels load)."""
    if t.device.type != "cpu":
        return False
    from chunkwise.engine import kernels

    return kernels.available()


# Up to this many rows an fp32 linear layer on an AVX2 CPU runs chunkwise's small-row kernel, past it oneDNN,
# over the same weight: where the two cross there (bench/cpu/linear_small_m.py: the kernel 2.75x oneDNN over
# the same weight at 4 rows, 1.06x at 64, 0.98x at 96). With AVX-512 oneDNN's packed layout wins at every
# row count instead (same script on an AVX-512 EPYC: 1.05-1.5x the kernel from 1 to 256 rows).
SMALL_M_ROWS = 64


# oneDNN builds (JIT-compiles) a kernel for each new row count a layer sees, and torch's op caches them by
# shape: a first call at a new count cost about 5 ms more than a cached one (a 512 -> 3072 bf16 layer at
# 33-1,024 rows on an AMX Xeon, bench/cpu/linear_rows.py), and a prefill step's row count is almost always
# new. vLLM builds its oneDNN matmul with the row count left to run time; torch's op cannot, so past
# ONEDNN_EXACT_ROWS rows a packed layer runs at the next of a few row counts: sixteen per doubling, at most
# 1/16 more rows than asked for.
ONEDNN_EXACT_ROWS = 32


def onednn_rows(m: int) -> int:
    """The row count a packed oneDNN layer computes `m` rows at: `m` up to ONEDNN_EXACT_ROWS (decode's
    steps, whose counts repeat), else `m` rounded up to a 32nd of the power of two at or above it."""
    if m <= ONEDNN_EXACT_ROWS:
        return m
    step = (1 << (m - 1).bit_length()) // 32
    return -(-m // step) * step


def onednn_row_counts(max_rows: int) -> list[int]:
    """Every row count onednn_rows gives for 1..max_rows rows, in order."""
    counts, m = [], 1
    while m <= max_rows:
        counts.append(onednn_rows(m))
        m = counts[-1] + 1
    return counts


# Warm-up calls past this many FLOPs are left to the first step that needs them: the multiply itself then
# costs as much as building its kernel, and warming every count of a large model would take minutes.
WARM_UP_MAX_FLOPS = 2e9


def warm_up_onednn(model: nn.Module, max_rows: int, head_rows: int) -> tuple[int, float]:
    """Build oneDNN's kernel for each row count a packed Linear of `model` runs at, up to `max_rows`
    (`head_rows` for the LM head, which sees a row per sequence), once per distinct layer shape, so that
    steps do not pay for it. Returns (calls made, seconds taken)."""
    t0 = time.perf_counter()
    seen: set[tuple[int, int, torch.dtype, bool, int]] = set()
    calls = 0
    with torch.inference_mode():
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or module.kernel != "onednn-packed":
                continue
            rows = head_rows if name.endswith("lm_head") else max_rows
            dtype = module._out_dtype or torch.float32
            key = (module.in_features, module.out_features, dtype, module.bias is None, rows)
            if key in seen:
                continue
            seen.add(key)
            for m in onednn_row_counts(rows):
                if 2 * m * module.in_features * module.out_features > WARM_UP_MAX_FLOPS:
                    break
                module(torch.zeros(m, module.in_features, dtype=dtype))
                calls += 1
    return calls, time.perf_counter() - t0


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_bf16_available() -> bool:
    """Whether torch's oneDNN ops take bf16 on this CPU: they refuse it without AVX512-BW/VL/DQ or
    AVX-NE-CONVERT ("bf16 path needs the cpu support ..."), e.g. on an AVX2 EPYC told CHUNKWISE_CPU_ISA=amx."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return _onednn_available() and check is not None and bool(check())


def _small_m_kernel_for(t: torch.Tensor) -> bool:
    """Whether the small-row kernel runs here: it is written for AVX2's 16 registers and FMA, which AVX-512
    builds have too."""
    if not cpu_kernels_for(t):
        return False
    from chunkwise.engine import kernels

    return kernels.isa() in ("avx2", "avx512")


class Part(NamedTuple):
    """Rows of a Linear's weight (and bias) read from one Hugging Face tensor: `rows` of them, consecutive,
    from row `start` of that tensor, which has `total` rows (0: `rows`, the whole tensor). A fused projection
    has one part per HF projection stacked into it; a column-parallel shard reads fewer rows than `total`."""

    name: str  # the HF projection ("q_proj"); "" for the Linear's own name
    rows: int
    start: int = 0
    total: int = 0


class Linear(nn.Module):
    """y = x W^T (+ b), weight [out_features, in_features] as in nn.Linear and Hugging Face checkpoints.

    Under tensor parallelism a Linear holds a shard and computes on it as on a whole weight: `parts` say
    which HF rows fill its output rows (column parallel: a share of q/k/v, of gate/up, of the vocabulary,
    whose last rows may be padding past the HF tensor's), `columns` which HF input columns it holds (row
    parallel: o_proj, down_proj; the model sums the ranks' outputs). The loader reads them (model/parallel.py).

    `prepare()` picks the kernel once the weights are final:
    - CPU with AVX-512 (cpu_has_avx512()), float32 or bfloat16: the weight is reordered once into oneDNN's
      blocked layout and replaces the plain one (a tied LM head gets its own packed copy; the embedding
      keeps the plain one). Measured on an AVX-512-BF16 EPYC over the benchmark model's weights: bf16
      1.3-2.2x F.linear at decode's rows (bench/cpu/linear_bf16.py), 2.3x on its LM head at one row, even
      at 1,024; fp32 1.05-1.8x the plain layout and 1.05-1.5x the small-row kernel from 1 to 256 rows
      (bench/cpu/linear_small_m.py). Issue 29's figures on an AMX Xeon: bf16 1.9-2.3x at decode.
    - CPU with AVX2 only, float32: the weight stays in Hugging Face's row-major layout, one copy (a tied LM
      head shares the embedding's). Up to SMALL_M_ROWS rows (decode), chunkwise's small-row kernel streams
      it once per tile of rows; past that (prefill chunks), oneDNN's GEMM. A copy prepacked for oneDNN was
      1-9% faster at a prefill chunk's rows there and 2.5x slower at decode's few.
    - CPU, bfloat16/float16 without bf16 units (cpu_has_bf16_matmul() is False): torch's half-precision
      matmul is a scalar fallback (5 GFLOP/s on an AVX2 EPYC). The weight, already rounded to the half
      dtype by loading, is kept as float32 and the input is widened per call: the same numbers as a bf16
      GEMM with fp32 accumulation (bf16 products are exact in fp32), at float32 speed, for twice the
      half-precision weight memory. The output is rounded back to the half dtype.
    - CPU float16 with bf16 units, CUDA, or no oneDNN: F.linear as it is.
    - A quantized weight (`quantize`, engine/quant/): quant/compute.py's kernels; the plain weight is then an
      empty [0, in_features] placeholder and the quantized one lives in the buffers qdata, qscale (and qzero).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parts: tuple[Part, ...] = (),
        columns: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        filled = sum(p.rows for p in parts)
        if (len(parts) > 1 and filled != out_features) or filled > out_features:
            raise ValueError(f"the parts {parts} do not add up to {out_features} outputs")
        if columns is not None and bias:
            raise ValueError("a row-parallel Linear (columns) cannot hold a bias: each rank would add it")
        self.in_features = in_features
        self.out_features = out_features
        # The Hugging Face tensors (by name) whose rows fill consecutive output rows: a fused projection's,
        # or a shard's; () is the Linear's own tensor, whole.
        self.parts = parts
        # (first, total): the HF weight's input columns [first, first + in_features) of `total` (row parallel).
        self.columns = columns
        self.weight: torch.Tensor = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # "torch", "onednn", "small-m+onednn" (fp32: the small-row kernel up to SMALL_M_ROWS rows), or
        # "onednn-packed" (the weight in oneDNN's layout).
        self.kernel = "torch"
        self._out_dtype: torch.dtype | None = None
        # Half-precision weights held as fp32 (a CPU without bf16 units): inputs widened, outputs narrowed.
        self._widen = False
        # LoRA (lora/slots.py): every resident adapter's A [slots, rank, in] and B [slots, out, rank] for this
        # projection, when the engine serves adapters.
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        # The QuantizedWeight's kind and group (engine/quant/weights.py), None for a full-precision layer.
        self.quant_kind: str | None = None
        self.quant_group_k = 0
        self._quantized: QuantizedWeight | None = None

    def quantize(self, kind: str, group_k: int) -> None:
        """Hold the weight quantized: buffers of `kind`'s shapes replace the plain weight (on its device,
        meta included, so a model built on meta allocates only the quantized bytes)."""
        device = self.weight.device
        qw = empty_like_shape(kind, self.out_features, self.in_features, group_k, device)
        self.weight = nn.Parameter(torch.empty(0, self.in_features, device=device), requires_grad=False)
        self.register_buffer("qdata", qw.data)
        self.register_buffer("qscale", qw.scale)
        self.register_buffer("qzero", qw.zero)
        self.quant_kind, self.quant_group_k = kind, group_k
        self.kernel = f"quantized-{kind}"

    @property
    def quantized(self) -> QuantizedWeight | None:
        """The buffers as one QuantizedWeight, built once they are final (prepare() drops a stale one)."""
        if self.quant_kind is None:
            return None
        qw = self._quantized
        if qw is None or qw.data is not self.qdata:
            qw = self._quantized = QuantizedWeight(
                self.quant_kind, self.qdata, self.qscale, self.qzero, self.quant_group_k, self.in_features
            )
        return qw

    def prepare(self, widen_half_on_cpu: bool) -> None:
        if self.quant_kind is not None:
            self._quantized = None
            return
        w = self.weight.detach()
        if w.device.type != "cpu" or not _onednn_available():
            return
        self._widen = w.dtype != torch.float32 and widen_half_on_cpu
        if w.dtype == torch.float16 and not self._widen:
            return
        if w.dtype == torch.bfloat16 and not self._widen and not onednn_bf16_available():
            return  # torch's own bf16 GEMM: slow without bf16 units, but it runs
        configure_onednn()
        self._out_dtype = w.dtype
        if self._widen:
            w = w.float()
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=False)
        if w.dtype == torch.bfloat16 or cpu_has_avx512():
            # An opaque oneDNN tensor: only _linear_pointwise reads it (the plain copy is dropped).
            self.weight = nn.Parameter(
                torch.ops.mkldnn._reorder_linear_weight(w.contiguous()), requires_grad=False
            )
            self.kernel = "onednn-packed"
            return
        if self._widen:
            self.weight = nn.Parameter(w.contiguous(), requires_grad=False)
        self.kernel = "small-m+onednn" if _small_m_kernel_for(w) else "onednn"

    def forward(self, x: torch.Tensor, lora: LoRARows | None = None) -> torch.Tensor:
        """x W^T (+ b), plus each adapter's update on the rows `lora` assigns to it."""
        y = self._base(x)
        if lora is not None and self.lora_a is not None and self.lora_b is not None:
            add_lora(y, x, self.lora_a, self.lora_b, lora)
        return y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        qw = self.quantized
        if qw is not None:
            return quantized_linear(x, qw, self.bias)
        if self.kernel == "torch":
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 0:  # a step whose last layer keeps no rows; oneDNN refuses empty inputs
            return x.new_empty(0, self.out_features)
        xin = x.float() if self._widen else x
        if (
            self.kernel == "small-m+onednn"
            and xin.dim() == 2
            and xin.shape[0] <= SMALL_M_ROWS
            and xin.stride(-1) == 1
        ):
            y = xin.new_empty(xin.shape[0], self.out_features)
            torch.ops.chunkwise.linear_small_m(y, xin, self.weight, self.bias)
        elif self.kernel == "onednn-packed" and xin.dim() == 2 and onednn_rows(xin.shape[0]) != xin.shape[0]:
            m = xin.shape[0]
            padded = xin.new_zeros(onednn_rows(m), xin.shape[1])
            padded[:m] = xin
            y = torch.ops.mkldnn._linear_pointwise(padded, self.weight, self.bias, "none", [], "")[:m]
        else:
            y = torch.ops.mkldnn._linear_pointwise(xin, self.weight, self.bias, "none", [], "")
        return y.to(self._out_dtype) if self._widen else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, kernel={self.kernel}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False
        # One Triton launch on a GPU, where torch's ~8 ops are 8 launches (model/triton_ops.py).
        self.triton: ModuleType | None = None

    def prepare(self, triton_layers: bool = True) -> None:
        self.fused = cpu_kernels_for(self.weight)
        self.triton = triton_kernels_for(self.weight) if triton_layers else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.triton
        if ops is not None and ops.supports_norm(x, self.weight):
            return ops.rms_norm(x, self.weight, self.eps)
        if self.fused and x.dim() == 2 and x.stride(-1) == 1 and x.dtype == self.weight.dtype:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            torch.ops.chunkwise.rms_norm(out, x, self.weight, self.eps)
            return out
        # Normalise in fp32 and cast back before the weight, as HF does, so half-precision runs match it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm): the residual add before a norm, one launch with Triton, one pass per row
        with chunkwise's CPU kernel. The sum is the residual stream's next value; Triton writes it into
        `residual` in place, the CPU kernel into `residual` and the norm into `x` (vLLM's fused_add_rms_norm:
        both are a layer's fresh outputs, which nothing else holds), torch into new tensors."""
        ops = self.triton
        if ops is not None and ops.supports_add_norm(x, residual, self.weight):
            return residual, ops.add_rms_norm(x, residual, self.weight, self.eps)
        if (
            self.fused
            and x.dim() == 2
            and x.shape == residual.shape
            and x.stride(-1) == 1
            and residual.stride(-1) == 1
            and x.dtype == residual.dtype == self.weight.dtype
        ):
            # One pass over each row where the add and the norm took three, and no new tensors: the 57M
            # model's 512-wide rows, 32 of them, fp32 8.5 -> 4.2 us, bf16 11.9 -> 8.6 (bench/cpu/elementwise.py).
            torch.ops.chunkwise.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return residual, x
        h = x + residual
        return h, self(h)


class SiluAndMul(nn.Module):
    """[gate | up] -> silu(gate) * up, the gated MLP's activation over the fused gate_up projection."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False

    def prepare(self, like: torch.Tensor) -> None:
        self.fused = cpu_kernels_for(like)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        if self.fused and x.dim() == 2 and x.stride(-1) == 1:
            out = torch.empty(x.shape[0], half, dtype=x.dtype, device=x.device)
            torch.ops.chunkwise.silu_and_mul(out, x)
            return out
        return F.silu(x[:, :half]) * x[:, half:]


@dataclass
class Rope:
    """A step's rotary inputs, looked up once and shared by every layer."""

    cos: torch.Tensor  # [T, 1, head_dim // 2], the activations' dtype
    sin: torch.Tensor
    positions: torch.Tensor  # [T]
    table: torch.Tensor  # [max_positions, 2, head_dim // 2] fp32, for the fused kernel


class RotaryEmbedding:
    """Rotary position embedding (HF's rotate-half layout) with cos/sin precomputed for every position.

    The table is fp32, built with HF's formula, and kept out of the module's state so `.to(dtype)` never rounds
    it; a step looks its positions up once and every layer reuses the result (`lookup`, then `apply`).
    """

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None = None
    ) -> None:
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._tables: dict[torch.device, torch.Tensor] = {}
        self.fused = False
        self.triton: ModuleType | None = None

    def prepare(self, like: torch.Tensor, triton_layers: bool = True) -> None:
        self.fused = cpu_kernels_for(like)
        self.triton = triton_kernels_for(like) if triton_layers else None

    def _table(self, device: torch.device) -> torch.Tensor:
        table = self._tables.get(device)
        if table is None:
            inv_freq, attention_factor = rope_frequencies(self.head_dim, self.theta, self.scaling)
            positions = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]
            # [max_positions, 2, head_dim // 2]: cos then sin, one gather per step for both, scaled in fp32
            # by the attention factor (YaRN, LongRoPE) before any cast, as transformers does.
            cs = torch.stack((freqs.cos(), freqs.sin()), dim=1)
            if attention_factor != 1.0:
                cs = cs * attention_factor
            table = cs.to(device)
            self._tables[device] = table
        return table

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The step's rotary inputs: cos, sin [T, 1, head_dim // 2] in the activations' dtype (as HF casts)."""
        table = self._table(positions.device)
        cs = table.index_select(0, positions).to(dtype)
        return Rope(cs[:, 0, None, :], cs[:, 1, None, :], positions, table)

    def apply(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [T, heads, head_dim] rotated: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). The fused kernel
        rotates x in place (returning it); torch returns a rotated copy."""
        ops = self.triton
        if ops is not None and ops.supports_rotary(x, rope.table, rope.positions):
            return ops.rotary(x, rope.table, rope.positions)
        if self.fused and x.stride(-1) == 1 and rope.positions.dtype == torch.int64:
            torch.ops.chunkwise.rotary_embedding(x, rope.table, rope.positions)
            return x
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin), dim=-1)
