"""Autoscalers for the simulator's loop: the fleet's signals over a window in, a replica count out.

The replay loop calls `evaluate` every interval of virtual time and applies the count it returns (a
replica added cold-starts, one removed drains). Each autoscaler is an object with that one method and no
other tie to the loop: its state (stabilization history, scale events, last activity) lives inside it, and
its times are the loop's virtual seconds.

- `ChunkwiseAutoscaler` runs the operator's own decision (`chunkwise_operator.autoscale.decide`) on
  signals built the way the operator builds them from the pods' /metrics (`chunkwise_operator.scrape`).
- `KedaQueueDepth` and `HpaKvUsage` are the baselines a user would deploy instead: KEDA's Prometheus scaler
  on `vllm:num_requests_waiting`, and a HorizontalPodAutoscaler on `vllm:kv_cache_usage_perc`. Both end in
  HPA's algorithm (tolerance, stabilization windows, rate limits: `_HpaBehavior`), with its defaults.

`make_autoscaler(name, **kw)` builds one by name: "chunkwise", "keda-queue", "hpa-kv".
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from chunkwise_operator.autoscale import Behavior, Decision, Recommendation, ScaleEvent
    from chunkwise_operator.scrape import PodSample
    from chunkwise_operator.spec import AutoscalingTargets

# An InferenceService's autoscaling defaults (chunkwise_operator.spec.AutoscalingSpec: minReplicas 1,
# maxReplicas 4), for every autoscaler here, so that a comparison left at its defaults runs each one over the
# same range. Not imported: the runtime may lack the operator package; a test pins them to the spec's.
DEFAULT_MIN_REPLICAS = 1
DEFAULT_MAX_REPLICAS = 4

# HPA's defaults (https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/): the
# cluster-wide tolerance (--horizontal-pod-autoscaler-tolerance), and autoscaling/v2's default `behavior`:
# scale up with no stabilization, by at most max(4 pods, 100%) per 15 s; scale down over a 300 s
# stabilization window, by at most 100% per 15 s.
HPA_TOLERANCE = 0.1
HPA_SCALE_UP_STABILIZATION_S = 0.0
HPA_SCALE_DOWN_STABILIZATION_S = 300.0
HPA_SCALE_UP_PODS = 4
HPA_SCALE_UP_PERCENT = 100.0
HPA_SCALE_DOWN_PERCENT = 100.0
HPA_POLICY_PERIOD_S = 15.0

# KEDA's ScaledObject default cooldownPeriod (https://keda.sh/docs/latest/reference/scaledobject-spec/):
# how long the triggers must be inactive before a ScaledObject with minReplicaCount 0 goes to 0.
KEDA_COOLDOWN_S = 300.0
# The vLLM production stack's KEDA recipe (docs.vllm.ai/projects/production-stack, "Autoscaling with KEDA"):
# query vllm:num_requests_waiting, threshold "5" (an AverageValue target: 5 waiting per replica).
DEFAULT_QUEUE_TARGET = 5.0
# The "HPA on vllm:kv_cache_usage_perc" recipe's usual target: 70% of the KV cache, averaged over pods.
DEFAULT_KV_TARGET = 0.7

# chunkwise:step_duration_seconds's buckets, as the engine exports them
# (chunkwise.engine.loop.metrics.STEP_DURATION_BUCKETS; a test pins the two equal). Copied, not imported:
# importing the engine's loop package imports torch, which the simulator does without. The operator sees
# step times only through these buckets, so the simulated p99 is interpolated within them as its is.
STEP_DURATION_BUCKETS = (
    0.001, 0.00125, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.008,
    0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08,
    0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
)  # fmt: skip


@dataclass(frozen=True)
class ReplicaSignals:
    """One replica over the last evaluation window."""

    ready: bool  # False while it cold-starts
    not_ready_since: float | None  # virtual seconds when it was created (None when ready)
    waiting: int  # requests waiting now (the scheduler's waiting + swapped)
    running: int
    kv_usage: float  # 0..1, now
    preemptions: int  # in the window
    step_times_s: Sequence[float]  # the window's step durations (for the p99); may be empty
    requests: int  # requests it saw in the window (arrived, running or finished)

    def __post_init__(self) -> None:
        for name in ("waiting", "running", "preemptions", "requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"ReplicaSignals.{name} must be >= 0, got {getattr(self, name)}")
        if not self.kv_usage >= 0.0 or not math.isfinite(self.kv_usage):
            raise ValueError(f"ReplicaSignals.kv_usage must be a fraction >= 0, got {self.kv_usage}")


@dataclass(frozen=True)
class FleetSignals:
    now: float  # virtual seconds
    window_s: float
    # Every replica that exists (ready or starting); not the draining ones.
    replicas: Sequence[ReplicaSignals]
    # Requests the router holds because no replica is ready (scaling from zero).
    held: int = 0

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not math.isfinite(self.window_s):
            raise ValueError(f"FleetSignals.window_s must be > 0, got {self.window_s}")
        if self.held < 0:
            raise ValueError(f"FleetSignals.held must be >= 0, got {self.held}")


class Autoscaler(Protocol):
    name: str

    def evaluate(self, signals: FleetSignals) -> int:
        """The desired replica count."""
        ...


def _check_range(min_replicas: int, max_replicas: int, who: str) -> None:
    for label, value in (("min_replicas", min_replicas), ("max_replicas", max_replicas)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{who}: {label} must be an integer, got {value!r}")
    if min_replicas < 0:
        raise ValueError(f"{who}: min_replicas must be >= 0, got {min_replicas}")
    if max_replicas < 1:
        raise ValueError(f"{who}: max_replicas must be >= 1, got {max_replicas}")
    if min_replicas > max_replicas:
        raise ValueError(
            f"{who}: min_replicas ({min_replicas}) must not exceed max_replicas ({max_replicas})"
        )


def _positive(value: float, label: str, who: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or not math.isfinite(value)
    ):
        raise ValueError(f"{who}: {label} must be a finite number > 0, got {value!r}")
    return float(value)


def _non_negative(value: float, label: str, who: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value >= 0
        or not math.isfinite(value)
    ):
        raise ValueError(f"{who}: {label} must be a finite number >= 0, got {value!r}")
    return float(value)


# -- chunkwise: the operator's decision ---------------------------------------------------------------------


def _operator_modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    """chunkwise_operator's autoscale, scrape and spec modules, or an ImportError that says what to install."""
    try:
        from chunkwise_operator import autoscale, scrape, spec
    except ImportError as e:
        raise ImportError(
            "the 'chunkwise' autoscaler runs the operator's own decision (chunkwise_operator.autoscale), and "
            f"the operator package is not importable here ({e}); install chunkwise with its operator extra "
            "(pip install 'chunkwise[operator]'), or pick the 'keda-queue' or 'hpa-kv' autoscaler"
        ) from e
    return autoscale, scrape, spec


def _cumulative_buckets(step_times_s: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """The window's step times as the engine's histogram would count them: cumulative (le, count), +Inf last
    (prometheus_client puts a value in the first bucket whose upper bound is >= it)."""
    bounds = (*STEP_DURATION_BUCKETS, math.inf)
    counts = [0.0] * len(bounds)
    for t in step_times_s:
        for i, le in enumerate(bounds):
            if t <= le:
                counts[i] += 1.0
                break
    result = []
    total = 0.0
    for le, c in zip(bounds, counts):
        total += c
        result.append((le, total))
    return tuple(result)


class ChunkwiseAutoscaler:
    """The operator's autoscaler, `chunkwise_operator.autoscale.decide`, evaluated on simulated replicas.

    Each evaluation does what the operator's `Reconciler.evaluate_autoscaler` does with the pods (reconcile.py):
    the ready replicas are the scraped pods, and their window becomes a pair of `scrape.PodSample`s (one at the
    window's start with zeroed counters, one now) that the operator's own `scrape.signals` turns into
    `Observed`: queue depth (waiting, plus the router's held requests) and KV usage summed over the ready
    replicas and divided by the whole count, the preemption rate per second over the window, the p99 step
    time from the merged histogram. The not-ready replicas give `unready_since`; `autoscale.starting` and
    `autoscale.last_activity` give the idle time for scaling to zero; history and scale events carry over
    from one evaluation to the next, as status.autoscaler carries them in the cluster.

    One difference from the cluster: the operator rates counters only for a pod it scraped at the previous
    evaluation too, so a replica's first window after it turns ready adds no preemption rate, no step times and
    no finished requests there; here every ready replica's window counts (a replica knows its own window).

    Defaults are the InferenceService's (chunkwise_operator.spec.AutoscalingSpec): targets, tolerances,
    stabilization windows (scale up 30 s, scale down 300 s; `Behavior.from_spec`), scaleToZeroAfterSeconds
    300 (read only with min_replicas 0, as in the operator; None turns it off). The startup grace defaults
    to `cold_start_s`, the simulated replicas' startup time, which is what a startup probe's budget would be
    sized to; without it, to the operator's default (autoscale.STARTUP_GRACE_S).
    """

    name = "chunkwise"

    def __init__(
        self,
        *,
        min_replicas: int = DEFAULT_MIN_REPLICAS,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        targets: AutoscalingTargets | Mapping[str, float] | None = None,
        scale_to_zero_after_s: float | None = 300.0,
        behavior: Behavior | None = None,
        grace_s: float | None = None,
        cold_start_s: float | None = None,
    ) -> None:
        who = "chunkwise autoscaler"
        autoscale, scrape, spec = _operator_modules()
        self._autoscale = autoscale
        self._scrape = scrape
        _check_range(min_replicas, max_replicas, who)
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        defaults = autoscale.per_metric(spec.AutoscalingTargets())
        if targets is None:
            resolved = dict(defaults)
        elif isinstance(targets, spec.AutoscalingTargets):
            resolved = autoscale.per_metric(targets)
        elif isinstance(targets, Mapping):
            unknown = sorted(set(targets) - set(autoscale.METRICS))
            if unknown:
                raise ValueError(f"{who}: unknown target(s) {unknown}; known: {list(autoscale.METRICS)}")
            resolved = {**defaults, **targets}
        else:
            raise ValueError(f"{who}: targets must be an AutoscalingTargets or a mapping, got {targets!r}")
        self.targets: dict[str, float] = {k: _positive(v, f"target {k}", who) for k, v in resolved.items()}
        if scale_to_zero_after_s is not None:
            scale_to_zero_after_s = _positive(scale_to_zero_after_s, "scale_to_zero_after_s", who)
        self.scale_to_zero_after_s = scale_to_zero_after_s
        if behavior is None:
            behavior = autoscale.Behavior.from_spec(spec.AutoscalingSpec())
        elif not isinstance(behavior, autoscale.Behavior):
            raise ValueError(
                f"{who}: behavior must be a chunkwise_operator.autoscale.Behavior, got {behavior!r}"
            )
        self.behavior: Behavior = behavior
        if cold_start_s is not None:
            cold_start_s = _non_negative(cold_start_s, "cold_start_s", who)
        if grace_s is None:
            grace_s = cold_start_s if cold_start_s is not None else float(autoscale.STARTUP_GRACE_S)
        self.grace_s = _non_negative(grace_s, "grace_s", who)
        self._history: tuple[Recommendation, ...] = ()
        self._events: tuple[ScaleEvent, ...] = ()
        self._last_active: float | None = None
        # The last evaluation's whole decision (reason, message, proposals), for the loop to record.
        self.last_decision: Decision | None = None

    @property
    def last_reason(self) -> str | None:
        return None if self.last_decision is None else self.last_decision.reason

    def _samples(self, signals: FleetSignals) -> tuple[list[PodSample], dict[str, PodSample]]:
        """Each ready replica's window as two scrapes of its pod: at the window's start and now."""
        sample = self._scrape.PodSample
        start = signals.now - signals.window_s
        zero = tuple((le, 0.0) for le in (*STEP_DURATION_BUCKETS, math.inf))
        samples, previous = [], {}
        for i, r in enumerate(x for x in signals.replicas if x.ready):
            key = f"replica-{i}"
            previous[key] = sample(
                key=key, time=start, waiting=0.0, kv_usage=0.0, preemptions=0.0, step_buckets=zero
            )
            samples.append(
                sample(
                    key=key,
                    time=signals.now,
                    waiting=float(r.waiting),
                    kv_usage=float(r.kv_usage),
                    preemptions=float(r.preemptions),
                    step_buckets=_cumulative_buckets(r.step_times_s),
                    running=float(r.running),
                    # scrape.signals counts waiting + running now, plus the requests finished in the window:
                    # the rest of what the replica saw is what finished.
                    finished=float(max(0, r.requests - r.waiting - r.running)),
                )
            )
        return samples, previous

    def evaluate(self, signals: FleetSignals) -> int:
        a = self._autoscale
        now = signals.now
        current = len(signals.replicas)
        # autoscale.not_ready_since: since when each not-ready pod is not ready; `now` when unknown.
        unready_since = tuple(
            sorted(
                now if r.not_ready_since is None else min(r.not_ready_since, now)
                for r in signals.replicas
                if not r.ready
            )
        )
        samples, previous = self._samples(signals)
        # The router's held requests (scrape.held), which the operator reads whenever the router is enabled:
        # the simulator always routes.
        observed = self._scrape.signals(samples, previous, current, float(signals.held))
        young = a.starting(current, observed.ready_replicas, unready_since, now, self.grace_s)
        self._last_active = a.last_activity(self._last_active, observed.requests, young, now)
        decision = a.decide(
            current=current,
            observed=observed,
            targets=self.targets,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            behavior=self.behavior,
            history=self._history,
            events=self._events,
            now=now,
            idle_s=now - self._last_active,
            scale_to_zero_after_s=self.scale_to_zero_after_s,
            unready_since=unready_since,
            grace_s=self.grace_s,
        )
        self._history, self._events = decision.history, decision.events
        self.last_decision = decision
        return int(decision.desired)


# -- HPA's algorithm, for the baselines ----------------------------------------------------------------------


@dataclass
class _HpaBehavior:
    """HPA's normalization of a metric's recommendation (pkg/controller/podautoscaler/horizontal.go:
    stabilizeRecommendationWithBehaviors, convertDesiredReplicasWithBehaviorRate), with its default behavior.

    Stabilization: every raw recommendation is kept with its time; the count goes up to at most the smallest
    of the scale-up window and down to at least the largest of the scale-down window (a sample counts while
    it is younger than the window). Rate: within a policy's period, a scale up reaches at most the largest of
    the policies' limits (periodStart + pods, ceil(periodStart × (1 + percent))), a scale down at least the
    smallest (periodStart × (1 − percent), truncated); periodStart is the count before the period's own scale
    events. Then [min, max].
    """

    scale_up_stabilization_s: float = HPA_SCALE_UP_STABILIZATION_S
    scale_down_stabilization_s: float = HPA_SCALE_DOWN_STABILIZATION_S
    scale_up_pods: int = HPA_SCALE_UP_PODS
    scale_up_percent: float = HPA_SCALE_UP_PERCENT
    scale_down_percent: float = HPA_SCALE_DOWN_PERCENT
    period_s: float = HPA_POLICY_PERIOD_S
    _recommendations: list[tuple[float, int]] = field(default_factory=list)
    _events: list[tuple[float, int]] = field(default_factory=list)  # (time, signed change)

    def normalize(self, current: int, raw: int, lo: int, hi: int, now: float) -> int:
        up, down = raw, raw
        for t, r in self._recommendations:
            if t > now - self.scale_up_stabilization_s:
                up = min(up, r)
            if t > now - self.scale_down_stabilization_s:
                down = max(down, r)
        stabilized = current
        if stabilized < up:
            stabilized = up
        if stabilized > down:
            stabilized = down
        keep = max(self.scale_up_stabilization_s, self.scale_down_stabilization_s)
        self._recommendations = [(t, r) for t, r in self._recommendations if t > now - keep]
        self._recommendations.append((now, raw))

        recent = [(t, c) for t, c in self._events if t > now - self.period_s]
        added = sum(c for _, c in recent if c > 0)
        deleted = -sum(c for _, c in recent if c < 0)
        start = current - added + deleted
        desired = stabilized
        if desired > current:
            limit = max(start + self.scale_up_pods, math.ceil(start * (1 + self.scale_up_percent / 100)))
            desired = min(desired, max(limit, current), hi)
        elif desired < current:
            limit = int(start * (1 - self.scale_down_percent / 100))
            desired = max(desired, min(limit, current), lo)
        desired = min(max(desired, lo), hi)
        self.record(current, desired, now)
        return desired

    def record(self, current: int, desired: int, now: float) -> None:
        """A scale event of HPA's own (it counts against the rate limits of the period)."""
        self._events = [(t, c) for t, c in self._events if t > now - self.period_s]
        if desired != current:
            self._events.append((now, desired - current))


def _hpa_reason(current: int, raw: int, desired: int, lo: int, hi: int) -> str:
    """Why HPA moved or held the count, in the operator's reason words (chunkwise_operator.autoscale)."""
    if desired > current:
        return "ScaledUp"
    if desired < current:
        return "ScaledDown"
    if raw == current:
        return "WithinTolerance"
    if raw > current:
        return "AtMaxReplicas" if current >= hi else "ScaleUpLimited"
    return "AtMinReplicas" if current <= lo else "ScaleDownStabilized"


class KedaQueueDepth:
    """KEDA's Prometheus scaler on the queue: what a user of vLLM's production stack deploys.

    The recipe (docs.vllm.ai/projects/production-stack, "Autoscaling with KEDA") queries
    vllm:num_requests_waiting with threshold "5"; the query here also adds the router's held requests (they
    wait as much as a replica's queue does; KEDA's HTTP add-on counts its held requests the same way). KEDA
    hands the sum to an HPA it creates as an External metric with an AverageValue target
    (https://keda.sh/docs/latest/concepts/scaling-deployments/), so HPA decides from 1 replica up
    (pkg/controller/podautoscaler/replica_calculator.go, GetExternalPerPodMetricReplicas):
    desired = ceil(total / target), unless total / (target × current) is within HPA's tolerance (0.1) of 1;
    then HPA's default behavior (300 s scale-down stabilization, `_HpaBehavior`). KEDA itself owns 0 <-> 1
    (https://keda.sh/docs/latest/reference/scaledobject-spec/): at 0 replicas an active trigger scales to
    max(min_replicas, 1) and HPA takes over from the next evaluation; with min_replicas 0, a trigger inactive
    for longer than cooldownPeriod (300 s) scales to 0. Active means waiting + running + held > 0 (an
    activationThreshold of 0 on a query that also sums running requests: the generous reading, under which a
    fleet that is serving is never deactivated).

    target_per_replica defaults to 5, the recipe's threshold, rather than the operator's queue target (8):
    the baseline is the configuration a user copies, so that the comparison measures what they would get.
    """

    name = "keda-queue"

    def __init__(
        self,
        *,
        min_replicas: int = DEFAULT_MIN_REPLICAS,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        target_per_replica: float = DEFAULT_QUEUE_TARGET,
        cooldown_s: float = KEDA_COOLDOWN_S,
        tolerance: float = HPA_TOLERANCE,
        scale_down_stabilization_s: float = HPA_SCALE_DOWN_STABILIZATION_S,
    ) -> None:
        who = "keda-queue autoscaler"
        _check_range(min_replicas, max_replicas, who)
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.target_per_replica = _positive(target_per_replica, "target_per_replica", who)
        self.cooldown_s = _non_negative(cooldown_s, "cooldown_s", who)
        self.tolerance = _non_negative(tolerance, "tolerance", who)
        self._hpa = _HpaBehavior(
            scale_down_stabilization_s=_non_negative(
                scale_down_stabilization_s, "scale_down_stabilization_s", who
            )
        )
        self._last_active: float | None = None
        self.last_reason: str | None = None

    def evaluate(self, signals: FleetSignals) -> int:
        now = signals.now
        current = len(signals.replicas)
        ready = [r for r in signals.replicas if r.ready]
        total = sum(r.waiting for r in ready) + signals.held
        active = total + sum(r.running for r in ready) > 0
        # The first evaluation counts as activity: a fleet the simulation starts with was just deployed.
        if active or self._last_active is None:
            self._last_active = now
        if current == 0:
            if active:
                self.last_reason = "KedaActivated"
                return max(self.min_replicas, 1)
            self.last_reason = "KedaInactive"
            return self.min_replicas
        if self.min_replicas == 0 and not active and now - self._last_active > self.cooldown_s:
            self.last_reason = "KedaCooledDown"
            return 0
        # HPA from here on: its minReplicas is max(minReplicaCount, 1).
        lo, hi = max(self.min_replicas, 1), self.max_replicas
        if current > hi or current < lo:
            self.last_reason = "HpaOutOfRange"
            desired = min(max(current, lo), hi)
            self._hpa.record(current, desired, now)
            return desired
        ratio = total / (self.target_per_replica * current)
        if abs(1.0 - ratio) <= self.tolerance:
            raw = current
        else:
            raw = math.ceil(total / self.target_per_replica)
        desired = self._hpa.normalize(current, raw, lo, hi, now)
        self.last_reason = _hpa_reason(current, raw, desired, lo, hi)
        return desired


class HpaKvUsage:
    """A HorizontalPodAutoscaler on vllm:kv_cache_usage_perc, averaged over the pods (a Pods metric with an
    AverageValue target): the common "scale on KV-cache usage" recipe. target defaults to 0.7, the recipe's
    usual 70%: low enough to add a replica before the cache is full and the scheduler preempts.

    HPA's algorithm (https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/#algorithm-details;
    replica_calculator.go, calcPlainMetricReplicas): the ready replicas report; ratio = their mean / target;
    within the tolerance (0.1) of 1 the count stays, else desired = ceil(ratio × ready). Replicas still
    starting are HPA's unready pods: set aside for a scale down (they do not hold one), and counted at 0 for a
    scale up, which is then recomputed over all pods and dropped if it no longer is one. No ready replica: no
    metrics, no change. Then HPA's default behavior (`_HpaBehavior`). HPA never goes to 0 and does nothing at
    0 replicas ("scaling is disabled" while the target's replicas are 0), so min_replicas 0 is refused.
    """

    name = "hpa-kv"

    def __init__(
        self,
        *,
        min_replicas: int = DEFAULT_MIN_REPLICAS,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        target: float = DEFAULT_KV_TARGET,
        tolerance: float = HPA_TOLERANCE,
        scale_down_stabilization_s: float = HPA_SCALE_DOWN_STABILIZATION_S,
    ) -> None:
        who = "hpa-kv autoscaler"
        _check_range(min_replicas, max_replicas, who)
        if min_replicas == 0:
            raise ValueError(
                f"{who}: min_replicas 0 is not possible: an HPA cannot scale to zero (nor from it); use the "
                "'keda-queue' or 'chunkwise' autoscaler to scale to zero"
            )
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.target = _positive(target, "target", who)
        if self.target > 1.0:
            raise ValueError(f"{who}: target is a KV-cache fraction, at most 1, got {target}")
        self.tolerance = _non_negative(tolerance, "tolerance", who)
        self._hpa = _HpaBehavior(
            scale_down_stabilization_s=_non_negative(
                scale_down_stabilization_s, "scale_down_stabilization_s", who
            )
        )
        self.last_reason: str | None = None

    def _raw(self, current: int, ready: Sequence[ReplicaSignals], unready: int) -> int:
        ratio = sum(r.kv_usage for r in ready) / len(ready) / self.target
        if not (unready > 0 and ratio > 1.0):
            if abs(1.0 - ratio) <= self.tolerance:
                return current
            return math.ceil(ratio * len(ready))
        # A scale up with pods still starting: they count as 0, over all pods.
        pods = len(ready) + unready
        new_ratio = sum(r.kv_usage for r in ready) / pods / self.target
        if abs(1.0 - new_ratio) <= self.tolerance or new_ratio < 1.0:
            return current
        return max(math.ceil(new_ratio * pods), current)

    def evaluate(self, signals: FleetSignals) -> int:
        current = len(signals.replicas)
        if current == 0:
            self.last_reason = "ScalingDisabled"
            return 0
        if current > self.max_replicas or current < self.min_replicas:
            self.last_reason = "OutOfRange"
            desired = min(max(current, self.min_replicas), self.max_replicas)
            self._hpa.record(current, desired, signals.now)
            return desired
        ready = [r for r in signals.replicas if r.ready]
        if not ready:
            self.last_reason = "FailedGetPodsMetric"
            return current
        raw = self._raw(current, ready, current - len(ready))
        desired = self._hpa.normalize(current, raw, self.min_replicas, self.max_replicas, signals.now)
        self.last_reason = _hpa_reason(current, raw, desired, self.min_replicas, self.max_replicas)
        return desired


# -- by name ----------------------------------------------------------------------------------------------------

AUTOSCALERS: dict[str, Callable[..., Autoscaler]] = {
    ChunkwiseAutoscaler.name: ChunkwiseAutoscaler,
    KedaQueueDepth.name: KedaQueueDepth,
    HpaKvUsage.name: HpaKvUsage,
}
# What the loop may pass to any of them: the baselines have no startup grace (HPA's applies to CPU only),
# so they take no cold_start_s and make_autoscaler drops it for them.
COMMON = ("min_replicas", "max_replicas", "cold_start_s")


def make_autoscaler(name: str, **kw: Any) -> Autoscaler:
    """The autoscaler called `name` ("chunkwise", "keda-queue", "hpa-kv"), built from its keyword arguments;
    a ValueError names what is wrong (an unknown name, an unknown or bad parameter)."""
    factory = AUTOSCALERS.get(name)
    if factory is None:
        raise ValueError(f"unknown autoscaler {name!r}; known: {', '.join(AUTOSCALERS)}")
    accepted = set(inspect.signature(factory).parameters)
    if "cold_start_s" not in accepted:
        kw.pop("cold_start_s", None)
    unknown = sorted(set(kw) - accepted)
    if unknown:
        raise ValueError(
            f"autoscaler {name!r} takes no {', '.join(unknown)}; it takes: {', '.join(sorted(accepted))}"
        )
    return factory(**kw)
