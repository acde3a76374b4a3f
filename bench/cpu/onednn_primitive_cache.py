"""oneDNN's primitive cache at its default size against the size chunkwise sets (platform.configure_onednn).

A server meets many row counts; each (weight shape, row count) is one oneDNN primitive. This makes 299 row
counts x 5 of the benchmark model's weight shapes (1,495 primitives, past the default 1,024) and times three
passes over them: with room in the cache, the second and third passes reuse what the first made.

    taskset -c 1 .venv/bin/python bench/cpu/onednn_primitive_cache.py default
    taskset -c 1 .venv/bin/python bench/cpu/onednn_primitive_cache.py chunkwise
"""

from __future__ import annotations

import os
import sys
import time

import torch

if sys.argv[1:] == ["chunkwise"]:
    from chunkwise.engine.hardware import configure_onednn

    configure_onednn()
elif sys.argv[1:] != ["default"]:
    sys.exit("usage: onednn_primitive_cache.py default|chunkwise")
torch.set_num_threads(1)
SHAPES = [(512, 768), (512, 512), (512, 3072), (1536, 512), (512, 1024)]  # (in, out)
weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k) * 0.02, 32) for k, n in SHAPES]
ROWS = range(1, 300)
inputs = {(m, k): torch.randn(m, k) for m in ROWS for k in (512, 1536)}


def one_pass() -> float:
    t0 = time.perf_counter()
    for m in ROWS:
        for (k, _), w in zip(SHAPES, weights):
            torch.ops.mkldnn._linear_pointwise(inputs[(m, k)], w, None, "none", [], "")
    return time.perf_counter() - t0


passes = [one_pass() for _ in range(3)]
capacity = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024 (default)")
print(f"capacity {capacity}: passes " + ", ".join(f"{p:.2f} s" for p in passes))
