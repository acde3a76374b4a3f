"""Side-by-side comparisons on the real engine: configurations take turns on one workload in one process
(A B B A A B ..., so a drift in machine load hits both alike), and each reported figure is the median over
repeats of a per-repeat ratio, with its range: on a shared machine absolute times are noise, ratios of
interleaved runs much less so.

base.py        Ratio, Comparison, noise, machine_info, interleave, ratio: what every comparison shares
policies.py    batching, chunked, prefix: a scheduler policy against its alternative on one workload
hf.py          chunkwise against transformers' generate
overhead.py    sched-overhead: the engine's host work per step at a full batch
preemption.py  forced swap against forced recompute, and the crossover
"""

from chunkwise.bench.compare.base import (
    DEFAULT_KV_BYTES,
    Comparison,
    Ratio,
    interleave,
    machine_info,
    noise,
    ratio,
    timestamp,
)
from chunkwise.bench.compare.hf import compare_hf
from chunkwise.bench.compare.overhead import HOST_PARTS, LOOP_PARTS, scheduler_overhead
from chunkwise.bench.compare.policies import compare_batching, compare_chunked, compare_prefix, padding_share
from chunkwise.bench.compare.preemption import PreemptionTiming, compare_preemption, crossover

__all__ = [
    "DEFAULT_KV_BYTES",
    "HOST_PARTS",
    "LOOP_PARTS",
    "Comparison",
    "PreemptionTiming",
    "Ratio",
    "compare_batching",
    "compare_chunked",
    "compare_hf",
    "compare_preemption",
    "compare_prefix",
    "crossover",
    "interleave",
    "machine_info",
    "noise",
    "padding_share",
    "ratio",
    "scheduler_overhead",
    "timestamp",
]
