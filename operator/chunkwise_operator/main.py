"""Kopf registration for the chunkwise operator: `kopf run -m chunkwise_operator.main`, or run_operator().

Only wiring lives here; the work is in reconcile.py. Handler ids are explicit so that Kopf's stored progress
survives renaming a function.
"""

from __future__ import annotations

import argparse
from typing import Any

import kopf

from chunkwise_operator.kube import Kube
from chunkwise_operator.manifests import LABEL_MANAGED_BY, MANAGER
from chunkwise_operator.reconcile import Reconciler
from chunkwise_operator.spec import GROUP, PLURAL, VERSION


@kopf.on.startup(id="configure")
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress in annotations only: the CRD's status schema has no `kopf` field, so the API server would
    # prune Kopf's default status-based progress and retries would lose count.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.reporting_component = MANAGER
    memo.reconciler = Reconciler(Kube.from_environment())


@kopf.on.cleanup(id="close")
def close(memo: kopf.Memo, **_: Any) -> None:
    reconciler = memo.get("reconciler")
    if isinstance(reconciler, Reconciler):
        reconciler.close()


@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-resume", backoff=15)
@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-create", backoff=15)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", id="reconcile-update", backoff=15)
def reconcile(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    _reconciler(memo).reconcile(body, logger)


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGER}, id="child-deployment")
def child_deployment(
    type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    _reconciler(memo).child_changed(type, body, logger)


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
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    args = parser.parse_args(argv)
    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    # Standalone: one operator replica (the Deployment uses the Recreate strategy), so no peering objects.
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
    return 0
