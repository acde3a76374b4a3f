"""`chunkwise replay calibrate`: time real engine steps of chosen shapes and fit the simulator's cost model.

The shapes come from small calibration workloads run on the real engine (EngineCore.step, so a step's
time includes scheduling, input preparation, the forward pass, sampling and detokenization, all of which a
served step pays): wide decode batches, long contexts, many prompts prefilled in one step, prompts of
assorted lengths, a mixed long-tailed run, and "staircases" (a decode batch shrinking a row every other step,
so every width is timed, right after a request finished and not) over short, long and shared-prefix
contexts. What each step held is recovered exactly by replaying the same workload through the same
scheduler code in the simulator (and checked against the engine's own per-step token counts), so every
timed step becomes one row of a regression of step time on the profile's features (chunkwise.sim.profile).
A step's time is its interval as the run's clock saw it (step_intervals): the engine's step plus the work
between steps that a client also waits for.

The fit is least squares on relative error (short and long steps count alike) with every coefficient
non-negative, leaving out the steps something outside the engine slowed down (fit_robust: on a shared
machine one step in a few hundred takes many times its usual time). The profile keeps the fit's error per
workload, the steps left out, the clock, the thread count and the machine.

On a shared machine, `fit_profile` also takes runs that were interleaved step by step with other work
(chunkwise.bench.offline.run_interleaved), which is how the replay-vs-real test calibrates, or runs that
took turns run by run with the runs it is compared with (`chunkwise replay validate`).
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


def _staircase(
    n: int,
    prompt: int,
    seed: int,
    *,
    shared: bool = False,
    suffix: tuple[int, int] = (16, 64),
    tail: int = 16,
) -> list[WorkItem]:
    """n requests whose outputs grow by 2 tokens each (2, 4, ...), the last `tail` tokens longer still: the
    decode batch shrinks a row every other step from n to 1, so every batch width is timed at a steady
    context length, both in a step right after a request finished (its batch changed) and in one whose
    batch is the last step's (cheaper), side by side in time; then the last request decodes alone.
    Shared: one prefix of `prompt` tokens (the prefix cache serves it to all but the first) plus each
    request's own suffix, so decode rows share KV blocks and prefill chunks start deep into a context."""
    rng = np.random.default_rng(seed)
    base = tuple(int(t) for t in rng.integers(3, 256, prompt))
    items = []
    for i in range(n):
        if shared:
            tail_len = int(rng.integers(suffix[0], suffix[1] + 1))
            ids = base + tuple(int(t) for t in rng.integers(3, 256, tail_len))
        else:
            ids = tuple(int(t) for t in rng.integers(3, 256, prompt))
        items.append(WorkItem(ids, 2 + 2 * i + (tail if i == n - 1 else 0)))
    return items


def _shared(
    n: int, prompt: int, output: int, seed: int, suffix: tuple[int, int] = (16, 128)
) -> list[WorkItem]:
    """n requests of one shared prefix plus their own suffix, all with the same output length: a wide decode
    batch over shared blocks, unchanged from step to step."""
    return [
        dataclasses.replace(it, max_tokens=output)
        for it in _staircase(n, prompt, seed, shared=True, suffix=suffix)
    ]


def _prompts(n: int, shortest: int, longest: int, output: int, seed: int) -> list[WorkItem]:
    """Prompts of assorted lengths, all at once: prefill steps of every mix of chunk lengths and counts."""
    rng = np.random.default_rng(seed)
    return [
        WorkItem(
            tuple(int(t) for t in rng.integers(3, 256, int(rng.integers(shortest, longest + 1)))), output
        )
        for _ in range(n)
    ]


def calibration_workloads(max_model_len: int, quick: bool = False) -> list[tuple[str, list[WorkItem]]]:
    """Workloads whose steps cover the features: rows, contexts, prefill chunks deep into a prompt, decode
    batches of every width, prompts sharing a prefix (prefix-cache hits, decode rows sharing blocks)."""
    from chunkwise.bench.workloads import long_tailed

    def fit(n: int) -> int:  # a prompt length that leaves room for the longest suffix and output
        return max(16, min(n, max_model_len - 256))

    long_prompt = fit(512 if quick else 1536)
    if quick:
        return [
            ("wide-decode", _uniform(32, 16, 12, 1)),
            ("long-context", _uniform(2, long_prompt, 12, 2)),
            ("many-prompts", _uniform(12, 48, 2, 3)),
            ("mixed", long_tailed(16, vocab_size=256, median_output=12, max_output=48, seed=4)),
            ("prompts", _prompts(24, 16, fit(384), 2, 5)),
            ("staircase", _staircase(16, fit(128), 6)),
            ("shared-staircase", _staircase(16, fit(384), 7, shared=True)),
        ]
    return [
        ("wide-decode", _uniform(64, 24, 16, 1)),
        ("long-context", _uniform(2, long_prompt, 16, 2)),
        ("many-prompts", _uniform(16, 64, 2, 3)),
        ("mixed", long_tailed(24, vocab_size=256, median_output=16, max_output=64, seed=4)),
        ("prompts", _prompts(48, 16, fit(512), 2, 5)),
        ("staircase", _staircase(48, 16, 6)),
        ("long-staircase", _staircase(32, fit(256), 7)),
        ("shared-staircase", _staircase(32, fit(256), 8, shared=True, suffix=(16, 128))),
        ("deep-shared-staircase", _staircase(32, fit(1024), 9, shared=True, suffix=(16, 128))),
        ("shared-decode", _shared(32, fit(1024), 24, 10)),
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


def fit_robust(x: np.ndarray, y: np.ndarray, rounds: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """fit_nonnegative, leaving out the steps something outside the engine slowed down: on a shared machine
    a step now and then takes many times its usual time (another process, a page fault storm); one such
    step among hundreds would pull every coefficient its features touch. A step is left out when it took
    longer than predicted by more than 5 robust standard deviations of the relative residuals (1.4826 x
    their median absolute deviation) above their median; refitted until that leaves out no more (at most
    `rounds` times). Returns the coefficients and the mask of the steps kept."""
    kept = np.ones(len(y), dtype=bool)
    coef = fit_nonnegative(x, y)
    for _ in range(rounds):
        pred = np.maximum(x @ coef, 1e-12)
        r = y / pred - 1
        mid = float(np.median(r[kept]))
        spread = 1.4826 * float(np.median(np.abs(r[kept] - mid)))
        now = r <= mid + 5 * max(spread, 1e-3)
        if (now == kept).all():
            break
        kept = now
        coef = fit_nonnegative(x[kept], y[kept])
    return coef, kept


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
        # Every request was added before the first step (and its cost lies there, however few it admits).
        arrivals = 0 if feats else len(items)
        feats.append((StepFeatures.of(so, bs, arrivals), (so.num_prefill_tokens, rows)))

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


def unused_terms(engine: EngineCore) -> tuple[str, ...]:
    """The cost terms that do not apply to this engine (left at 0 rather than fitted to noise)."""
    return () if engine.runner.backend.name == "torch" else ("per_decode_group_s",)


def step_intervals(run: RunResult) -> list[float]:
    """Each step's time as a client sees it: from the end of the previous step (the first: from the start of
    the run) to the end of this one, on the run's clock. Besides the engine's step that holds the host work
    between steps: admitting the requests that arrived (all of them, before the first step, in a
    calibration run) and handing each step's outputs over."""
    out = []
    prev = 0.0
    for s in run.steps:
        out.append(s.t - prev)
        prev = s.t
    return out


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
        times.extend(step_intervals(run))
    x = np.array([f.vector() for f in feats])
    y = np.array(times)
    # Only the torch reference backend pads decode rows into length groups; elsewhere the term would only
    # fit noise.
    used = [i for i, term in enumerate(LINEAR_TERMS) if term not in unused_terms(engine)]
    coef = np.zeros(len(LINEAR_TERMS))
    coef[used], kept = fit_robust(x[:, used], y)
    cost = LinearCost(*coef.tolist())
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
        # Steps left out of the fit as disturbed (see fit_robust), and their share of the measured time.
        "outliers": int((~kept).sum()),
        "outlier_time_share": float(y[~kept].sum() / y.sum()),
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
