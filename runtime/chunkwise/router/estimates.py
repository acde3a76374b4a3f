"""What a replica's /metrics says about it: load gauges now, and its speed learned over time.

The routing formula needs each replica's prefill rate and time per output token (TPOT). Neither is exported
directly, so both are learned from counters, between consecutive scrapes:

- step cost. Each step costs a fixed overhead plus a per-token part: over a scrape interval,
  Δ step seconds = a·Δ steps + b·Δ tokens (chunkwise:step_duration_seconds and vllm:iteration_tokens_total).
  A least-squares fit with exponential forgetting gives a and b; the prefill rate is 1/b, the marginal
  speed of a large prompt, which a plain tokens-per-second ratio understates whenever steps are small.
- TPOT: the mean of vllm:inter_token_latency_seconds over the interval, smoothed. An interval with no
  tokens at all makes the estimate stale: a replica measured slow once (during its warm-up, say) and then
  avoided would otherwise never be measured again, so the cost model blends a stale estimate towards the
  fleet's (`staleness`).

Until a replica has shown enough work to fit, the fleet's average (or the router's defaults) stand in; a new
replica's first busy intervals (its warm-up) are not used at all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from chunkwise import metric_names

WAITING = metric_names.NUM_REQUESTS_WAITING
RUNNING = metric_names.NUM_REQUESTS_RUNNING
KV_USAGE = metric_names.KV_CACHE_USAGE
STEP = metric_names.STEP_DURATION
ITERATION_TOKENS = metric_names.ITERATION_TOKENS
ITL = metric_names.INTER_TOKEN_LATENCY
CACHE_CONFIG_INFO = metric_names.CACHE_CONFIG_INFO
LORA_ADAPTERS = metric_names.LORA_ADAPTERS
LORA_REQUESTS_INFO = metric_names.LORA_REQUESTS_INFO
LORA_LOADS = metric_names.LORA_LOADS
LORA_LOAD_SECONDS = metric_names.LORA_LOAD_SECONDS

# Forgetting factor of the step-cost fit per scrape: about the last 10 intervals count.
FIT_DECAY = 0.9
# A fresh engine's first steps are slow (lazy initialisation, cold caches): its first intervals with work
# teach nothing about its speed, and its estimates are used only once this many intervals were fitted.
WARMUP_INTERVALS = 2
MIN_FIT_INTERVALS = 3
# Smoothing of the TPOT observations.
TPOT_ALPHA = 0.3
# An interval teaches the per-token cost only if its steps carried prefill work, not just decode rows.
MIN_TOKENS_PER_STEP = 16.0


@dataclass(frozen=True)
class MetricsSample:
    """One scrape, summed over label sets (a replica serves one model)."""

    time: float
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    step_seconds: float = 0.0
    steps: float = 0.0
    iteration_tokens: float = 0.0
    itl_seconds: float = 0.0
    itl_count: float = 0.0
    cache_blocks: int | None = None
    # LoRA: the base model's name (the metrics' model_name label), the adapters served, those whose weights
    # are on the device (a vLLM replica shows only its running ones), and the slot fills with their time.
    model_name: str | None = None
    lora_adapters: frozenset[str] = frozenset()
    lora_resident: frozenset[str] = frozenset()
    lora_loads: float = 0.0
    lora_load_seconds: float = 0.0


def parse_metrics(text: str, now: float) -> MetricsSample:
    values: dict[str, float] = {}
    cache_blocks: int | None = None
    model_name: str | None = None
    adapters: set[str] = set()
    resident: set[str] = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + float(s.value)
            model_name = model_name or s.labels.get("model_name")
            if s.name == LORA_ADAPTERS and s.labels.get("lora_name"):
                adapters.add(s.labels["lora_name"])
                if s.labels.get("resident") == "true":
                    resident.add(s.labels["lora_name"])
            elif s.name == LORA_REQUESTS_INFO:
                resident.update(n for n in s.labels.get("running_lora_adapters", "").split(",") if n)
            if s.name == CACHE_CONFIG_INFO and "num_gpu_blocks" in s.labels:
                try:
                    cache_blocks = int(float(s.labels["num_gpu_blocks"]))
                except ValueError:
                    cache_blocks = None

    def get(name: str) -> float:
        v = values.get(name, 0.0)
        return v if math.isfinite(v) else 0.0

    return MetricsSample(
        time=now,
        waiting=get(WAITING),
        running=get(RUNNING),
        kv_usage=get(KV_USAGE),
        step_seconds=get(STEP + "_sum"),
        steps=get(STEP + "_count"),
        # A histogram named ..._total: its samples are ..._total_sum and ..._total_count.
        iteration_tokens=get(ITERATION_TOKENS + "_sum"),
        itl_seconds=get(ITL + "_sum"),
        itl_count=get(ITL + "_count"),
        cache_blocks=cache_blocks,
        model_name=model_name,
        lora_adapters=frozenset(adapters),
        lora_resident=frozenset(resident),
        lora_loads=get(LORA_LOADS),
        lora_load_seconds=get(LORA_LOAD_SECONDS),
    )


# Counts changes to what the fleet averages read (a scrape observed, a replica made): the cost model
# recomputes its fleet means when it moves, not on every prediction (a pick predicts every replica).
_fleet_generation = 0


def bump_fleet_generation() -> None:
    global _fleet_generation
    _fleet_generation += 1


def fleet_generation() -> int:
    return _fleet_generation


class StepCostFit:
    """Least squares for Δtime = a·Δsteps + b·Δtokens, older intervals weighing less."""

    def __init__(self, decay: float = FIT_DECAY) -> None:
        self.decay = decay
        self._ss = self._st = self._tt = self._sy = self._ty = 0.0
        self._n = 0

    def add(self, steps: float, tokens: float, seconds: float) -> None:
        d = self.decay
        self._ss = d * self._ss + steps * steps
        self._st = d * self._st + steps * tokens
        self._tt = d * self._tt + tokens * tokens
        self._sy = d * self._sy + steps * seconds
        self._ty = d * self._ty + tokens * seconds
        self._n += 1

    @property
    def intervals(self) -> int:
        return self._n

    def solve(self) -> tuple[float, float] | None:
        """(a, b) = (seconds per step, seconds per token), or None while the data cannot separate them."""
        if self._n == 0:
            return None
        det = self._ss * self._tt - self._st * self._st
        # Nearly collinear intervals (every step the same size) cannot tell overhead from per-token cost.
        if det > 1e-9 * self._ss * self._tt:
            a = (self._sy * self._tt - self._ty * self._st) / det
            b = (self._ss * self._ty - self._st * self._sy) / det
            if a >= 0 and b > 0:
                return a, b
        # Fall back to all of the time charged to tokens: a lower bound of the rate, never an infinity.
        if self._tt > 0 and self._ty > 0:
            return 0.0, self._ty / self._tt
        return None


class ReplicaEstimates:
    """A replica's learned speed; None where nothing has been measured yet."""

    def __init__(self) -> None:
        self.fit = StepCostFit()
        self.prefill_rate: float | None = None
        self.step_overhead: float | None = None
        self.tpot: float | None = None
        self.busy_intervals = 0
        # Scrape intervals since the TPOT estimate last saw a token.
        self.staleness = 0
        self.last: MetricsSample | None = None
        # Seconds to bring a LoRA adapter into a device slot, smoothed over the fills seen.
        self.lora_load_s: float | None = None

    def __setattr__(self, name: str, value: object) -> None:
        # Whoever changes an estimate (a scrape, a test) changes the fleet's means (cost.py caches them).
        object.__setattr__(self, name, value)
        bump_fleet_generation()

    def observe(self, sample: MetricsSample) -> None:
        prev, self.last = self.last, sample
        if prev is None:
            return
        d_steps = sample.steps - prev.steps
        d_tokens = sample.iteration_tokens - prev.iteration_tokens
        d_seconds = sample.step_seconds - prev.step_seconds
        if d_steps < 0 or d_tokens < 0 or d_seconds < 0:
            return  # the replica restarted: its counters began again
        if d_steps > 0:
            self.busy_intervals += 1
        warm = self.busy_intervals > WARMUP_INTERVALS
        if warm and d_seconds > 0 and d_tokens / d_steps >= MIN_TOKENS_PER_STEP:
            self.fit.add(d_steps, d_tokens, d_seconds)
            solved = self.fit.solve()
            if solved is not None and self.fit.intervals >= MIN_FIT_INTERVALS:
                self.step_overhead, per_token = solved
                self.prefill_rate = 1.0 / per_token
        d_loads = sample.lora_loads - prev.lora_loads
        d_load_s = sample.lora_load_seconds - prev.lora_load_seconds
        if d_loads > 0 and d_load_s >= 0:
            load_s = d_load_s / d_loads
            self.lora_load_s = load_s if self.lora_load_s is None else 0.7 * self.lora_load_s + 0.3 * load_s
        d_itl = sample.itl_count - prev.itl_count
        d_itl_s = sample.itl_seconds - prev.itl_seconds
        if d_itl > 0 and d_itl_s >= 0 and warm:
            tpot = d_itl_s / d_itl
            self.tpot = tpot if self.tpot is None else (1 - TPOT_ALPHA) * self.tpot + TPOT_ALPHA * tpot
            self.staleness = 0
        elif d_itl == 0:
            self.staleness += 1


def fleet_mean(values: Iterable[float | None], default: float) -> float:
    known = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return sum(known) / len(known) if known else default
