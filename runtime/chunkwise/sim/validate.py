"""`chunkwise replay validate`: how closely the simulator reproduces a real run on this machine.

One workload runs for real on the engine `rounds` times; the same workload is replayed on a profile calibrated
in those same rounds (or a saved one), and each headline metric is compared as replay / real mean, with the
real runs' spread across rounds beside it (the noise floor of the comparison):

    mean TTFT, p99 TTFT, mean TPOT, output throughput        goal: every ratio within 1 +- 0.05

Each round runs the real workload and every calibration workload (chunkwise.sim.calibrate) once, one run at a
time on one engine, timed on the engine thread's CPU clock (other processes on a shared machine cannot
stretch it, though they still disturb a step now and then); an unrecorded warm-up round comes first (the
first run of a shape builds its kernels). One profile
is fitted to every round's calibration runs. The simulator is deterministic, so it replays once, with the
engine's own scheduler configuration, KV blocks, prefix caching and swap space: both run the same scheduler
code on the same sizes, and when every request arrives at once both take exactly the same steps (the table
shows the counts).

Why one engine, run by run, and not two engines taking turns step by step (as
tests/bench/test_calibrate_replay.py does, to share the machine's slow spells evenly): the steps of a run
interleaved with another engine's came out about 10% slower here than the same steps of a run alone (each
engine's turn evicts the other's data from the caches), which a deployment does not pay.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkwise.bench.clock import ClockName

if TYPE_CHECKING:
    from chunkwise.bench.results import RunResult
    from chunkwise.bench.workloads import WorkItem
    from chunkwise.sim.profile import Profile

# The goal: every ratio within 5% (Vidur, the reference simulator, reports up to 9% error).
GOAL = 0.05
# The engine options `replay validate` takes (the real engine's; the replay runs its scheduler configuration).
ENGINE_OPTIONS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "max_model_len",
    "num_blocks",
    "dtype",
)
# (report key, label, unit) of the metrics compared, in the table's order.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("mean_ttft_ms", "mean TTFT", "ms"),
    ("p99_ttft_ms", "p99 TTFT", "ms"),
    ("mean_tpot_ms", "mean TPOT", "ms"),
    ("output_throughput", "output throughput", "tok/s"),
)


@dataclass(frozen=True)
class MetricComparison:
    """One metric: its value in each real round, and in the replay."""

    key: str
    label: str
    unit: str
    real: tuple[float, ...]
    replay: float

    @property
    def real_mean(self) -> float:
        return statistics.fmean(self.real)

    @property
    def real_min(self) -> float:
        return min(self.real)

    @property
    def real_max(self) -> float:
        return max(self.real)

    @property
    def real_spread(self) -> float:
        """(max - min) / mean over the real rounds: how far apart the real runs themselves are."""
        mean = self.real_mean
        return (self.real_max - self.real_min) / mean if mean > 0 else math.inf

    @property
    def ratio(self) -> float:
        """replay / real mean."""
        mean = self.real_mean
        if mean > 0:
            return self.replay / mean
        return 1.0 if self.replay == 0 else math.inf

    def within(self, tolerance: float) -> bool:
        return abs(self.ratio - 1.0) <= tolerance


@dataclass(frozen=True)
class ValidationResult:
    model: str
    workload: str
    rounds: int
    clock: str
    metrics: tuple[MetricComparison, ...]
    real_steps: tuple[int, ...]
    replay_steps: int
    # The profile replayed: fitted to this validation's calibration runs (calibrated) or given. Its meta
    # holds the fit's detail (error per calibration run, the steps left out, the coefficients).
    profile: Profile
    calibrated: bool
    machine: str
    seconds: float
    goal: float = GOAL

    def metric(self, key: str) -> MetricComparison:
        for m in self.metrics:
            if m.key == key:
                return m
        raise KeyError(key)

    @property
    def passed(self) -> bool:
        return all(m.within(self.goal) for m in self.metrics)

    @property
    def max_error(self) -> float:
        return max(abs(m.ratio - 1.0) for m in self.metrics)

    def table(self) -> str:
        return format_table(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "workload": self.workload,
            "rounds": self.rounds,
            "clock": self.clock,
            "goal": self.goal,
            "passed": self.passed,
            "max_error": self.max_error,
            "metrics": {
                m.key: {
                    "label": m.label,
                    "unit": m.unit,
                    "real": list(m.real),
                    "real_mean": m.real_mean,
                    "real_spread": m.real_spread,
                    "replay": m.replay,
                    "ratio": m.ratio,
                    "pass": m.within(self.goal),
                }
                for m in self.metrics
            },
            "real_steps": list(self.real_steps),
            "replay_steps": self.replay_steps,
            "calibrated": self.calibrated,
            "profile": self.profile.to_json(),
            "machine": self.machine,
            "seconds": self.seconds,
        }


def compare(
    real_reports: Sequence[dict[str, Any]], replay_report: dict[str, Any]
) -> tuple[MetricComparison, ...]:
    """The compared metrics from the real runs' reports (one per round) and the replay's."""
    if not real_reports:
        raise ValueError("no real runs to compare with")
    return tuple(
        MetricComparison(
            key, label, unit, tuple(float(r[key]) for r in real_reports), float(replay_report[key])
        )
        for key, label, unit in METRICS
    )


def format_table(v: ValidationResult) -> str:
    head = (
        f"{'metric':<26}{'real mean':>12}{'real min-max':>22}{'spread':>8}{'replay':>12}{'ratio':>8}"
        f"   goal {1 - v.goal:.2f}-{1 + v.goal:.2f}"
    )
    lines = [
        f"replay vs real: {v.model}, {v.workload}; {v.rounds} real round(s) on the {v.clock} clock; {v.machine}",
        f"profile: {v.profile.name} ({v.profile.source})",
        head,
        "-" * len(head),
    ]
    for m in v.metrics:
        span = f"{m.real_min:.2f}-{m.real_max:.2f}"
        lines.append(
            f"{m.label + ' (' + m.unit + ')':<26}{m.real_mean:>12.2f}{span:>22}{m.real_spread:>8.1%}"
            f"{m.replay:>12.2f}{m.ratio:>8.3f}   {'PASS' if m.within(v.goal) else 'FAIL'}"
        )
    lines.append("-" * len(head))
    steps = ", ".join(str(n) for n in sorted(set(v.real_steps)))
    lines.append(
        f"steps: real {steps}, replay {v.replay_steps}; largest error {v.max_error:.1%}: "
        f"{'PASS' if v.passed else 'FAIL'} (goal {v.goal:.0%})"
    )
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_validation(
    model: str,
    engine_args: dict[str, Any],
    items: Sequence[WorkItem],
    rounds: int = 4,
    *,
    profile: Profile | None = None,
    quick: bool = False,
    clock: ClockName = "cpu",
    workload: str = "workload",
    progress: bool = False,
    goal: float = GOAL,
    warmup_rounds: int = 1,
) -> ValidationResult:
    """Run `items` on the real engine `rounds` times (after `warmup_rounds` unrecorded ones) and replay them
    on `profile`, or, when None, on a profile fitted to the calibration workloads (`quick`: the small set)
    run in the same rounds; compare the four metrics. Every item needs its max_tokens (the real engine
    cannot end a request at a hidden length)."""
    import platform

    from chunkwise.bench.offline import build_engine, run_engine, warm_up
    from chunkwise.sim.calibrate import calibration_workloads, fit_profile
    from chunkwise.sim.replay import replay

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    t0 = time.perf_counter()
    say = _log if progress else (lambda _msg: None)
    engine = build_engine(model, dict(engine_args))
    if profile is not None and profile.block_size != engine.kv.block_size:
        raise ValueError(
            f"profile {profile.name!r} has KV blocks of {profile.block_size} tokens, the engine "
            f"{engine.kv.block_size}"
        )
    warm_up(engine)
    calibrated = profile is None
    cal = calibration_workloads(engine.max_model_len, quick=quick) if calibrated else []
    reals: list[RunResult] = []
    calibration: list[tuple[Sequence[WorkItem], RunResult]] = []
    for k in range(-warmup_rounds, rounds):
        # The real run, then the calibration runs: each run follows a run of another workload, the real
        # ones included (two real runs back to back came out faster). Every run has its own cache salt, so
        # no run hits another's prefix cache.
        real = run_engine(engine, items, "real", salt=f"real-{k}", clock=clock)
        cal_runs = [(w, run_engine(engine, w, name, salt=f"{name}-{k}", clock=clock)) for name, w in cal]
        if k < 0:
            say(f"warm-up round done ({time.perf_counter() - t0:.0f} s so far)")
            continue
        reals.append(real)
        calibration += cal_runs
        say(
            f"round {k + 1}/{rounds}: real run {real.duration_s:.2f} s on the {clock} clock, "
            f"{len(real.steps)} steps, {real.report()['output_throughput']:.1f} output tok/s"
            + (f"; {len(cal)} calibration runs" if cal else "")
            + f" ({time.perf_counter() - t0:.0f} s so far)"
        )
    if profile is None:
        profile = fit_profile(engine, calibration, clock=clock, name=f"{model}-validate")
        say(
            f"fitted {profile.name}: {profile.meta['steps']} steps ({profile.meta['outliers']} left out as "
            f"disturbed), per-step median |error| {profile.meta['step_fit_median_abs_error']:.1%}"
        )
    sim = replay(
        items,
        profile,
        engine.config.scheduler,
        num_blocks=engine.num_blocks,
        enable_prefix_caching=engine.kv.enable_prefix_caching,
        num_host_blocks=engine.kv.swap_space.num_host_blocks,
        encode=engine.tokenizer.encode,
    )
    failed = [r.report()["failed"] for r in [*reals, sim]]
    if any(failed):
        raise RuntimeError(f"failed requests (real rounds, then the replay): {failed}")
    return ValidationResult(
        model=model,
        workload=workload,
        rounds=rounds,
        clock=clock,
        metrics=compare([r.report() for r in reals], sim.report()),
        real_steps=tuple(len(r.steps) for r in reals),
        replay_steps=len(sim.steps),
        profile=profile,
        calibrated=calibrated,
        machine=f"{platform.machine()}, {_cpu_model()}",
        seconds=time.perf_counter() - t0,
        goal=goal,
    )


def _cpu_model() -> str:
    """The CPU's model name (what lscpu prints), from /proc/cpuinfo where there is one."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
