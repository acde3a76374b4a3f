"""What a new row count costs a packed oneDNN linear layer, and what onednn_rows' padding saves.

Each mode runs in a fresh process (oneDNN's kernel cache is per process): the benchmark model's gate/up layer
(512 -> 3072, bf16 on a CPU with bf16 units, else fp32), its weight packed once as Linear.prepare does, called
at 300 row counts drawn from 33..1,024 (a prefill step's, seeded), twice over. `exact` calls it at each count
as given, `padded` at onednn_rows(count) (the input padded, the output cut back), as Linear.forward does.
Prints each pass's total: the first pays for building kernels, the second shows what is left.

    PYTHONPATH=runtime taskset -c 1 .venv/bin/python bench/cpu/linear_rows.py
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time

import torch


def run(mode: str) -> None:
    from chunkwise.engine.hardware import cpu_has_bf16_matmul
    from chunkwise.engine.model.layers import onednn_rows

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if cpu_has_bf16_matmul() else torch.float32
    w = torch.ops.mkldnn._reorder_linear_weight((torch.randn(3072, 512) * 0.02).to(dtype))
    rng = random.Random(0)
    counts = [rng.randint(33, 1024) for _ in range(300)]
    inputs = {m: torch.randn(m, 512).to(dtype) for m in set(counts)}
    with torch.inference_mode():
        for rep in range(2):
            t0 = time.perf_counter()
            for m in counts:
                x = inputs[m]
                if mode == "padded":
                    p = x.new_zeros(onednn_rows(m), 512)
                    p[:m] = x
                    torch.ops.mkldnn._linear_pointwise(p, w, None, "none", [], "")[:m]
                else:
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            total = time.perf_counter() - t0
            kernels = len({onednn_rows(m) for m in counts}) if mode == "padded" else len(set(counts))
            print(
                f"{mode:6s} pass {rep + 1}: {total * 1e3:8.1f} ms for {len(counts)} calls, {kernels} row counts, {dtype}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["exact", "padded"], help="run one mode here (the script runs both)")
    args = p.parse_args()
    if args.mode:
        run(args.mode)
        return
    for mode in ("exact", "padded", "exact", "padded"):
        subprocess.run([sys.executable, __file__, "--mode", mode], check=True)


if __name__ == "__main__":
    main()
