"""Plots are written and load as PNG; the CLI entries work and stay cheap to import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chunkwise.bench.compare import Ratio, crossover
from chunkwise.bench.plots import write_plots
from chunkwise.bench.workloads import load_jsonl, long_tailed, with_arrivals
from chunkwise.cli import main
from chunkwise.sim.profile import load_profile
from chunkwise.sim.replay import replay, scheduler_config


def test_plots_are_written_and_load_as_png(tmp_path: Path) -> None:
    import matplotlib.image

    p = load_profile("llama3-8b-a100")
    items = with_arrivals(long_tailed(30, vocab_size=258, seed=1), [i * 0.02 for i in range(30)])
    runs = {
        "static": replay(items, p, scheduler_config(p, max_num_seqs=8, batching="static")),
        "continuous": replay(items, p, scheduler_config(p, max_num_seqs=8)),
    }
    paths = write_plots(runs, tmp_path, "batching")
    assert sorted(x.name for x in paths) == [
        "batching_itl_cdf.png",
        "batching_queue_kv.png",
        "batching_step_time_hist.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from chunkwise.cli import main\n"
        "for argv in (['--help'], ['bench', '--help'], ['replay', '--help'], ['bench', 'compare', 'hf', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_workload_to_jsonl_and_replay_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "agent.jsonl"
    argv = "bench workload --workload agent --num-requests 30 --system-len 256 --request-rate 10 --out"
    assert main([*argv.split(), str(trace)]) == 0
    items = load_jsonl(trace)
    assert len(items) == 30 and items[-1].arrival_s > 0
    out = tmp_path / "replay.json"
    argv = "replay run --profile llama3-8b-h100 --workload trace --replicas 2 --router predicted-completion"
    assert main([*argv.split(), "--trace", str(trace), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 30 and report["router"] == "predicted-completion"
    assert report["prefix_cache_hits"] > 0
    assert "Replay Result (simulated)" in capsys.readouterr().out


def test_replay_compare_estimator_under_kv_pressure(tmp_path: Path) -> None:
    # Lengths hidden from admission, a cache of 80 blocks: reserving for the mean output under-reserves
    # (preemptions), for the max over-reserves (fewer requests fit), the p90 sits between.
    out = tmp_path / "est.json"
    argv = (
        "replay compare estimator --profile llama3-8b-h100 --num-requests 150 --request-rate 15 "
        "--num-blocks 80 --max-model-len 1024 --median-output 64 --sigma 1.2 --max-output 768 "
        "--max-prompt 64 --seeds 1"
    )
    assert main([*argv.split(), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert all(r["runs"][0]["completed"] == 150 for r in results.values())
    mean, p90, top = (results[k]["preemptions_per_request"] for k in ("mean", "p90", "max"))
    assert mean > p90 >= top
    tput = {k: results[k]["output_throughput"] for k in results}
    assert tput["mean"] > tput["p90"] > tput["max"]


def test_crossover_and_ratio_lines() -> None:
    assert crossover([100, 200, 400], [1.0, 2.0, 3.0], [0.5, 2.5, 6.0]) == pytest.approx(150.0)
    assert crossover([100, 200], [1.0, 2.0], [3.0, 5.0]) is None
    r = Ratio("a/b", [2.0, 3.0, 2.5], goal="2x", clock="cpu", other_values=[1.0, 4.0], other_clock="wall")
    assert r.median == 2.5
    assert r.line() == (
        "a/b: 2.50x on the cpu clock (median of 3; range 2.00-3.00; wall clock 2.50x, range 1.00-4.00)  [goal: 2x]"
    )
