"""GPU benchmark of the Triton attention backend (see README.md beside this file).

    PYTHONPATH=runtime python bench/gpu/run_attention_bench.py --out $OUT          # on a GPU, < 10 minutes
    PYTHONPATH=runtime python bench/gpu/run_attention_bench.py --smoke --out DIR  # tiny shapes; CPU interpreter

Every shape is checked against the torch reference backend before it is timed; a shape that fails is not
timed, and the script exits non-zero. Results go to DIR/attention_bench.json and DIR/attention_bench.md,
rewritten after every section so that a run cut short still leaves what it measured.

Imports only this repository, torch and triton.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "runtime") not in sys.path:
    sys.path.insert(0, str(REPO / "runtime"))

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Triton vs the torch reference. On a GPU the kernel rounds the softmax weights to the cache dtype before
# the PV product (as flash attention does); the reference keeps them in fp32.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
FLUSH_BYTES = 256 << 20  # larger than any GPU's L2, so every timed call starts cold


# ---------------------------------------------------------------------------------------------------------
# batches


@dataclass
class Case:
    """One step's attention inputs over a paged cache filled with random keys and values."""

    requests: list[tuple[int, int]]  # (tokens already cached, tokens in this step)
    query: torch.Tensor
    cache: torch.Tensor
    meta: Any  # AttentionMetadata
    scale: float

    @property
    def kv_bytes(self) -> int:
        """Bytes of keys and values attention must read: each request's whole context, once."""
        _, _, _, num_kv_heads, head_dim = self.cache.shape
        tokens = sum(c + n for c, n in self.requests)
        return 2 * tokens * num_kv_heads * head_dim * self.cache.element_size()

    @property
    def causal_flops(self) -> int:
        """2 matmuls x 2 flops per (query, visible key) pair, per head."""
        num_heads, head_dim = self.query.shape[1], self.query.shape[2]
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in self.requests)
        return 4 * pairs * num_heads * head_dim


def make_case(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Case:
    from chunkwise.engine.attention.backend import AttentionMetadata, kv_cache_shape

    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_req = [math.ceil((c + n) / block_size) for c, n in requests]
    num_blocks = sum(blocks_per_req) + 1
    # Blocks handed out in random order, as a long-running block pool does.
    perm = torch.randperm(num_blocks, generator=gen)
    tables: list[list[int]] = []
    step_slots: list[torch.Tensor] = []
    used = 0
    for (computed, new), nb in zip(requests, blocks_per_req):
        blocks = perm[used : used + nb]
        used += nb
        tables.append(blocks.tolist())
        pos = torch.arange(computed, computed + new)
        step_slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in tables)
    query_lens = [n for _, n in requests]
    seq_lens = [c + n for c, n in requests]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        slot_mapping=torch.cat(step_slots).to(device),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    torch.manual_seed(seed)
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), device=device).to(
        dtype
    )
    query = torch.randn(sum(query_lens), num_heads, head_dim, device=device).to(dtype)
    return Case(requests, query, cache, meta, head_dim**-0.5)


def dense_kv(case: Case, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request `row`'s keys and values gathered into contiguous [num_kv_heads, seq_len, head_dim]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = case.cache.shape
    seq_len = case.meta.seq_lens_host[row]
    pos = torch.arange(seq_len, device=case.cache.device)
    slots = case.meta.block_tables[row, pos // block_size] * block_size + pos % block_size
    flat = case.cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    k = flat[0].index_select(0, slots).transpose(0, 1).contiguous()
    v = flat[1].index_select(0, slots).transpose(0, 1).contiguous()
    return k, v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """SDPA with grouped KV heads; where no SDPA kernel takes enable_gqa, KV heads are repeated (noted)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    except (RuntimeError, TypeError):
        group = q.shape[-3] // k.shape[-3]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, -3), v.repeat_interleave(group, -3), **kw
        )


def uniform_sdpa_fn(case: Case) -> Callable[[], torch.Tensor]:
    """SDPA over the same shapes with K/V materialised contiguously (built once, outside the timing).

    Requests must share (computed, new). Chunks that start at position 0 use is_causal; later chunks
    causal_lower_right (SDPA's is_causal triangle is aligned top-left)."""
    computed, new = case.requests[0]
    if any(r != case.requests[0] for r in case.requests):
        raise ValueError("uniform_sdpa_fn needs identical requests")
    b = len(case.requests)
    num_heads, head_dim = case.query.shape[1:]
    kv = [dense_kv(case, i) for i in range(b)]
    k = torch.stack([x[0] for x in kv])
    v = torch.stack([x[1] for x in kv])
    q = case.query.view(b, new, num_heads, head_dim).transpose(1, 2).contiguous()
    kw: dict[str, Any] = {"scale": case.scale}
    if new > 1 and computed == 0:
        kw["is_causal"] = True
    elif new > 1:
        # The causal triangle aligned to the bottom right (queries are the last `new` positions): a mask
        # object flash attention takes. A boolean mask would send SDPA to its masked math path, a baseline
        # slower than any real alternative.
        from torch.nn.attention.bias import causal_lower_right

        kw["attn_mask"] = causal_lower_right(new, computed + new)
    return lambda: sdpa(q, k, v, **kw)


# ---------------------------------------------------------------------------------------------------------
# timing


class Timer:
    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device = device
        self.iters = iters
        self.warmup = warmup
        self.flush = (
            torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device) if device.type == "cuda" else None
        )

    def __call__(self, fn: Callable[[], object], *, flush: bool = True) -> float:
        """Median microseconds of one call."""
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for s, e in zip(starts, ends):
            if flush and self.flush is not None:
                # While the GPU clears the flush buffer the host queues fn: the events time fn alone.
                self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max())


# ---------------------------------------------------------------------------------------------------------
# the benchmark


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        from chunkwise.engine.attention.torch_ref import TorchAttentionBackend
        from chunkwise.engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

        self.args = args
        self.device = device
        self.dtype = DTYPES[args.dtype]
        self.smoke = args.smoke
        self.deadline = time.monotonic() + args.budget_s
        self.out_dir = Path(args.out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.timer = Timer(device, iters=1 if self.smoke else args.iters, warmup=0 if self.smoke else 5)
        self.peak_bw = args.peak_tbps * 1e12
        self.Config = TritonAttentionConfig
        self.Triton = TritonAttentionBackend
        # On a GPU the reference's gather budget (sized for CPU page faults) would only add launches.
        self.torch_ref = TorchAttentionBackend(decode_gather_elements=1 << 30)
        self.triton = TritonAttentionBackend()
        self.failed = False
        self.report: dict[str, Any] = {
            "smoke": self.smoke,
            "environment": self.environment(),
            "dtype": args.dtype,
            "peak_hbm_tbps_assumed": args.peak_tbps,
            "triton_config": asdict(self.triton.config),
            "correctness": [],
            "errors": [],
            "skipped": [],
        }

    # -- bookkeeping ------------------------------------------------------------------------------------

    def environment(self) -> dict[str, Any]:
        import triton

        env: dict[str, Any] = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "device": str(self.device),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        }
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            env.update(
                gpu=props.name,
                sm_count=props.multi_processor_count,
                gpu_memory_gib=round(props.total_memory / 2**30, 1),
                cuda=torch.version.cuda,
            )
        return env

    def time_left(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.report["skipped"].append(f"{what}: time budget ({self.args.budget_s} s) spent")
        return False

    def section(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            fn()
        except Exception as exc:  # one broken section must not cost the others
            self.failed = True
            self.report["errors"].append(
                {"section": name, "error": repr(exc), "traceback": traceback.format_exc(limit=8)}
            )
            print(traceback.format_exc(), flush=True)
        self.report.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)
        self.write()

    def check(self, name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
        err = max_error(out, ref)
        tol = TOLERANCE[dtype]
        # A NaN anywhere fails: max() of a tensor holding NaN is NaN, and NaN <= tol is False.
        ok = bool(err <= tol * max(1.0, float(ref.float().abs().max())))
        self.report["correctness"].append({"case": name, "max_abs_err": err, "tolerance": tol, "ok": ok})
        print(f"  check {name}: max|err| {err:.2e} (tol {tol:g}) {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            self.failed = True
        return ok

    def case(self, requests: list[tuple[int, int]], heads: tuple[int, int, int], **kw: Any) -> Case:
        num_heads, num_kv_heads, head_dim = heads
        return make_case(
            requests,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=kw.pop("block_size", self.args.block_size),
            dtype=kw.pop("dtype", self.dtype),
            device=self.device,
            **kw,
        )

    def attend(self, backend: Any, case: Case) -> torch.Tensor:
        _, num_heads, head_dim = case.query.shape
        plan = backend.plan(case.meta, num_heads, case.cache.shape[3], head_dim)
        return backend.attend(case.query, case.cache, plan, case.scale)

    # -- sections ---------------------------------------------------------------------------------------

    def correctness(self) -> None:
        """Tricky small shapes in every dtype, before anything is timed."""
        mixed = [(0, 7), (13, 1), (5, 9), (16, 1), (0, 1), (20, 40), (3, 1), (97, 1), (31, 3), (300, 1)]
        cases: list[tuple[tuple[int, int, int], torch.dtype, int]]
        if self.smoke:
            cases = [((4, 4, 16), self.dtype, 16), ((8, 2, 32), self.dtype, 16)]
        else:
            # Every kernel specialisation costs a compile (seconds): the page size and dtype are constants,
            # so vary them on fewer head shapes.
            heads_list = [(8, 8, 64), (32, 8, 128), (32, 4, 64), (12, 2, 80)]
            cases = [(h, torch.bfloat16, 16) for h in heads_list]
            cases += [(h, torch.float16, 16) for h in heads_list[:2]]
            # fp32 (no tensor cores: the dots unroll into FMAs) is the slowest to compile; one shape.
            cases += [(heads_list[0], torch.float32, 16)]
            cases += [((32, 8, 128), self.dtype, 32)]
        for heads, dtype, block_size in cases:
            case = self.case(mixed, heads, dtype=dtype, block_size=block_size, seed=1)
            name = f"mixed H{heads[0]}/KV{heads[1]}/D{heads[2]} {str(dtype)[6:]} block {block_size}"
            self.check(name, self.attend(self.triton, case), self.attend(self.torch_ref, case), dtype)
        # Flash-decoding splits, forced (the heuristic picks them only for small decode batches).
        case = self.case(
            [(c, 1) for c in (0, 15, 16, 200, 1000)][: 3 if self.smoke else 5], (8, 2, 64), seed=2
        )
        split = self.Triton(self.Config(num_splits=4))
        self.check(
            "decode, 4 KV splits", self.attend(split, case), self.attend(self.torch_ref, case), self.dtype
        )
        # The KV write must be exact: same slots, same rounding as the reference's index_copy_. (The
        # interpreter truncates fp32 -> bf16 where a GPU rounds, so there the source is in the cache dtype.)
        src_dtype = case.cache.dtype if self.triton.interpreted else torch.float32
        cache = torch.zeros_like(case.cache)
        expected = torch.zeros_like(case.cache)
        num_tokens = 64
        slots = torch.randperm(cache.shape[1] * cache.shape[2], device=self.device)[:num_tokens]
        key = torch.randn(num_tokens, *cache.shape[3:], device=self.device).to(src_dtype)
        value = torch.randn_like(key)
        self.triton.write_kv(key, value, cache, slots)
        self.torch_ref.write_kv(key, value, expected, slots)
        ok = bool(torch.equal(cache, expected))
        name = f"write_kv {str(src_dtype)[6:]} -> {str(cache.dtype)[6:]}"
        self.report["correctness"].append({"case": name, "exact": ok, "ok": ok})
        print(f"  check {name}: {'exact' if ok else 'FAIL'}", flush=True)
        self.failed |= not ok

    def decode(self) -> None:
        ctx = 40 if self.smoke else 2048
        shapes: list[tuple[int, int, tuple[int, int, int]]]
        if self.smoke:
            shapes = [(2, ctx, (4, 2, 16))]
        else:
            shapes = [(64, ctx, (32, 8, 128)), (64, ctx, (32, 8, 64))]
            shapes += [(b, ctx, (32, 8, 128)) for b in (1, 8, 256)]
            shapes += [(8, 32768, (32, 8, 128)), (1, 32768, (32, 8, 128))]
        rows = self.report.setdefault("decode", [])
        for batch, context, heads in shapes:
            if not self.time_left(f"decode b{batch} ctx{context}"):
                return
            case = self.case([(context - 1, 1)] * batch, heads, seed=3)
            name = f"decode b{batch} ctx{context} H{heads[0]}/KV{heads[1]}/D{heads[2]}"
            if not self.check(
                name, self.attend(self.triton, case), self.attend(self.torch_ref, case), self.dtype
            ):
                continue
            plan = self.triton.launch_plan(case.meta, heads[0], heads[1], self.device)
            t_triton = self.timer(partial(self.attend, self.triton, case))
            t_sdpa = self.timer(uniform_sdpa_fn(case))
            t_ref = self.timer(partial(self.attend, self.torch_ref, case))
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "heads": list(heads),
                    "kv_splits": plan.num_splits,
                    "kv_bytes": case.kv_bytes,
                    "triton_us": t_triton,
                    "triton_gbps": case.kv_bytes / t_triton / 1e3,
                    "triton_pct_peak_hbm": 100 * case.kv_bytes / (t_triton * 1e-6) / self.peak_bw,
                    "sdpa_us": t_sdpa,
                    "sdpa_gbps": case.kv_bytes / t_sdpa / 1e3,
                    "torch_ref_us": t_ref,
                    "speedup_vs_sdpa": t_sdpa / t_triton,
                }
            )
            print(f"  {name}: triton {t_triton:.1f} us, sdpa {t_sdpa:.1f} us, ref {t_ref:.1f} us", flush=True)
            del case

    def prefill(self) -> None:
        shapes: list[tuple[int, int, int, tuple[int, int, int]]]
        if self.smoke:
            shapes = [(1, 0, 24, (4, 2, 16)), (1, 20, 12, (4, 2, 16))]
        else:
            heads = (32, 8, 128)
            shapes = [
                (1, 0, 2048, heads),
                (1, 6144, 2048, heads),
                (4, 0, 1024, heads),
                (1, 0, 2048, (32, 8, 64)),
            ]
            shapes += [(1, 0, 8192, heads)]
        rows = self.report.setdefault("prefill", [])
        for batch, computed, chunk, heads in shapes:
            if not self.time_left(f"prefill b{batch} chunk{chunk}"):
                return
            case = self.case([(computed, chunk)] * batch, heads, seed=4)
            name = f"prefill b{batch} chunk{chunk} at {computed} H{heads[0]}/KV{heads[1]}/D{heads[2]}"
            if not self.check(
                name, self.attend(self.triton, case), self.attend(self.torch_ref, case), self.dtype
            ):
                continue
            t_triton = self.timer(partial(self.attend, self.triton, case))
            t_sdpa = self.timer(uniform_sdpa_fn(case))
            tokens = batch * chunk
            rows.append(
                {
                    "batch": batch,
                    "context_before": computed,
                    "chunk": chunk,
                    "heads": list(heads),
                    "triton_us": t_triton,
                    "triton_tokens_per_s": tokens / (t_triton * 1e-6),
                    "triton_tflops": case.causal_flops / (t_triton * 1e-6) / 1e12,
                    "sdpa_us": t_sdpa,
                    "sdpa_tflops": case.causal_flops / (t_sdpa * 1e-6) / 1e12,
                    "speedup_vs_sdpa": t_sdpa / t_triton,
                }
            )
            print(f"  {name}: triton {t_triton:.1f} us, sdpa {t_sdpa:.1f} us", flush=True)
            del case

    def mixed(self) -> None:
        if self.smoke:
            heads, decodes, chunk = (4, 2, 16), [(39, 1)] * 3, (8, 16)
        else:
            heads, decodes, chunk = (32, 8, 128), [(2047, 1)] * 63, (1024, 1024)
        case = self.case([chunk, *decodes], heads, seed=5)
        if not self.check(
            "mixed step", self.attend(self.triton, case), self.attend(self.torch_ref, case), self.dtype
        ):
            return
        # SDPA cannot take the ragged step in one call: one call for the decode rows, one for the chunk.
        n = len(decodes)
        dec = self.case(decodes, heads, seed=6)
        pre = self.case([chunk], heads, seed=7)
        dec_fn, pre_fn = uniform_sdpa_fn(dec), uniform_sdpa_fn(pre)
        del dec, pre
        t_triton = self.timer(lambda: self.attend(self.triton, case))
        t_sdpa = self.timer(lambda: (dec_fn(), pre_fn()))
        t_ref = self.timer(lambda: self.attend(self.torch_ref, case))
        self.report["mixed"] = {
            "decode_rows": n,
            "decode_context": decodes[0][0] + 1,
            "prefill_chunk": chunk[1],
            "prefill_context_before": chunk[0],
            "heads": list(heads),
            "triton_us": t_triton,
            "sdpa_two_calls_us": t_sdpa,
            "torch_ref_us": t_ref,
            "kv_bytes": case.kv_bytes,
        }

    def sweep(self) -> None:
        """Alternative tile shapes, timed on the two headline shapes (the defaults are not tuned), and the
        KV-split target at small batch, where splitting decides how much of the GPU decode uses."""
        if self.smoke:
            decode_shape, prefill_shape, heads = [(39, 1)] * 2, [(0, 24)], (4, 2, 16)
            split_shape = [(39, 1)]
            decode_cfgs = [{"short_tile_n": 32}]
            prefill_cfgs = [{"long_block_m": 32, "long_tile_n": 32}]
            split_cfgs = [{"num_splits": 2}]
        else:
            decode_shape, prefill_shape, heads = [(2047, 1)] * 64, [(0, 2048)], (32, 8, 128)
            # 4 rows x 8 KV heads: 32 programs unsplit, far below one per SM.
            split_shape = [(8191, 1)] * 4
            decode_cfgs = [
                {"short_tile_n": n, "short_num_warps": w, "short_num_stages": s}
                for n in (32, 64, 128)
                for w in (4, 8)
                for s in (2, 3, 4)
                if not (n == 32 and w == 8)
            ]
            # Programs per SM the splits aim for (the default is 4): 2 was the old default; 4-8 waves
            # hide more latency per SM if occupancy allows (at 3 stages a program takes ~70 KB of shared
            # memory at head_dim 128: three fit an SM). Crossed with the pipeline depth.
            split_cfgs = [
                {"splits_target_waves": w, "short_num_stages": s} for w in (2, 4, 5, 6, 8) for s in (2, 3, 4)
            ]
            prefill_cfgs = [
                {"long_block_m": m, "long_tile_n": n, "long_num_warps": w, "long_num_stages": s}
                for m, n, w, s in [
                    (64, 64, 4, 2),
                    (64, 64, 4, 3),
                    (64, 32, 4, 3),
                    (64, 128, 4, 2),
                    (128, 64, 8, 2),
                    (128, 64, 8, 3),
                    (128, 32, 8, 3),
                    (128, 128, 8, 2),
                ]
            ]
        results = self.report.setdefault("sweep", {"decode": [], "prefill": [], "decode_splits": []})
        for kind, shape, cfgs in (
            ("decode", decode_shape, decode_cfgs),
            ("decode_splits", split_shape, split_cfgs),
            ("prefill", prefill_shape, prefill_cfgs),
        ):
            case = self.case(shape, heads, seed=8)
            ref = self.attend(self.torch_ref, case)
            for overrides in cfgs:
                if not self.time_left(f"sweep {kind} {overrides}"):
                    return
                backend = self.Triton(replace(self.triton.config, **overrides))
                entry: dict[str, Any] = {"config": overrides}
                try:
                    if kind.startswith("decode"):
                        _, num_heads, head_dim = case.query.shape
                        plan = backend.plan(case.meta, num_heads, case.cache.shape[3], head_dim)
                        entry["kv_splits"] = plan.launch.num_splits
                    out = self.attend(backend, case)
                    entry["max_abs_err"] = max_error(out, ref)
                    if entry["max_abs_err"] <= TOLERANCE[self.dtype] * max(
                        1.0, float(ref.float().abs().max())
                    ):
                        entry["us"] = self.timer(partial(self.attend, backend, case))
                        if kind.startswith("decode"):
                            entry["pct_peak_hbm"] = 100 * case.kv_bytes / (entry["us"] * 1e-6) / self.peak_bw
                        else:
                            entry["tflops"] = case.causal_flops / (entry["us"] * 1e-6) / 1e12
                    else:
                        entry["error"] = "wrong result"
                        self.failed = True
                except Exception as exc:  # e.g. out of shared memory: that config is simply not viable
                    entry["error"] = repr(exc)[:300]
                results[kind].append(entry)
                print(f"  sweep {kind} {overrides}: {entry.get('us', entry.get('error'))}", flush=True)

    def e2e_decode(self) -> None:
        """Decode steps of a ~1B Llama (random weights) at batch B and context C, vs the bandwidth roofline."""
        from chunkwise.engine.attention.backend import AttentionMetadata, kv_cache_shape
        from chunkwise.engine.datatypes.config import ModelConfig
        from chunkwise.engine.model.llama import Attention, LlamaForCausalLM

        if self.smoke:
            cfg = ModelConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
            )
            batch, context, steps, warmup = 2, 24, 2, 1
        else:
            # Llama-3.2-1B's shape.
            cfg = ModelConfig(
                vocab_size=128256,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                rope_theta=500000.0,
                tie_word_embeddings=True,
                max_position_embeddings=131072,
            )
            batch, context, steps, warmup = self.args.e2e_batch, self.args.e2e_context, 30, 3
        device, dtype, bs = self.device, self.dtype, self.args.block_size
        with torch.device(device):
            model = LlamaForCausalLM(cfg, self.triton)
        with torch.no_grad():
            for name, p in model.named_parameters():
                # The layers allocate without initialising (the loader fills them): random weights here.
                p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
        model = model.to(dtype).eval()
        n_params = sum(p.numel() for p in model.parameters())
        # Weights read per step: every matrix once, plus the tied embedding again as the LM head.
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if cfg.tie_word_embeddings:
            weight_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()

        total_steps = warmup + steps + 1
        blocks_per_req = math.ceil((context + total_steps) / bs)
        num_blocks = batch * blocks_per_req + 1
        perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(9)) + 1
        tables = perm.view(batch, blocks_per_req).to(device)
        caches = [
            torch.randn(
                kv_cache_shape(num_blocks, bs, cfg.num_key_value_heads, cfg.head_dim), device=device
            ).to(dtype)
            for _ in range(cfg.num_hidden_layers)
        ]
        gen = torch.Generator().manual_seed(10)

        def step_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
            pos = context + i  # the new token's position; the context before it is already cached
            positions = torch.full((batch,), pos, device=device)
            slots = tables[:, pos // bs] * bs + pos % bs
            meta = AttentionMetadata(
                query_start_loc=torch.arange(batch + 1, device=device),
                seq_lens=torch.full((batch,), pos + 1, device=device),
                block_tables=tables,
                slot_mapping=slots,
                query_lens_host=[1] * batch,
                seq_lens_host=[pos + 1] * batch,
                max_query_len=1,
                max_seq_len=pos + 1,
                block_size=bs,
            )
            ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(device)
            return ids, positions, meta

        def set_backend(backend: Any) -> None:
            # The model plans each step with its backend; every layer attends with it.
            model.model.backend = backend
            for module in model.modules():
                if isinstance(module, Attention):
                    module.backend = backend

        def forward(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            return model.compute_logits(model(ids, positions, caches, meta))

        inputs = [step_inputs(i) for i in range(total_steps)]
        kv_bytes_step = (
            (
                2
                * cfg.num_hidden_layers
                * cfg.num_key_value_heads
                * cfg.head_dim
                * torch.finfo(dtype).bits
                // 8
            )
            * batch
            * (context + warmup + steps // 2)
        )
        roofline_step_s = (weight_bytes + kv_bytes_step) / self.peak_bw
        result: dict[str, Any] = {
            "model": asdict(cfg),
            "parameters": n_params,
            "batch": batch,
            "context": context,
            "steps_timed": steps,
            "weight_bytes_per_step": weight_bytes,
            "kv_bytes_per_step": kv_bytes_step,
            "roofline_tokens_per_s": batch / roofline_step_s,
            "note": "step = forward + LM head over the batch; metadata is built before timing",
        }
        self.report["e2e_decode"] = result

        with torch.inference_mode():
            # Correctness: the same step through both backends (each writes the same slots).
            ids, positions, meta = inputs[0]
            set_backend(self.torch_ref)
            ref = forward(ids, positions, meta)
            set_backend(self.triton)
            out = forward(ids, positions, meta)
            rel = float((out - ref).norm() / ref.norm())
            # A sanity check of the wiring (the kernels were checked closely above): rounding differences
            # pass through 16 layers here, so the bound is loose; NaN fails it.
            ok = rel < (1e-3 if dtype == torch.float32 else 0.1)
            agree = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
            self.report["correctness"].append(
                {"case": "e2e decode step logits", "relative_error": rel, "argmax_agreement": agree, "ok": ok}
            )
            print(f"  e2e step logits: relative error {rel:.2e}, argmax agreement {agree:.3f}", flush=True)
            if not ok:
                self.failed = True
                return

            def run_eager(backend: Any) -> float:
                set_backend(backend)
                for i in range(warmup):
                    forward(*inputs[i])
                self.sync()
                t0 = time.perf_counter()
                for i in range(warmup, warmup + steps):
                    forward(*inputs[i])
                self.sync()
                return (time.perf_counter() - t0) / steps

            modes: dict[str, float] = {}
            modes["triton_eager"] = run_eager(self.triton)
            if self.time_left("e2e torch reference"):
                modes["torch_ref_eager"] = run_eager(self.torch_ref)
            if self.device.type == "cuda" and self.time_left("e2e cuda graph"):
                try:
                    modes["triton_cuda_graph"] = self.graph_steps(forward, inputs, warmup, steps, set_backend)
                except Exception as exc:  # capture is an extra: report why it failed, keep the rest
                    result["cuda_graph_error"] = repr(exc)[:500]
            for mode, step_s in modes.items():
                result[mode] = {
                    "step_ms": step_s * 1e3,
                    "tokens_per_s": batch / step_s,
                    "fraction_of_roofline": roofline_step_s / step_s,
                }
                print(f"  e2e {mode}: {step_s * 1e3:.2f} ms/step, {batch / step_s:.0f} tok/s", flush=True)

    def graph_steps(
        self,
        forward: Callable[..., torch.Tensor],
        inputs: list[Any],
        warmup: int,
        steps: int,
        set_backend: Callable[[Any], None],
    ) -> float:
        """Decode steps replayed from one CUDA graph, inputs copied into its static buffers."""
        set_backend(self.triton)
        ids0, pos0, meta0 = inputs[0]
        static_ids, static_pos = ids0.clone(), pos0.clone()
        last = inputs[-1][2]
        # The launch plan is fixed at capture: give it the largest context the replays will see.
        static_meta = replace(
            meta0,
            seq_lens=meta0.seq_lens.clone(),
            slot_mapping=meta0.slot_mapping.clone(),
            seq_lens_host=list(last.seq_lens_host),
            max_seq_len=last.max_seq_len,
        )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward(static_ids, static_pos, static_meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward(static_ids, static_pos, static_meta)

        def load(i: int) -> None:
            ids, pos, meta = inputs[i]
            static_ids.copy_(ids)
            static_pos.copy_(pos)
            static_meta.seq_lens.copy_(meta.seq_lens)
            static_meta.slot_mapping.copy_(meta.slot_mapping)

        load(1)
        graph.replay()
        eager = forward(*inputs[1])
        rel = float((static_out - eager).norm() / eager.norm())
        if not rel < 1e-2:
            raise RuntimeError(f"CUDA graph replay disagrees with the eager step (relative error {rel:.2e})")
        for i in range(warmup):
            load(i)
            graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            load(i)
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- output -----------------------------------------------------------------------------------------

    def write(self) -> None:
        (self.out_dir / "attention_bench.json").write_text(json.dumps(self.report, indent=2, default=str))
        (self.out_dir / "attention_bench.md").write_text(render_markdown(self.report))


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(r: dict[str, Any]) -> str:
    env = r["environment"]
    out = ["# Triton attention benchmark", ""]
    if r["smoke"]:
        out += ["**smoke run**: tiny shapes, one iteration; the timings mean nothing.", ""]
    out += [
        f"{env.get('gpu', env['device'])}, torch {env['torch']}, triton {env['triton']}, dtype {r['dtype']}, "
        f"peak HBM assumed {r['peak_hbm_tbps_assumed']} TB/s. Times are medians of single calls with a cold L2.",
        "",
        "## Correctness (vs the torch reference, before timing)",
        "",
    ]
    out.append(
        _table(
            ["case", "max abs err / rel err", "ok"],
            [
                [c["case"], c.get("max_abs_err", c.get("relative_error", c.get("exact", ""))), c["ok"]]
                for c in r["correctness"]
            ],
        )
    )
    if r.get("decode"):
        out += ["", "## Decode attention (one query per request)", ""]
        out.append(
            _table(
                [
                    "batch",
                    "context",
                    "H/KV/D",
                    "splits",
                    "triton us",
                    "GB/s",
                    "% peak",
                    "SDPA us",
                    "SDPA GB/s",
                    "ref us",
                    "vs SDPA",
                ],
                [
                    [
                        d["batch"],
                        d["context"],
                        "/".join(map(str, d["heads"])),
                        d["kv_splits"],
                        d["triton_us"],
                        d["triton_gbps"],
                        d["triton_pct_peak_hbm"],
                        d["sdpa_us"],
                        d["sdpa_gbps"],
                        d["torch_ref_us"],
                        d["speedup_vs_sdpa"],
                    ]
                    for d in r["decode"]
                ],
            )
        )
    if r.get("prefill"):
        out += ["", "## Prefill chunks", ""]
        out.append(
            _table(
                [
                    "batch",
                    "context before",
                    "chunk",
                    "H/KV/D",
                    "triton us",
                    "tokens/s",
                    "TFLOP/s",
                    "SDPA us",
                    "SDPA TFLOP/s",
                    "vs SDPA",
                ],
                [
                    [
                        p["batch"],
                        p["context_before"],
                        p["chunk"],
                        "/".join(map(str, p["heads"])),
                        p["triton_us"],
                        p["triton_tokens_per_s"],
                        p["triton_tflops"],
                        p["sdpa_us"],
                        p["sdpa_tflops"],
                        p["speedup_vs_sdpa"],
                    ]
                    for p in r["prefill"]
                ],
            )
        )
    if r.get("mixed"):
        m = r["mixed"]
        out += ["", "## Mixed step", ""]
        out.append(
            _table(
                [
                    "decode rows x context",
                    "chunk (after context)",
                    "triton us",
                    "SDPA, two calls us",
                    "torch ref us",
                ],
                [
                    [
                        f"{m['decode_rows']} x {m['decode_context']}",
                        f"{m['prefill_chunk']} ({m['prefill_context_before']})",
                        m["triton_us"],
                        m["sdpa_two_calls_us"],
                        m["torch_ref_us"],
                    ]
                ],
            )
        )
    if r.get("sweep"):
        out += ["", "## Tile sweep", ""]
        for kind, entries in r["sweep"].items():
            rows = [
                [
                    kind,
                    json.dumps(e["config"]) + (f" ({e['kv_splits']} KV splits)" if "kv_splits" in e else ""),
                    e.get("us", ""),
                    e.get("pct_peak_hbm", e.get("tflops", "")),
                    e.get("error", ""),
                ]
                for e in entries
            ]
            if rows:
                out.append(_table(["launch", "config", "us", "% peak HBM / TFLOP/s", "error"], rows))
                out.append("")
    if r.get("e2e_decode"):
        e = r["e2e_decode"]
        out += [
            "",
            f"## End-to-end decode: {e['parameters'] / 1e9:.2f}B parameters, batch {e['batch']}, context {e['context']}",
            "",
            f"Roofline {e['roofline_tokens_per_s']:.0f} tokens/s (weights {e['weight_bytes_per_step'] / 1e9:.2f} GB + "
            f"KV {e['kv_bytes_per_step'] / 1e9:.2f} GB per step at the assumed peak).",
            "",
        ]
        rows = [
            [mode, e[mode]["step_ms"], e[mode]["tokens_per_s"], e[mode]["fraction_of_roofline"]]
            for mode in ("triton_eager", "triton_cuda_graph", "torch_ref_eager")
            if mode in e
        ]
        out.append(_table(["mode", "ms/step", "tokens/s", "fraction of roofline"], rows))
        if "cuda_graph_error" in e:
            out += ["", f"CUDA graph capture failed: `{e['cuda_graph_error']}`"]
    if r["errors"] or r["skipped"]:
        out += ["", "## Errors and skips", ""]
        out += [f"- {x['section']}: `{x['error']}`" for x in r["errors"]]
        out += [f"- skipped {s}" for s in r["skipped"]]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for attention_bench.json and attention_bench.md")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes, one iteration (runs on CPU in the interpreter)"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block (page) size in tokens")
    p.add_argument("--iters", type=int, default=30, help="timed calls per kernel measurement")
    p.add_argument(
        "--peak-tbps", type=float, default=4.8, help="HBM bandwidth the percentages refer to (H200)"
    )
    p.add_argument("--e2e-batch", type=int, default=64)
    p.add_argument("--e2e-context", type=int, default=2048)
    p.add_argument("--budget-s", type=float, default=480.0, help="start no new measurement after this long")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument(
        "--sections",
        type=lambda v: [x for x in v.split(",") if x],
        default=list(SECTIONS),
        help=f"comma-separated, run in this order: {','.join(SECTIONS)} (default: all; correctness always runs)",
    )
    args = p.parse_args(argv)
    if set(args.sections) - set(SECTIONS):
        p.error(
            f"--sections: unknown {sorted(set(args.sections) - set(SECTIONS))}; choose from {','.join(SECTIONS)}"
        )
    return args


SECTIONS = ("correctness", "decode", "prefill", "mixed", "e2e_decode", "sweep")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        # Must precede the first import of the kernels: triton.jit reads it at decoration time.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
    else:
        print("no CUDA device: this benchmark needs a GPU (use --smoke for a CPU dry run)", file=sys.stderr)
        return 2
    bench = Bench(args, device)
    torch.manual_seed(0)
    bench.section("correctness", bench.correctness)
    if bench.failed:
        bench.report["skipped"].append("all timing: correctness failed")
        bench.write()
        print("correctness failed; nothing timed", file=sys.stderr)
        return 1
    skipped = {"e2e_decode"} if args.no_e2e else set()
    skipped |= {"sweep"} if args.no_sweep else set()
    for name in SECTIONS[1:]:
        if name in args.sections and name not in skipped:
            bench.section(name, getattr(bench, name))
    print(f"wrote {bench.out_dir / 'attention_bench.json'} and attention_bench.md", flush=True)
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
