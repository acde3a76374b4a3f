"""The reconcile: parse the spec, apply the children, remove the stale ones, write status, post events.

Glue between the pure modules (spec, manifests, status, autoscale, scrape) and the thin I/O (kube). Kopf
calls it from main.py.

Work for one InferenceService is serialised by a per-object lock, because four Kopf workers touch the same
object: the CR's own handler, the watch on its children, the status refresh and the autoscaler. Each reads
the cluster, computes, and writes children and status; interleaved, a status computed from older reads could
land after a newer one, or a drift correction from an older spec after the reconcile of the new one. The lock
is held across those API calls on purpose (it makes read-compute-write one step), and that is safe because:
- every call has a timeout and no retries inside the client (kube.py), and a failed call ends the locked
  section, except two failures caught under it (a child's apply in `reconcile`, whose `_fail` then writes
  status; the restore in `child_changed`, followed by its status refresh), after which the next failure ends
  it: a hold lasts at most 2 timeouts plus the time of the calls that did answer, however dead the
  connection;
- the lock is per object: an InferenceService whose calls hang holds no other's lock, and Kopf runs each
  object's sync handlers in its thread pool, so the others proceed;
- it is never awaited on the event loop (the async autoscaler takes it in a thread), and acquiring it gives up
  after LOCK_WAIT_TIMEOUTS timeouts: ObjectBusy, which the caller turns into a retry or a skipped turn.
No lock is shared between objects and none is held while scraping pods (the autoscaler scrapes first, then
takes the lock only to write).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, cast

import httpx
import kopf

from chunkwise_operator import adapters, autoscale, gateway, manifests, prometheus, scrape, status
from chunkwise_operator.kube import (
    DEFAULT_API_TIMEOUT_S,
    INFERENCE_POOL,
    LEADER_WORKER_SET,
    ApiException,
    ApiUnreachable,
    ChildConflict,
    Kube,
    Outcome,
    controller_owner,
    owned_by,
)
from chunkwise_operator.spec import (
    RUNTIME_IMAGE_STATUS,
    UPGRADE_RUNTIME_ANNOTATION,
    ServiceSpec,
    SpecError,
    parse,
    runtime_image,
    validate_name,
)

NORMAL = "Normal"
WARNING = "Warning"
# A write of spec.replicas whose precondition keeps failing while the count stays the same is given up
# after this many tries (the next evaluation decides again).
REPLICA_WRITE_ATTEMPTS = 3
# An evaluation that changes nothing but times writes status.autoscaler at most this often: a stalled
# autoscaler still shows (lastEvaluationTime), and a restart loses at most this much of its times.
EVALUATION_HEARTBEAT_S = 60.0
# How long a worker waits for the object's lock, in API timeouts: past the longest hold (2 timeouts and the
# calls that answered, see above).
LOCK_WAIT_TIMEOUTS = 4
# The event reason of a child put back as the spec wants it after someone else changed or deleted it.
DRIFT_CORRECTED = "DriftCorrected"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_service(name: str, body: Mapping[str, Any]) -> ServiceSpec | SpecError:
    try:
        validate_name(name)
        return parse(body.get("spec"), runtime_image(body))
    except SpecError as e:
        return e


class ServiceGone(Exception):
    """The InferenceService is deleted or being deleted: its daemons end."""


class ObjectBusy(Exception):
    """Another worker held the InferenceService's lock for longer than any bounded hold: retry later."""


def _deleting(body: Mapping[str, Any]) -> bool:
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        clock: Callable[[], str] = utc_now,
        wall: Callable[[], float] = time.time,
        prometheus_url: str | None = None,
    ) -> None:
        self.kube = kube
        self._clock = clock
        # The autoscaler's clock: epoch seconds, because its history is stored and outlives the process.
        self._wall = wall
        # Where the autoscaler reads its signals when it does not scrape the pods itself.
        self._prometheus_url = prometheus_url
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        # Per object: the autoscaler's last block, and the lastEvaluationTime of the last one it wrote.
        self._blocks: dict[tuple[str, str], tuple[dict[str, Any], Any]] = {}
        self._guard = threading.Lock()

    def close(self) -> None:
        self.kube.close()

    @contextlib.contextmanager
    def _lock(self, namespace: str, name: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault((namespace, name), threading.Lock())
        wait_s = LOCK_WAIT_TIMEOUTS * getattr(self.kube, "timeout", DEFAULT_API_TIMEOUT_S)
        if not lock.acquire(timeout=wait_s):
            raise ObjectBusy(f"{namespace}/{name} was busy for {wait_s:g} s")
        try:
            yield
        finally:
            lock.release()

    def reconcile(self, body: Mapping[str, Any], logger: Any) -> None:
        """Bring the children in line with `body`'s spec. Idempotent: create, update and resume all call it.

        An invalid spec is reported (Degraded condition, Warning event) and returns normally: retrying
        cannot fix it, and the next spec change calls this again. API failures raise Kopf's errors so that
        Kopf retries with a delay that suits the failure.
        """
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        generation = meta.get("generation")
        try:
            with self._lock(namespace, name):
                self._reconcile(body, name, namespace, uid, generation, logger)
        except ObjectBusy as e:
            raise kopf.TemporaryError(str(e), delay=5) from e

    def _reconcile(
        self,
        body: Mapping[str, Any],
        name: str,
        namespace: str,
        uid: str,
        generation: int | None,
        logger: Any,
    ) -> None:
        parsed = parse_service(name, body)
        if isinstance(parsed, SpecError):
            logger.warning(f"Invalid spec, children left as they are: {parsed.message}")
            _event(body, WARNING, parsed.reason, parsed.message)
            self._refresh(namespace, name, parsed=parsed, generation=generation, failure=None)
            return
        self._pin_runtime_image(body, namespace, name, logger)
        try:
            pool, missing = self._apply_children(body, name, namespace, uid, parsed, logger)
        except ChildConflict as e:
            self._fail(body, namespace, name, parsed, generation, status.CHILD_CONFLICT, str(e), logger)
            raise kopf.TemporaryError(str(e), delay=60) from e
        except ApiException as e:
            message = (
                str(e.reason)
                if isinstance(e, ApiUnreachable)
                else f"the API server refused a child: {e.status} {e.reason}: {_body_message(e)}"
            )
            if e.status == 403:
                self._fail(body, namespace, name, parsed, generation, status.FORBIDDEN, message, logger)
                raise kopf.TemporaryError(message, delay=300) from e
            if e.status in (400, 422):
                self._fail(body, namespace, name, parsed, generation, status.CHILD_REJECTED, message, logger)
                raise kopf.PermanentError(message) from e
            self._fail(body, namespace, name, parsed, generation, status.API_ERROR, message, logger)
            raise kopf.TemporaryError(message, delay=15) from e
        self._refresh(namespace, name, parsed=parsed, generation=generation, failure=missing, pool=pool)

    def _pin_runtime_image(self, body: Mapping[str, Any], namespace: str, name: str, logger: Any) -> None:
        """Record the default runtime image the children are about to get, before they get it.

        Written first, so that a service never runs an image its status does not name: after an operator
        upgrade the next reconcile reads it back and keeps it (runtime_image).
        """
        image = runtime_image(body)
        recorded = (body.get("status") or {}).get(RUNTIME_IMAGE_STATUS)
        if recorded == image:
            return
        self.kube.patch_inference_service_status(namespace, name, {RUNTIME_IMAGE_STATUS: image})
        if recorded:
            logger.info(f"Runtime image moved from {recorded} to {image} ({UPGRADE_RUNTIME_ANNOTATION})")

    def _apply_children(
        self, body: Mapping[str, Any], name: str, namespace: str, uid: str, parsed: ServiceSpec, logger: Any
    ) -> tuple[status.PoolState | status.Keep, status.Failure | None]:
        """Apply every child and delete the stale ones. Returns what became of the InferencePool, if one is
        wanted, and the failure to report when the runtime's LeaderWorkerSet cannot be created (no LWS API).
        """
        pool: status.PoolState | status.Keep = status.KEEP
        missing: status.Failure | None = None
        for child in manifests.children(name, namespace, parsed):
            if child["kind"] == gateway.KIND:
                pool = self._apply_pool(body, child, uid, logger)
            elif child["kind"] == manifests.LWS_KIND:
                missing = self._apply_group(body, child, uid, parsed, logger)
            else:
                self._apply_one(body, child, uid, logger)
        for api_version, kind, child_name in manifests.stale_children(name, parsed):
            pool_kind = (api_version, kind) == (gateway.API_VERSION, gateway.KIND)
            lws_kind = (api_version, kind) == (manifests.LWS_API_VERSION, manifests.LWS_KIND)
            # Where GAIE (or LWS) is not installed there is no such child to delete, and no read of one to send.
            if pool_kind and not self.kube.serves(INFERENCE_POOL):
                continue
            if lws_kind and not self.kube.serves(LEADER_WORKER_SET):
                continue
            if missing is not None and kind == "Deployment" and child_name == manifests.runtime_name(name):
                # The replicas keep serving as a Deployment until their LeaderWorkerSet can be created.
                continue
            if self.kube.delete_owned(api_version, kind, namespace, child_name, uid):
                if pool_kind:
                    why = "spec.gateway.inferencePool is off"
                elif child_name == manifests.runtime_name(name):
                    why = f"the runtime is now a {manifests.runtime_kind(parsed)[1]}"
                else:
                    why = "the router is disabled"
                logger.info(f"Deleted {kind} {child_name}: {why}")
                _event(body, NORMAL, "Deleted", f"Deleted {kind} {child_name}")
        return pool, missing

    def _apply_group(
        self,
        owner: Mapping[str, Any],
        group: dict[str, Any],
        uid: str,
        parsed: ServiceSpec,
        logger: Any,
        warn: bool = True,
    ) -> status.Failure | None:
        """Apply the runtime's LeaderWorkerSet if the cluster serves its API; else the failure to report.

        As for the InferencePool, a missing CRD is the cluster's state: no retry loop through Kopf (which would
        only repeat the discovery), one Warning event, and the status refresh creates the group once served.
        """
        if not self.kube.serves(LEADER_WORKER_SET):
            message = status.lws_not_installed_message(parsed.engine.pipeline_parallel_size)
            if warn:
                logger.warning(f"LeaderWorkerSet {group['metadata']['name']} not created: {message}")
                _event(owner, WARNING, status.LWS_NOT_INSTALLED, message)
            return status.Failure(status.LWS_NOT_INSTALLED, message)
        self._apply_one(owner, group, uid, logger)
        return None

    def _apply_pool(
        self, owner: Mapping[str, Any], pool: dict[str, Any], uid: str, logger: Any, warn: bool = True
    ) -> status.PoolState:
        """Apply the InferencePool if the cluster serves its API; else say so (the other children stand).

        A missing CRD is the cluster's state, not an error of this spec: no retry loop, no Degraded, only the
        InferencePoolReady condition (and, with `warn`, a log line and a Warning event); the status refresh
        checks again and creates the pool once GAIE's CRDs are installed.
        """
        if not self.kube.serves(INFERENCE_POOL):
            message = gateway.not_installed_message()
            if warn:
                logger.warning(f"InferencePool {pool['metadata']['name']} not created: {message}")
                _event(owner, WARNING, gateway.CRD_NOT_INSTALLED, message)
            return status.PoolState(False, gateway.CRD_NOT_INSTALLED, message)
        self._apply_one(owner, pool, uid, logger)
        ref = pool["spec"]["endpointPickerRef"]
        port = pool["spec"]["targetPorts"][0]["number"]
        return status.PoolState(
            True, gateway.APPLIED, gateway.applied_message(pool["metadata"]["name"], ref["name"], port)
        )

    def _apply_one(
        self, owner: Mapping[str, Any], child: dict[str, Any], uid: str, logger: Any, drift: bool = False
    ) -> Outcome:
        """Apply one child; a change is one log line and one event. `drift`: someone else changed it."""
        # Only the owner reference of kopf.adopt(): adopt would also copy the CR's labels onto the
        # children, making them depend on CR metadata that no handler here watches.
        kopf.append_owner_reference(child, owner=owner)  # type: ignore[arg-type]
        outcome = self.kube.apply(child, uid)
        if outcome is not Outcome.UNCHANGED:
            what = f"{child['kind']} {child['metadata']['name']}"
            if not drift:
                reason = "Created" if outcome is Outcome.CREATED else "Updated"
                message = f"{reason} {what}"
            elif outcome is Outcome.CREATED:
                reason, message = DRIFT_CORRECTED, f"Recreated {what}: it had been deleted"
            else:
                reason, message = DRIFT_CORRECTED, f"Restored {what}: it had been edited"
            logger.info(message)
            _event(owner, NORMAL, reason, message)
        return outcome

    def _fail(
        self,
        body: Mapping[str, Any],
        namespace: str,
        name: str,
        parsed: ServiceSpec,
        generation: int | None,
        reason: str,
        message: str,
        logger: Any,
    ) -> None:
        logger.error(f"{reason}: {message}")
        _event(body, WARNING, reason, message)
        try:
            self._refresh(
                namespace, name, parsed=parsed, generation=generation, failure=status.Failure(reason, message)
            )
        except ApiException as e:
            # The status write can fail for the same reason the children did; Kopf's retry covers both.
            logger.warning(f"Could not record the failure in status: {e.status} {e.reason}")

    def child_changed(self, kind: str, child: Mapping[str, Any], logger: Any) -> None:
        """A child changed: undo drift (or a deletion), then refresh the owner's status."""
        meta = child.get("metadata") or {}
        namespace, child_name = meta.get("namespace"), meta.get("name")
        owner_name = controller_owner(child)
        if owner_name is None or not namespace:
            return
        try:
            with self._lock(namespace, owner_name):
                self._child_changed(kind, namespace, owner_name, child, child_name, logger)
        except ObjectBusy as e:
            # An event handler is not retried; the worker that held the lock was reconciling this object.
            logger.warning(f"{kind} {child_name} changed while {e}; not checked for drift this time")

    def _child_changed(
        self,
        kind: str,
        namespace: str,
        owner_name: str,
        child: Mapping[str, Any],
        child_name: Any,
        logger: Any,
    ) -> None:
        owner = self.kube.get_inference_service(namespace, owner_name)
        if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
            return
        uid = owner["metadata"]["uid"]
        if not owned_by(child, uid):
            return  # the child of an earlier object with the same name, awaiting garbage collection
        parsed = parse_service(owner_name, owner)
        if isinstance(parsed, ServiceSpec):
            self._pin_runtime_image(owner, namespace, owner_name, logger)
            wanted = {
                (c["kind"], c["metadata"]["name"]): c
                for c in manifests.children(owner_name, namespace, parsed)
            }
            desired = wanted.get((kind, child_name))
            if desired is not None:
                try:
                    self._apply_one(owner, desired, uid, logger, drift=True)
                except (ApiException, ChildConflict) as e:
                    logger.warning(f"Could not restore {kind} {child_name}: {e}")
        if kind not in ("Deployment", manifests.LWS_KIND):
            return  # the status reads only the workloads (Deployments, the LeaderWorkerSet) and pods
        self._refresh(namespace, owner_name, parsed=parsed, generation=status.KEEP, failure=status.KEEP)

    def refresh_status(self, namespace: str, name: str, logger: Any) -> None:
        """Status from fresh reads alone: pods that fail to start change no Deployment, so a timer calls this.

        One write besides: an InferencePool the reconcile could not create for want of GAIE's CRDs is created
        here once the cluster serves them, since installing a CRD changes nothing the operator watches.
        """
        with self._lock(namespace, name):
            current = self.kube.get_inference_service(namespace, name)
            if current is None or _deleting(current):
                raise ServiceGone(f"{namespace}/{name}")
            parsed = parse_service(name, current)
            pool: status.PoolState | status.Keep = status.KEEP
            failure: status.Failure | status.Keep | None = status.KEEP
            if isinstance(parsed, ServiceSpec) and parsed.gateway.inference_pool and _awaits_crd(current):
                pool = self._retry_pool(current, namespace, name, logger)
            if (
                isinstance(parsed, ServiceSpec)
                and manifests.pipeline_parallel(parsed)
                and _awaits_lws(current)
            ):
                failure = self._retry_group(current, namespace, name, parsed, logger)
            self._refresh(namespace, name, parsed=parsed, generation=status.KEEP, failure=failure, pool=pool)

    def _retry_group(
        self, owner: Mapping[str, Any], namespace: str, name: str, parsed: ServiceSpec, logger: Any
    ) -> status.Failure | status.Keep | None:
        """The LeaderWorkerSet a reconcile could not create for want of its API, tried again: once the API is
        served, the whole reconcile (the group, then the Deployment it replaces removed)."""
        if not self.kube.serves(LEADER_WORKER_SET):
            return status.KEEP
        try:
            _, missing = self._apply_children(
                owner, name, namespace, owner["metadata"]["uid"], parsed, logger
            )
        except (ApiException, ChildConflict) as e:
            # Best effort: the next reconcile (a spec change, a restart) reports such a failure in Degraded.
            logger.warning(f"Could not create LeaderWorkerSet {manifests.runtime_name(name)}: {e}")
            return status.KEEP
        return missing

    def _retry_pool(
        self, owner: Mapping[str, Any], namespace: str, name: str, logger: Any
    ) -> status.PoolState | status.Keep:
        pool = manifests.inference_pool(name, namespace)
        try:
            return self._apply_pool(owner, pool, owner["metadata"]["uid"], logger, warn=False)
        except (ApiException, ChildConflict) as e:
            # Best effort: the next reconcile (a spec change, a restart) reports such a failure in Degraded.
            logger.warning(f"Could not create InferencePool {pool['metadata']['name']}: {e}")
            return status.KEEP

    def _refresh(
        self,
        namespace: str,
        name: str,
        *,
        parsed: ServiceSpec | SpecError,
        generation: int | status.Keep | None,
        failure: status.Failure | status.Keep | None,
        pool: status.PoolState | status.Keep = status.KEEP,
    ) -> None:
        current = self.kube.get_inference_service(namespace, name)
        if current is None:
            return
        uid = current["metadata"].get("uid", "")

        def owned_deployment(child_name: str, kind: tuple[str, str] = ("apps/v1", "Deployment")) -> Any:
            obj = self.kube.get(*kind, namespace, child_name)
            return obj if obj is not None and owned_by(obj, uid) else None

        runtime = self._runtime_workload(namespace, name, parsed, owned_deployment)

        previous = current.get("status") or {}
        pods = self.kube.list_pods(namespace, manifests.match_labels(name, manifests.RUNTIME))
        if isinstance(parsed, ServiceSpec) and manifests.pipeline_parallel(parsed):
            # A stage worker that cannot start keeps its whole group unready: why counts as much as a
            # leader's (only the status reads workers; the scrape and every selector see leaders only).
            pods += self.kube.list_pods(namespace, manifests.match_labels(name, manifests.RUNTIME_WORKER))
        new = status.compute_status(
            name=name,
            namespace=namespace,
            parsed=parsed,
            runtime=runtime,
            router=owned_deployment(manifests.router_name(name)),
            previous=previous,
            now=self._clock(),
            generation=generation,
            failure=failure,
            pods=pods,
            pool=pool,
            metadata=current["metadata"],
        )
        patch = status.status_patch(previous, new)
        if patch is not None:
            self.kube.patch_inference_service_status(namespace, name, patch)
        if (fight := status.replicas_fight_began(previous, new)) is not None:
            _event(current, "Warning", status.REPLICAS_FIGHT_SCALER, fight)

    def _runtime_workload(
        self,
        namespace: str,
        name: str,
        parsed: ServiceSpec | SpecError,
        read: Callable[[str, tuple[str, str]], Any],
    ) -> dict[str, Any] | None:
        """The runtime's workload as the status reads it: the kind `parsed` wants (a LeaderWorkerSet is read
        only where its API is served); with an invalid spec, whichever of the two exists."""
        runtime = manifests.runtime_name(name)
        if isinstance(parsed, ServiceSpec):
            kind = manifests.runtime_kind(parsed)
            if kind[1] == manifests.LWS_KIND and not self.kube.serves(LEADER_WORKER_SET):
                return None
            result: dict[str, Any] | None = read(runtime, kind)
            return result
        found = read(runtime, ("apps/v1", "Deployment"))
        if found is None and self.kube.serves(LEADER_WORKER_SET):
            found = read(runtime, (manifests.LWS_API_VERSION, manifests.LWS_KIND))
        return found

    # -- LoRA adapters -------------------------------------------------------------------------------------
    async def sync_adapters(
        self,
        namespace: str,
        name: str,
        failures: MutableMapping[tuple[str, str], adapters.Failure],
        client: httpx.AsyncClient,
        logger: Any,
    ) -> list[adapters.ReplicaState] | None:
        """One pass over the ready replicas: read the adapters each serves and, with runtime updates, load and
        unload them to match spec.adapters; then write status.adapters (and AdaptersReady).

        Like the autoscaler's scrape, the calls to the replicas are made without the object's lock (a load may
        take minutes: the replica fetches the adapter); only the status write takes it. `failures` holds the
        loads replicas refused (kept by the caller between passes). None when there is nothing to do.
        """
        body = await asyncio.to_thread(self.kube.get_inference_service, namespace, name)
        if body is None or _deleting(body):
            raise ServiceGone(f"{namespace}/{name}")
        parsed = parse_service(name, body)
        if isinstance(parsed, SpecError) or not parsed.lora_enabled:
            return None
        pods = await asyncio.to_thread(
            self.kube.list_pods, namespace, manifests.match_labels(name, manifests.RUNTIME)
        )
        want = adapters.wanted(parsed)
        runtime = parsed.engine.runtime_lora_updates
        states = await adapters.sync(client, adapters.replicas(pods), want, runtime, failures, self._wall())
        for state in states:
            pod = state.replica.name
            for change in state.changes:
                logger.info(f"Adapters: {change} on pod {pod}")
            for adapter, message in state.failed:
                text = f"adapter {adapter} on pod {pod}: {message}"
                logger.warning(f"Adapters: could not load {text}")
                _event(body, WARNING, adapters.LOAD_FAILED, f"Could not load {text}")
        items = adapters.entries(parsed.adapters, want, states, failures)
        await asyncio.to_thread(self._write_adapters, namespace, name, parsed, items)
        return states

    def _write_adapters(
        self, namespace: str, name: str, parsed: ServiceSpec, items: list[dict[str, Any]]
    ) -> None:
        with self._lock(namespace, name):
            current = self.kube.get_inference_service(namespace, name)
            if current is None or _deleting(current):
                raise ServiceGone(f"{namespace}/{name}")
            fresh = parse_service(name, current)
            if (
                not isinstance(fresh, ServiceSpec)
                or fresh.adapters != parsed.adapters
                or fresh.engine.runtime_lora_updates != parsed.engine.runtime_lora_updates
            ):
                return  # the spec changed during the pass: the next pass reports on the new one
            stored = (current.get("status") or {}).get("adapters")
            if stored == items:
                return
            # A list is replaced whole by a merge patch; then the refresh derives AdaptersReady from it.
            self.kube.patch_inference_service_status(namespace, name, {"adapters": items})
            self._refresh(namespace, name, parsed=parsed, generation=status.KEEP, failure=status.KEEP)

    # -- the autoscaler ------------------------------------------------------------------------------------
    async def evaluate_autoscaler(
        self,
        namespace: str,
        name: str,
        samples: MutableMapping[str, scrape.PodSample],
        client: httpx.AsyncClient,
        logger: Any,
    ) -> autoscale.Decision | None:
        """One evaluation: scrape the ready runtime pods (or ask Prometheus), decide, write spec.replicas and
        status.autoscaler.

        `samples` holds each pod's previous sample (counter deltas need two); the caller keeps it between
        evaluations. Returns None when there is nothing to do (invalid spec, autoscaling off); raises ServiceGone
        once the object is gone.
        """
        body = await asyncio.to_thread(self.kube.get_inference_service, namespace, name)
        if body is None or _deleting(body):
            self._blocks.pop((namespace, name), None)
            raise ServiceGone(f"{namespace}/{name}")
        parsed = parse_service(name, body)
        if isinstance(parsed, SpecError) or not parsed.autoscaling.enabled:
            return None
        now = self._wall()
        failed: list[str] = []
        pods = await asyncio.to_thread(
            self.kube.list_pods, namespace, manifests.match_labels(name, manifests.RUNTIME)
        )
        unready_since = autoscale.not_ready_since(pods, now)
        deployment = await asyncio.to_thread(
            self._runtime_workload,
            namespace,
            name,
            parsed,
            lambda child, kind: self.kube.get(*kind, namespace, child),
        )
        creation_failing = status.deployment_failure(deployment) is not None
        if self._prometheus_url is not None:
            observed = await prometheus.observe(
                client, self._prometheus_url, namespace, name, parsed.replicas
            )
        else:
            found, failed = await scrape.scrape(client, scrape.targets(pods), now)
            for line in failed:
                logger.warning(f"Could not scrape {line}")
            held = None
            if parsed.router.enabled:
                routers = await asyncio.to_thread(
                    self.kube.list_pods, namespace, manifests.match_labels(name, manifests.ROUTER)
                )
                held = await scrape.held(client, scrape.targets(routers))
            observed = scrape.signals(found, samples, parsed.replicas, held)
            samples.clear()
            samples.update({s.key: s for s in found})
        stored = (body.get("status") or {}).get("autoscaler")
        previous = self._last_block(namespace, name, stored)
        history, events = status.autoscaler_history(previous)
        a = parsed.autoscaling
        grace_s = float(parsed.engine.startup_timeout_seconds)
        young = autoscale.starting(
            parsed.replicas, observed.ready_replicas, unready_since, now, grace_s, creation_failing
        )
        last_active = autoscale.last_activity(status.last_active(previous), observed.requests, young, now)
        external: tuple[autoscale.ExternalScaler, ...] = ()
        if not a.delegated:
            scalers = await asyncio.to_thread(self.kube.list_scalers, namespace)
            external = autoscale.external_scalers(name, scalers)
        decision = autoscale.decide(
            current=parsed.replicas,
            observed=observed,
            targets=autoscale.per_metric(a.targets),
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            behavior=autoscale.Behavior.from_spec(a),
            history=history,
            events=events,
            now=now,
            external=external,
            idle_s=now - last_active,
            scale_to_zero_after_s=float(a.scale_to_zero_after_seconds),
            unready_since=unready_since,
            grace_s=grace_s,
            creation_failing=creation_failing,
        )
        if decision.reason == autoscale.NO_METRICS and failed:
            decision = dataclasses.replace(decision, message=scrape.unreachable(failed))
        await asyncio.to_thread(
            self._apply_autoscale, body, parsed, decision, observed, now, last_active, previous, logger
        )
        return decision

    def _apply_autoscale(
        self,
        body: Mapping[str, Any],
        parsed: ServiceSpec,
        decision: autoscale.Decision,
        observed: autoscale.Observed,
        now: float,
        last_active: float,
        previous: Any,
        logger: Any,
    ) -> None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        stored = (body.get("status") or {}).get("autoscaler")
        if parsed.autoscaling.delegated and not observed.ready_replicas:
            return  # nothing to report: the reconcile's own block (Delegated) stands
        with self._lock(namespace, name):
            if not parsed.autoscaling.delegated and decision.desired != parsed.replicas:
                if not self._write_replicas(body, decision.desired, logger):
                    return  # the count changed under this decision; the next evaluation starts from it
                message = f"{parsed.replicas} -> {decision.desired} replicas: {decision.message}"
                logger.info(f"Autoscaler: {message}")
                _event(body, NORMAL, decision.reason, message)
            block = status.autoscaler_block(
                spec=parsed,
                decision=decision,
                observed=observed,
                previous=previous,
                now=now,
                last_active=last_active,
            )
            patch = status.status_patch({"autoscaler": stored or {}}, {"autoscaler": block})
            written = stored.get("lastEvaluationTime") if isinstance(stored, Mapping) else None
            if patch is not None and not _only_times_moved(stored, block, now):
                self.kube.patch_inference_service_status(namespace, name, patch)
                written = block["lastEvaluationTime"]
            self._blocks[namespace, name] = (block, written)
            if status.autoscaler_conditions(block) != status.autoscaler_conditions(previous):
                # The autoscaler's conditions follow its block, and conditions are the refresh's to write.
                self._refresh(namespace, name, parsed=parsed, generation=status.KEEP, failure=status.KEEP)

    def _last_block(self, namespace: str, name: str, stored: Any) -> Any:
        """The block of this process's last evaluation, if status still holds what it last wrote; else status.

        An evaluation whose only news is the time (its own, the last request's, a repeated recommendation's)
        writes nothing, so the next one starts from what it computed: a later write by someone else (another
        operator replica after a failover) wins, since its lastEvaluationTime differs.
        """
        remembered = self._blocks.get((namespace, name))
        if remembered is None or not isinstance(stored, Mapping):
            return stored
        block, written = remembered
        return block if stored.get("lastEvaluationTime") == written else stored

    def _write_replicas(self, body: Mapping[str, Any], desired: int, logger: Any) -> bool:
        """spec.replicas := desired, over the version the decision read; False if the count moved meanwhile.

        A scrape takes up to a few seconds: a `kubectl scale` (or any scaler) in that time must win, not be
        overwritten. The precondition fails on any write, so a conflict that left the count alone (Kopf's
        annotations, a label) is retried on the fresh version.
        """
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        decided_on = (body.get("spec") or {}).get("replicas")
        version = meta.get("resourceVersion")
        for _ in range(REPLICA_WRITE_ATTEMPTS):
            # spec.replicas is the one source of the count; the update handler carries it to the
            # Deployment, exactly as for kubectl scale.
            patch: dict[str, Any] = {"spec": {"replicas": desired}}
            if version is not None:
                patch["metadata"] = {"resourceVersion": version}
            try:
                self.kube.patch_inference_service(namespace, name, patch)
                return True
            except ApiException as e:
                if e.status != 409:
                    raise
            fresh = self.kube.get_inference_service(namespace, name)
            if fresh is None or _deleting(fresh):
                raise ServiceGone(f"{namespace}/{name}")
            now_replicas = (fresh.get("spec") or {}).get("replicas")
            if now_replicas != decided_on:
                logger.info(
                    f"Autoscaler: spec.replicas went from {decided_on} to {now_replicas} during the evaluation; "
                    f"not overwriting it with {desired}"
                )
                return False
            version = fresh["metadata"].get("resourceVersion")
        logger.warning(f"Autoscaler: spec.replicas kept changing; {desired} not written this evaluation")
        return False


def _only_times_moved(stored: Any, block: Mapping[str, Any], now: float) -> bool:
    """`block` says what `stored` says but for times, and `stored` was written less than a heartbeat ago.

    Every evaluation (every 15 s, per InferenceService) would otherwise write the CR's status, and so wake
    every watcher of InferenceServices (Kopf included) for nothing. What is not written is kept in memory
    (`_last_block`); an operator restart loses at most a heartbeat of it: its lastActiveTime and the times of
    repeated recommendations read up to EVALUATION_HEARTBEAT_S older, which can bring a scale down or to zero
    forward by as much, once, after a restart.
    """
    if not isinstance(stored, Mapping):
        return False
    written = status.parse_time(stored.get("lastEvaluationTime"))
    if written is None or now - written >= EVALUATION_HEARTBEAT_S:
        return False
    return _without_times(stored) == _without_times(block)


def _without_times(block: Mapping[str, Any]) -> dict[str, Any]:
    result = {k: v for k, v in block.items() if k not in ("lastEvaluationTime", "lastActiveTime")}
    # A run of equal recommendations acts as its latest one on every stabilization window (the windows
    # end now), so only the values, runs collapsed, are news.
    values = [r.get("replicas") for r in block.get("recommendations") or [] if isinstance(r, Mapping)]
    result["recommendations"] = [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]
    return result


def _awaits_crd(body: Mapping[str, Any]) -> bool:
    """The last attempt found the InferencePool's CRD missing (its condition says CRDNotInstalled)."""
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(
        isinstance(c, Mapping)
        and c.get("type") == gateway.CONDITION
        and c.get("reason") == gateway.CRD_NOT_INSTALLED
        for c in conditions
    )


def _awaits_lws(body: Mapping[str, Any]) -> bool:
    """The last attempt found the LeaderWorkerSet API missing (Degraded says LeaderWorkerSetNotInstalled)."""
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(
        isinstance(c, Mapping)
        and c.get("type") == status.DEGRADED
        and c.get("reason") == status.LWS_NOT_INSTALLED
        for c in conditions
    )


def _event(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    # Kopf posts plain dicts as well as its Body wrappers; its annotation names only the latter.
    kopf.event(cast(Any, obj), type=type_, reason=reason, message=message)


def _body_message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or "{}").get("message", ""))
    except (ValueError, AttributeError):
        return str(e.body or "")
