"""bench/gpu/first_run.py, the first GPU run's one script: its token check (token_gate.py), its time boxes,
and a dry run of every section on CPU with only what the GPU machine has importable."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench/gpu" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gate = _load("token_gate")
first_run = _load("first_run")


# -- the token check ---------------------------------------------------------------------------------------


def _seq(*steps):
    """(token, logprob, top) steps; the top-3 are the chosen token and two others."""
    return list(steps)


def _step(token, lp, *others):
    return (token, lp, [(token, lp), *others])


REF = [
    _seq(
        _step(5, -0.1, (6, -2.5), (7, -3.0)), _step(9, -0.4, (8, -0.45), (2, -4.0)), _step(1, -0.2, (3, -3.0))
    ),
    _seq(_step(4, -1.0, (3, -1.5)), _step(4, -0.3, (2, -2.0))),
]


def _check(other, **kw):
    return gate.compare(REF, other, **{"logprob_tol": 0.1, "tie_tol": 0.1, **kw})


def test_identical_runs_pass():
    r = _check(REF)
    assert r.ok and r.compared == r.positions == 5 and r.max_abs_logprob_diff == 0 and not r.ties


def test_log_probs_within_tolerance_pass_and_beyond_it_fail():
    near = [[(t, lp + 0.05, [(a, b + 0.05) for a, b in top]) for t, lp, top in s] for s in REF]
    r = _check(near)
    assert r.ok and r.max_abs_logprob_diff == pytest.approx(0.05)
    # An alternative's log-prob moved by a nat: a wrong input does this, and the chosen token is the same.
    off = [list(s) for s in REF]
    off[0][0] = _step(5, -0.1, (6, -1.5), (7, -3.0))
    r = _check(off)
    assert not r.ok and "token 6" in r.failures[0]


def test_a_split_at_a_near_tie_passes_and_stops_the_comparison():
    # Position 1 of sequence 0: 9 (-0.4) and 8 (-0.45) are within 0.1; the other run chose 8, and its
    # following tokens differ freely.
    other = [list(s) for s in REF]
    other[0][1:] = [_step(8, -0.41, (9, -0.44)), _step(77, -0.1)]
    r = _check(other)
    assert r.ok and len(r.ties) == 1 and r.compared == 3


def test_a_split_that_is_not_a_tie_fails():
    other = [list(s) for s in REF]
    other[0][0] = _step(6, -0.3, (5, -2.0))  # the reference's 5 is two nats below 6 here
    assert not _check(other).ok
    other[0][0] = _step(42, -0.3, (43, -2.0))  # the reference's choice is not even in the other's top-k
    r = _check(other)
    assert not r.ok and "not in top-k" in r.failures[0]


def test_too_few_comparable_positions_fail_even_when_every_split_is_a_tie():
    other = [[_step(6, -2.45, (5, -2.5))], [_step(3, -1.45, (4, -1.5))]]
    ref = [[_step(5, -2.5, (6, -2.45))], [_step(4, -1.5, (3, -1.45))]]
    r = gate.compare(ref, other, logprob_tol=0.1, tie_tol=0.1)
    assert not r.ok and r.compared == 0 and len(r.ties) == 2


def test_lengths_must_match():
    other = [REF[0][:2], REF[1]]
    assert not _check(other).ok
    with pytest.raises(ValueError):
        gate.compare(REF, REF[:1], logprob_tol=0.1, tie_tol=0.1)


# -- the script ------------------------------------------------------------------------------------------


def test_the_time_boxes_fit_the_lease():
    # 15 minutes of device time, the machine's start included: the sections get under 9.
    assert sum(s.box_s for s in first_run.SECTIONS) < 9 * 60
    assert all(s.box_s > first_run.MARGIN_S for s in first_run.SECTIONS)


def test_a_section_past_its_box_is_killed_and_the_next_still_runs(tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import time, sys\nprint('started', flush=True)\ntime.sleep(120)\n")
    section = first_run.Section("correctness", 2, str(hang), (), (), "hangs")
    outcome = first_run.run_section(section, tmp_path / "out", dry_run=True)
    assert outcome.status == "timed out" and outcome.seconds < 30
    assert "started" in (tmp_path / "out" / "log.txt").read_text()


# Every runtime dependency the GPU machine lacks (it has torch, triton and numpy), made unimportable.
NOT_ON_THE_GPU_MACHINE = """
import sys
DENIED = {"yaml", "safetensors", "tokenizers", "fastapi", "starlette", "pydantic", "uvicorn", "uvloop",
          "httptools", "orjson", "httpx", "prometheus_client", "llguidance", "kubernetes", "boto3", "grpc",
          "matplotlib", "transformers", "huggingface_hub", "openai", "kopf", "jsonschema"}
class Deny:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in DENIED:
            raise ImportError(name + " is not on the GPU machine")
sys.meta_path.insert(0, Deny())
"""


def test_dry_run_of_every_section_with_only_what_the_gpu_machine_has(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(NOT_ON_THE_GPU_MACHINE)
    probe = subprocess.run(
        [sys.executable, "-c", "import yaml"], env={"PYTHONPATH": str(block)}, capture_output=True, text=True
    )
    assert "not on the GPU machine" in probe.stderr  # the blocker is in force in child processes
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/gpu/first_run.py"), "--dry-run", "--out", str(out)],
        env={"PYTHONPATH": str(block), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=500,
    )
    logs = "".join((d / "log.txt").read_text()[-3000:] for d in out.iterdir() if (d / "log.txt").is_file())
    assert proc.returncode == 0, proc.stdout[-3000:] + logs
    summary = json.loads((out / "first_run.json").read_text())
    sections = {s["name"]: s for s in summary["sections"]}
    assert [s["status"] for s in sections.values()] == ["ok"] * 5, sections

    correctness = sections["correctness"]["report"]
    checks = {n: c.get("token_check") for n, c in correctness["configs"].items()}
    assert set(checks) == {"torch-eager", "cpu-eager", "cpu-buckets", "triton-interpreted"}
    assert all(c["ok"] and c["compared"] == c["positions"] > 0 for c in checks.values())
    race = correctness["race"]
    assert race["identical"] and race["prompt_only_steps"] >= 2

    tp = sections["tp"]["report"]
    check = tp["runs"]["tp2-gloo"]["token_check"]
    assert tp["ok"] and check["ok"] and check["compared"] == check["positions"] > 0 and not tp["orphans"]

    throughput = sections["throughput"]["report"]["configs"]
    # Sized as a user's engine is (on CPU that is the default 1 GiB), the other sections pinned.
    assert {c["kv_sized_by"] for c in throughput.values()} == {"gpu_memory_utilization"}
    assert {c["kv_sized_by"] for c in correctness["configs"].values()} == {"kv_cache_memory_bytes"}
    for name in ("cpu-eager", "cpu-buckets"):
        for d in throughput[name]["decode"].values():
            assert d["p99_step_ms"] >= d["step_ms"] > d["host_ms"] > 0
        assert throughput[name]["prefill"]["prefill_tokens_per_s"] > 0

    attention = sections["attention"]["report"]
    assert attention["decode"] and all(c["ok"] for c in attention["correctness"])
    assert "prefill" not in attention  # only the sections asked for

    convoy = sections["convoy"]["report"]["configs"]["cpu-buckets"]["convoy"]
    assert convoy["max_itl_ms"] >= convoy["p99_itl_ms"] >= convoy["median_itl_ms"] > 0
    md = (out / "first_run.md").read_text()
    assert "Host time per decode step" in md and "dry run" in md
