"""The operator as a process: what importing it pulls in, and both ways of starting it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from operator_harness import ROOT, Cluster, eventually

PROBE = """
import json, sys
import chunkwise_operator, chunkwise_operator.main, chunkwise_operator.spec, chunkwise_operator.manifests
import chunkwise_operator.status, chunkwise_operator.kube, chunkwise_operator.reconcile
import operator
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "chunkwise": sorted(m for m in sys.modules if m == "chunkwise" or m.startswith("chunkwise.")),
    "operator_module": getattr(operator, "__file__", None),
    "run_operator": callable(chunkwise_operator.main.run_operator),
}))
"""


def test_importing_the_operator_imports_neither_torch_nor_the_engine() -> None:
    # A fresh interpreter: this test process may already hold torch from the runtime tests.
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    assert result["torch"] == []
    assert result["chunkwise"] == []
    assert result["run_operator"] is True
    # operator/ is a source root, not a package: Python's own `operator` module must still win.
    assert result["operator_module"] is not None
    assert not Path(result["operator_module"]).is_relative_to(ROOT)


ENTRY_POINTS = {
    "kopf-run": [
        sys.executable,
        "-m",
        "kopf",
        "run",
        "--standalone",
        "--all-namespaces",
        "-m",
        "chunkwise_operator.main",
    ],
    "run_operator": [
        sys.executable,
        "-c",
        "import sys; from chunkwise_operator.main import run_operator; sys.exit(run_operator(['--verbose']))",
    ],
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
async def test_entry_point_starts_the_operator(entry: str, cluster: Cluster, tmp_path: Path) -> None:
    log = tmp_path / "operator.log"
    with log.open("w") as sink:
        # KUBECONFIG (set by the cluster fixture) is how the process finds the emulator.
        proc = subprocess.Popen(
            ENTRY_POINTS[entry], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        try:
            await eventually(
                lambda: proc.poll() is not None or cluster.watching(Cluster.ISVCS),
                timeout=30,
                what="watching",
            )
            assert proc.poll() is None, log.read_text()
            await cluster.create_isvc("tiny", {"model": {"preset": "tiny"}, "image": "chunkwise:dev"})
            await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "tiny"), timeout=20, what="deployment")
            await eventually(
                lambda: ((cluster.isvc("tiny") or {}).get("status") or {}).get("observedGeneration") == 1,
                what="status",
            )
        finally:
            # SIGINT is what Kopf treats as a graceful stop, like Ctrl-C or the kubelet's SIGTERM.
            proc.send_signal(signal.SIGINT)
            try:
                code = await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    output = log.read_text()
    assert code == 0, output
    assert "Handler 'reconcile-create' succeeded" in output
