"""`chunkwise bench compare quantization`: both engines run the same workload (the quantized one really
quantized), and the quality check scores held-out text under both."""

from __future__ import annotations

from chunkwise.bench.compare.quantization import compare_quantization, quantization_quality
from chunkwise.bench.workloads import long_tailed


def test_the_comparison_runs_the_workload_on_a_full_and_a_quantized_engine() -> None:
    items = long_tailed(4, vocab_size=258, prompt_len=(4, 12), median_output=6, max_output=8, seed=3)
    cmp = compare_quantization(
        "tiny",
        items,
        quantization="int8",
        max_num_seqs=2,
        repeats=1,
        engine_args={"kv_cache_memory_bytes": 16 << 20, "dtype": "float32"},
        log=lambda _: None,
    )
    assert set(cmp.results) == {"full", "int8"}
    assert str(cmp.info["quantization"]).startswith("int8")
    for runs in cmp.results.values():
        assert sum(r.counters["num_rows"] for r in runs) >= sum(it.output_len for it in items)
    assert [r.label for r in cmp.ratios] == ["int8/full output throughput", "full/int8 mean TPOT"]
    assert all(v > 0 for r in cmp.ratios for v in r.values)


def test_quality_on_pylm_is_close_but_not_identical() -> None:
    q = quantization_quality(
        "pylm", "int8", dtype="float32", prompts=4, prompt_len=32, max_tokens=8, log=lambda _: None
    )
    assert q["prompts"] == 4 and q["scored_tokens"] == 4 * (32 + 8 - 1)
    # int8 weights move each token's log-probability a little (the two models are not the same one), and
    # leave the model as good as it was.
    assert 0 < q["mean_abs_logprob_diff"] < 0.05
    assert abs(q["perplexity_int8"] / q["perplexity_full"] - 1) < 0.02
    assert 0 <= q["greedy_leading_agreement"] <= 1
