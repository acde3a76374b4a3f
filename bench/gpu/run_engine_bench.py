"""GPU benchmark of the whole engine (see README.md beside this file).

    PYTHONPATH=runtime python bench/gpu/run_engine_bench.py --out $OUT          # one GPU, < 10 minutes
    PYTHONPATH=runtime python bench/gpu/run_engine_bench.py --smoke --out DIR  # tiny shapes, on CPU

On a random Llama-3-8B-shaped model in bf16 (the `llama3-8b` preset: weights drawn on the GPU, nothing
downloaded), for each engine configuration (Triton attention eager, Triton with CUDA graphs, the torch
reference eager):
1. tokens: greedy output of the same prompts, compared with the first configuration's (graphs must not change
   a token: this is the check that lets graphs be on by default);
2. decode: output tok/s of decode-only steps at batch 1, 64 and 256, with the HBM bandwidth they reach
   (weights plus the KV read per step, over the step time) against --peak-tbps;
3. convoy: 32 decoding streams with 8k-token prompts injected, p99 and max inter-token latency of the streams.
Results go to DIR/engine_bench.json and DIR/engine_bench.md, rewritten after every measurement.

Imports only this repository, torch and triton (llguidance is imported only by structured outputs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "runtime") not in sys.path:
    sys.path.insert(0, str(REPO / "runtime"))


@dataclass(frozen=True)
class Shape:
    model: str
    dtype: str
    batches: tuple[int, ...]
    context: int  # prompt tokens of each decoding request
    decode_steps: int
    streams: int
    long_prompt: int
    num_long: int
    budget: int  # max_num_batched_tokens
    max_num_seqs: int
    max_model_len: int
    kv_bytes: int


GPU = Shape(
    model="llama3-8b",
    dtype="bfloat16",
    batches=(1, 64, 256),
    context=512,
    decode_steps=24,
    streams=32,
    long_prompt=8192 - 512,
    num_long=2,
    budget=2048,
    max_num_seqs=256,
    max_model_len=8192,
    kv_bytes=48 << 30,
)
SMOKE = Shape(
    model="tiny",
    dtype="float32",
    batches=(1, 4),
    context=8,
    decode_steps=3,
    streams=3,
    long_prompt=60,
    num_long=1,
    # Under batch x context, so the prompts of a decode measurement take several steps, as on the GPU.
    budget=12,
    max_num_seqs=4,
    max_model_len=128,
    kv_bytes=1 << 24,
)


@dataclass(frozen=True)
class Config:
    name: str
    attention_backend: str
    enforce_eager: bool
    # False: only the token check (the interpreted Triton kernels on CPU are far too slow to time).
    timed: bool = True


def configs(device: str) -> list[Config]:
    if device == "cuda":
        return [
            Config("triton-eager", "triton", True),
            Config("triton-graphs", "triton", False),
            Config("torch-eager", "torch", True),
        ]
    # CPU: the interpreted Triton kernels, the C++ kernels, and the bucketed path graphs would replay.
    return [
        Config("torch-eager", "torch", True),
        Config("cpu-eager", "cpu", True),
        Config("cpu-buckets", "cpu", False),
        Config("triton-interpreted", "triton", True, timed=False),
    ]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.smoke = args.smoke
        self.shape = SMOKE if args.smoke else GPU
        self.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.failed = False
        self.report: dict[str, Any] = {
            "smoke": self.smoke,
            "device": torch.cuda.get_device_name()
            if self.device == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "shape": self.shape.__dict__,
            "configs": {},
            "errors": [],
        }

    def time_left(self, what: str) -> bool:
        if time.monotonic() - self.t0 < self.args.budget_s:
            return True
        self.report["errors"].append(f"skipped {what}: over the {self.args.budget_s:.0f} s budget")
        return False

    def engine(self, cfg: Config) -> Any:
        from chunkwise.config import engine_config_from_kwargs
        from chunkwise.engine import EngineCore
        from chunkwise.worker.cuda_graphs import bucket_sizes

        s = self.shape
        engine = EngineCore(
            engine_config_from_kwargs(
                s.model,
                device=self.device,
                dtype=s.dtype,
                attention_backend=cfg.attention_backend,
                enforce_eager=cfg.enforce_eager,
                max_num_seqs=s.max_num_seqs,
                max_num_batched_tokens=s.budget,
                max_model_len=s.max_model_len,
                kv_cache_memory_bytes=s.kv_bytes,
                enable_prefix_caching=False,
            )
        )
        if self.device == "cpu" and not cfg.enforce_eager:
            engine.runner.use_decode_graphs(bucket_sizes(s.max_num_seqs), capture=False)
        return engine

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    # -- measurements -----------------------------------------------------------------------------------

    def tokens(self, engine: Any) -> list[list[int]]:
        from chunkwise.sampling_params import SamplingParams

        prompts = [[3 + (i * 37 + j * 11) % 250 for j in range(5 + 7 * i)] for i in range(6)]
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"tok-{i}", p, sp)
        out: dict[str, list[int]] = {f"tok-{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.outputs[0].token_ids)
        return [out[f"tok-{i}"] for i in range(len(prompts))]

    def decode(self, engine: Any, batch: int) -> dict[str, float]:
        """Decode-only steps of `batch` requests at `context` tokens: tok/s and the HBM bandwidth reached."""
        from chunkwise.sampling_params import SamplingParams

        s = self.shape
        cfg = engine.loaded.config
        # Long enough that the first requests are still decoding when the last prompt is prefilled: the
        # prompts take about batch * context / (budget - batch) steps, during which the early ones decode.
        prefill_steps = -(-batch * s.context // max(1, s.budget - batch))
        sp = SamplingParams(max_tokens=prefill_steps + s.decode_steps + 8, temperature=0.0, ignore_eos=True)
        ids = [f"dec-{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [3 + (i + j) % 250 for j in range(s.context)], sp)
        times = []
        while engine.has_unfinished() and len(times) < s.decode_steps:
            self.sync()
            t0 = time.perf_counter()
            engine.step()
            self.sync()
            st = engine.last_step
            if st is not None and st.num_prefill_tokens == 0 and st.num_decode_rows == batch:
                times.append(time.perf_counter() - t0)
        engine.abort(ids)  # the timed steps are what was wanted; the rest would only take the budget
        if not times:
            raise RuntimeError(f"no decode-only step of {batch} rows happened (max_tokens {sp.max_tokens})")
        step_s = statistics.median(times)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
        kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
        kv_read = batch * (s.context + s.decode_steps // 2) * kv_token
        return {
            "steps_timed": len(times),
            "step_ms": step_s * 1e3,
            "output_tokens_per_s": batch / step_s,
            "hbm_tbps": (weight_bytes + kv_read) / step_s / 1e12,
            "fraction_of_peak": (weight_bytes + kv_read) / step_s / (self.args.peak_tbps * 1e12),
        }

    def convoy(self, engine: Any) -> dict[str, float]:
        """Decoding streams with long prompts injected: what a stream waits between tokens."""
        from chunkwise.bench.offline import run_engine
        from chunkwise.bench.workloads import WorkItem, with_long_prompts

        s = self.shape
        streams = [
            WorkItem(tuple(3 + (i * 13 + j) % 250 for j in range(32)), 48 if self.smoke else 256)
            for i in range(s.streams)
        ]
        items = with_long_prompts(
            streams,
            vocab_size=250,
            num_long=s.num_long,
            long_len=s.long_prompt,
            at_s=[0.0, 0.5][: s.num_long] if self.smoke else [1.0, 3.0][: s.num_long],
            seed=0,
        )
        result = run_engine(engine, items, "convoy", salt="convoy")
        # The streams' gaps only: the long prompts' own few tokens are not what the test is about.
        gaps = sorted(g * 1e3 for r in result.records if r.prompt_len < s.long_prompt for g in r.itl)
        long_ttft = [r.ttft * 1e3 for r in result.records if r.prompt_len >= s.long_prompt]
        return {
            "p99_itl_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "max_itl_ms": gaps[-1],
            "median_itl_ms": statistics.median(gaps),
            "long_prompt_ttft_ms": statistics.mean(long_ttft),
        }

    # -- driver -----------------------------------------------------------------------------------------

    def run(self) -> int:
        reference: list[list[int]] | None = None
        for cfg in configs(self.device):
            if not self.time_left(cfg.name):
                break
            entry: dict[str, Any] = {
                "attention_backend": cfg.attention_backend,
                "enforce_eager": cfg.enforce_eager,
            }
            self.report["configs"][cfg.name] = entry
            print(f"== {cfg.name}", flush=True)
            engine = None
            try:
                t0 = time.monotonic()
                engine = self.engine(cfg)
                entry["start_s"] = time.monotonic() - t0
                entry["graphs"] = engine.runner.graphs is not None
                tokens = self.tokens(engine)
                if reference is None:
                    reference = tokens
                entry["tokens_match_first_config"] = tokens == reference
                if tokens != reference:
                    self.failed = True
                print(f"  tokens identical to the first config: {tokens == reference}", flush=True)
                if not cfg.timed:
                    continue
                entry["decode"] = {}
                for batch in self.shape.batches:
                    if not self.time_left(f"{cfg.name} decode {batch}"):
                        break
                    if cfg.attention_backend == "torch" and batch > 64 and not self.smoke:
                        continue  # the reference's per-step gathers at 256 x 512 tokens add nothing to learn
                    d = self.decode(engine, batch)
                    entry["decode"][str(batch)] = d
                    print(
                        f"  batch {batch}: {d['step_ms']:.2f} ms/step, {d['output_tokens_per_s']:.0f} tok/s, "
                        f"{d['hbm_tbps']:.2f} TB/s",
                        flush=True,
                    )
                    self.write()
                if self.time_left(f"{cfg.name} convoy") and cfg.attention_backend != "torch":
                    entry["convoy"] = self.convoy(engine)
                    print(f"  convoy: {entry['convoy']}", flush=True)
            except Exception as exc:
                self.failed = True
                entry["error"] = repr(exc)[:500]
                self.report["errors"].append(f"{cfg.name}: {traceback.format_exc()[-2000:]}")
                print(f"  failed: {exc!r}", flush=True)
            finally:
                del engine
                gc.collect()
                if self.device == "cuda":
                    import torch

                    torch.cuda.empty_cache()
                self.write()
        return 1 if self.failed else 0

    def write(self) -> None:
        (self.out / "engine_bench.json").write_text(json.dumps(self.report, indent=2, default=str))
        (self.out / "engine_bench.md").write_text(render(self.report))


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Engine benchmark" + (" (smoke run: the timings mean nothing)" if report["smoke"] else ""),
        "",
        f"{report['device']}, torch {report['torch']}, model {report['shape']['model']} {report['shape']['dtype']}",
        "",
        "| config | graphs | same tokens | batch | ms/step | tok/s | HBM TB/s | p99 ITL ms (convoy) | max ITL ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in report["configs"].items():
        convoy = entry.get("convoy", {})
        for batch, d in entry.get("decode", {}).items() or [("-", {})]:
            lines.append(
                f"| {name} | {entry.get('graphs', '-')} | {entry.get('tokens_match_first_config', '-')} | {batch} "
                f"| {d.get('step_ms', float('nan')):.2f} | {d.get('output_tokens_per_s', float('nan')):.0f} "
                f"| {d.get('hbm_tbps', float('nan')):.2f} | {convoy.get('p99_itl_ms', float('nan')):.1f} "
                f"| {convoy.get('max_itl_ms', float('nan')):.1f} |"
            )
    if report["errors"]:
        lines += ["", "Errors:", *[f"- {e.splitlines()[-1] if e else e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for engine_bench.json and engine_bench.md")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, to check the code paths")
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak for the fraction (H200: 4.8)")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no new measurement after this long")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        # The Triton configuration runs in the interpreter on CPU; it must be chosen before triton loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    torch.manual_seed(0)
    bench = Bench(args)
    status = bench.run()
    bench.write()
    print((bench.out / "engine_bench.md").read_text())
    return status


if __name__ == "__main__":
    raise SystemExit(main())
