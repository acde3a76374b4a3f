"""The autoscaler's decision, as a pure function: observed signals and history in, a replica count out.

It follows the HorizontalPodAutoscaler's algorithm, so that its behaviour is the one operators already
know (https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/#algorithm-details):

1. Each configured metric proposes ceil(current × observed / target), or `current` while observed/target
   is within that metric's tolerance of 1; KV usage is a threshold, proposing a scale up as soon as it is
   above its target (a bounded fraction would otherwise act only near saturation). The recommendation is the largest proposal (the metric in most need),
   clamped to [minReplicas, maxReplicas]. While some replicas are starting (not ready for less than the
   startup budget, STARTUP_GRACE_S), a scale down is held: their share of the load is unknown. A replica not
   ready for longer (Pending for want of a GPU node, crash-looping) holds nothing: like HPA, which sets
   not-yet-ready pods aside when scaling down, the ready replicas' load decides, and extensive signals are
   still divided by the whole count (unready replicas count as idle, HPA's conservative rule for a scale up).
   The p99 step time is a ceiling, not a load: a step is capped by its token budget, so its time does not
   fall in proportion to replicas added, and ceil(current x p99/target) would add replicas every evaluation
   up to maxReplicas. Above its target it holds the count (no scale down while steps are slow); below, it
   has no say. Demand is the queue's, the preemptions' and the KV cache's to show.
2. Stabilization: every recommendation is kept with its time. A scale up goes to the smallest
   recommendation of the scale-up window, a scale down to the largest of the scale-down window, so the
   count moves only when the whole window agrees; a spike shorter than the window moves nothing, and no
   pair of opposite moves can fall within one window.
3. Rate limits: within a period, a scale up adds at most max(pods, percent of the count at the period's
   start), and a scale down removes at most its percent; the history of scale events counts what the
   period already did.

State lives in the arguments (history, events) and the result (their pruned successors), so the caller can
persist it (in status.autoscaler) and an operator restart resumes where it stopped.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkwise_operator.spec import (
    DEFAULT_STARTUP_TIMEOUT_SECONDS,
    GROUP,
    KIND,
    AutoscalingSpec,
    AutoscalingTargets,
    AutoscalingTolerances,
)

QUEUE_DEPTH = "queueDepthPerReplica"
PREEMPTION_RATE = "preemptionRatePerSecond"
P99_STEP_TIME = "p99StepTimeSeconds"
KV_USAGE = "kvUsageFraction"
METRICS = (QUEUE_DEPTH, PREEMPTION_RATE, P99_STEP_TIME, KV_USAGE)
# Bounded signals: above the target is already too much, so their tolerance applies below the target only.
THRESHOLDS = frozenset({KV_USAGE})
# Ceiling signals: above the target they hold the count (propose `current`); at or below it they propose
# nothing. Their tolerance is unused.
CEILINGS = frozenset({P99_STEP_TIME})
# How long a replica may be not ready and still count as starting: the startup probe's budget (the kubelet
# restarts a container that has not started by then). Past it, the replica holds no decision and is no
# activity for scaling to zero. The reconcile passes the service's own (spec.engine.startupTimeoutSeconds);
# this is the CPU default, for callers without a spec.
STARTUP_GRACE_S = float(DEFAULT_STARTUP_TIMEOUT_SECONDS)

# Reasons, as status.autoscaler.reason and event reasons.
SCALED_UP = "ScaledUp"
SCALED_DOWN = "ScaledDown"
WITHIN_TOLERANCE = "WithinTolerance"
SCALE_UP_STABILIZED = "ScaleUpStabilized"
SCALE_DOWN_STABILIZED = "ScaleDownStabilized"
SCALE_DOWN_HELD = "ScaleDownHeld"
SCALE_UP_LIMITED = "ScaleUpLimited"
SCALE_DOWN_LIMITED = "ScaleDownLimited"
AT_MAX = "AtMaxReplicas"
AT_MIN = "AtMinReplicas"
NO_METRICS = "NoMetrics"
BELOW_MIN = "BelowMinReplicas"
SCALER_CONFLICT = "ScalerConflict"
SCALED_TO_ZERO = "ScaledToZero"
ABOVE_MAX = "AboveMaxReplicas"


def per_metric(values: AutoscalingTargets | AutoscalingTolerances) -> dict[str, float]:
    """A spec section with one field per metric (targets, tolerance), keyed by the metric's name."""
    return {
        QUEUE_DEPTH: values.queue_depth_per_replica,
        PREEMPTION_RATE: values.preemption_rate_per_second,
        P99_STEP_TIME: values.p99_step_time_seconds,
        KV_USAGE: values.kv_usage_fraction,
    }


@dataclass(frozen=True)
class Behavior:
    """HPA's defaults (autoscaling/v2 `behavior`), with the windows from the InferenceService's spec."""

    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    tolerances: Mapping[str, float] = field(default_factory=lambda: per_metric(AutoscalingTolerances()))
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    scale_up_period_s: float = 15.0
    scale_down_percent: float = 100.0
    scale_down_period_s: float = 15.0

    @classmethod
    def from_spec(cls, spec: AutoscalingSpec, **overrides: float) -> Behavior:
        values: dict[str, float] = {
            "scale_up_stabilization_s": float(spec.scale_up_stabilization_seconds),
            "scale_down_stabilization_s": float(spec.scale_down_stabilization_seconds),
        }
        values.update(overrides)
        return cls(tolerances=per_metric(spec.tolerance), **values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Observed:
    """The fleet's signals averaged per replica; None where a signal has no data yet (or none this window)."""

    values: Mapping[str, float | None]
    ready_replicas: int
    # Requests seen over the fleet this window (running, waiting, finished); None without data. Only
    # scaling to zero reads it: no request at all, not a low queue.
    requests: float | None = None


@dataclass(frozen=True)
class Recommendation:
    time: float  # seconds since the epoch: history must survive an operator restart
    replicas: int


@dataclass(frozen=True)
class ScaleEvent:
    time: float
    replicas_from: int
    replicas_to: int


@dataclass(frozen=True)
class Decision:
    desired: int
    # The metrics' recommendation this evaluation (clamped), before stabilization and rate limits.
    recommendation: int | None
    reason: str
    message: str
    # Which metric proposed the recommendation, and what each metric proposed.
    driver: str | None
    proposals: Mapping[str, int]
    history: tuple[Recommendation, ...]
    events: tuple[ScaleEvent, ...]


@dataclass(frozen=True)
class ExternalScaler:
    """An HPA or KEDA ScaledObject whose scaleTargetRef is an InferenceService."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


def external_scalers(name: str, objects: Iterable[Mapping[str, Any]]) -> tuple[ExternalScaler, ...]:
    """Which of `objects` (HPAs, ScaledObjects) scale the InferenceService `name`, sorted."""
    found = set()
    for obj in objects:
        ref = (obj.get("spec") or {}).get("scaleTargetRef") or {}
        group = str(ref.get("apiVersion") or "").split("/")[0]
        if ref.get("kind") == KIND and ref.get("name") == name and group in ("", GROUP):
            found.add(ExternalScaler(str(obj.get("kind")), str((obj.get("metadata") or {}).get("name"))))
    return tuple(sorted(found, key=lambda s: (s.kind, s.name)))


def _epoch(stamp: Any) -> float | None:
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


def not_ready_since(pods: Iterable[Mapping[str, Any]], now: float) -> tuple[float, ...]:
    """For each pod that is not ready and not terminating, since when (epoch seconds), sorted.

    The Ready condition's lastTransitionTime when it is False, else (no Ready condition yet: Pending) the pod's
    creation; `now` when neither is known, so that a pod of unknown age counts as just starting.
    """
    result = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if isinstance(c, Mapping)]
        ready = next((c for c in conditions if c.get("type") == "Ready"), None)
        if ready is not None and ready.get("status") == "True":
            continue
        since = _epoch((ready or {}).get("lastTransitionTime")) or _epoch(meta.get("creationTimestamp"))
        result.append(min(since, now) if since is not None else now)
    return tuple(sorted(result))


def starting(
    current: int,
    ready: int,
    unready_since: Sequence[float],
    now: float,
    grace_s: float,
    creation_failing: bool = False,
) -> int:
    """Replicas that may still become ready: not ready for less than `grace_s`, plus those of the count
    with no pod seen at all (not created yet; a pod still to come is starting by definition) unless
    `creation_failing`: the Deployment reports ReplicaFailure (a quota, Pod Security, a webhook), so those
    pods are not coming, and holding a scale down for them would keep the count where the quota refuses it."""
    young = sum(1 for t in unready_since if now - t < grace_s)
    unseen = 0 if creation_failing else max(0, current - ready - len(unready_since))
    return young + unseen


def last_activity(previous: float | None, requests: float | None, young: int, now: float) -> float:
    """When the fleet was last active, for scaling to zero: now if it had requests (or no data), or if a
    replica is starting (the request that woke it may not have arrived), else `previous`. A replica not ready
    past the startup budget is not starting (see `starting`): it would keep an idle fleet, and its pod's
    request for a node, up forever."""
    if previous is None or requests is None or requests > 0 or young > 0:
        return now
    return previous


def proposals(
    current: int,
    observed: Mapping[str, float | None],
    targets: Mapping[str, float],
    tolerances: Mapping[str, float],
) -> dict[str, int]:
    """What each metric with data asks for."""
    result: dict[str, int] = {}
    for name in METRICS:
        value, target = observed.get(name), targets.get(name)
        if value is None or target is None or target <= 0 or not math.isfinite(value):
            continue
        ratio = value / target
        tolerance = tolerances.get(name, 0.0)
        if name in CEILINGS:
            if ratio > 1.0:
                result[name] = current
            continue
        if name in THRESHOLDS:
            within = 1.0 - tolerance <= ratio <= 1.0
        else:
            within = abs(ratio - 1.0) <= tolerance
        result[name] = current if within else math.ceil(current * ratio)
    return result


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def decide(
    *,
    current: int,
    observed: Observed,
    targets: Mapping[str, float],
    min_replicas: int,
    max_replicas: int,
    behavior: Behavior,
    history: Sequence[Recommendation],
    events: Sequence[ScaleEvent],
    now: float,
    external: Sequence[ExternalScaler] = (),
    idle_s: float | None = None,
    scale_to_zero_after_s: float | None = None,
    unready_since: Sequence[float] = (),
    grace_s: float = STARTUP_GRACE_S,
    creation_failing: bool = False,
) -> Decision:
    """The replica count to run now, why, and the history to keep for the next evaluation.

    `external` are other scalers writing the same spec.replicas: while there is one, the count is theirs.
    With min_replicas 0, only `idle_s` (seconds since the fleet last had a request) of at least
    `scale_to_zero_after_s` goes to 0; the metrics alone never do, since a short queue is no idle fleet.
    """
    keep = max(behavior.scale_up_stabilization_s, behavior.scale_down_stabilization_s)
    period = max(behavior.scale_up_period_s, behavior.scale_down_period_s)
    kept = tuple(h for h in history if now - h.time <= keep)
    recent = tuple(e for e in events if now - e.time <= period)

    def result(
        desired: int,
        reason: str,
        message: str,
        rec: int | None = None,
        driver: str | None = None,
        asked: Mapping[str, int] | None = None,
    ) -> Decision:
        new_events = recent
        if desired != current:
            new_events = (*recent, ScaleEvent(now, current, desired))
        return Decision(desired, rec, reason, message, driver, dict(asked or {}), kept, new_events)

    if external:
        names = ", ".join(str(s) for s in external)
        return result(
            current,
            SCALER_CONFLICT,
            f"{names} also scales this InferenceService; the built-in autoscaler stands down until it is "
            "removed or autoscaling.delegated is true",
        )
    # Out of bounds (a spec edit or a manual scale): back within them at once, as HPA does.
    if current < min_replicas:
        return result(min_replicas, BELOW_MIN, f"{current} replicas is below minReplicas {min_replicas}")
    if current > max_replicas:
        return result(max_replicas, ABOVE_MAX, f"{current} replicas is above maxReplicas {max_replicas}")
    if (
        min_replicas == 0
        and current > 0
        and idle_s is not None
        and scale_to_zero_after_s is not None
        and idle_s >= scale_to_zero_after_s
    ):
        return result(
            0,
            SCALED_TO_ZERO,
            f"no request for {_fmt(idle_s)} s (scaleToZeroAfterSeconds {_fmt(scale_to_zero_after_s)})",
        )
    if min_replicas == 0 and current == 0:
        # Requests held at the router (scrape.signals counts them as the queue, over one replica): go
        # straight to what they need, within maxReplicas and one period's scale up, not 0 -> 1 only.
        queue, target = observed.values.get(QUEUE_DEPTH), targets.get(QUEUE_DEPTH)
        if queue and target and target > 0 and math.isfinite(queue):
            wanted = min(max(1, math.ceil(queue / target)), max_replicas)
            desired = min(wanted, max(1, behavior.scale_up_pods))
            note = f"; limited to +{desired} this period" if desired < wanted else ""
            message = f"{_fmt(queue)} requests held at the router; {QUEUE_DEPTH} asks for {wanted}{note}"
            asked = {QUEUE_DEPTH: wanted}
            return result(desired, SCALED_UP, message, wanted, QUEUE_DEPTH, asked)
        return result(0, SCALED_TO_ZERO, "at 0 replicas until a request arrives (the router scales up)")
    # Going to 0 is the idle rule's alone: the metrics' floor is 1 while any replica runs.
    floor = max(min_replicas, 1)

    asked = proposals(current, observed.values, targets, behavior.tolerances)
    if not asked:
        if any(observed.values.get(name) is not None for name in METRICS):
            return result(current, WITHIN_TOLERANCE, "every reported metric is below its target")
        return result(current, NO_METRICS, "no ready replica has reported metrics yet")
    driver = max(asked, key=lambda name: asked[name])
    raw = asked[driver]
    seen = ", ".join(
        f"{name} {_fmt(v)}/{_fmt(targets[name])}"
        for name in METRICS
        if (v := observed.values.get(name)) is not None and name in targets
    )
    young = starting(current, observed.ready_replicas, unready_since, now, grace_s, creation_failing)
    if raw < current and young:
        return result(
            current,
            SCALE_DOWN_HELD,
            f"{observed.ready_replicas} of {current} replicas ready and {young} starting (not ready for less "
            f"than {_fmt(grace_s)} s); not scaling down until they are ready or past it ({seen})",
            None,
            driver,
            asked,
        )
    rec = min(max(raw, floor), max_replicas)
    kept = (*kept, Recommendation(now, rec))

    up_window = [h.replicas for h in kept if now - h.time <= behavior.scale_up_stabilization_s]
    down_window = [h.replicas for h in kept if now - h.time <= behavior.scale_down_stabilization_s]
    up_to, down_to = min(up_window), max(down_window)
    if current < up_to:
        stabilized, direction = up_to, SCALED_UP
    elif current > down_to:
        stabilized, direction = down_to, SCALED_DOWN
    else:
        stabilized, direction = current, None

    desired = stabilized
    limited = False
    if direction == SCALED_UP:
        added = sum(
            e.replicas_to - e.replicas_from for e in recent if now - e.time <= behavior.scale_up_period_s
        )
        start = current - max(0, added)
        most = max(start + behavior.scale_up_pods, math.ceil(start * (1 + behavior.scale_up_percent / 100)))
        if desired > most:
            desired, limited = max(most, current), True
    elif direction == SCALED_DOWN:
        removed = sum(
            e.replicas_from - e.replicas_to for e in recent if now - e.time <= behavior.scale_down_period_s
        )
        start = current + max(0, removed)
        fewest = math.floor(start * (1 - behavior.scale_down_percent / 100))
        if desired < fewest:
            desired, limited = min(fewest, current), True

    if desired > current:
        note = f"; limited to +{desired - current} this period" if limited else ""
        return result(desired, SCALED_UP, f"{driver} asks for {rec} ({seen}){note}", rec, driver, asked)
    if desired < current:
        note = f"; limited to -{current - desired} this period" if limited else ""
        return result(desired, SCALED_DOWN, f"{driver} asks for {rec} ({seen}){note}", rec, driver, asked)
    if limited:
        reason = SCALE_UP_LIMITED if direction == SCALED_UP else SCALE_DOWN_LIMITED
        message = f"{driver} asks for {rec}, but this period's scaling is spent ({seen})"
        return result(current, reason, message, rec, driver, asked)
    if raw > current and current == max_replicas:
        return result(
            current, AT_MAX, f"{driver} asks for {raw}; held at maxReplicas ({seen})", rec, driver, asked
        )
    if raw < current and current == floor:
        return result(
            current, AT_MIN, f"{driver} asks for {raw}; held at minReplicas ({seen})", rec, driver, asked
        )
    if rec > current:
        window = _fmt(behavior.scale_up_stabilization_s)
        message = f"{driver} asks for {rec}; not every recommendation of the last {window} s did ({seen})"
        return result(current, SCALE_UP_STABILIZED, message, rec, driver, asked)
    if rec < current:
        window = _fmt(behavior.scale_down_stabilization_s)
        message = (
            f"{driver} asks for {rec}; holding {current} through the {window} s scale-down window ({seen})"
        )
        return result(current, SCALE_DOWN_STABILIZED, message, rec, driver, asked)
    if driver in CEILINGS and any(v < current for v in asked.values()):
        message = f"{driver} is above its target; not scaling down while steps are slow ({seen})"
        return result(current, SCALE_DOWN_HELD, message, rec, driver, asked)
    return result(
        current, WITHIN_TOLERANCE, f"every metric is within its target ({seen})", rec, driver, asked
    )
