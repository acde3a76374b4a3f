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
import dataclasses
import gc
import json
import math
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
for _dir in (REPO / "runtime", Path(__file__).resolve().parent):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

import token_gate  # noqa: E402  (beside this file; stdlib only)

# The token check's tolerances (token_gate.py), per dtype: how far two configurations' log-probs of the same
# token may differ, and how close two candidates must be for a split between them to count as a tie. On the
# random 8B model bf16 rounding alone moved torch's own log-probs 0.66 nats from float32's (first H200 run),
# so only the float32 check is strict enough to catch a wrong input; bf16's tolerance is for real checkpoints.
GATE_TOLERANCE = {"float32": (1e-3, 1e-3), "bfloat16": (0.25, 0.25), "float16": (0.1, 0.1)}


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


MEASURES = ("tokens", "race", "decode", "prefill", "convoy")


@dataclass(frozen=True)
class Config:
    name: str
    attention_backend: str
    enforce_eager: bool
    # False: only the token check (the interpreted Triton kernels on CPU are far too slow to time).
    timed: bool = True


def configs(device: str) -> list[Config]:
    if device == "cuda":
        # The torch reference first: the token check compares the others with it.
        return [
            Config("torch-eager", "torch", True),
            Config("triton-eager", "triton", True),
            Config("triton-graphs", "triton", False),
        ]
    # CPU: the interpreted Triton kernels, the C++ kernels, and the bucketed path graphs would replay.
    return [
        Config("torch-eager", "torch", True),
        Config("cpu-eager", "cpu", True),
        Config("cpu-buckets", "cpu", False),
        Config("triton-interpreted", "triton", True, timed=False),
    ]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (no interpolation: with 24 steps, p99 is the slowest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def decode_step_bytes(engine: Any, batch: int, context: int) -> int:
    """What one decode step must read from memory: every weight once, except the embedding table, of which
    a step reads only its rows' vectors (an untied table is ~7% of an 8B model), plus each row's K/V."""
    cfg = engine.loaded.config
    model = engine.loaded.model
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:  # tied: the LM head reads the whole table anyway
        weights -= embed.numel() * embed.element_size() - batch * embed.shape[1] * embed.element_size()
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * embed.element_size()
    return weights + batch * context * kv_token


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.smoke = args.smoke
        shape = SMOKE if args.smoke else GPU
        self.shape = dataclasses.replace(shape, dtype=args.dtype) if args.dtype else shape
        self.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.kv_bytes = (
            self.shape.kv_bytes if args.kv_cache_memory_bytes is None else args.kv_cache_memory_bytes
        )
        self.failed = False
        self.report: dict[str, Any] = {
            "smoke": self.smoke,
            "device": torch.cuda.get_device_name()
            if self.device == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "shape": self.shape.__dict__,
            # Under tensor parallel the HBM figures are the whole model's bytes over the step: every GPU's.
            "tensor_parallel_size": args.tensor_parallel_size,
            "configs": {},
            "errors": [],
        }

    def time_left(self, what: str) -> bool:
        if time.monotonic() - self.t0 < self.args.budget_s:
            return True
        self.report["errors"].append(f"skipped {what}: over the {self.args.budget_s:.0f} s budget")
        return False

    def engine(self, cfg: Config) -> Any:
        from chunkwise.engine import EngineCore
        from chunkwise.engine.datatypes.config import engine_config_from_kwargs
        from chunkwise.engine.worker.cuda_graphs import bucket_sizes

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
                # 0: sized as a user's engine is, by gpu_memory_utilization and a profiled peak on CUDA.
                **({"kv_cache_memory_bytes": self.kv_bytes} if self.kv_bytes else {}),
                enable_prefix_caching=False,
                tensor_parallel_size=self.args.tensor_parallel_size,
                distributed_backend=self.args.distributed_backend,
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

    def tokens(self, engine: Any) -> list[list[token_gate.Step]]:
        """Greedy output of six prompts of different lengths, each token with its top-5 log-probs."""
        from chunkwise.engine.datatypes.sampling_params import SamplingParams

        prompts = [[3 + (i * 37 + j * 11) % 250 for j in range(5 + 7 * i)] for i in range(6)]
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
        for i, p in enumerate(prompts):
            engine.add_request(f"tok-{i}", p, sp)
        out: dict[str, list[token_gate.Step]] = {f"tok-{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for o in engine.step():
                # Each output carries this step's new tokens and their log-probs.
                c = o.outputs[0]
                if len(c.logprobs or []) != len(c.token_ids):
                    raise RuntimeError(f"{o.request_id}: {len(c.token_ids)} tokens, log-probs for fewer")
                out[o.request_id] += [(lp.token_id, lp.logprob, list(lp.top)) for lp in c.logprobs or []]
        return [out[f"tok-{i}"] for i in range(len(prompts))]

    def gate(self, reference: list[list[token_gate.Step]], other: list[list[token_gate.Step]]) -> dict:
        tol, tie = GATE_TOLERANCE[self.shape.dtype]
        return token_gate.compare(
            reference,
            other,
            logprob_tol=self.args.logprob_tol or tol,
            tie_tol=self.args.tie_tol or tie,
        ).as_dict()

    def race(self, engine: Any) -> dict[str, Any]:
        """Issue 30's race on the pinned input buffers, on the device: a prompt of several chunks alone, so
        its steps are prompt-only and nothing synchronises between them, run as usual and then with the host
        waiting for the device after every step. The two must give the same tokens and log-probs exactly
        (same batches, same kernels); with the race, the first run's chunks read the next step's inputs."""
        from chunkwise.engine.datatypes.sampling_params import SamplingParams

        s = self.shape
        prompt = [3 + (j * 29) % 250 for j in range(3 * s.budget + s.budget // 2)]
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
        runs = []
        for synced in (False, True):
            rid = f"race-{synced}"
            engine.add_request(rid, prompt, sp)
            got: list[tuple[int, float]] = []
            prompt_only = 0
            while engine.has_unfinished():
                for o in engine.step():
                    got += [(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs or []]
                st = engine.last_step
                if st is not None and st.num_decode_rows == 0 and st.num_prefill_tokens == s.budget:
                    prompt_only += 1
                if synced:
                    self.sync()
            runs.append({"tokens": got, "prompt_only_steps": prompt_only})
        return {
            "prompt_tokens": len(prompt),
            "prompt_only_steps": runs[0]["prompt_only_steps"],
            "identical": runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) == 4,
            "unsynced": runs[0]["tokens"],
            "synced": runs[1]["tokens"],
        }

    def decode(self, engine: Any, batch: int) -> dict[str, float]:
        """Decode-only steps of `batch` requests at `context` tokens: tok/s, p50/p99 step time, the HBM
        bandwidth reached, and the host's share of the step (StepStats: everything outside the forward)."""
        from chunkwise.engine.datatypes.sampling_params import SamplingParams

        s = self.shape
        # Long enough that the first requests are still decoding when the last prompt is prefilled: the
        # prompts take about batch * context / (budget - batch) steps, during which the early ones decode.
        prefill_steps = -(-batch * s.context // max(1, s.budget - batch))
        sp = SamplingParams(max_tokens=prefill_steps + s.decode_steps + 8, temperature=0.0, ignore_eos=True)
        ids = [f"dec-{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [3 + (i + j) % 250 for j in range(s.context)], sp)
        times: list[float] = []
        stats: list[Any] = []
        while engine.has_unfinished() and len(times) < s.decode_steps:
            self.sync()
            t0 = time.perf_counter()
            engine.step()
            self.sync()
            st = engine.last_step
            if st is not None and st.num_prefill_tokens == 0 and st.num_decode_rows == batch:
                times.append(time.perf_counter() - t0)
                stats.append(st)
        engine.abort(ids)  # the timed steps are what was wanted; the rest would only take the budget
        if not times:
            raise RuntimeError(f"no decode-only step of {batch} rows happened (max_tokens {sp.max_tokens})")
        step_s = statistics.median(times)
        step_bytes = decode_step_bytes(engine, batch, s.context + s.decode_steps // 2)

        def ms(values: list[float]) -> float:
            return statistics.median(values) * 1e3

        return {
            "steps_timed": len(times),
            "step_ms": step_s * 1e3,
            "p99_step_ms": percentile(times, 0.99) * 1e3,
            "output_tokens_per_s": batch / step_s,
            "hbm_tbps": step_bytes / step_s / 1e12,
            "fraction_of_peak": step_bytes / step_s / (self.args.peak_tbps * 1e12),
            # The forward is the device's share up to the sampled ids on the host; the rest is host work
            # during which the device idles (no overlap of scheduling with the forward yet).
            "forward_ms": ms([st.forward_seconds for st in stats]),
            "host_ms": ms([st.host_seconds for st in stats]),
            "schedule_ms": ms([st.schedule_seconds for st in stats]),
            "prepare_ms": ms([st.prepare_seconds for st in stats]),
            "sample_ms": ms([st.sample_seconds for st in stats]),
            "update_ms": ms([st.update_seconds for st in stats]),
            "output_ms": ms([st.output_seconds for st in stats]),
        }

    def prefill(self, engine: Any) -> dict[str, float]:
        """Prompt-only steps of a full token budget: prefill tok/s and p50/p99 step time."""
        from chunkwise.engine.datatypes.sampling_params import SamplingParams

        s = self.shape
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        ids = [f"pre-{i}" for i in range(2)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [3 + (i * 7 + j) % 250 for j in range(s.long_prompt)], sp)
        times: list[float] = []
        while engine.has_unfinished():
            self.sync()
            t0 = time.perf_counter()
            engine.step()
            self.sync()
            st = engine.last_step
            if st is not None and st.num_decode_rows == 0 and st.num_prefill_tokens == s.budget:
                times.append(time.perf_counter() - t0)
        if not times:
            raise RuntimeError(f"no prompt-only step of {s.budget} tokens happened")
        return {
            "steps_timed": len(times),
            "chunk_tokens": s.budget,
            "step_ms": statistics.median(times) * 1e3,
            "p99_step_ms": percentile(times, 0.99) * 1e3,
            "prefill_tokens_per_s": s.budget / statistics.median(times),
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
            "p99_itl_ms": percentile(gaps, 0.99),
            "max_itl_ms": gaps[-1],
            "median_itl_ms": statistics.median(gaps),
            "long_prompt_ttft_ms": statistics.mean(long_ttft),
        }

    # -- driver -----------------------------------------------------------------------------------------

    def run(self) -> int:
        """Every configuration asked for (--configs), each through the measurements asked for (--measure),
        in order. The first configuration run is the token check's reference."""
        reference: list[list[token_gate.Step]] | None = None
        measures = self.args.measure
        chosen = [c for c in configs(self.device) if not self.args.configs or c.name in self.args.configs]
        if self.args.configs and len(chosen) != len(self.args.configs):
            known = [c.name for c in configs(self.device)]
            raise SystemExit(
                f"--configs {','.join(self.args.configs)}: on {self.device} the configurations are {known}"
            )
        for cfg in chosen:
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
                entry["kv_blocks"] = engine.model_info.num_blocks
                entry["kv_sized_by"] = "kv_cache_memory_bytes" if self.kv_bytes else "gpu_memory_utilization"
                if "tokens" in measures:
                    tokens = self.tokens(engine)
                    if reference is None:
                        reference = tokens
                        entry["reference"] = True
                    gate = self.gate(reference, tokens)
                    entry["token_check"] = gate
                    # The tokens themselves, so that runs in other dtypes can be compared afterwards.
                    entry["tokens"] = tokens
                    self.failed |= not gate["ok"]
                    print(
                        f"  token check against the first config: {'ok' if gate['ok'] else 'FAILED'} "
                        f"({gate['compared']}/{gate['positions']} positions, max |dlogprob| "
                        f"{gate['max_abs_logprob_diff']:.2e}, {len(gate['ties'])} tie(s)) {gate['failures'][:3]}",
                        flush=True,
                    )
                if "race" in measures and "race" not in self.report:
                    race = self.report["race"] = {"config": cfg.name, **self.race(engine)}
                    self.failed |= not race["identical"]
                    print(
                        f"  race check ({race['prompt_only_steps']} prompt-only steps): "
                        f"{'identical' if race['identical'] else 'DIFFERENT'}",
                        flush=True,
                    )
                if not cfg.timed:
                    continue
                if "decode" in measures:
                    entry["decode"] = {}
                    for batch in self.shape.batches:
                        if not self.time_left(f"{cfg.name} decode {batch}"):
                            break
                        if cfg.attention_backend == "torch" and batch > 64 and not self.smoke:
                            continue  # the reference's per-step gathers at 256 x 512 tokens add nothing
                        d = self.decode(engine, batch)
                        entry["decode"][str(batch)] = d
                        print(
                            f"  batch {batch}: {d['step_ms']:.2f} ms/step (p99 {d['p99_step_ms']:.2f}, host "
                            f"{d['host_ms']:.2f}), {d['output_tokens_per_s']:.0f} tok/s, {d['hbm_tbps']:.2f} TB/s",
                            flush=True,
                        )
                        self.write()
                if "prefill" in measures and self.time_left(f"{cfg.name} prefill"):
                    entry["prefill"] = self.prefill(engine)
                    print(f"  prefill: {entry['prefill']}", flush=True)
                    self.write()
                if (
                    "convoy" in measures
                    and self.time_left(f"{cfg.name} convoy")
                    and cfg.attention_backend != "torch"
                ):
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


def table(header: str, rows: list[str]) -> list[str]:
    """A markdown table after a blank line, from "a | b" strings; nothing when there are no rows."""
    if not rows:
        return []
    width = header.count("|") + 1
    return ["", f"| {header} |", "|" + "---|" * width, *(f"| {r} |" for r in rows)]


def render(report: dict[str, Any]) -> str:
    nan = float("nan")
    lines = [
        "# Engine benchmark" + (" (smoke run: the timings mean nothing)" if report["smoke"] else ""),
        "",
        f"{report['device']}, torch {report['torch']}, model {report['shape']['model']} {report['shape']['dtype']}",
        "",
        "| config | graphs | token check (compared/positions, max abs dlogprob, ties) | start s |",
        "|---|---|---|---|",
    ]
    for name, entry in report["configs"].items():
        g = entry.get("token_check")
        check = (
            "reference"
            if entry.get("reference")
            else "-"
            if g is None
            else f"{'ok' if g['ok'] else 'FAILED'} ({g['compared']}/{g['positions']}, "
            f"{g['max_abs_logprob_diff']:.2e}, {len(g['ties'])})"
        )
        lines.append(f"| {name} | {entry.get('graphs', '-')} | {check} | {entry.get('start_s', nan):.1f} |")
    race = report.get("race")
    if race:
        lines += [
            "",
            f"Race check ({race['config']}, a {race['prompt_tokens']}-token prompt alone, "
            f"{race['prompt_only_steps']} prompt-only steps): "
            + (
                "identical with and without a sync after every step" if race["identical"] else "**DIFFERENT**"
            ),
        ]
    decode_rows = [(n, b, d) for n, e in report["configs"].items() for b, d in e.get("decode", {}).items()]
    lines += table(
        "config | batch | ms/step p50 | p99 | tok/s | HBM TB/s | % of peak | forward ms | host ms "
        "(schedule / prepare / sample / update / output)",
        [
            f"{name} | {batch} | {d['step_ms']:.2f} | {d['p99_step_ms']:.2f} | {d['output_tokens_per_s']:.0f} "
            f"| {d['hbm_tbps']:.2f} | {100 * d['fraction_of_peak']:.0f} | {d['forward_ms']:.2f} "
            f"| {d['host_ms']:.2f} ({d['schedule_ms']:.2f} / {d['prepare_ms']:.2f} / {d['sample_ms']:.2f} / "
            f"{d['update_ms']:.2f} / {d['output_ms']:.2f})"
            for name, batch, d in decode_rows
        ],
    )
    lines += table(
        "config | chunk tokens | ms/step p50 | p99 | prefill tok/s",
        [
            f"{name} | {d['chunk_tokens']} | {d['step_ms']:.1f} | {d['p99_step_ms']:.1f} "
            f"| {d['prefill_tokens_per_s']:.0f}"
            for name, e in report["configs"].items()
            if (d := e.get("prefill"))
        ],
    )
    lines += table(
        "config | streams' p50 ITL ms | p99 | max | long prompts' mean TTFT ms",
        [
            f"{name} | {c['median_itl_ms']:.1f} | {c['p99_itl_ms']:.1f} | {c['max_itl_ms']:.1f} "
            f"| {c['long_prompt_ttft_ms']:.0f}"
            for name, e in report["configs"].items()
            if (c := e.get("convoy"))
        ],
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
    p.add_argument(
        "--configs",
        type=lambda v: [x for x in v.split(",") if x],
        default=[],
        help="comma-separated configurations to run, in their usual order (default: all)",
    )
    p.add_argument(
        "--measure",
        type=lambda v: set(v.split(",")),
        default=set(MEASURES),
        help=f"comma-separated measurements (default: all of {','.join(MEASURES)})",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size (default: the shape's, 48 GiB on the GPU); 0 sizes it as a user's engine is "
        "(gpu_memory_utilization and a profiled peak on CUDA)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(GATE_TOLERANCE),
        default=None,
        help="model and KV dtype (default: the shape's, bfloat16 on the GPU). float32 makes the token check "
        "strict: bf16 rounding through a random 8B model's 32 layers moves log-probs by tenths of a nat",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is sharded over, one GPU each under NCCL (CUDA graphs stay off under tensor "
        "parallel for now)",
    )
    p.add_argument(
        "--distributed-backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="the engine's distributed_backend: gloo runs every rank on one GPU (slow; for checking)",
    )
    p.add_argument(
        "--logprob-tol", type=float, default=0.0, help="token check: override the dtype's tolerance"
    )
    p.add_argument(
        "--tie-tol", type=float, default=0.0, help="token check: override the dtype's tie tolerance"
    )
    args = p.parse_args(argv)
    if args.measure - set(MEASURES):
        p.error(
            f"--measure: unknown {sorted(args.measure - set(MEASURES))}; choose from {','.join(MEASURES)}"
        )
    return args


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
