"""`chunkwise replay calibrate`: time real engine steps of chosen shapes and fit the simulator's cost model.

The shapes come from small calibration workloads run on the real engine (EngineCore.step, so a step's
time includes scheduling, input preparation, the forward pass, sampling and detokenization, all of which a
served step pays): wide decode batches, long contexts, many prompts prefilled in one step, and a mixed
long-tailed run. What each step held is recovered exactly by replaying the same workload through the same
scheduler code in the simulator (and checked against the engine's own per-step token counts), so every
timed step becomes one row of a regression of step time on the profile's features (chunkwise.sim.profile).

The fit is least squares on relative error (short and long steps count alike) with every coefficient
non-negative. The profile keeps the fit's error per workload, the clock, the thread count and the machine.

On a shared machine, `fit_profile` also takes runs that were interleaved step by step with other work
(chunkwise.bench.offline.run_interleaved), which is how the replay-vs-real test calibrates.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import platform
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from chunkwise.bench.clock import ClockName
from chunkwise.bench.workloads import WorkItem
from chunkwise.sim.profile import LINEAR_TERMS, LinearCost, Profile, StepFeatures

if TYPE_CHECKING:
    from chunkwise.bench.results import RunResult
    from chunkwise.engine import EngineCore
    from chunkwise.engine.sched.output import SchedulerOutput

# The prefill rate a profile reports (for swap-or-recompute and the router) is that of a chunk this long.
_PREFILL_RATE_CHUNK = 512
_RUNS = itertools.count()


def _uniform(n: int, prompt: int, output: int, seed: int) -> list[WorkItem]:
    rng = np.random.default_rng(seed)
    return [WorkItem(tuple(int(t) for t in rng.integers(3, 256, prompt)), output) for _ in range(n)]


def calibration_workloads(max_model_len: int, quick: bool = False) -> list[tuple[str, list[WorkItem]]]:
    """Workloads whose steps cover the features: rows, contexts, prefill chunks deep into a prompt."""
    from chunkwise.bench.workloads import long_tailed

    long_prompt = min(max_model_len - 64, 512 if quick else 1536)
    if quick:
        return [
            ("wide-decode", _uniform(32, 16, 12, 1)),
            ("long-context", _uniform(2, long_prompt, 12, 2)),
            ("many-prompts", _uniform(12, 48, 2, 3)),
            ("mixed", long_tailed(16, vocab_size=256, median_output=12, max_output=48, seed=4)),
        ]
    return [
        ("wide-decode", _uniform(64, 24, 16, 1)),
        ("long-context", _uniform(2, long_prompt, 16, 2)),
        ("many-prompts", _uniform(16, 64, 2, 3)),
        ("mixed", long_tailed(24, vocab_size=256, median_output=16, max_output=64, seed=4)),
    ]


def fit_nonnegative(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Least squares with coefficients >= 0, on relative error by default.

    Relative error means weights 1/E[y], which we take from a first unweighted fit rather than from y
    itself: dividing by the measured y would favour the steps that other processes happened to slow down
    least, and bias every prediction low. Negative terms are dropped one at a time (most negative first)
    and the rest refitted: an active-set method, plenty for a handful of terms.
    """
    if weights is None:
        first = _nnls(x, y, np.ones_like(y))
        weights = 1.0 / np.maximum(x @ first, 1e-3 * max(float(np.median(y)), 1e-12))
    return _nnls(x, y, weights)


def _nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    xw = x * w[:, None]
    yw = y * w
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def schedule_of(engine: EngineCore, items: Sequence[WorkItem]) -> list[tuple[StepFeatures, tuple[int, int]]]:
    """The steps the engine's scheduler composes for `items` (all arriving at once), by replaying them in
    the simulator with the engine's own scheduler configuration: the same code makes the same decisions.
    Each step comes with (prefill tokens, decode rows) as the engine's StepStats count them, to check."""
    from chunkwise.sim.replay import replay

    proxy = Profile(
        name="schedule-only",
        kind="linear",
        source="none: only the schedule is used",
        model=engine.config.model,
        kv_bytes_per_token=1,
        host_copy_bytes_per_s=1.0,
        prefill_tokens_per_s=engine.cost_model.prefill_tokens_per_s,
        num_blocks=engine.num_blocks,
        block_size=engine.kv.block_size,
        max_model_len=engine.max_model_len,
        linear=LinearCost(1.0, 0.0, 0.0, 0.0, 0.0),
    )
    feats: list[tuple[StepFeatures, tuple[int, int]]] = []
    bs = engine.kv.block_size

    def record(_replica: int, so: SchedulerOutput) -> None:
        rows = sum(1 for sr in so.scheduled if len(sr.token_ids) == 1)
        feats.append((StepFeatures.of(so, bs), (so.num_prefill_tokens, rows)))

    replay(
        [dataclasses.replace(it, arrival_s=0.0) for it in items],
        proxy,
        engine.config.scheduler,
        enable_prefix_caching=engine.kv.enable_prefix_caching,
        num_host_blocks=engine.kv.swap_space.num_host_blocks,
        on_step=record,
        keep_steps=False,
    )
    return feats


def step_rows(engine: EngineCore, items: Sequence[WorkItem], run: RunResult) -> list[StepFeatures]:
    """The features of each step of a real run (all arrivals at 0), checked against what the engine ran."""
    steps = schedule_of(engine, items)
    real = [(s.num_prefill_tokens, s.num_decode_rows) for s in run.steps]
    if real != [check for _, check in steps]:
        raise RuntimeError(
            f"the simulator's schedule of calibration run {run.name!r} differs from the engine's; is the "
            "scheduler reading something other than its inputs (e.g. wall time)?"
        )
    return [f for f, _ in steps]


def fit_profile(
    engine: EngineCore,
    runs: Sequence[tuple[Sequence[WorkItem], RunResult]],
    *,
    clock: ClockName,
    name: str | None = None,
) -> Profile:
    """Fit a linear profile to real runs of `engine` (each with all its requests arriving at once)."""
    import torch

    from chunkwise.engine.worker.kv_tensors import kv_bytes_per_token

    feats: list[StepFeatures] = []
    times: list[float] = []
    per_run: list[tuple[str, int, int]] = []
    for items, run in runs:
        f = step_rows(engine, items, run)
        per_run.append((run.name, len(feats), len(feats) + len(f)))
        feats.extend(f)
        times.extend(s.step_s for s in run.steps)
    x = np.array([f.vector() for f in feats])
    y = np.array(times)
    cost = LinearCost(*fit_nonnegative(x, y).tolist())
    pred = x @ np.array(cost.coefficients())
    rel = (pred - y) / y
    bs = engine.kv.block_size
    model = engine.config.model
    meta: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "torch": torch.__version__,
        "device": engine.config.device,
        "dtype": engine.config.dtype,
        "clock": clock,
        "steps": len(y),
        "coefficients": dict(zip(LINEAR_TERMS, cost.coefficients())),
        "runs": [
            {
                "run": rname,
                "steps": hi - lo,
                "measured_s": float(y[lo:hi].sum()),
                "fit_s": float(pred[lo:hi].sum()),
                "fit_error": float(pred[lo:hi].sum() / y[lo:hi].sum() - 1),
            }
            for rname, lo, hi in per_run
        ],
        "step_fit_median_abs_error": float(np.median(np.abs(rel))),
        "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    prefill = StepFeatures(
        prefill_tokens=_PREFILL_RATE_CHUNK, prefill_rows=1, prefill_attention=_PREFILL_RATE_CHUNK**2 / 2
    )
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        engine.config.dtype
    ]
    return Profile(
        name=name or f"{model}-{engine.config.device}",
        kind="linear",
        source=(
            f"measured: {model} on this machine ({meta['machine']}), torch {meta['threads']} thread(s), "
            f"{len(y)} engine steps, {clock} clock"
        ),
        model=model,
        kv_bytes_per_token=kv_bytes_per_token(engine.loaded.config, dtype),
        host_copy_bytes_per_s=engine.cost_model.host_copy_bytes_per_s,
        # From the fit rather than the engine's one-shot start-up timing: steadier, and consistent with the
        # step times the simulator charges.
        prefill_tokens_per_s=_PREFILL_RATE_CHUNK / max(cost.compute_s(prefill), 1e-12),
        num_blocks=engine.num_blocks,
        block_size=bs,
        max_model_len=engine.max_model_len,
        linear=cost,
        meta=meta,
    )


def calibrate_engine(
    engine: EngineCore,
    *,
    quick: bool = False,
    repeats: int = 1,
    clock: ClockName = "wall",
    progress: bool = False,
    name: str | None = None,
) -> Profile:
    """Run the calibration workloads `repeats` times each (in turn) on `engine` and fit a profile."""
    from chunkwise.bench.offline import run_engine

    runs = []
    workloads = calibration_workloads(engine.max_model_len, quick)
    for _ in range(repeats):
        for wname, items in workloads:
            salt = f"calibrate-{next(_RUNS)}"
            runs.append((items, run_engine(engine, items, wname, salt=salt, progress=progress, clock=clock)))
    return fit_profile(engine, runs, clock=clock, name=name)


def calibrate(
    model: str = "small",
    *,
    engine_args: dict[str, Any] | None = None,
    quick: bool = False,
    repeats: int = 1,
    clock: ClockName = "wall",
    progress: bool = False,
    name: str | None = None,
) -> Profile:
    from chunkwise.bench.offline import build_engine, warm_up

    engine = build_engine(model, dict(engine_args or {}))
    warm_up(engine)
    return calibrate_engine(engine, quick=quick, repeats=repeats, clock=clock, progress=progress, name=name)
