"""Kopf registration for the chunkwise operator: `kopf run -m chunkwise_operator.main`, or run_operator().

Only wiring lives here; the work is in reconcile.py. Handler ids are explicit so that Kopf's stored progress
survives renaming a function.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
import kopf

from chunkwise_operator.adapters import Failure as AdapterFailure
from chunkwise_operator.kube import CHILD_KINDS, DEFAULT_API_TIMEOUT_S, ApiException, ChildKind, Kube
from chunkwise_operator.manifests import LABEL_MANAGED_BY, MANAGER
from chunkwise_operator.reconcile import ObjectBusy, Reconciler, ServiceGone
from chunkwise_operator.scrape import PodSample
from chunkwise_operator.spec import GROUP, PLURAL, UPGRADE_RUNTIME_ANNOTATION, VERSION

# Seconds between autoscaler evaluations of one InferenceService (each scrapes every ready runtime pod).
AUTOSCALER_INTERVAL_ENV = "CHUNKWISE_AUTOSCALER_INTERVAL_SECONDS"
DEFAULT_AUTOSCALER_INTERVAL_S = 15.0
# Seconds between passes of the LoRA adapter sync over one InferenceService's ready replicas (adapters.py).
ADAPTER_INTERVAL_ENV = "CHUNKWISE_ADAPTER_INTERVAL_SECONDS"
DEFAULT_ADAPTER_INTERVAL_S = 10.0
# Seconds between status refreshes of one InferenceService (a list of its runtime pods).
STATUS_INTERVAL_ENV = "CHUNKWISE_STATUS_INTERVAL_SECONDS"
DEFAULT_STATUS_INTERVAL_S = 30.0
# A Prometheus to read the autoscaler's signals from (its HTTP API), instead of scraping the pods' /metrics.
PROMETHEUS_URL_ENV = "CHUNKWISE_PROMETHEUS_URL"
# Replicas of the operator find each other in this KopfPeering / ClusterKopfPeering (manifests/): the one
# with the highest priority works, the others stand by.
PEERING_NAME = "chunkwise-operator"
# Seconds a replica's peering record stays valid without a keep-alive: how long a replica that died without
# saying so (SIGKILL, a lost node) blocks a standby from taking over. Kopf's default.
PEERING_LIFETIME_ENV = "CHUNKWISE_PEERING_LIFETIME_SECONDS"
DEFAULT_PEERING_LIFETIME_S = 60.0
# Seconds one Kubernetes API call may take, the operator's own and Kopf's: past it the call fails and its
# handler is retried, instead of a half-open connection holding the handler (and its object) forever.
API_TIMEOUT_ENV = "CHUNKWISE_API_TIMEOUT_SECONDS"
# Kopf's watch requests: the API server ends each after this long, and the client gives up 30 s later if it
# has not (a watch over a dead connection otherwise waits forever: no event ever arrives to say so).
WATCH_SERVER_TIMEOUT_S = 300.0
WATCH_CLIENT_TIMEOUT_S = WATCH_SERVER_TIMEOUT_S + 30.0
# The namespace a namespaced install runs in and serves (the downward API sets it): its KopfPeering goes there.
POD_NAMESPACE_ENV = "POD_NAMESPACE"
# Every child carries this label (manifests.labels); the watches see only objects that do.
CHILD_LABELS = {LABEL_MANAGED_BY: MANAGER}


def _prometheus_url() -> str | None:
    url = os.environ.get(PROMETHEUS_URL_ENV) or None
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"{PROMETHEUS_URL_ENV} (--prometheus-url) must be an http(s) URL, got {url!r}")
    return url


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = float(raw)
    if not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {raw!r}")
    return value


def peering_priority(started: float, jitter: int) -> int:
    """Kopf's peering priority for a replica started at `started` (epoch s): the oldest replica is active.

    Kopf pauses every replica that sees a peer of higher priority, and all of them on a tie, so replicas of one
    Deployment need distinct priorities. Older-wins keeps the active replica active while new ones start (a
    rollout or a rescheduled standby takes nothing over); `jitter` (0-999) breaks ties within a millisecond.
    """
    return -(int(started * 1000) * 1000 + jitter)


@kopf.on.startup(id="configure")
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    # Progress in annotations only: the CRD's status schema has no `kopf` field, so the API server would
    # prune Kopf's default status-based progress and retries would lose count.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.reporting_component = MANAGER
    settings.peering.priority = peering_priority(time.time(), random.randrange(1000))
    lifetime = _env_float(PEERING_LIFETIME_ENV, DEFAULT_PEERING_LIFETIME_S)
    settings.peering.lifetime = max(1, round(lifetime or DEFAULT_PEERING_LIFETIME_S))
    # Children are watched through a server-side label selector: the operator's watch streams carry only
    # its own objects, not every Deployment and Service of the cluster.
    selector = ",".join(f"{k}={v}" for k, v in CHILD_LABELS.items())
    for child in CHILD_KINDS:
        settings.watching.label_selectors[child.group, child.plural] = selector
    api_timeout = _env_float(API_TIMEOUT_ENV, DEFAULT_API_TIMEOUT_S) or DEFAULT_API_TIMEOUT_S
    settings.networking.request_timeout = api_timeout
    settings.networking.connect_timeout = api_timeout
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
    memo.autoscaler_interval = _env_float(AUTOSCALER_INTERVAL_ENV, DEFAULT_AUTOSCALER_INTERVAL_S)
    memo.status_interval = _env_float(STATUS_INTERVAL_ENV, DEFAULT_STATUS_INTERVAL_S)
    memo.adapter_interval = _env_float(ADAPTER_INTERVAL_ENV, DEFAULT_ADAPTER_INTERVAL_S)
    if not settings.peering.clusterwide:
        # Namespaced (a Role, no cluster-wide reads): no watch on CRDs and namespaces, which a Role cannot
        # grant; the resources found at start-up are served.
        settings.scanning.disabled = True
    try:
        url = _prometheus_url()
    except ValueError as e:
        raise kopf.PermanentError(str(e)) from None  # a misconfiguration no retry fixes: the operator stops
    kube = Kube.from_environment(api_timeout)
    memo.reconciler = Reconciler(kube, prometheus_url=url)
    if settings.peering.mandatory and not settings.peering.standalone:
        _ensure_peering(kube, settings, logger)


def _ensure_peering(kube: Kube, settings: kopf.OperatorSettings, logger: kopf.Logger) -> None:
    """The peering object must exist, or every replica waits for it, paused."""
    namespace = None if settings.peering.clusterwide else os.environ.get(POD_NAMESPACE_ENV)
    if not settings.peering.clusterwide and not namespace:
        logger.warning(
            f"Peering in namespaces but {POD_NAMESPACE_ENV} is not set: create the KopfPeering "
            f"{settings.peering.name!r} in each watched namespace, or every replica stays paused"
        )
        return
    if kube.ensure_peering(settings.peering.name, namespace):
        logger.info(
            f"Created the peering object {settings.peering.name!r}"
            + (f" in {namespace}" if namespace else "")
        )


@kopf.on.cleanup(id="close")
def close(memo: kopf.Memo, **_: Any) -> None:
    reconciler = memo.get("reconciler")
    if isinstance(reconciler, Reconciler):
        reconciler.close()


@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-resume", backoff=15)
@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-create", backoff=15)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", id="reconcile-update", backoff=15)
# The opt-in to the running operator's runtime image is an annotation, outside `spec`.
@kopf.on.update(
    GROUP,
    VERSION,
    PLURAL,
    field=("metadata", "annotations", UPGRADE_RUNTIME_ANNOTATION),
    id="reconcile-upgrade-runtime",
    backoff=15,
)
def reconcile(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    _reconciler(memo).reconcile(body, logger)


def _watch_child(child: ChildKind) -> None:
    def child_event(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
        _reconciler(memo).child_changed(child.kind, body, logger)

    # The same filter as the API server's (configure), repeated here for a server that ignores selectors.
    kopf.on.event(
        child.group, child.version, child.plural, labels=CHILD_LABELS, id=f"child-{child.kind.lower()}"
    )(child_event)


for _child in CHILD_KINDS:
    _watch_child(_child)


@kopf.daemon(GROUP, VERSION, PLURAL, id="status-refresh", cancellation_timeout=5)
async def status_refresh(
    stopped: kopf.DaemonStopped,
    name: str,
    namespace: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Status from fresh reads every interval: a pod that crashes before it is ready changes no Deployment."""
    if namespace is None:
        return
    reconciler = _reconciler(memo)
    interval = float(memo.get("status_interval") or DEFAULT_STATUS_INTERVAL_S)
    while not stopped:
        await stopped.wait(interval)
        if stopped:
            break
        try:
            await asyncio.to_thread(reconciler.refresh_status, namespace, name, logger)
        except ServiceGone:
            return  # no finalizer, so Kopf never stops this daemon itself: it ends with its object
        except (ApiException, ObjectBusy, OSError) as e:
            logger.warning(f"Status refresh failed: {type(e).__name__}: {e}")


def _autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    autoscaling = spec.get("autoscaling")
    return isinstance(autoscaling, Mapping) and autoscaling.get("enabled") is True


@kopf.daemon(GROUP, VERSION, PLURAL, id="autoscaler", when=_autoscaling_enabled, cancellation_timeout=5)
async def autoscaler(
    stopped: kopf.DaemonStopped,
    name: str,
    namespace: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Every interval, one evaluation for this InferenceService while its autoscaling is enabled.

    A daemon rather than a timer: its interval is read at start-up (tests run it every second or two),
    and Kopf starts and stops it as spec.autoscaling.enabled turns on and off.
    """
    if namespace is None:
        return  # InferenceService is namespaced; Kopf types the argument for cluster-scoped kinds too
    reconciler = _reconciler(memo)
    interval = float(memo.get("autoscaler_interval") or DEFAULT_AUTOSCALER_INTERVAL_S)
    samples: dict[str, PodSample] = {}

    async def once(client: httpx.AsyncClient) -> None:
        await reconciler.evaluate_autoscaler(namespace, name, samples, client, logger)

    await _every(stopped, interval, once, "Autoscaler evaluation", logger)


async def _every(
    stopped: kopf.DaemonStopped,
    interval: float,
    once: Callable[[httpx.AsyncClient], Awaitable[None]],
    what: str,
    logger: kopf.Logger,
) -> None:
    """A daemon's loop: `once` every interval until stopped or the InferenceService is gone. A failed pass
    changes nothing and is logged; the next one retries."""
    # Pod IPs are cluster addresses: never reach them through a proxy from the environment.
    async with httpx.AsyncClient(trust_env=False) as client:
        while not stopped:
            try:
                await once(client)
            except ServiceGone:
                return
            except (ApiException, ObjectBusy, httpx.HTTPError, OSError) as e:
                logger.warning(f"{what} failed: {type(e).__name__}: {e}")
            await stopped.wait(interval)


def _serves_adapters(spec: kopf.Spec, **_: Any) -> bool:
    """spec.adapters names some, or the replicas take them at run time (the engine's --enable-lora)."""
    engine = spec.get("engine")
    adapters = spec.get("adapters")
    runtime = isinstance(engine, Mapping) and engine.get("runtimeLoraUpdates") is True
    return runtime or (isinstance(adapters, list) and len(adapters) > 0)


@kopf.daemon(GROUP, VERSION, PLURAL, id="adapters", when=_serves_adapters, cancellation_timeout=5)
async def adapter_sync(
    stopped: kopf.DaemonStopped,
    name: str,
    namespace: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Every interval, one pass of the LoRA adapter sync over this InferenceService's ready replicas.

    A daemon, as the autoscaler is: Kopf starts it once the spec names adapters (or turns runtime loading on)
    and stops it when neither holds any more. Adding an adapter with runtime loading on thus reaches every
    ready replica within one interval, without a rollout.
    """
    if namespace is None:
        return
    reconciler = _reconciler(memo)
    interval = float(memo.get("adapter_interval") or DEFAULT_ADAPTER_INTERVAL_S)
    failures: dict[tuple[str, str], AdapterFailure] = {}

    async def once(client: httpx.AsyncClient) -> None:
        await reconciler.sync_adapters(namespace, name, failures, client, logger)

    await _every(stopped, interval, once, "Adapter sync", logger)


def _without_finalizers(registry: kopf.OperatorRegistry) -> None:
    """The daemons block no deletion: Kopf would put its finalizer on every InferenceService they serve.

    They hold nothing that outlives their object (the autoscaler's state is in status; the children go with
    it through garbage collection), so a finalizer would only make deletion hang whenever the operator is
    not running, `kubectl delete -k manifests/` included. Kopf's decorator has no option for daemons (its
    `kopf.daemon` hard-codes requires_finalizer=True, and timers do too), hence the replaced handlers; a test
    pins that no finalizer is ever set. Each daemon ends when its object is gone (ServiceGone), since Kopf
    stops daemons on deletion only through its finalizer.

    `_spawning._handlers` is Kopf's private state: pyproject.toml pins Kopf to the minor version this is
    tested against, and a Kopf without it stops the operator at import rather than running with finalizers.
    """
    spawning: Any = getattr(registry, "_spawning", None)
    handlers = getattr(spawning, "_handlers", None)
    if not isinstance(handlers, list) or not all(
        dataclasses.is_dataclass(h) and hasattr(h, "requires_finalizer") for h in handlers
    ):
        raise RuntimeError(
            f"kopf {getattr(kopf, '__version__', '?')} has no registry._spawning._handlers list of handler "
            "dataclasses: the operator is tested with the Kopf version pinned in pyproject.toml"
        )
    spawning._handlers = [dataclasses.replace(h, requires_finalizer=False) for h in handlers]


_without_finalizers(kopf.get_default_registry())


def _reconciler(memo: kopf.Memo) -> Reconciler:
    reconciler = memo.get("reconciler")
    if not isinstance(reconciler, Reconciler):
        raise kopf.TemporaryError("the operator has not finished starting", delay=1)
    return reconciler


def run_operator(argv: list[str] | None = None) -> int:
    """`chunkwise operator [-n NS ...] [--liveness URL] [--verbose]`: run until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="chunkwise operator",
        description="Run the chunkwise operator: InferenceService resources become runtime pods and routers.",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; Kopf glob patterns allowed); default: all namespaces",
    )
    parser.add_argument(
        "--liveness", default=None, help="serve Kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--autoscaler-interval-seconds",
        type=float,
        default=None,
        help=f"seconds between autoscaler evaluations (default {DEFAULT_AUTOSCALER_INTERVAL_S:g}; "
        f"or the environment variable {AUTOSCALER_INTERVAL_ENV})",
    )
    parser.add_argument(
        "--prometheus-url",
        default=None,
        help="read the autoscaler's signals from this Prometheus (e.g. http://prometheus-operated.monitoring:9090) "
        f"instead of scraping the pods (or the environment variable {PROMETHEUS_URL_ENV})",
    )
    parser.add_argument(
        "--peering",
        action="store_true",
        help=f"run as one of several replicas: peer through the KopfPeering {PEERING_NAME!r} (manifests/), "
        "the oldest replica active; default: standalone, a single replica",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    args = parser.parse_args(argv)
    if args.autoscaler_interval_seconds is not None:
        if not args.autoscaler_interval_seconds > 0:
            parser.error("--autoscaler-interval-seconds must be positive")
        # Read by the start-up handler, which runs inside kopf.run below.
        os.environ[AUTOSCALER_INTERVAL_ENV] = repr(args.autoscaler_interval_seconds)
    if args.prometheus_url is not None:
        os.environ[PROMETHEUS_URL_ENV] = args.prometheus_url  # checked by the start-up handler
    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    kopf.run(
        standalone=not args.peering,
        peering_name=PEERING_NAME if args.peering else None,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
    return 0
