"""`chunkwise bench compare batching` on the tiny model: the static run's padding rows are counted and reported."""

from __future__ import annotations

import pytest

from chunkwise.bench.compare import compare_batching
from chunkwise.bench.workloads import long_tailed, useful_work_fraction


def test_compare_batching_reports_the_static_runs_padding_share_as_the_seeds_one_minus_u() -> None:
    items = long_tailed(8, vocab_size=258, prompt_len=(4, 12), median_output=4, max_output=16, seed=3)
    cmp = compare_batching(
        "tiny",
        items,
        max_num_seqs=4,
        repeats=1,
        engine_args={"kv_cache_memory_bytes": 16 << 20},
        log=lambda _: None,
    )
    u = useful_work_fraction([it.output_len for it in items], 4)
    assert u < 0.9  # the workload does leave slots idle
    # Every prompt fits its batch's first step, so each batch computes n * max l rows, sum l of them real:
    # padding is exactly 1 - U (docs/scheduling.md) of the static run's rows. Continuous batching computes none.
    assert cmp.info["static_padding_share"] == pytest.approx(1 - u)
    assert cmp.info["continuous_padding_share"] == 0.0
    (static,) = cmp.results["static"]
    assert static.counters["num_padding_rows"] > 0
    assert static.counters["num_rows"] == sum(it.output_len for it in items)
