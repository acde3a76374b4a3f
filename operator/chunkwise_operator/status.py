"""Pure status computation: the CR's status from its spec (or spec error) and its Deployments' status.

Two callers write status: the reconcile (after applying children, for the generation it handled) and the
watch on child Deployments (readiness changes between reconciles). Both compute the whole managed status
here from fresh reads, so neither can leave a half-updated view; `status_patch` turns it into a JSON merge
patch that touches only the keys this module owns.
"""

from __future__ import annotations

import datetime
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chunkwise_operator import adapters, gateway, manifests
from chunkwise_operator.autoscale import (
    NO_METRICS,
    SCALED_TO_ZERO,
    SCALER_CONFLICT,
    Decision,
    Observed,
    Recommendation,
    ScaleEvent,
)
from chunkwise_operator.spec import ServiceSpec, SpecError

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
# Present while the built-in autoscaler owns the count (enabled, not delegated), from status.autoscaler:
# SCALER_CONFLICT (named as the autoscaler's reason) is True while another scaler (HPA, ScaledObject)
# targets the same InferenceService and the built-in one stands down; METRICS_AVAILABLE is False while no
# ready replica's /metrics could be read, with why.
METRICS_AVAILABLE = "MetricsAvailable"
# SCALER_CONFLICT's reason, with any autoscaling (built-in or delegated), while an applied manifest declares
# spec.replicas: each GitOps sync or `kubectl apply` writes its count back over the scaler's.
REPLICAS_FIGHT_SCALER = "ReplicasFightScaler"
# Where `kubectl apply` (and Argo CD's default client-side apply) keeps what it applied.
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
# Present while spec.gateway.inferencePool is on: whether the InferencePool could be applied.
INFERENCE_POOL_READY = gateway.CONDITION
# Present while the service serves LoRA adapters (spec.adapters or runtimeLoraUpdates): whether every adapter
# is loaded on every ready replica (adapters.condition), from status.adapters.
ADAPTERS_READY = adapters.CONDITION
CONDITION_TYPES = (
    READY,
    PROGRESSING,
    DEGRADED,
    SCALER_CONFLICT,
    METRICS_AVAILABLE,
    INFERENCE_POOL_READY,
    ADAPTERS_READY,
)

# Everything else under .status (for instance fields a later autoscaler adds) is left alone.
MANAGED_KEYS = (
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "selector",
    "url",
    "model",
    "conditions",
    "autoscaler",
    "adapters",
)


# Degraded reasons for a reconcile that failed against the API (spec errors carry their own reasons).
CHILD_CONFLICT = "ChildConflict"
FORBIDDEN = "Forbidden"
CHILD_REJECTED = "ChildRejected"
API_ERROR = "ApiError"
# spec.engine.pipelineParallelSize above 1 where the cluster does not serve LeaderWorkerSet: the other
# children stand, the runtime cannot exist; the status refresh creates it once the API is served.
LWS_NOT_INSTALLED = "LeaderWorkerSetNotInstalled"
FAILURE_REASONS = frozenset({CHILD_CONFLICT, FORBIDDEN, CHILD_REJECTED, API_ERROR, LWS_NOT_INSTALLED})


def lws_not_installed_message(pipeline_parallel_size: int) -> str:
    return (
        f"spec.engine.pipelineParallelSize {pipeline_parallel_size} runs each replica as a LeaderWorkerSet "
        f"group, but the API server does not serve {manifests.LWS_PLURAL}.{manifests.LWS_GROUP}/"
        f"{manifests.LWS_VERSION}: install LeaderWorkerSet ({manifests.LWS_INSTALL_HINT}); the operator "
        "checks again every status refresh and creates the group then"
    )


# Why runtime pods fail to start, read from their container statuses.
ENGINE_ARGS_REJECTED = "EngineArgsRejected"
MODEL_FETCH_FAILED = "ModelFetchFailed"
ENGINE_FAILING = "EngineFailing"
# `chunkwise serve` and `chunkwise fetch-model` exit 2 on arguments they refuse (argparse's usage code).
USAGE_EXIT_CODE = 2
_MESSAGE_LIMIT = 512

# Why pods do not start, in Kubernetes' own words: the Deployment controller's (FailedCreate in a
# ReplicaFailure condition, ProgressDeadlineExceeded in Progressing), the scheduler's (PodScheduled False)
# and the kubelet's (a container's waiting reason, kept verbatim: ImagePullBackOff, ErrImagePull,
# CreateContainerConfigError, ...).
FAILED_CREATE = "FailedCreate"
UNSCHEDULABLE = "Unschedulable"
PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
CRASH_LOOP = "CrashLoopBackOff"
# Waiting reasons of a container that is on its way: no failure.
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})
# A waiting reason not named in ORDER (CreateContainerError, RunContainerError, PreStartHookError, ...)
# ranks here.
OTHER = "Other"
# When pods differ, the reason shown is the first of these that some pod (or the Deployment) has: most
# actionable first. A pod that cannot even be created blocks every replica and its message names the quota
# or policy; then the faults whose message names exactly what to fix (a missing Secret or ConfigMap, an
# image: the registry's answer in ErrImagePull before the back-off that only repeats the image's name);
# then containers that exited (the engine's own last words); then the kubelet's other errors; last the pods
# no node can take, which a cluster autoscaler may yet resolve by itself. Ties go to the pod first by name.
ORDER = (
    FAILED_CREATE,
    "CreateContainerConfigError",
    "InvalidImageName",
    "ErrImageNeverPull",
    "ErrImagePull",
    "ImagePullBackOff",
    ENGINE_ARGS_REJECTED,
    MODEL_FETCH_FAILED,
    ENGINE_FAILING,
    CRASH_LOOP,
    OTHER,
    UNSCHEDULABLE,
)


@dataclass(frozen=True)
class Failure:
    """A reconcile that could not apply the children; shown as Degraded until a reconcile succeeds.

    Also why runtime pods do not start (`pod_failure`, `deployment_failure`), in the same shape.
    """

    reason: str
    message: str


@dataclass(frozen=True)
class PodProblem:
    """The most actionable thing wrong with one pod."""

    pod: str
    reason: str
    message: str

    @property
    def rank(self) -> int:
        return rank(self.reason)


def rank(reason: str) -> int:
    """A reason's place in ORDER: lower is more actionable."""
    return ORDER.index(reason) if reason in ORDER else ORDER.index(OTHER)


@dataclass(frozen=True)
class PoolState:
    """What the last attempt to apply the InferencePool found: applied, or why not (CRDNotInstalled).

    `ready` None is Unknown: no attempt yet.
    """

    ready: bool | None
    reason: str
    message: str


class Keep(enum.Enum):
    """Keep the previous value (the child watch knows nothing about the last reconcile's outcome)."""

    KEEP = "keep"


KEEP = Keep.KEEP


@dataclass(frozen=True)
class DeploymentState:
    exists: bool
    desired: int = 0
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    rolled_out: bool = False


def _seen(deployment: Mapping[str, Any]) -> bool:
    """The Deployment controller has seen the latest template: its counts and conditions are about it.

    A LeaderWorkerSet (the runtime with pipeline stages) is read through the same counts (spec.replicas,
    status.replicas, readyReplicas, updatedReplicas: groups); observedGeneration is optional in its status
    (a release or a moment may leave it out), and without it the counts are taken as they are.
    """
    generation = (deployment.get("metadata") or {}).get("generation")
    observed = (deployment.get("status") or {}).get("observedGeneration")
    if observed is None and deployment.get("kind") == manifests.LWS_KIND:
        return True
    return generation is None or (observed is not None and observed >= generation)


def deployment_state(deployment: Mapping[str, Any] | None) -> DeploymentState:
    if deployment is None:
        return DeploymentState(exists=False)
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    desired = int(spec.get("replicas", 1))
    state = DeploymentState(
        exists=True,
        desired=desired,
        replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
    )
    # The Deployment controller must have seen the latest template before its counts mean anything.
    done = (
        _seen(deployment)
        and state.updated == desired
        and state.ready == desired
        and state.replicas == desired
    )
    return DeploymentState(**{**state.__dict__, "rolled_out": done})


def _head(text: Any) -> str:
    """A message from the scheduler, kubelet or controller on one line: its start says what is wrong."""
    words = " ".join(str(text or "").split())
    return words if len(words) <= _MESSAGE_LIMIT else words[: _MESSAGE_LIMIT - 3] + "..."


def _tail(text: Any) -> str:
    """A container's last words on one line: a log tail ends with the error."""
    words = " ".join(str(text or "").split())
    return words if len(words) <= _MESSAGE_LIMIT else "..." + words[-_MESSAGE_LIMIT:]


def _deployment_condition(deployment: Mapping[str, Any] | None, ctype: str) -> Mapping[str, Any] | None:
    if deployment is None or not _seen(deployment):
        return None  # a verdict on an older template (a new one restarts the progress deadline)
    if deployment.get("kind") == manifests.LWS_KIND:
        # An LWS's Progressing goes False once every group is ready: not the Deployment's verdict of a
        # stalled rollout, and it has no ReplicaFailure. Its groups' troubles show on the leaders' pods.
        return None
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == ctype:
            return cond
    return None


def deployment_failure(deployment: Mapping[str, Any] | None) -> Failure | None:
    """The Deployment's ReplicaFailure (FailedCreate: a quota, Pod Security, a webhook): no pod to read."""
    cond = _deployment_condition(deployment, "ReplicaFailure")
    if cond is None or cond.get("status") != "True" or deployment is None:
        return None
    name = (deployment.get("metadata") or {}).get("name", "?")
    return Failure(
        str(cond.get("reason") or FAILED_CREATE), f"Deployment {name}: {_head(cond.get('message'))}"
    )


def deployment_stalled(deployment: Mapping[str, Any] | None) -> Failure | None:
    """Progressing False (ProgressDeadlineExceeded): the controller gave up waiting for the rollout."""
    cond = _deployment_condition(deployment, "Progressing")
    if cond is None or cond.get("status") != "False" or deployment is None:
        return None
    name = (deployment.get("metadata") or {}).get("name", "?")
    reason = str(cond.get("reason") or PROGRESS_DEADLINE_EXCEEDED)
    return Failure(reason, f"Deployment {name}: {_head(cond.get('message'))}")


def _container_problem(pod_name: str, key: str, c: Mapping[str, Any]) -> PodProblem | None:
    state = c.get("state") or {}
    if "running" in state:
        return None  # running, ready or not yet (a startup probe still waiting is no failure)
    name = c.get("name")
    waiting = state.get("waiting") or {}
    waiting_reason = waiting.get("reason")
    if waiting_reason and waiting_reason not in _STARTING and waiting_reason != CRASH_LOOP:
        said = _head(waiting.get("message")) or str(waiting_reason)
        return PodProblem(pod_name, str(waiting_reason), f"pod {pod_name}: container {name}: {said}")
    terminated = state.get("terminated") or (c.get("lastState") or {}).get("terminated")
    crash_looping = waiting_reason == CRASH_LOOP
    if terminated and (terminated.get("exitCode") or crash_looping):
        # In CrashLoopBackOff even a clean exit is a failure: the engine must never return.
        code = terminated.get("exitCode", 0)
        if key == "initContainerStatuses":
            reason = MODEL_FETCH_FAILED
        elif code == USAGE_EXIT_CODE:
            reason = ENGINE_ARGS_REJECTED
        else:
            reason = ENGINE_FAILING
        words = _tail(terminated.get("message") or terminated.get("reason"))
        return PodProblem(
            pod_name,
            reason,
            f"pod {pod_name}: container {name} exited with code {code} "
            f"({c.get('restartCount', 0)} restarts): {words}",
        )
    if crash_looping:
        said = _head(waiting.get("message")) or CRASH_LOOP
        return PodProblem(pod_name, CRASH_LOOP, f"pod {pod_name}: container {name}: {said}")
    return None


def pod_problem(pod: Mapping[str, Any]) -> PodProblem | None:
    """What keeps one pod from serving, its most actionable fault first (ORDER); None if nothing is wrong.

    Read from the pod's conditions (PodScheduled False: Unschedulable, with the scheduler's message) and its
    containers' states (waiting reasons, and the last termination of a container that exited with an error
    or is in CrashLoopBackOff: the engine and the fetcher end with a one-line reason, their termination
    message or the log tail the kubelet keeps under FallbackToLogsOnError). A pod being deleted is none.
    """
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    pod_name = str(meta.get("name", "?"))
    status = pod.get("status") or {}
    found: list[PodProblem] = []
    for cond in status.get("conditions") or []:
        if (
            isinstance(cond, Mapping)
            and cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == UNSCHEDULABLE
        ):
            said = _head(cond.get("message")) or "no node fits it"
            found.append(PodProblem(pod_name, UNSCHEDULABLE, f"pod {pod_name} cannot be scheduled: {said}"))
    for key in ("initContainerStatuses", "containerStatuses"):
        for c in status.get(key) or []:
            if isinstance(c, Mapping) and (problem := _container_problem(pod_name, key, c)) is not None:
                found.append(problem)
    return min(found, key=lambda p: p.rank, default=None)


def pod_failure(pods: Sequence[Mapping[str, Any]]) -> Failure | None:
    """Why runtime pods do not serve: the most actionable pod's reason and message (ORDER, then by name).

    With more than one pod in trouble, the message ends with a count of each reason, e.g.
    `[3 pods: 1 ImagePullBackOff, 2 Unschedulable]`.
    """
    problems = sorted(
        (p for pod in pods if (p := pod_problem(pod)) is not None), key=lambda p: (p.rank, p.pod)
    )
    if not problems:
        return None
    first = problems[0]
    if len(problems) == 1:
        return Failure(first.reason, first.message)
    counts: dict[str, int] = {}
    for p in problems:
        counts[p.reason] = counts.get(p.reason, 0) + 1
    summary = ", ".join(f"{n} {reason}" for reason, n in counts.items())
    return Failure(first.reason, f"{first.message} [{len(problems)} pods: {summary}]")


def _condition(
    ctype: str, status: bool | None, reason: str, message: str, generation: int | None
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "type": ctype,
        "status": "Unknown" if status is None else "True" if status else "False",
        "reason": reason,
        "message": message,
    }
    if generation is not None:
        result["observedGeneration"] = generation
    return result


def _with_times(
    conditions: list[dict[str, Any]], previous: list[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """lastTransitionTime moves only when a condition's status flips, as the API conventions ask."""
    before = {c.get("type"): c for c in previous if isinstance(c, Mapping)}
    result = []
    for cond in conditions:
        old = before.get(cond["type"])
        if old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime"):
            cond = {**cond, "lastTransitionTime": old["lastTransitionTime"]}
        else:
            cond = {**cond, "lastTransitionTime": now}
        result.append(cond)
    return result


def replicas_writers(metadata: Mapping[str, Any]) -> tuple[str, ...]:
    """Who declares spec.replicas in a manifest they apply again and again, from the object's metadata.

    Client-side apply (`kubectl apply`, Argo CD's default) records what it applied in an annotation: a
    replicas there is written back at every apply. Server-side apply (Flux, `kubectl apply --server-side`,
    Argo CD's ServerSideApply) shows as a managedFields entry of operation Apply that owns f:spec.f:replicas.
    A scaler's writes are Updates (the HPA's through the scale subresource, the operator's a patch), and a
    one-off `kubectl scale` or `kubectl edit` is an Update too: none of them is named here.
    """
    found: list[str] = []
    annotations = metadata.get("annotations")
    last = annotations.get(LAST_APPLIED) if isinstance(annotations, Mapping) else None
    if isinstance(last, str):
        try:
            applied = json.loads(last)
        except ValueError:
            applied = None
        applied_spec = applied.get("spec") if isinstance(applied, Mapping) else None
        if isinstance(applied_spec, Mapping) and "replicas" in applied_spec:
            found.append("kubectl apply (its last-applied-configuration)")
    for entry in metadata.get("managedFields") or []:
        if not isinstance(entry, Mapping) or entry.get("operation") != "Apply" or entry.get("subresource"):
            continue
        if entry.get("manager") == manifests.MANAGER:
            continue
        spec_fields = (entry.get("fieldsV1") or {}).get("f:spec")
        if isinstance(spec_fields, Mapping) and "f:replicas" in spec_fields:
            found.append(f"server-side apply by {entry.get('manager') or 'an unnamed manager'}")
    return tuple(found)


def replicas_fight(spec: ServiceSpec, metadata: Mapping[str, Any]) -> str | None:
    """Why a write to spec.replicas fights the scaler that owns it, or None when nothing does."""
    a = spec.autoscaling
    if not a.enabled:
        return None  # spec.replicas is the user's to set: nothing else writes it
    writers = replicas_writers(metadata)
    if not writers:
        return None
    scaler = "the HPA or KEDA (autoscaling.delegated)" if a.delegated else "the built-in autoscaler"
    return (
        f"spec.replicas is declared by {' and '.join(writers)} while {scaler} owns it: every sync writes "
        "its count back over the scaler's; leave replicas out of the manifest (docs/operator.md, GitOps)"
    )


def replicas_fight_began(previous: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """The fight's message when `new` reports it and `previous` did not: the moment for one Warning event."""

    def fighting(st: Mapping[str, Any]) -> Mapping[str, Any] | None:
        for cond in st.get("conditions") or []:
            if (
                isinstance(cond, Mapping)
                and cond.get("type") == SCALER_CONFLICT
                and cond.get("status") == "True"
                and cond.get("reason") == REPLICAS_FIGHT_SCALER
            ):
                return cond
        return None

    now = fighting(new)
    if now is None or fighting(previous) is not None:
        return None
    return str(now.get("message", ""))


def compute_status(
    *,
    name: str,
    namespace: str,
    parsed: ServiceSpec | SpecError,
    runtime: Mapping[str, Any] | None,
    router: Mapping[str, Any] | None,
    previous: Mapping[str, Any],
    now: str,
    generation: int | Keep | None = KEEP,
    failure: Failure | Keep | None = KEEP,
    pods: Sequence[Mapping[str, Any]] = (),
    pool: PoolState | Keep = KEEP,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The managed part of .status. `generation` is the generation just reconciled, or KEEP.

    `pods` are the runtime pods: why they do not serve (`pod_failure`), or why the Deployment controller
    cannot create them or gave up on the rollout (`deployment_failure`, `deployment_stalled`), sets Degraded,
    Ready while no replica is ready, and Progressing once the rollout's deadline has passed.
    `pool` is what the reconcile found applying the InferencePool; KEEP: as the previous status says.
    `metadata` is the InferenceService's own: whether an applied manifest fights the scaler (replicas_fight).
    """
    observed = previous.get("observedGeneration") if generation is KEEP else generation
    run = deployment_state(runtime)
    rtr = deployment_state(router)
    valid = isinstance(parsed, ServiceSpec)

    if failure is KEEP:
        failure = _previous_failure(previous)

    # With an invalid spec the children keep running as they are: report them as they are.
    router_expected = parsed.router.enabled if isinstance(parsed, ServiceSpec) else rtr.exists
    desired = parsed.replicas if isinstance(parsed, ServiceSpec) else run.desired

    if not run.exists and isinstance(failure, Failure) and failure.reason == LWS_NOT_INSTALLED:
        ready = (False, failure.reason, failure.message)
    elif not run.exists:
        ready = (False, "NoRuntime", "the runtime Deployment does not exist yet")
    elif desired == 0:
        ready = (False, "ScaledToZero", "spec.replicas is 0")
    elif run.ready == 0:
        ready = (False, "NoReadyReplicas", f"0 of {desired} replicas are ready")
    elif router_expected and rtr.ready == 0:
        ready = (False, "RouterUnavailable", "no router replica is ready")
    else:
        ready = (True, "Available", f"{run.ready} of {desired} replicas are ready")

    # Why pods do not serve: the runtime's (its Deployment's or its pods', by ORDER), the router's.
    runtime_problem = min(
        (f for f in (deployment_failure(runtime), pod_failure(pods)) if f is not None),
        key=lambda f: rank(f.reason),
        default=None,
    )
    router_problem = deployment_failure(router) if router_expected else None
    stalled = deployment_stalled(runtime) or (deployment_stalled(router) if router_expected else None)
    if ready[1] in ("NoRuntime", "NoReadyReplicas"):
        why_not = runtime_problem or deployment_stalled(runtime)
    else:
        why_not = (router_problem or deployment_stalled(router)) if ready[1] == "RouterUnavailable" else None
    if why_not is not None:
        ready = (False, why_not.reason, why_not.message)

    if not valid:
        progressing = (False, "InvalidSpec", "the spec is invalid; see the Degraded condition")
    elif ready[1] == LWS_NOT_INSTALLED:
        progressing = (
            False,
            LWS_NOT_INSTALLED,
            "waiting for the LeaderWorkerSet API; see the Degraded condition",
        )
    elif not run.exists or (router_expected and not rtr.exists):
        progressing = (True, "Creating", "creating the runtime" + (" and router" if router_expected else ""))
    elif stalled is not None:
        # The Deployment controller gave up; the cause, if a pod shows one, follows its words.
        cause = runtime_problem or router_problem
        progressing = (False, stalled.reason, stalled.message + (f"; {cause.message}" if cause else ""))
    elif not run.rolled_out or run.desired != desired or (router_expected and not rtr.rolled_out):
        progressing = (
            True,
            "RollingOut",
            f"{run.updated} updated, {run.ready} ready, {run.replicas} running of {desired} replicas",
        )
    else:
        progressing = (False, "Complete", f"all {desired} replicas are updated and ready")

    if isinstance(parsed, SpecError):
        degraded = (True, parsed.reason, parsed.message)
    elif failure is not None:
        degraded = (True, failure.reason, failure.message)
    elif (why := runtime_problem or router_problem or stalled) is not None:
        degraded = (True, why.reason, why.message)
    else:
        degraded = (False, "AsExpected", "the spec is valid and its children are applied")

    gen = observed if isinstance(observed, int) else None
    conditions = [
        _condition(READY, *ready, gen),
        _condition(PROGRESSING, *progressing, gen),
        _condition(DEGRADED, *degraded, gen),
    ]
    status: dict[str, Any] = {
        "replicas": run.replicas,
        "readyReplicas": run.ready,
        "selector": manifests.selector_string(name),
    }
    if gen is not None:
        status["observedGeneration"] = gen
    if isinstance(parsed, ServiceSpec):
        status["url"] = manifests.service_url(name, namespace, parsed)
        status["model"] = parsed.model.served_name
        status["autoscaler"] = _autoscaler(parsed, previous.get("autoscaler"))
        fight = replicas_fight(parsed, metadata or {})
        if parsed.autoscaling.enabled and not parsed.autoscaling.delegated:
            block = status["autoscaler"]
            message = str(block.get("message", ""))
            for ctype, on, reason in autoscaler_conditions(block):
                if ctype == SCALER_CONFLICT and not on and fight is not None:
                    # Another scaler's conflict (ExternalScaler) is reported first: it stops the autoscaler.
                    conditions.append(_condition(ctype, True, REPLICAS_FIGHT_SCALER, fight, gen))
                else:
                    conditions.append(_condition(ctype, on, reason, message, gen))
        elif parsed.autoscaling.enabled:
            conditions.append(
                _condition(
                    SCALER_CONFLICT,
                    fight is not None,
                    REPLICAS_FIGHT_SCALER if fight is not None else "NoConflict",
                    fight or "no applied manifest declares spec.replicas: the HPA or KEDA owns it",
                    gen,
                )
            )
        if parsed.gateway.inference_pool:
            state = _previous_pool(previous) if pool is KEEP else pool
            conditions.append(_condition(INFERENCE_POOL_READY, state.ready, state.reason, state.message, gen))
        if parsed.lora_enabled:
            # The adapter sync's last word (status.adapters) for the adapters the spec still names, until it
            # writes the next; the condition follows it.
            items = adapters.carried(parsed.adapters, previous.get("adapters"))
            status["adapters"] = items
            conditions.append(_condition(ADAPTERS_READY, *adapters.condition(items, run.ready), gen))
    else:
        for key in ("url", "model", "autoscaler", "adapters"):
            if previous.get(key) is not None:
                status[key] = previous[key]
        # The pool, like every child, stays as it was while the spec is invalid: so does its condition, and
        # the adapters' (the replicas keep serving what they served).
        kept = [c for c in previous.get("conditions") or [] if _is_pool_condition(c)][:1]
        kept += [c for c in previous.get("conditions") or [] if _is_adapters_condition(c)][:1]
        conditions += [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in kept]
    status["conditions"] = _with_times(conditions, list(previous.get("conditions") or []), now)
    return status


def autoscaler_conditions(block: Any) -> tuple[tuple[str, bool | None, str], ...]:
    """(type, status, reason) of the built-in autoscaler's conditions, from its status block.

    Status None is Unknown: standing down for another scaler, or at 0 replicas, it reads no metrics at all.
    """
    reason = block.get("reason") if isinstance(block, Mapping) else None
    conflict = (
        SCALER_CONFLICT,
        reason == SCALER_CONFLICT,
        "ExternalScaler" if reason == SCALER_CONFLICT else "NoExternalScaler",
    )
    if reason in (SCALER_CONFLICT, SCALED_TO_ZERO):
        # Standing down, or nothing to read at 0 replicas: whether metrics would arrive is not known.
        metrics: tuple[str, bool | None, str] = (METRICS_AVAILABLE, None, str(reason))
    elif reason in (NO_METRICS, AWAITING_METRICS):
        metrics = (METRICS_AVAILABLE, False, str(reason))
    else:
        metrics = (METRICS_AVAILABLE, True, "MetricsReported")
    return conflict, metrics


def _is_pool_condition(cond: Any) -> bool:
    return isinstance(cond, Mapping) and cond.get("type") == INFERENCE_POOL_READY


def _is_adapters_condition(cond: Any) -> bool:
    return isinstance(cond, Mapping) and cond.get("type") == ADAPTERS_READY


PENDING_POOL = PoolState(None, gateway.PENDING, "the InferencePool has not been applied yet")


def _previous_pool(previous: Mapping[str, Any]) -> PoolState:
    """The pool's condition as the last reconcile left it; Pending before any reconcile has tried."""
    for cond in previous.get("conditions") or []:
        if _is_pool_condition(cond):
            ready = {"True": True, "False": False}.get(str(cond.get("status")))
            return PoolState(ready, str(cond.get("reason", "")), str(cond.get("message", "")))
    return PENDING_POOL


def _previous_failure(previous: Mapping[str, Any]) -> Failure | None:
    for cond in previous.get("conditions") or []:
        if (
            isinstance(cond, Mapping)
            and cond.get("type") == DEGRADED
            and cond.get("status") == "True"
            and cond.get("reason") in FAILURE_REASONS
        ):
            return Failure(str(cond["reason"]), str(cond.get("message", "")))
    return None


DISABLED = "Disabled"
DELEGATED = "Delegated"
AWAITING_METRICS = "AwaitingMetrics"
# What the autoscaler reports while scaling is delegated, kept by the reconcile's own status writes.
_REPORTED = (
    "recommendedReplicas",
    "message",
    "metrics",
    "scrapedReplicas",
    "lastEvaluationTime",
    "recommendations",
)


def _autoscaler(spec: ServiceSpec, previous: Any) -> dict[str, Any]:
    a = spec.autoscaling
    prev = previous if isinstance(previous, Mapping) else {}
    if not a.enabled:
        return {"reason": DISABLED}
    if a.delegated:
        kept = {k: prev[k] for k in _REPORTED if k in prev and prev.get("reason") == DELEGATED}
        return {**kept, "desiredReplicas": spec.replicas, "reason": DELEGATED}
    # The operator's own autoscaler owns this block once it has decided something; until then, say so.
    if prev.get("reason") not in (None, DISABLED, DELEGATED):
        return dict(prev)
    return {"desiredReplicas": spec.replicas, "reason": AWAITING_METRICS}


def iso_time(t: float) -> str:
    """RFC 3339 with milliseconds: stabilization windows in tests are a few seconds long."""
    stamp = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def autoscaler_history(block: Any) -> tuple[tuple[Recommendation, ...], tuple[ScaleEvent, ...]]:
    """The stabilization history and scale events stored in status.autoscaler (what a restart resumes)."""
    if not isinstance(block, Mapping):
        return (), ()
    history = []
    for item in block.get("recommendations") or []:
        if isinstance(item, Mapping) and isinstance(item.get("replicas"), int):
            t = parse_time(item.get("time"))
            if t is not None:
                history.append(Recommendation(t, int(item["replicas"])))
    events = []
    for item in block.get("scaleEvents") or []:
        if (
            isinstance(item, Mapping)
            and isinstance(item.get("from"), int)
            and isinstance(item.get("to"), int)
        ):
            t = parse_time(item.get("time"))
            if t is not None:
                events.append(ScaleEvent(t, int(item["from"]), int(item["to"])))
    return tuple(history), tuple(events)


def last_active(block: Any) -> float | None:
    """When the fleet last had a request, as the previous evaluation stored it."""
    return parse_time(block.get("lastActiveTime")) if isinstance(block, Mapping) else None


def autoscaler_block(
    *,
    spec: ServiceSpec,
    decision: Decision,
    observed: Observed,
    previous: Any,
    now: float,
    last_active: float | None = None,
) -> dict[str, Any]:
    """status.autoscaler after an evaluation: the decision, the signals it saw, and its history."""
    prev = previous if isinstance(previous, Mapping) else {}
    block: dict[str, Any] = {
        "scrapedReplicas": observed.ready_replicas,
        "lastEvaluationTime": iso_time(now),
        "metrics": {k: round(v, 6) for k, v in observed.values.items() if v is not None},
        "recommendations": [{"time": iso_time(h.time), "replicas": h.replicas} for h in decision.history],
    }
    if last_active is not None:
        block["lastActiveTime"] = iso_time(last_active)
    if spec.autoscaling.delegated:
        # Reporting only: what chunkwise would run, while an HPA or KEDA owns spec.replicas.
        block.update(
            desiredReplicas=spec.replicas,
            recommendedReplicas=decision.desired,
            reason=DELEGATED,
            message=f"an external scaler owns spec.replicas; chunkwise would run {decision.desired} "
            f"({decision.reason}: {decision.message})",
        )
        return block
    block.update(desiredReplicas=decision.desired, reason=decision.reason, message=decision.message)
    if decision.recommendation is not None:
        block["recommendedReplicas"] = decision.recommendation
    block["scaleEvents"] = [
        {"time": iso_time(e.time), "from": e.replicas_from, "to": e.replicas_to} for e in decision.events
    ]
    if decision.desired != spec.replicas:
        block["lastScaleTime"] = iso_time(now)
    elif isinstance(prev.get("lastScaleTime"), str):
        block["lastScaleTime"] = prev["lastScaleTime"]
    return block


def _merge_patch(old: Any, new: Any) -> Any:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        patch: dict[str, Any] = {}
        for key in new:
            if key not in old:
                patch[key] = new[key]
            else:
                sub = _merge_patch(old[key], new[key])
                if sub is not _SAME:
                    patch[key] = sub
        for key in old:
            if key not in new:
                patch[key] = None
        return patch if patch else _SAME
    return _SAME if old == new else new


_SAME = object()


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch for .status turning `old` into `new` on the managed keys; None if nothing changed."""
    old_managed = {k: old[k] for k in MANAGED_KEYS if k in old}
    new_managed = {k: new[k] for k in MANAGED_KEYS if k in new}
    patch = _merge_patch(old_managed, new_managed)
    return None if patch is _SAME else patch
