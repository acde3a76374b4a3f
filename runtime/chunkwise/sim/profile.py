"""Step-latency models for the simulator, and the profiles (JSON) that carry them.

A step's cost depends on what the scheduler put in it. From a SchedulerOutput (and the requests its rows
point to) we take these features; "on `tiny` here" figures were measured on the AMX Xeon of
docs/benchmarks.md ("Replay accuracy"), one torch thread:

  compute
    P   prefill tokens (rows computing more than one token: chunks, recomputes)
    D   decode rows (one token each)
    Cd  the decode rows' context tokens, summed (attention reads every cached token of its row)
    Cu  of those, the distinct ones: Cd less the tokens of KV blocks an earlier row of the step also reads.
        Rows sharing a prompt prefix share its blocks, and a block read twice in a step comes from cache the
        second time: on `tiny` here a shared context token costs about half an unshared one
    Ap  prefill attention pairs: for each chunk of n tokens starting at s, n * (s + (n + 1) / 2)
    Ac  their causal part, n * (n + 1) / 2 a chunk (the chunk with itself), which may cost more a pair
    At  tail pairs: the chunk's last n mod 16 queries times the keys they see (s + n). Attention kernels take
        queries 16 rows at a time and the rows of a partial block take a slower path: on `tiny` here a chunk
        of 76 tokens costs more than one of 80
  per row and per step (host work: the scheduler, input preparation, the runner's per-row state)
    R   prefill rows (chunks): each is its own attention call and bookkeeping, whatever its length
    Rp  prefill rows starting past 0 (after a prefix-cache hit or an earlier chunk), and Pp their prefix
        tokens, summed: such a chunk gathers its context (on `tiny` here about 0.2 ms more than a chunk of a
        fresh prompt, plus its prefix's length)
    G   decode groups: the torch reference attention pads decode rows into groups of similar length (a group
        closes below half its longest row) and makes one call per group and layer; fitted only for that
        backend (chunkwise.sim.calibrate.unused_terms)
    Q   1 for a step composed on the scheduler's general path (all but the steady state's all-decode step,
        SchedulerOutput.decode_only), and Dq its decode rows: the general path and the runner's mixed-batch
        path do more for a decode row than the steady state's (on `tiny` here about 14 us more a row)
    V   decode rows feeding back a request's first output token (its first decode: the runner sets up its
        row state)
  requests coming and going (counted where the engine pays for them)
    N   requests added since the previous step: EngineCore.add_request (validation, the request's state,
        the queue; about 20 us on `tiny` here) runs between steps, so an arrival delays the next step. A
        caller that does not say how many arrived gets the rows starting a request (their first chunk)
        instead: the same number unless a burst is larger than a step admits
    E   rows that end their request this step (length-capped: their output reaches max_tokens): freeing
        its blocks and its final output
    F   requests that finished since the previous step (SchedulerOutput.finished_req_ids): the batch the
        runner then re-indexes instead of reusing (a decode batch unchanged since the last step is cheaper)
  copies
    S   tokens of KV swapped out or in

Two models map them to seconds:

- `LinearCost` (measured): t = the features above times their coefficients, plus a constant, plus
  S * kv_bytes_per_token / copy bandwidth; fitted by `chunkwise replay calibrate` from timed steps of chosen
  shapes on this machine (chunkwise.sim.calibrate). A step's time is what a client sees of it: from the end
  of the previous step to the end of this one, so the host work between steps (emitting outputs, admitting
  arrivals) counts too. A profile written before a term existed reads its coefficient as 0.
- `RooflineCost` (derived, not measured): t = overhead + max(FLOPs / achievable FLOP/s, bytes / achievable
  bytes/s), from a model's parameter count and KV size and a GPU's datasheet peaks times stated
  efficiencies. Built-in GPU profiles use it and say so in their `source`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from chunkwise.engine.sched.output import ScheduledRequest, SchedulerOutput

# Query rows an attention kernel takes at a time (tail_pairs).
_QUERY_BLOCK = 16


def _length_groups(lengths: list[int]) -> int:
    """How many padded groups the torch backend makes of decode rows of these context lengths (longest
    first, a new group when a row is under half the group's longest)."""
    groups = 0
    longest = 0
    for n in sorted(lengths, reverse=True):
        if groups == 0 or 2 * n < longest:
            groups += 1
            longest = n
    return groups


def _repeated_blocks(rows: list[ScheduledRequest], block_size: int) -> int:
    """KV blocks of these decode rows' contexts that an earlier row of the list also reads. Shared blocks are
    a shared prompt prefix, so they lead the block table: only rows with the same first block can share
    any, and a step of unrelated rows costs a dict insert per row."""
    by_first: dict[int, list[ScheduledRequest]] = {}
    for sr in rows:
        if sr.block_table:
            by_first.setdefault(sr.block_table[0], []).append(sr)
    repeated = 0
    for group in by_first.values():
        if len(group) < 2:
            continue
        seen: set[int] = set()
        for sr in group:
            # Its context is start_pos + 1 tokens; the block it is writing is its own.
            blocks = sr.block_table[: (sr.start_pos + block_size) // block_size]
            before = len(seen)
            seen.update(blocks)
            repeated += len(blocks) - (len(seen) - before)
    return repeated


@dataclass(frozen=True)
class StepFeatures:
    """A step's features (the module docstring's letters in brackets)."""

    prefill_tokens: int = 0  # P
    decode_rows: int = 0  # D
    decode_context: int = 0  # Cd
    prefill_attention: float = 0.0  # Ap
    swap_tokens: int = 0  # S
    prefill_rows: int = 0  # R
    decode_groups: int = 0  # G
    prefill_prefix: int = 0  # Pp
    # Cu; None: as many as decode_context (no row shares a block with another).
    decode_distinct_context: int | None = None
    arrivals: int = 0  # N
    prefill_causal: float = 0.0  # Ac
    finished: int = 0  # F
    prefix_rows: int = 0  # Rp
    general: int = 0  # Q
    tail_pairs: int = 0  # At
    finishing: int = 0  # E
    first_decodes: int = 0  # V
    general_decode_rows: int = 0  # Dq

    @classmethod
    def of(cls, so: SchedulerOutput, block_size: int, arrivals: int | None = None) -> StepFeatures:
        """The features of a scheduled step (read before the step runs: nothing here depends on its
        result); `arrivals` (requests added since the previous step) when the caller knows it, else the rows
        starting a request stand in for it."""
        p = d = cd = rows = prefix = prefix_rows = tail = starts = finishing = first = 0
        ap = causal = 0.0
        lengths = []
        decode: list[ScheduledRequest] = []
        for sr in so.scheduled:
            n = len(sr.token_ids)
            if n == 1:
                d += 1
                cd += sr.start_pos + 1
                lengths.append(sr.start_pos + 1)
                decode.append(sr)
            else:
                p += n
                rows += 1
                ap += n * (sr.start_pos + (n + 1) / 2)
                causal += n * (n + 1) / 2
                prefix += sr.start_pos
                prefix_rows += sr.start_pos > 0
                tail += n % _QUERY_BLOCK * (sr.start_pos + n)
            req = sr.req
            if req is None:
                continue
            outputs = req.num_tokens - req.num_prompt_tokens
            first += n == 1 and outputs == 1
            finishing += sr.samples and outputs + 1 >= req.max_tokens
            # Its first chunk: nothing computed yet but what the prefix cache gave it at admission.
            starts += (
                sr.start_pos == req.num_cached_tokens
                and req.preempt_count == 0
                and sr.start_pos < req.num_prompt_tokens
            )
        repeated = _repeated_blocks(decode, block_size) if len(decode) > 1 else 0
        return cls(
            prefill_tokens=p,
            decode_rows=d,
            decode_context=cd,
            prefill_attention=ap,
            # The host tier's offloads and restores (in swap_in) cost what swap's copies do.
            swap_tokens=(len(so.swap_out) + len(so.swap_in) + len(so.offload)) * block_size,
            prefill_rows=rows,
            decode_groups=_length_groups(lengths),
            prefill_prefix=prefix,
            decode_distinct_context=cd - block_size * repeated,
            arrivals=starts if arrivals is None else arrivals,
            prefill_causal=causal,
            finished=len(so.finished_req_ids),
            prefix_rows=prefix_rows,
            general=int(bool(so.scheduled) and not so.decode_only),
            tail_pairs=tail,
            finishing=finishing,
            first_decodes=first,
            general_decode_rows=0 if so.decode_only else d,
        )

    @property
    def distinct_context(self) -> int:
        return self.decode_context if self.decode_distinct_context is None else self.decode_distinct_context

    def vector(self) -> list[float]:
        """The linear model's regressors, in LinearCost's coefficient order (LINEAR_TERMS)."""
        return [
            1.0,
            self.prefill_tokens,
            self.decode_rows,
            self.decode_context,
            self.prefill_attention,
            self.prefill_rows,
            self.decode_groups,
            self.prefill_prefix,
            self.distinct_context,
            self.arrivals,
            self.prefill_causal,
            self.finished,
            self.prefix_rows,
            self.general,
            self.tail_pairs,
            self.finishing,
            self.first_decodes,
            self.general_decode_rows,
        ]


# LinearCost's coefficients, in StepFeatures.vector()'s order.
LINEAR_TERMS = (
    "base_s",
    "per_prefill_token_s",  # P
    "per_decode_row_s",  # D
    "per_context_token_s",  # Cd
    "per_attention_pair_s",  # Ap
    "per_prefill_row_s",  # R
    "per_decode_group_s",  # G
    "per_prefix_token_s",  # Pp
    "per_distinct_context_token_s",  # Cu
    "per_arrival_s",  # N
    "per_causal_pair_s",  # Ac
    "per_finished_s",  # F
    "per_prefix_row_s",  # Rp
    "per_general_step_s",  # Q
    "per_tail_pair_s",  # At
    "per_finishing_s",  # E
    "per_first_decode_s",  # V
    "per_general_decode_row_s",  # Dq
)


@dataclass(frozen=True)
class LinearCost:
    base_s: float
    per_prefill_token_s: float
    per_decode_row_s: float
    per_context_token_s: float
    per_attention_pair_s: float
    per_prefill_row_s: float = 0.0
    per_decode_group_s: float = 0.0
    per_prefix_token_s: float = 0.0
    # On top of per_context_token_s, for a context token no earlier row of the step read.
    per_distinct_context_token_s: float = 0.0
    per_arrival_s: float = 0.0
    # On top of per_attention_pair_s, for a pair of the chunk with itself.
    per_causal_pair_s: float = 0.0
    per_finished_s: float = 0.0
    per_prefix_row_s: float = 0.0
    per_general_step_s: float = 0.0
    per_tail_pair_s: float = 0.0
    per_finishing_s: float = 0.0
    per_first_decode_s: float = 0.0
    per_general_decode_row_s: float = 0.0

    def coefficients(self) -> list[float]:
        return [getattr(self, k) for k in LINEAR_TERMS]

    def compute_s(self, f: StepFeatures) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), f.vector()))

    def plus(self, other: LinearCost) -> LinearCost:
        return LinearCost(*(a + b for a, b in zip(self.coefficients(), other.coefficients())))


@dataclass(frozen=True)
class RooflineCost:
    """Per-step time of a memory/compute roofline; every figure is an input, none is measured."""

    num_params: float
    weight_bytes: float
    # FLOPs per (query token, context token) pair over all layers: QK^T and AV, 2 FLOPs per MAC.
    attention_flops_per_pair: float
    peak_flops: float
    peak_bytes_per_s: float
    compute_efficiency: float
    bandwidth_efficiency: float
    overhead_s: float

    def compute_s(self, f: StepFeatures, kv_bytes_per_token: int) -> float:
        tokens = f.prefill_tokens + f.decode_rows
        if tokens == 0:
            return self.overhead_s
        pairs = f.decode_context + f.prefill_attention
        flops = 2.0 * self.num_params * tokens + self.attention_flops_per_pair * pairs
        # Weights are read once per step; decode rows read their whole context; every token writes its KV.
        kv_bytes = kv_bytes_per_token * (f.decode_context + tokens)
        t_compute = flops / (self.peak_flops * self.compute_efficiency)
        t_memory = (self.weight_bytes + kv_bytes) / (self.peak_bytes_per_s * self.bandwidth_efficiency)
        return self.overhead_s + max(t_compute, t_memory)


@dataclass
class Profile:
    """A replica's hardware and model, as the simulator sees them."""

    name: str
    kind: Literal["linear", "roofline"]
    # Where the numbers come from: "measured: ..." or "derived: ...". Reports print it.
    source: str
    model: str
    kv_bytes_per_token: int
    host_copy_bytes_per_s: float
    prefill_tokens_per_s: float
    num_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    linear: LinearCost | None = None
    roofline: RooflineCost | None = None
    # Calibration detail (the timed shapes, fit quality, machine, threads): kept for the record.
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind == "linear" and self.linear is None:
            raise ValueError(f"profile {self.name!r}: a linear profile needs its coefficients")
        if self.kind == "roofline" and self.roofline is None:
            raise ValueError(f"profile {self.name!r}: a roofline profile needs its figures")

    def step_seconds(self, so: SchedulerOutput, arrivals: int | None = None) -> float:
        """A step's time; `arrivals`: requests added since the previous step (see StepFeatures.of)."""
        return self.features_seconds(StepFeatures.of(so, self.block_size, arrivals))

    def features_seconds(self, f: StepFeatures) -> float:
        swap_s = f.swap_tokens * self.kv_bytes_per_token / self.host_copy_bytes_per_s
        if self.linear is not None and self.kind == "linear":
            return max(self.linear.compute_s(f), 0.0) + swap_s
        assert self.roofline is not None
        return self.roofline.compute_s(f, self.kv_bytes_per_token) + swap_s

    def decode_step_seconds(self, rows: int, context: int) -> float:
        """A step of `rows` decode rows of `context` tokens each (what a router calls TPOT)."""
        return self.features_seconds(StepFeatures(decode_rows=rows, decode_context=rows * context))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Profile:
        obj = dict(obj)
        lin = obj.pop("linear", None)
        roof = obj.pop("roofline", None)
        return cls(
            **obj,
            linear=LinearCost(**lin) if lin else None,
            roofline=RooflineCost(**roof) if roof else None,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


# -- derived GPU profiles -----------------------------------------------------------------------------------
# Datasheet peaks (dense, no sparsity): H100 SXM5 989 TFLOP/s BF16 and 3.35 TB/s HBM3; H200 SXM 989 TFLOP/s
# BF16 and 4.8 TB/s HBM3e (141 GB); A100 SXM4 80 GB 312 TFLOP/s BF16 and 2.039 TB/s HBM2e. Host links: PCIe
# Gen5 x16 (H100/H200, 64 GB/s per direction) and Gen4 x16 (A100, 32 GB/s); we assume 70% of it for swaps.
# Achievable fractions are assumptions: 50% of peak FLOP/s in large matmuls, 80% of peak bandwidth, and 4 ms
# of per-step host overhead (scheduling, input preparation, sampling), typical of a Python engine.
_GPUS: dict[str, dict[str, float]] = {
    "h100": {"flops": 989e12, "bw": 3.35e12, "mem": 80e9, "pcie": 64e9},
    "h200": {"flops": 989e12, "bw": 4.8e12, "mem": 141e9, "pcie": 64e9},
    "a100": {"flops": 312e12, "bw": 2.039e12, "mem": 80e9, "pcie": 32e9},
}
# Llama-3-8B (bf16): 8.03e9 parameters, 32 layers, 32 query heads, 8 KV heads, head_dim 128.
_LLAMA3_8B = {"params": 8.03e9, "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128, "bytes": 2}
_COMPUTE_EFF = 0.5
_BANDWIDTH_EFF = 0.8
_OVERHEAD_S = 0.004
_PCIE_EFF = 0.7
# Fraction of GPU memory given to weights + KV cache (vLLM's default gpu_memory_utilization).
_MEM_UTIL = 0.9


def derived_gpu_profile(gpu: str, block_size: int = 16) -> Profile:
    g = _GPUS[gpu]
    m = _LLAMA3_8B
    kv_per_token = int(2 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["bytes"])
    weight_bytes = m["params"] * m["bytes"]
    num_blocks = int((g["mem"] * _MEM_UTIL - weight_bytes) // (kv_per_token * block_size))
    roof = RooflineCost(
        num_params=m["params"],
        weight_bytes=weight_bytes,
        attention_flops_per_pair=4.0 * m["layers"] * m["heads"] * m["head_dim"],
        peak_flops=g["flops"],
        peak_bytes_per_s=g["bw"],
        compute_efficiency=_COMPUTE_EFF,
        bandwidth_efficiency=_BANDWIDTH_EFF,
        overhead_s=_OVERHEAD_S,
    )
    prefill_rate = (g["flops"] * _COMPUTE_EFF) / (2.0 * m["params"])
    return Profile(
        name=f"llama3-8b-{gpu}",
        kind="roofline",
        source=(
            f"derived, not measured: {gpu.upper()} datasheet peaks ({g['flops'] / 1e12:.0f} TFLOP/s bf16 dense, "
            f"{g['bw'] / 1e12:.2f} TB/s) x assumed efficiencies ({_COMPUTE_EFF:.0%} compute, "
            f"{_BANDWIDTH_EFF:.0%} bandwidth) + {_OVERHEAD_S * 1000:.0f} ms/step host overhead; Llama-3-8B bf16"
        ),
        model="llama3-8b",
        kv_bytes_per_token=kv_per_token,
        host_copy_bytes_per_s=g["pcie"] * _PCIE_EFF,
        prefill_tokens_per_s=prefill_rate,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=8192,
        roofline=roof,
    )


BUILTIN_PROFILES = tuple(f"llama3-8b-{gpu}" for gpu in _GPUS)


def load_profile(name_or_path: str) -> Profile:
    """A built-in derived profile by name, or a JSON profile file (e.g. from `chunkwise replay calibrate`)."""
    if name_or_path in BUILTIN_PROFILES:
        return derived_gpu_profile(name_or_path.rsplit("-", 1)[1])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"profile {name_or_path!r} is neither a built-in ({', '.join(BUILTIN_PROFILES)}) nor a JSON file; "
            "make one with `chunkwise replay calibrate --model small --out small.json`"
        )
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a chunkwise profile: {e}") from None
