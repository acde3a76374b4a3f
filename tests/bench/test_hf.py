"""The transformers baseline of `bench compare hf` runs a preset's own weights."""

from __future__ import annotations

from chunkwise.bench.hf import greedy_agreement, load_hf_model
from chunkwise.bench.offline import build_engine


def test_a_preset_in_transformers_generates_what_chunkwise_does():
    hf = load_hf_model("tiny")
    engine = build_engine(
        "tiny", {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 1 << 24}
    )
    prompts = [list(range(40, 70)), [7, 8, 9] * 5]
    assert greedy_agreement(hf, engine, prompts, 12) == [(12, 12), (12, 12)]
