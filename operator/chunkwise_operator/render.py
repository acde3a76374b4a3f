"""`chunkwise operator render -f service.yaml`: the objects reconcile would apply, without a cluster.

The same pure builders the operator runs (spec.parse, manifests.children), so a GitOps review sees exactly
what a cluster would get. Owner references are left out: they carry the InferenceService's uid, which only
the API server assigns. Nothing here imports Kopf or talks to an API server.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

import yaml

from chunkwise_operator import manifests
from chunkwise_operator.spec import API_VERSION, KIND, SpecError, parse, runtime_image, validate_name

DEFAULT_NAMESPACE = "default"


class RenderError(Exception):
    """A document that cannot be rendered; the message names the document and the reason."""


def render_documents(
    documents: Iterable[Any], source: str, namespace: str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The children of every InferenceService in `documents`, and a note for each document skipped."""
    objects: list[dict[str, Any]] = []
    skipped: list[str] = []
    for index, doc in enumerate(documents):
        if doc is None:
            continue
        where = f"{source}: document {index + 1}"
        if not isinstance(doc, dict):
            raise RenderError(f"{where}: not a Kubernetes object")
        if (doc.get("apiVersion"), doc.get("kind")) != (API_VERSION, KIND):
            skipped.append(f"{where}: {doc.get('kind')} {doc.get('apiVersion')} is not an {KIND}; skipped")
            continue
        meta = doc.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise RenderError(f"{where}: metadata.name is required")
        ns = namespace or meta.get("namespace") or DEFAULT_NAMESPACE
        try:
            validate_name(name)
            # A live object (`kubectl get infsvc NAME -o yaml | chunkwise operator render -f -`) renders with
            # the runtime image its status pins, as the operator would apply it.
            parsed = parse(doc.get("spec"), runtime_image(doc))
        except SpecError as e:
            # The reason and message the Degraded condition would carry.
            raise RenderError(f"{where} ({KIND} {ns}/{name}): {e.reason}: {e.message}") from None
        objects += manifests.children(name, ns, parsed)
    return objects, skipped


def _read(path: str) -> tuple[list[Any], str]:
    try:
        if path == "-":
            return list(yaml.safe_load_all(sys.stdin)), "<stdin>"
        with open(path, encoding="utf-8") as f:
            return list(yaml.safe_load_all(f)), path
    except OSError as e:
        raise RenderError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise RenderError(f"{path}: not YAML: {e}") from None


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="chunkwise operator render",
        description="Print, as multi-document YAML, the objects the operator would apply for each "
        "InferenceService in the files (owner references aside). Exits 1 naming the field of an invalid spec.",
    )
    parser.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        help="a YAML file of InferenceServices (repeatable; - reads standard input)",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        default=None,
        help=f"namespace for every object (default: each one's metadata.namespace, else {DEFAULT_NAMESPACE})",
    )
    args = parser.parse_args(argv)
    out = out or sys.stdout
    objects: list[dict[str, Any]] = []
    try:
        for path in args.filename:
            documents, source = _read(path)
            found, skipped = render_documents(documents, source, args.namespace)
            for note in skipped:
                print(note, file=sys.stderr)
            objects += found
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not objects:
        print(f"error: no {KIND} in {', '.join(args.filename)}", file=sys.stderr)
        return 1
    # `render ... | head`: the reader has what it wanted.
    with contextlib.suppress(BrokenPipeError):
        yaml.safe_dump_all(objects, out, sort_keys=False, default_flow_style=False)
    return 0
