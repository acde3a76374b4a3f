"""LoRA on a GPU: decode throughput with adapters against the base model, on one engine configuration.

    PYTHONPATH=runtime python bench/gpu/lora_bench.py --out DIR           # on the GPU, about two minutes
    PYTHONPATH=runtime python bench/gpu/lora_bench.py --smoke --out DIR   # tiny, on CPU

A random Llama-3-8B-shaped model in bf16 (the `llama3-8b` preset), `--batch` requests decoding together, and
the median time of their decode-only steps, for: the base model eager (LoRA needs eager steps: their per-row
gathers are not captured in graphs yet) and with graphs; an engine with LoRA on whose requests all run the
base model; and the requests spread evenly over 1, 2 and 4 rank-16 adapters on every projection.
Writes DIR/lora_bench.json and DIR/lora_bench.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "runtime") not in sys.path:
    sys.path.insert(0, str(REPO / "runtime"))


def decode_step_ms(engine: Any, batch: int, context: int, steps: int, loras: list[Any], sync: Any) -> float:
    from chunkwise.engine.datatypes.sampling_params import SamplingParams

    # Enough tokens that every request still decodes after the last prompt's prefill and the timed steps.
    sp = SamplingParams(max_tokens=context + steps * 4, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(rid, [3 + (i * 7 + j) % 250 for j in range(context)], sp, lora_request=lora)
    times: list[float] = []
    while len(times) < steps:
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        st = engine.last_step
        if st is not None and st.num_prefill_tokens == 0 and st.num_decode_rows == batch:
            times.append(time.perf_counter() - t0)
    engine.abort(ids)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from chunkwise.bench.lora import write_random_adapter
    from chunkwise.engine import EngineCore
    from chunkwise.engine.datatypes.config import engine_config_from_kwargs
    from chunkwise.engine.datatypes.lora import LoRARequest
    from chunkwise.engine.model.presets import PRESETS

    device = "cpu" if args.smoke else "cuda"
    model, dtype = ("tiny", "float32") if args.smoke else ("llama3-8b", "bfloat16")
    batch, context, steps, rank = (4, 16, 4, 4) if args.smoke else (args.batch, 512, 16, 16)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_random_adapter(PRESETS[model], tmp / f"a{i}", rank, seed=i)))
        for i in range(4)
    ]
    common = {
        "device": device,
        "dtype": dtype,
        "max_num_seqs": batch,
        "max_num_batched_tokens": 2048 if not args.smoke else 64,
        "max_model_len": 4 * context,
        "kv_cache_memory_bytes": (16 << 30) if not args.smoke else (1 << 24),
        "enable_prefix_caching": False,
    }
    cases: list[tuple[str, dict[str, Any], list[Any]]] = [
        ("base, eager", {"enforce_eager": True}, []),
        ("base, graphs", {"enforce_eager": False}, []),
        ("LoRA on, base requests", {"enable_lora": True, "max_loras": 4, "max_lora_rank": rank}, []),
        ("1 adapter", {"enable_lora": True, "max_loras": 4, "max_lora_rank": rank}, adapters[:1]),
        ("2 adapters", {"enable_lora": True, "max_loras": 4, "max_lora_rank": rank}, adapters[:2]),
        ("4 adapters", {"enable_lora": True, "max_loras": 4, "max_lora_rank": rank}, adapters),
    ]
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": model,
        "dtype": dtype,
        "batch": batch,
        "context": context,
        "rank": rank,
        "cases": {},
    }
    for name, extra, loras in cases:
        engine = EngineCore(engine_config_from_kwargs(model, **common, **extra))
        try:
            ms = decode_step_ms(engine, batch, context, steps, loras, sync)
        finally:
            engine.close()
            del engine
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        report["cases"][name] = {"step_ms": ms, "tokens_per_s": batch / ms * 1e3}
        print(f"== {name}: {ms:.2f} ms/step, {batch / ms * 1e3:.0f} tok/s", flush=True)
    return report


def render(r: dict[str, Any]) -> str:
    eager = r["cases"].get("base, eager", {}).get("step_ms")
    lines = [
        "# LoRA decode" + (" (smoke run on CPU: the timings mean nothing)" if r.get("smoke") else ""),
        "",
        f"{r['device']}, torch {r['torch']}, {r['model']} {r['dtype']}, batch {r['batch']}, context "
        f"{r['context']}, adapters of rank {r['rank']} on every projection",
        "",
        "| case | ms/step | tok/s | vs base eager |",
        "|---|---|---|---|",
    ]
    for name, c in r["cases"].items():
        rel = f"{eager / c['step_ms']:.2f}x" if eager else "-"
        lines.append(f"| {name} | {c['step_ms']:.2f} | {c['tokens_per_s']:.0f} | {rel} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for lora_bench.json and lora_bench.md")
    p.add_argument("--smoke", action="store_true", help="the tiny model on CPU, to check the code paths")
    p.add_argument("--batch", type=int, default=64, help="requests decoding together (64)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    report["smoke"] = args.smoke
    (out / "lora_bench.json").write_text(json.dumps(report, indent=2))
    (out / "lora_bench.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
