"""Pipeline parallel over two real processes as a LeaderWorkerSet group would run them, on loopback: the
leader (an offline LLM in a helper script, LWS_WORKER_INDEX=0) and a worker pod's `python -m chunkwise.cli
serve` with the same arguments (LWS_WORKER_INDEX=1: stage 1, no server) meet at LWS_LEADER_ADDRESS on
--distributed-port; the tokens equal one process's, and when the leader is killed the worker exits non-zero
saying it lost the leader."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from chunkwise import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12] * 7]
ARGS = ["--model", "tiny", "--dtype", "float32", "--pipeline-parallel-size", "2", "--block-size", "4"]

LEADER = f"""
import os, signal, sys
from chunkwise import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM("tiny", dtype="float32", pipeline_parallel_size=2, block_size=4, distributed_port=int(sys.argv[1]))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate({PROMPTS!r}, sp)
    print("TOKENS", [o.outputs[0].token_ids for o in outs], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the leader lost, as a pod that dies
"""


def _two_free_ports() -> int:
    """A port p with p + 1 free too (the rendezvous, then the step messages)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with contextlib.suppress(OSError):
                b.bind(("127.0.0.1", port + 1))
                return int(port)
    raise RuntimeError("no two consecutive free ports")


def test_leader_and_worker_pod_equal_one_process_and_the_worker_exits_when_the_leader_is_lost(
    tmp_path: Path,
) -> None:
    one = LLM("tiny", dtype="float32", block_size=4)
    try:
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, sp)]
    finally:
        one.engine.close()
    port = _two_free_ports()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT}",
        "LWS_LEADER_ADDRESS": "127.0.0.1",
        "LWS_GROUP_SIZE": "2",
    }
    (tmp_path / "leader.py").write_text(LEADER)
    worker_log, leader_log = tmp_path / "worker.log", tmp_path / "leader.log"
    # Files, not pipes: a process left behind holding one would not hold up the test.
    with worker_log.open("w") as wf, leader_log.open("w") as lf:
        worker = subprocess.Popen(
            [sys.executable, "-m", "chunkwise.cli", "serve", *ARGS, "--distributed-port", str(port)],
            stdout=wf,
            stderr=subprocess.STDOUT,
            env={**env, "LWS_WORKER_INDEX": "1"},
        )
        try:
            leader = subprocess.run(
                [sys.executable, str(tmp_path / "leader.py"), str(port)],
                stdout=lf,
                stderr=subprocess.STDOUT,
                env={**env, "LWS_WORKER_INDEX": "0"},
                timeout=120,
            )
            code = worker.wait(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    out, log = leader_log.read_text(), worker_log.read_text()
    assert leader.returncode == -signal.SIGKILL, out
    tokens = [line for line in out.splitlines() if line.startswith("TOKENS ")]
    assert tokens == [f"TOKENS {expected}"], out
    assert "pipeline stage 1 of 2: ranks [1]" in log, log
    assert "rank 1: lost the leader at 127.0.0.1 (its connection closed): exiting" in log, log
    assert code == 1, log
