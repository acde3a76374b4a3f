"""Each family and rotary scaling chunkwise loads: greedy output equal to transformers' token for token under
chunked prefill (several chunks per prompt), concurrent requests and prefix-cache hits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chunkwise import LLM, SamplingParams
from chunkwise.engine import EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from tests.engine.loop.test_engine_exact import run_staggered
from tests.hf_models import FAMILIES, hf_greedy, save_random_family


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_family(tmp_path_factory.mktemp("family"), request.param)


def test_greedy_matches_transformers(family_dir: Path) -> None:
    rng = random.Random(7)
    # Prompts of up to 90 tokens: past the llama3 and yarn checkpoints' original context of 32 positions.
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 90))] for _ in range(8)]
    max_new = [rng.randint(2, 16) for _ in prompts]
    expected = hf_greedy(family_dir, prompts, max_new)
    # A 16-token budget: the longer prompts take 6 chunks, mixed with the others' decode rows.
    engine = EngineCore(
        engine_config_from_kwargs(str(family_dir), dtype="float32", max_num_batched_tokens=16, block_size=4)
    )
    assert run_staggered(engine, prompts, max_new) == expected


def test_greedy_matches_transformers_with_prefix_cache_hits(family_dir: Path) -> None:
    rng = random.Random(8)
    shared = [rng.randrange(3, 300) for _ in range(41)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    expected = hf_greedy(family_dir, prompts, [6] * len(prompts))
    llm = LLM(str(family_dir), dtype="float32", max_num_batched_tokens=32, block_size=4)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], sp)
    rest = llm.generate(prompts[1:], sp)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens == 40 for o in rest)  # 10 full shared blocks of 4


def test_what_the_loader_understood(family_dir: Path) -> None:
    llm = LLM(str(family_dir), dtype="float32", max_model_len=64)
    config = llm.engine.loaded.config
    name = family_dir.name
    kind = None if config.rope_scaling is None else config.rope_scaling.rope_type
    assert kind == {
        "llama3-rope": "llama3",
        "llama-linear": "linear",
        "llama-dynamic": "dynamic",
        "llama-longrope": "longrope",
        "qwen2-bias-yarn": "yarn",
    }.get(name)
    assert config.qk_norm == (name == "qwen3")
    assert config.attention_bias == name.startswith("qwen2")
    # longrope is served within its original context, where its frequencies do not switch.
    assert config.max_position_embeddings == (128 if name == "llama-longrope" else 512)
