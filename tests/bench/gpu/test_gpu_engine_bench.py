"""bench/gpu/run_engine_bench.py's smoke mode: every code path the GPU run takes, on tiny shapes on CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_engine_bench_smoke_mode(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("run_engine_bench", REPO / "bench/gpu/run_engine_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine_bench.json").read_text())
    assert report["smoke"] is True and not report["errors"]
    configs = report["configs"]
    assert set(configs) == {"torch-eager", "cpu-eager", "cpu-buckets", "triton-interpreted"}
    # The bucketed path (what CUDA graphs replay) and every backend pass the token check against the
    # reference (on CPU in fp32 every position is compared: no split).
    assert configs["torch-eager"]["reference"]
    assert all(c["token_check"]["ok"] and c["token_check"]["compared"] == 72 for c in configs.values())
    assert report["race"]["identical"]
    assert configs["cpu-buckets"]["graphs"] is True
    for name in ("cpu-eager", "cpu-buckets"):
        decode = configs[name]["decode"]
        # Every batch reaches decode-only steps of all its rows, and exactly the asked number is timed
        # (the prompts take several steps: the first requests must not finish before the last is prefilled).
        assert set(decode) == {"1", "4"}
        assert all(d["steps_timed"] == bench.SMOKE.decode_steps for d in decode.values()), decode
        assert all(d["p99_step_ms"] >= d["step_ms"] > d["host_ms"] > 0 for d in decode.values())
        assert configs[name]["prefill"]["steps_timed"] > 0
        convoy = configs[name]["convoy"]
        assert convoy["max_itl_ms"] >= convoy["p99_itl_ms"] >= convoy["median_itl_ms"] > 0
    assert "smoke run" in (tmp_path / "engine_bench.md").read_text()
