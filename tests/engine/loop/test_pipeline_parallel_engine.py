"""The engine over real gloo ranks in pipeline stages (LLM(pipeline_parallel_size=P), with and without
tensor_parallel_size=2: rank 0 here, the other ranks spawned): greedy tokens equal transformers' in float32
on Llama (an uneven layer split), Qwen3 (a tied LM head on the last stage, and two tensor-parallel ranks per
stage) and Mistral (one KV head, three stages: a middle one); the same outputs as one rank under chunked
prefill, prefix caching, swap and recompute preemption, n > 1, n-gram speculation, prompt and sampled
log-probs and structured outputs; each stage holds only its layers' KV; a killed rank fails
the next step naming it and leaves no process; fewer layers than stages, a LeaderWorkerSet of another size,
an engine in a worker pod, and the server's engine are refused before any process starts."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
from pathlib import Path

import pytest

from chunkwise import LLM, SamplingParams
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.loop import tp_ranks
from chunkwise.engine.loop.tp_ranks import EngineRanks
from tests.engine.loop.test_tensor_parallel_engine import (
    _constrained,
    _gone,
    _logprob_values,
    _run,
    _summary,
)
from tests.hf_models import hf_greedy, save_random_family


@pytest.fixture(autouse=True)
def short_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's collectives and receives give up after 30 s, not 300: ranks out of step fail a test."""
    monkeypatch.setattr(tp_ranks, "COLLECTIVE_TIMEOUT_S", 30.0)


@pytest.mark.parametrize(
    ("family", "layers", "pp", "tp"),
    [
        ("llama3-rope", 3, 2, 1),  # stages of 2 and 1 layers (vLLM's split: the last stage the lighter)
        ("qwen3", 2, 2, 2),  # tied embeddings: the last stage's LM head is its embedding shard, over 2 ranks
        ("mistral", 3, 3, 1),  # a middle stage: it receives hidden states and sends them on
    ],
)
def test_greedy_equals_transformers(family: str, layers: int, pp: int, tp: int, tmp_path: Path) -> None:
    path = save_random_family(tmp_path, family, num_hidden_layers=layers)
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    max_new = [rng.randint(3, 8) for _ in prompts]
    expected = hf_greedy(path, prompts, max_new)
    llm = LLM(
        str(path),
        dtype="float32",
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        max_num_batched_tokens=16,
        block_size=4,
    )
    try:
        # Rank 0 (stage 0) holds the first stage's layers' KV only.
        assert len(llm.engine.runner.kv_caches) == (2 if (layers, pp) == (3, 2) else 1)

        outs = llm.generate(
            prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
        )
    finally:
        llm.engine.close()
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize(
    ("tp", "mode"), [(1, "swap"), (2, "recompute")], ids=["pp2-swap", "tp2xpp2-recompute"]
)
def test_stages_equal_one_rank(tp: int, mode: str) -> None:
    """Prefix-cache hits, preemption (each rank moving its own layers' KV), n = 2, n-gram verification rows,
    prompt log-probs: the same on the stages as on one rank."""
    one, (preempted, drafted) = _run(1, mode)
    staged, counts = _run(tp, mode, pp=2)
    assert preempted > 0 and drafted > 0 and counts == (preempted, drafted)
    assert all(len(o.outputs) == 2 for o in one[1::4])  # n = 2
    assert any(o.num_cached_tokens for o in one)  # and hits the prefix cache
    assert _summary(staged) == _summary(one)
    assert _logprob_values(staged) == pytest.approx(_logprob_values(one), abs=1e-4)
    assert len(_logprob_values(one)) > 50


def test_structured_outputs_with_ngram_on_two_stages() -> None:
    """Grammar masks (and n-gram drafts cut by them) on rank 0, over the last stage's logits."""
    engine_args = {"speculative_method": "ngram", "adaptive_speculation": False}
    one = _constrained(1, **engine_args)
    assert one[0][:2] == list(b"ab")  # the grammar did constrain
    assert _constrained(1, pipeline_parallel_size=2, **engine_args) == one


def test_killed_rank_fails_the_next_step_naming_it_and_leaves_no_process() -> None:
    llm = LLM("tiny", dtype="float32", pipeline_parallel_size=2)
    try:
        ranks = llm.engine.runner.ranks
        assert isinstance(ranks, EngineRanks)
        pids = ranks.pids
        assert len(pids) == 1
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids) == 4
        os.kill(pids[0], signal.SIGKILL)  # rank 1: stage 1, the one rank 0 receives logits from
        with pytest.raises(
            RuntimeError, match=rf"pipeline stage 1's rank 1 \(pid {pids[0]}\) died \(killed by signal 9\)"
        ):
            llm.generate([[5, 6, 7]], sp)
        assert _gone(pids)
        with pytest.raises(RuntimeError, match=r"pipeline parallel: .*rank 1"):  # the engine stays stopped
            llm.generate([[8, 9]], sp)
    finally:
        llm.engine.close()


def test_fewer_layers_than_stages_are_refused_before_any_process_starts() -> None:
    # `tiny` has 2 layers.
    with pytest.raises(ValueError, match=r"num_hidden_layers \(2\) is fewer than pipeline_parallel_size 3"):
        LLM("tiny", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be positive"):
        LLM("tiny", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 2 runs on CPU only"):
        engine_config_from_kwargs("tiny", device="cuda", pipeline_parallel_size=2)
    assert multiprocessing.active_children() == []


def test_a_leader_worker_set_of_another_size_or_an_engine_in_a_worker_pod_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("LWS_GROUP_SIZE", "3")
    monkeypatch.setenv("LWS_WORKER_INDEX", "0")
    with pytest.raises(ValueError, match=r"LWS_GROUP_SIZE=3 pods .* pipeline_parallel_size must be 3, not 2"):
        LLM("tiny", pipeline_parallel_size=2)
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    with pytest.raises(
        ValueError, match=r"this pod is LeaderWorkerSet worker 1: it runs pipeline stage 1's ranks"
    ):
        LLM("tiny", pipeline_parallel_size=2)
    assert multiprocessing.active_children() == []
