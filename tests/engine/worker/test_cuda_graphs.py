"""The bucketed decode path (what CUDA graphs replay) on CPU: padding changes no token and touches no block
but the sink."""

from __future__ import annotations

import pytest
import torch

from chunkwise import LLM, SamplingParams
from chunkwise.engine import EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.worker.cuda_graphs import bucket_sizes


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]


PROMPTS = ["The scheduler", "Chunked prefill keeps every stream moving", "x", "A paged KV cache " * 3, "q"]


def _generate(attention_backend: str, bucketed: bool, dtype: str) -> list[list[int]]:
    llm = LLM(
        "tiny",
        dtype=dtype,
        attention_backend=attention_backend,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=4,
        max_model_len=256,
    )
    if bucketed:
        llm.engine.runner.use_decode_graphs(bucket_sizes(8), capture=False)
    # Different lengths: the batch shrinks as requests finish, through buckets 8, 4, 2, 1.
    sp = [SamplingParams(max_tokens=6 + 7 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, sp)
    stats = llm.engine.stats
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    assert stats.num_decode_tokens > 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("attention_backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bucketed_decode_gives_the_plain_tokens(attention_backend, dtype):
    assert _generate(attention_backend, True, dtype) == _generate(attention_backend, False, dtype)


def test_padding_rows_write_only_the_sink_block():
    engine = EngineCore(
        engine_config_from_kwargs(
            "tiny", dtype="float32", max_num_seqs=8, block_size=4, max_model_len=64, num_blocks=64
        )
    )
    runner = engine.runner
    runner.use_decode_graphs([8], capture=False)
    for i in range(3):
        engine.add_request(
            f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
    engine.step()  # prefill (eager)
    used = {b for t in engine.kv.block_tables.values() for b in t}
    before = [c.clone() for c in runner.kv_caches]
    engine.step()  # three decode rows in a bucket of eight: five padding rows
    assert engine.last_step is not None and engine.last_step.num_decode_rows == 3
    for old, new in zip(before, runner.kv_caches):
        changed = {b for b in range(new.shape[1]) if not torch.equal(old[:, b], new[:, b])}
        assert changed - used <= {runner.sink_block}, changed - used
        assert runner.sink_block in changed  # the padding rows did write: into the sink
    assert runner.sink_block == engine.num_blocks  # a block the pool never hands out


def test_graphs_are_cuda_only(caplog):
    # Graphs are on by default (vLLM's enforce_eager=False): on CPU that default captures nothing and says
    # nothing on every start, and capturing by hand is refused.
    with caplog.at_level("INFO", logger="chunkwise.engine"):
        engine = EngineCore(engine_config_from_kwargs("tiny", max_model_len=64))
    assert engine.config.enforce_eager is False
    assert engine.runner.graphs is None
    assert not any("graph" in r.getMessage().lower() for r in caplog.records)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        engine.runner.use_decode_graphs([1, 2], capture=True)
