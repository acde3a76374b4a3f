"""Side-by-side comparisons on the real engine: configurations take turns on one workload in one process
(A B B A A B ..., so a drift in machine load hits both alike), and each reported figure is the median over
repeats of a per-repeat ratio, with its range: on a shared machine absolute times are noise, ratios of
interleaved runs much less so.
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkwise.bench.clock import CLOCKS, ClockName
from chunkwise.bench.metrics import summarize
from chunkwise.bench.results import RunResult
from chunkwise.bench.workloads import WorkItem
from chunkwise.config import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from chunkwise.bench.offline import EngineRun
    from chunkwise.engine import EngineCore

# Comparisons give each engine this much KV memory unless told otherwise: ample for their workloads, and two
# engines side by side stay well inside a small machine's memory.
DEFAULT_KV_BYTES = 512 << 20


@dataclass
class Ratio:
    label: str
    values: list[float]
    goal: str = ""
    clock: str = "wall"
    # The same ratio read on the run's other clock (wall when the headline is cpu, and vice versa).
    other_values: list[float] = field(default_factory=list)
    other_clock: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "median": self.median,
            "min": min(self.values),
            "max": max(self.values),
            "values": self.values,
            "goal": self.goal,
            "clock": self.clock,
            "other_clock": self.other_clock,
            "other_values": self.other_values,
        }

    def line(self) -> str:
        spread = f"range {min(self.values):.2f}-{max(self.values):.2f}" if len(self.values) > 1 else "one run"
        goal = f"  [goal: {self.goal}]" if self.goal else ""
        other = ""
        if self.other_values:
            o = self.other_values
            other = f"; {self.other_clock} clock {statistics.median(o):.2f}x, range {min(o):.2f}-{max(o):.2f}"
        on = f" on the {self.clock} clock" if self.clock else ""
        return f"{self.label}: {self.median:.2f}x{on} (median of {len(self.values)}; {spread}{other}){goal}"


@dataclass
class Comparison:
    what: str
    results: dict[str, list[RunResult]]
    ratios: list[Ratio]
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def as_dict(self, slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
        return {
            "what": self.what,
            "info": self.info,
            "notes": self.notes,
            "ratios": [r.as_dict() for r in self.ratios],
            "runs": {name: [r.report(slos_ms) for r in runs] for name, runs in self.results.items()},
            "noise": noise(self.results),
        }


def noise(
    results: dict[str, list[RunResult]], metric: str = "output_throughput"
) -> dict[str, dict[str, float]]:
    """Per configuration and clock, (max - min) / median of `metric` over its repeats: how much the
    machine wobbled."""
    out: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        if len(runs) < 2:
            continue
        readings = {runs[0].clock: runs}
        if all(r.other is not None for r in runs):
            readings[runs[0].other.clock] = [r.other for r in runs]  # type: ignore[union-attr,misc]
        for clock, rs in readings.items():
            values = [r.report()[metric] for r in rs]
            out.setdefault(name, {})[clock] = (max(values) - min(values)) / statistics.median(values)
    return out


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }


def interleave(
    configs: Sequence[tuple[str, Callable[[int], EngineRun | RunResult]]],
    repeats: int,
    log: Callable[[str], None],
) -> dict[str, list[RunResult]]:
    """Run each configuration `repeats` times. Engine runs take turns step by step (run_interleaved), each
    timed only on its own steps, so both see the same machine at the same moments; a configuration that
    cannot be stepped (transformers' generate) runs whole, first in one repeat and last in the next."""
    from chunkwise.bench.offline import EngineRun, run_interleaved

    results: dict[str, list[RunResult]] = {name: [] for name, _ in configs}
    for rep in range(repeats):
        order = list(configs) if rep % 2 == 0 else list(reversed(configs))
        lanes: list[tuple[str, EngineRun]] = []
        for name, make in order:
            run = make(rep)
            if isinstance(run, EngineRun):
                lanes.append((name, run))
                continue
            log(f"repeat {rep + 1}/{repeats}: {name} done")
            results[name].append(run)
        if lanes:
            log(f"repeat {rep + 1}/{repeats}: {' and '.join(n for n, _ in lanes)}, step by step")
            for (name, _), [res] in zip(lanes, run_interleaved([[r] for _, r in lanes])):
                results[name].append(res)
    return results


def ratio(
    label: str,
    results: dict[str, list[RunResult]],
    num: str,
    den: str,
    metric: str | Callable[[RunResult], float],
    goal: str = "",
) -> Ratio:
    def value(r: RunResult) -> float:
        return metric(r) if callable(metric) else float(r.report()[metric])

    pairs = list(zip(results[num], results[den]))
    # A counter (a callable metric here) reads the same on every clock.
    clock = "" if callable(metric) else pairs[0][0].clock
    out = Ratio(label, [value(a) / max(value(b), 1e-12) for a, b in pairs], goal, clock=clock)
    others = [(a.other, b.other) for a, b in pairs]
    # Counters read the same on both clocks: only time-based metrics get a second reading (step times are
    # kept on the headline clock only).
    if (
        not callable(metric)
        and all(a is not None and b is not None for a, b in others)
        and metric in summarize([], 1.0)
    ):
        out.other_values = [value(a) / max(value(b), 1e-12) for a, b in others]  # type: ignore[arg-type]
        out.other_clock = others[0][0].clock  # type: ignore[union-attr]
    return out


def _engine(model: str, args: dict[str, Any]) -> EngineCore:
    from chunkwise.bench.offline import build_engine, warm_up

    engine = build_engine(model, {"kv_cache_memory_bytes": DEFAULT_KV_BYTES, **args})
    warm_up(engine)
    return engine


def _runner(
    engine: EngineCore, items: Sequence[WorkItem], name: str, progress: bool, clock: ClockName
) -> Callable[[int], EngineRun]:
    from chunkwise.bench.offline import EngineRun

    return lambda rep: EngineRun(engine, items, name, salt=f"{name}-{rep}", progress=progress, clock=clock)


# -- continuous vs static batching --------------------------------------------------------------------------
def compare_batching(
    model: str,
    items: Sequence[WorkItem],
    *,
    max_num_seqs: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    from chunkwise.bench.workloads import useful_work_fraction

    args = {**(engine_args or {}), "max_num_seqs": max_num_seqs}
    static = _engine(model, {**args, "batching": "static"})
    cont = _engine(model, {**args, "batching": "continuous"})
    results = interleave(
        [
            ("static", _runner(static, items, "static", progress, clock)),
            ("continuous", _runner(cont, items, "continuous", progress, clock)),
        ],
        repeats,
        log,
    )
    u = useful_work_fraction([it.output_len for it in items], max_num_seqs)
    return Comparison(
        "batching",
        results,
        [
            ratio(
                "continuous/static output throughput",
                results,
                "continuous",
                "static",
                "output_throughput",
                "3x or more",
            ),
            ratio("static/continuous mean e2e latency", results, "static", "continuous", "mean_e2el_ms"),
        ],
        info={
            "useful_work_fraction": u,
            "max_num_seqs": max_num_seqs,
            "num_requests": len(items),
            # Static batching computes a padding row per held slot of a finished request, as the seed's does.
            "static_padding_share": padding_share(results["static"]),
            "continuous_padding_share": padding_share(results["continuous"]),
        },
    )


def padding_share(runs: Sequence[RunResult]) -> float:
    """Padding rows over all rows computed (real + padding), over the runs together."""
    pad = sum(r.counters.get("num_padding_rows", 0) for r in runs)
    real = sum(r.counters.get("num_rows", 0) for r in runs)
    return pad / max(1, pad + real)


# -- chunked vs unchunked prefill ---------------------------------------------------------------------------
def compare_chunked(
    model: str,
    items: Sequence[WorkItem],
    *,
    max_model_len: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    args = {**(engine_args or {}), "max_model_len": max_model_len}
    unchunked = _engine(
        model, {**args, "enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len}
    )
    chunked = _engine(model, {**args, "enable_chunked_prefill": True})
    results = interleave(
        [
            ("unchunked", _runner(unchunked, items, "unchunked", progress, clock)),
            ("chunked", _runner(chunked, items, "chunked", progress, clock)),
        ],
        repeats,
        log,
    )
    budget = chunked.config.scheduler.max_num_batched_tokens
    return Comparison(
        "chunked",
        results,
        [
            ratio("unchunked/chunked p99 ITL", results, "unchunked", "chunked", "p99_itl_ms", "5x or more"),
            ratio("unchunked/chunked max ITL", results, "unchunked", "chunked", "max_itl_ms"),
            ratio("unchunked/chunked max step time", results, "unchunked", "chunked", "max_step_ms"),
            ratio(
                "chunked/unchunked output throughput", results, "chunked", "unchunked", "output_throughput"
            ),
        ],
        info={"max_model_len": max_model_len, "chunked_budget": budget, "num_requests": len(items)},
    )


# -- prefix caching on vs off -------------------------------------------------------------------------------
def compare_prefix(
    model: str,
    items: Sequence[WorkItem],
    *,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    args = dict(engine_args or {})
    off = _engine(model, {**args, "enable_prefix_caching": False})
    on = _engine(model, {**args, "enable_prefix_caching": True})
    results = interleave(
        [
            ("off", _runner(off, items, "off", progress, clock)),
            ("on", _runner(on, items, "on", progress, clock)),
        ],
        repeats,
        log,
    )

    def prefill(r: RunResult) -> float:
        return float(r.counters["num_prefill_tokens"])

    saved = [1 - prefill(a) / prefill(b) for a, b in zip(results["on"], results["off"])]
    hit = [
        r.counters["prefix_cache_hits"] / max(1, r.counters["prefix_cache_queries"]) for r in results["on"]
    ]
    return Comparison(
        "prefix",
        results,
        [
            ratio("off/on prefill tokens computed", results, "off", "on", prefill),
            ratio("on/off output throughput", results, "on", "off", "output_throughput"),
            ratio("off/on mean TTFT", results, "off", "on", "mean_ttft_ms"),
        ],
        info={
            "prefill_tokens_saved_fraction": statistics.median(saved),
            "prefix_cache_hit_rate": statistics.median(hit),
            "num_requests": len(items),
        },
    )


# -- chunkwise vs transformers ------------------------------------------------------------------------------
def compare_hf(
    model: str,
    items: Sequence[WorkItem],
    *,
    concurrency: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    agreement_prompts: int = 3,
    agreement_tokens: int = 16,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    from chunkwise.bench.hf import greedy_agreement, load_hf_model, run_hf
    from chunkwise.bench.workloads import useful_work_fraction

    engine = _engine(model, {**(engine_args or {}), "max_num_seqs": concurrency})
    hf = load_hf_model(model, engine.config.dtype)
    agree = greedy_agreement(
        hf, engine, [it.token_ids() for it in items[:agreement_prompts]], agreement_tokens
    )
    log(f"greedy agreement (equal leading tokens / generated), transformers vs chunkwise: {agree}")
    from chunkwise.bench.offline import EngineRun

    run_hf(hf, items[: min(len(items), 2)], 2)  # warm-up
    results: dict[str, list[RunResult]] = {"transformers": [], "chunkwise": []}
    for rep in range(repeats):
        # generate() cannot be stepped from outside, but its streamer is called after every step: chunkwise
        # takes its turns there, so the two still alternate step by step; whichever finishes first leaves
        # the other to run alone.
        ours = EngineRun(engine, items, "chunkwise", salt=f"chunkwise-{rep}", progress=progress, clock=clock)
        ours.rc.pause()

        def turn(run: EngineRun = ours) -> None:
            if not run.done:
                run.rc.resume()
                run.advance()
                run.rc.pause()

        log(f"repeat {rep + 1}/{repeats}: transformers and chunkwise, step by step")
        theirs, _ = run_hf(hf, items, concurrency, progress=progress, clock=clock, between_steps=turn)
        while not ours.done:
            turn()
        results["transformers"].append(theirs)
        results["chunkwise"].append(ours.result())
    return Comparison(
        "hf",
        results,
        [
            ratio(
                f"chunkwise/transformers output throughput at concurrency {concurrency}",
                results,
                "chunkwise",
                "transformers",
                "output_throughput",
                "5x or more",
            ),
        ],
        notes=[
            "transformers: generate() on left-padded static batches of the given concurrency, each batch "
            "running to its longest max_tokens (EOS ignored), useful tokens counted",
        ],
        info={
            "greedy_agreement": [list(a) for a in agree],
            "concurrency": concurrency,
            "useful_work_fraction": useful_work_fraction([it.output_len for it in items], concurrency),
            "num_requests": len(items),
        },
    )


# -- host work per step at a full batch --------------------------------------------------------------------
# The step loop's own host work, and the output side's (AsyncEngine runs it on its output thread, beside the
# next step's forward; the offline API runs it after each step).
LOOP_PARTS = ("schedule", "prepare", "sample", "update")
HOST_PARTS = (*LOOP_PARTS, "output")


def scheduler_overhead(
    model: str,
    *,
    num_running: int,
    prompt_len: int,
    max_tokens: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    """The engine's host work per step (StepStats) over the steps that hold `num_running` decoding requests:
    the step loop's share (everything outside the forward but output processing), each part, and output
    processing beside it."""
    engine = _engine(model, {**(engine_args or {}), "max_num_seqs": num_running})
    items = [
        WorkItem(tuple(3 + (i * 7 + j) % 250 for j in range(prompt_len)), max_tokens)
        for i in range(num_running)
    ]
    results = interleave(
        [("full-batch", _runner(engine, items, "full-batch", progress, clock))], repeats, log
    )
    full = [
        s
        for r in results["full-batch"]
        for s in r.steps
        if s.num_running == num_running and s.num_prefill_tokens == 0
    ]
    if not full:
        raise RuntimeError(f"no step held {num_running} running requests; raise the KV cache or max_tokens")

    def ms(values: Sequence[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {
            "median_ms": statistics.median(ordered) * 1000,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
        }

    parts = {name: ms([getattr(s, f"{name}_s") for s in full]) for name in HOST_PARTS}
    loop = ms([s.host_s - s.output_s for s in full])
    for name, v in parts.items():
        log(f"  {name:>8}: median {v['median_ms']:.3f} ms, p99 {v['p99_ms']:.3f} ms")
    log(
        f"  step loop's host work (step - forward - output): median {loop['median_ms']:.3f} ms, "
        f"p99 {loop['p99_ms']:.3f} ms"
    )
    return Comparison(
        "sched-overhead",
        results,
        [],
        notes=[
            "host work = the step outside the forward (model, logits, sampler up to the ids on the host); the "
            "step loop's share excludes output processing (detokenization, stop strings), which the server "
            "runs on its output thread while the next step computes",
        ],
        info={
            "num_running": num_running,
            "steps_measured": len(full),
            "median_loop_host_ms": loop["median_ms"],
            "p99_loop_host_ms": loop["p99_ms"],
            "median_output_ms": parts["output"]["median_ms"],
            "host_parts": parts,
            "median_forward_ms": statistics.median(s.forward_s for s in full) * 1000,
            "median_loop_host_share_of_step": statistics.median(
                (s.host_s - s.output_s) / s.engine_step_s for s in full
            ),
            "median_schedule_ms": parts["schedule"]["median_ms"],
            "p99_schedule_ms": parts["schedule"]["p99_ms"],
        },
    )


# -- swap vs recompute --------------------------------------------------------------------------------------
@dataclass
class PreemptionTiming:
    context: int
    mode: str
    extra_seconds: list[float]


def _forced_preemption(engine: EngineCore, context: int, tag: str, clock: ClockName = "wall") -> float:
    """One forced preemption of a request of `context` tokens; returns the time it added.

    Two requests fill the cache exactly: O (older, short prompt) and V (the victim, `context` tokens). Both
    reserve one block of output (cold-start estimate 1), so when O outgrows its reservation the cache is
    full and the scheduler preempts V (the newest). O is then aborted, so V resumes at the next step. The
    preemption's cost is the extra time of the step that preempted V (the swap-out copies, for swap) plus
    the extra time of the step that resumed it (the swap-in, or the re-prefill), each against the step right
    after it, which holds the same decode rows without the preemption work.
    """
    bs = engine.kv.block_size
    stats = engine.stats
    prompt_o = [3 + i % 250 for i in range(2 * bs)]
    prompt_v = [5 + (i * 13) % 250 for i in range(context)]
    from chunkwise.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    o = f"{tag}-o"
    v = f"{tag}-v"
    engine.add_request(o, prompt_o, sp, cache_salt=tag)
    engine.add_request(v, prompt_v, sp, cache_salt=tag)
    before = stats.num_preemptions_swap + stats.num_preemptions_recompute

    read = CLOCKS[clock]

    def step() -> float:
        t0 = read()
        engine.step()
        return read() - t0

    guard = 0
    t_pre = step()
    while stats.num_preemptions_swap + stats.num_preemptions_recompute == before:
        t_pre = step()
        guard += 1
        if guard > 4 * bs:
            raise RuntimeError("no preemption happened; the cache is not as tight as planned")
    t_after_pre = step()
    engine.abort([o])
    t_resume = step()
    t_after_resume = step()
    engine.abort([v])
    while engine.has_unfinished():
        engine.step()
    return (t_pre - t_after_pre) + (t_resume - t_after_resume)


def compare_preemption(
    model: str,
    contexts: Sequence[int],
    *,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> tuple[list[PreemptionTiming], dict[str, Any]]:
    """Time forced swap and forced recompute preemptions of several context lengths on the real engine."""
    timings: list[PreemptionTiming] = []
    predicted: dict[str, list[float]] = {"swap": [], "recompute": []}
    rates: dict[str, float] = {}
    bs = DEFAULT_BLOCK_SIZE
    for ctx in contexts:
        # O: 2 prompt blocks + 1 reserved; V: ctx tokens + 1 reserved block; nothing else.
        num_blocks = 2 + 1 + -(-ctx // bs) + 1
        engines = {}
        for mode in ("swap", "recompute"):
            engines[mode] = _engine(
                model,
                {
                    **(engine_args or {}),
                    "preemption_mode": mode,
                    "enable_prefix_caching": False,
                    "num_blocks": num_blocks,
                    "kv_cache_memory_bytes": None,
                    "block_size": bs,
                    "max_model_len": num_blocks * bs,
                    "max_num_batched_tokens": num_blocks * bs,
                    "long_prompt_threshold": num_blocks * bs + 1,
                    "cold_start_output_tokens": 1,
                },
            )
        got: dict[str, list[float]] = {"swap": [], "recompute": []}
        for rep in range(repeats):
            order = ("swap", "recompute") if rep % 2 == 0 else ("recompute", "swap")
            for mode in order:
                eng = engines[mode]
                got[mode].append(_forced_preemption(eng, ctx, f"{mode}-{ctx}-{rep}", clock))
                counts = (eng.stats.num_preemptions_swap, eng.stats.num_preemptions_recompute)
                if (mode == "swap") != (counts[0] > 0) or (mode == "recompute") != (counts[1] > 0):
                    raise RuntimeError(f"forced {mode} preemption took another path: {counts}")
            log(
                f"context {ctx}: swap {got['swap'][-1] * 1000:.1f} ms, recompute {got['recompute'][-1] * 1000:.1f} ms"
            )
        cm = engines["swap"].cost_model
        predicted["swap"].append(cm.swap_cost_s(ctx))
        predicted["recompute"].append(engines["recompute"].cost_model.recompute_cost_s(ctx))
        rates = {
            "host_copy_bytes_per_s": cm.host_copy_bytes_per_s,
            "prefill_tokens_per_s": engines["recompute"].cost_model.prefill_tokens_per_s,
            "kv_bytes_per_token": cm.kv_bytes_per_token,
        }
        for mode in ("swap", "recompute"):
            timings.append(PreemptionTiming(ctx, mode, got[mode]))
        engines.clear()
        gc.collect()
    return timings, {"predicted_s": predicted, "rates": rates, "contexts": list(contexts)}


def crossover(contexts: Sequence[int], swap_s: Sequence[float], recompute_s: Sequence[float]) -> float | None:
    """The context length where the cheaper mode changes, interpolated linearly between the two measured
    lengths around the first change; None when one mode is cheaper at every measured length."""
    pts = sorted(zip(contexts, swap_s, recompute_s))
    for (l0, s0, r0), (l1, s1, r1) in itertools.pairwise(pts):
        d0, d1 = s0 - r0, s1 - r1
        if d0 == 0:
            return float(l0)
        if (d0 < 0) != (d1 < 0):
            return l0 + (l1 - l0) * d0 / (d0 - d1)
    return None


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
