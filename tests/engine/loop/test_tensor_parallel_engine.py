"""The engine over two real gloo ranks (LLM(tensor_parallel_size=2): rank 0 here, one spawned worker rank):
greedy tokens equal transformers' in float32 on Llama, Qwen2, Qwen3 and Mistral (one KV head for two ranks);
the same outputs as one rank under chunked prefill, prefix caching, swap and recompute preemption, n > 1,
n-gram speculation, prompt and sampled log-probs (greedy and seeded sampling), structured outputs and static
batching; and the ranks' lifecycle: a killed worker fails the next step naming it, and no worker outlives
the engine (closed, dropped, or its process killed); sizes and places tensor parallel does not run are
refused before any process starts."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chunkwise import LLM, SamplingParams
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.datatypes.outputs import RequestOutput
from chunkwise.engine.datatypes.structured_output import StructuredOutput
from chunkwise.engine.loop import tp_ranks
from chunkwise.engine.loop.tp_ranks import EngineRanks
from tests.hf_models import hf_greedy, save_random_family

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def short_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's collectives give up after 30 s, not 300: ranks out of step fail a test instead of hanging it."""
    monkeypatch.setattr(tp_ranks, "COLLECTIVE_TIMEOUT_S", 30.0)


def _ranks(llm: LLM) -> EngineRanks:
    ranks = llm.engine.runner.ranks
    assert isinstance(ranks, EngineRanks)
    return ranks


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Every pid has exited and been reaped (or was never ours)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("family", ["llama3-rope", "qwen2-bias-yarn", "qwen3", "mistral"])
def test_greedy_equals_transformers(family: str, tmp_path: Path) -> None:
    path = save_random_family(tmp_path, family)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    max_new = [rng.randint(3, 10) for _ in prompts]
    expected = hf_greedy(path, prompts, max_new)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4)
    try:
        outs = llm.generate(
            prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
        )
    finally:
        llm.engine.close()
    assert [o.outputs[0].token_ids for o in outs] == expected


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(12)]  # three blocks of 4: prefix-cache hits
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    for i in range(8):
        motif = [rng.randrange(3, 250) for _ in range(5)]
        # Repeated motifs, so that the n-gram proposer finds drafts.
        prompts.append(shared + motif * 3 + [rng.randrange(3, 250) for _ in range(rng.randint(0, 6))])
        if i % 4 == 0:
            params.append(SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, prompt_logprobs=2))
        elif i % 4 == 1:
            params.append(SamplingParams(max_tokens=12, temperature=0.8, seed=i, n=2, ignore_eos=True))
        elif i % 4 == 2:
            params.append(SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2))
        else:
            params.append(
                SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=100 + i, ignore_eos=True)
            )
    return prompts, params


def _run(tp: int, mode: str, pp: int = 1) -> tuple[list[RequestOutput], tuple[int, int]]:
    """The workload over tp x pp ranks (the pipeline tests' too): outputs, (preemptions, drafted tokens)."""
    # 24 blocks of 4 tokens for 8 requests of up to 51 tokens each: they preempt one another.
    llm = LLM(
        "tiny",
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=16,
        block_size=4,
        num_blocks=24,
        max_model_len=64,
        preemption_mode=mode,
        speculative_method="ngram",
        num_speculative_tokens=3,
        adaptive_speculation=False,  # drafts every step, accepted or not
    )
    # Admission trusts max_tokens; under-promise so that the running requests outgrow the cache.
    llm.engine.scheduler.admission.output_estimate = lambda req: 0  # type: ignore[method-assign]
    try:
        prompts, params = _workload()
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats
    finally:
        llm.engine.close()
    preempted = stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute
    return outs, (preempted, stats.spec_num_draft_tokens)


def _summary(outs: list[RequestOutput]) -> list[object]:
    return [
        (
            [(c.index, c.token_ids, c.finish_reason) for c in o.outputs],
            [(t.token_id, t.rank, [i for i, _ in t.top]) for t in o.prompt_logprobs or []],
        )
        for o in outs
    ]


def _logprob_values(outs: list[RequestOutput]) -> list[float]:
    values = [t.logprob for o in outs for t in o.prompt_logprobs or []]
    for o in outs:
        for c in o.outputs:
            values += [t.logprob for t in c.logprobs or []]
    return values


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_two_ranks_equal_one(mode: str) -> None:
    one, (preempted, drafted) = _run(1, mode)
    two, counts = _run(2, mode)
    # The workload does preempt, by `mode`, and verifies n-gram drafts; both the same on two ranks.
    assert preempted > 0 and drafted > 0 and counts == (preempted, drafted)
    assert all(len(o.outputs) == 2 for o in one[1::4])  # n = 2
    assert any(o.num_cached_tokens for o in one)  # and hits the prefix cache
    assert _summary(two) == _summary(one)
    assert _logprob_values(two) == pytest.approx(_logprob_values(one), abs=1e-4)
    assert len(_logprob_values(one)) > 50


def test_killed_worker_fails_the_next_step_naming_it() -> None:
    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2)
    try:
        pids = _ranks(llm).pids
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids) == 4
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {pids[0]}\) died \(killed by signal 9\)"):
            llm.generate([[5, 6, 7]], sp)
        assert _gone(pids)
        with pytest.raises(RuntimeError, match="rank 1"):  # the engine stays stopped
            llm.generate([[8, 9]], sp)
    finally:
        llm.engine.close()


def test_a_worker_killed_mid_step_fails_the_step_at_once() -> None:
    """Rank 0 waits for the dead rank inside a step's all-reduce: its watcher aborts the wait, so the step
    fails within moments, not after the collective timeout (30 s here)."""
    import threading

    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2)
    try:
        (pid,) = _ranks(llm).pids
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {pid}\) died \(killed by signal 9\)"):
            llm.generate([[5, 6, 7]] * 8, sp)  # far longer than a second
        assert time.monotonic() - t0 < 15.0
        assert _gone([pid])
    finally:
        llm.engine.close()


def test_closed_or_dropped_engine_leaves_no_process() -> None:
    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2)
    pids = _ranks(llm).pids
    llm.engine.close()
    assert _gone(pids)
    llm.engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2))
    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2)  # a group again, the last one left
    pids = _ranks(llm).pids
    with pytest.raises(
        RuntimeError, match="a tensor-parallel or pipeline-parallel engine is already running in this process"
    ):
        LLM("tiny", dtype="float32", tensor_parallel_size=2)
    del llm
    gc.collect()
    assert _gone(pids)


def test_workers_die_with_a_killed_rank_0(tmp_path: Path) -> None:
    script = (
        "import os, signal\n"
        "from chunkwise import LLM\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM('tiny', dtype='float32', tensor_parallel_size=2)\n"
        "    print(*llm.engine.runner.ranks.pids, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    (tmp_path / "rank0.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT}"}
    out = tmp_path / "out.txt"
    with out.open("w") as f:  # a file, not a pipe: an orphan holding it would not hold up the run
        proc = subprocess.run(
            [sys.executable, str(tmp_path / "rank0.py")], stdout=f, stderr=f, env=env, timeout=60
        )
    lines = out.read_text().splitlines()
    assert proc.returncode == -signal.SIGKILL, lines
    pids = [int(p) for p in lines[-1].split()]
    assert len(pids) == 1
    try:
        assert _gone(pids)
    finally:
        for pid in pids:  # an orphan found is a failure, and is not left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_sizes_that_do_not_divide_are_refused_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_ranks(*args: object) -> None:
        raise AssertionError("worker processes were started")

    monkeypatch.setattr("chunkwise.engine.loop.builder.EngineRanks", no_ranks)
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) does not divide over tensor_parallel_size 3"
    ):
        LLM("tiny", tensor_parallel_size=3)
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        LLM("tiny", tensor_parallel_size=0)


def test_what_parallelism_does_not_run_yet_is_refused() -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 2 runs on CPU only: on cuda .*issue 33"):
        engine_config_from_kwargs("tiny", device="cuda", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"distributed_backend 'nccl' needs a CUDA device, not 'cpu'"):
        engine_config_from_kwargs("tiny", tensor_parallel_size=2, distributed_backend="nccl")
    # Tensor parallel on CUDA is accepted: each rank a GPU under NCCL, or every rank on one under gloo.
    assert engine_config_from_kwargs("tiny", device="cuda", tensor_parallel_size=2).world_size == 2
    assert multiprocessing.active_children() == []


def _drafted(tp: int) -> tuple[list[list[int]], int]:
    llm = LLM(
        "tiny",
        dtype="float32",
        tensor_parallel_size=tp,
        speculative_method="draft",
        speculative_model="tiny",
        num_speculative_tokens=3,
        max_num_batched_tokens=32,
        block_size=4,
    )
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
    ]
    try:
        outs = llm.generate([[5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11]], params)
        accepted = llm.engine.scheduler.stats.spec_num_accepted_tokens
    finally:
        llm.engine.close()
    return [o.outputs[0].token_ids for o in outs], accepted


def test_a_draft_model_proposes_on_rank_0_and_every_rank_verifies() -> None:
    """The draft model runs whole on rank 0 (its proposals travel in the step message); the target's
    verification rows run sharded on every rank. Greedy and seeded rows equal one rank's."""
    two, accepted = _drafted(2)
    assert accepted > 0
    assert two == _drafted(1)[0]


def _constrained(tp: int, **engine_args: object) -> list[list[int]]:
    llm = LLM(
        "tiny",
        dtype="float32",
        tensor_parallel_size=tp,
        max_num_batched_tokens=16,
        block_size=4,
        **engine_args,
    )
    spec = StructuredOutput.regex(r"(ab|cd)+e")
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, structured=spec),
        SamplingParams(max_tokens=9, temperature=0.7, seed=3, structured=spec),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    ]
    try:
        outs = llm.generate(["hello there", "xyz", "a longer prompt, its batch's last to finish"], params)
    finally:
        llm.engine.close()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "engine_args",
    [{"batching": "static"}, {"speculative_method": "ngram", "adaptive_speculation": False}],
    ids=["static-batching", "ngram"],
)
def test_structured_outputs_and_static_batching_on_two_ranks(engine_args: dict[str, object]) -> None:
    """Grammar masks (and n-gram drafts cut by them) on rank 0 only; static batching's padding rows."""
    one = _constrained(1, **engine_args)
    assert one[0][:2] == list(b"ab")  # the grammar did constrain
    assert _constrained(2, **engine_args) == one


def test_each_rank_steps_on_its_own_share_of_the_cpus() -> None:
    """Rank 0's stepping thread and each worker are pinned to consecutive equal shares of the CPUs this
    process may use (all of them, shared, where there are fewer CPUs than ranks); rank 0's mask comes back at
    close."""
    import threading

    tid = threading.get_native_id()
    before = os.sched_getaffinity(tid)
    cpus = sorted(before)
    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2)
    try:
        (pid,) = _ranks(llm).pids
        if len(cpus) >= 2:
            k = len(cpus) // 2
            assert os.sched_getaffinity(tid) == set(cpus[:k])
            assert os.sched_getaffinity(pid) == set(cpus[k:])
        else:
            assert os.sched_getaffinity(tid) == os.sched_getaffinity(pid) == before
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids) == 3
    finally:
        llm.engine.close()
    assert os.sched_getaffinity(tid) == before
