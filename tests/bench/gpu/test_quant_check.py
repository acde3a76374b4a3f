"""bench/gpu/quant_check.py's smoke run on CPU: every layer, row count and kind is checked against the
dequantized reference and reported (the GPU run's logic, before a device spends minutes on it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_smoke_run_checks_every_case(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/gpu/quant_check.py"), "--smoke", "--out", str(tmp_path)],
        env={"PYTHONPATH": str(REPO / "runtime"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "quant_check.json").read_text())
    cases = {(r["layer"], r["rows"], r["kind"]) for r in report}
    assert cases == {
        (layer, m, kind)
        for layer in ("qkv", "o", "gate_up", "down")
        for m in (1, 16)
        for kind in ("fp8", "int4")
    }
    assert all(0 < r["rel_error"] < 0.02 for r in report)
