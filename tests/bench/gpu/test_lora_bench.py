"""bench/gpu/lora_bench.py's smoke run on CPU: every case runs (adapters of every projection in a batch of
several, on the engine the GPU run builds) and the report has a time for each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_smoke_run_times_every_case(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/gpu/lora_bench.py"), "--smoke", "--out", str(tmp_path)],
        env={"PYTHONPATH": str(REPO / "runtime"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "lora_bench.json").read_text())
    assert list(report["cases"]) == [
        "base, eager",
        "base, graphs",
        "LoRA on, base requests",
        "1 adapter",
        "2 adapters",
        "4 adapters",
    ]
    assert all(c["step_ms"] > 0 for c in report["cases"].values())
    assert "| 4 adapters |" in (tmp_path / "lora_bench.md").read_text()
