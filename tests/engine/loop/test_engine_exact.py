"""chunkwise's greedy output is token-for-token that of transformers, however the scheduler slices the work."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chunkwise import LLM, SamplingParams
from chunkwise.engine import EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from tests.hf_models import CONFIGS, hf_greedy, save_random_llama


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("hf"), request.param)


def workload(n: int = 10, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 160) for _ in range(rng.randint(5, 70))] for _ in range(n)]
    max_new = [rng.randint(1, 24) for _ in range(n)]
    return prompts, max_new


def run_staggered(engine: EngineCore, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Requests arrive over the first steps, so prefill chunks and decode rows mix in every step."""
    tokens: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_unfinished():
        for i in list(pending):
            if i % 4 <= step:
                pending.remove(i)
                sp = SamplingParams(max_tokens=max_new[i], temperature=0.0, ignore_eos=True)
                engine.add_request(str(i), prompts[i], sp)
                tokens[str(i)] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
        engine.kv.pool.check_invariants()
        step += 1
    assert engine.kv.num_free_blocks == engine.num_blocks
    return [tokens[str(i)] for i in range(len(prompts))]


def test_greedy_matches_transformers_under_chunked_prefill_and_mixed_batches(model_dir: Path) -> None:
    prompts, max_new = workload()
    expected = hf_greedy(model_dir, prompts, max_new)
    # A 16-token budget splits the longer prompts into 3 or more chunks.
    engine = EngineCore(
        engine_config_from_kwargs(str(model_dir), dtype="float32", max_num_batched_tokens=16, block_size=4)
    )
    assert max(len(p) for p in prompts) > 3 * 16 - 16
    assert run_staggered(engine, prompts, max_new) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_transformers_through_forced_preemption(model_dir: Path, mode: str) -> None:
    prompts, max_new = workload(seed=1)
    expected = hf_greedy(model_dir, prompts, max_new)
    # 32 blocks of 4 tokens cannot hold ten growing requests: the scheduler must preempt.
    engine = EngineCore(
        engine_config_from_kwargs(
            str(model_dir),
            dtype="float32",
            max_num_batched_tokens=32,
            block_size=4,
            num_blocks=32,
            max_model_len=128,
            preemption_mode=mode,
            cold_start_output_tokens=0,
        )
    )
    # Admission trusts max_tokens; under-promise so that the running set outgrows the cache.
    original = engine.scheduler.admission.output_estimate
    engine.scheduler.admission.output_estimate = lambda req: 0  # type: ignore[method-assign]
    got = run_staggered(engine, prompts, max_new)
    engine.scheduler.admission.output_estimate = original  # type: ignore[method-assign]
    stats = engine.stats
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    assert got == expected


def test_greedy_matches_transformers_with_prefix_cache_hits(model_dir: Path) -> None:
    rng = random.Random(2)
    shared = [rng.randrange(3, 160) for _ in range(37)]
    prompts = [shared + [rng.randrange(3, 160) for _ in range(rng.randint(1, 9))] for _ in range(8)]
    max_new = [8] * len(prompts)
    expected = hf_greedy(model_dir, prompts, max_new)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=64, block_size=4)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], sp)
    rest = llm.generate(prompts[1:], sp)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens == 36 for o in rest)  # 9 full shared blocks of 4
    assert llm.engine.stats.prefix_cache_hits >= 36 * 7


def test_static_and_continuous_batching_give_identical_greedy_tokens() -> None:
    prompts, max_new = workload(n=12, seed=3)
    prompts = [[t % 250 + 3 for t in p] for p in prompts]
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_new]
    out = {}
    for batching in ("continuous", "static"):
        llm = LLM("tiny", dtype="float32", batching=batching, max_num_seqs=4, max_num_batched_tokens=32)
        out[batching] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert out["continuous"] == out["static"]
    assert [len(t) for t in out["static"]] == max_new


@pytest.mark.parametrize("caching", [True, False])
def test_each_of_n_greedy_choices_matches_transformers(model_dir: Path, caching: bool) -> None:
    """n=3 forks after the prompt but its last token: every choice is the transformers greedy output, the
    copied partial blocks included (prompt lengths land on every offset within a block of 4)."""
    prompts, max_new = workload(n=6, seed=3)
    expected = hf_greedy(model_dir, prompts, max_new)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=128,
        enable_prefix_caching=caching,
    )
    params = [SamplingParams(n=3, max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    outs = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e] * 3 for e in expected]
    assert llm.engine.all_blocks_free()
