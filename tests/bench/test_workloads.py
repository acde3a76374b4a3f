"""Workload generators: the useful-work regime of docs/scheduling.md, arrival processes, traces."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from chunkwise.bench.workloads import (
    WorkItem,
    arrival_times,
    burst_arrivals,
    load_jsonl,
    long_tailed,
    offered_rate,
    save_jsonl,
    shared_prefix,
    useful_work_fraction,
    with_arrivals,
    with_long_prompts,
)

VOCAB = 258


# (batch, longest output): the shapes `bench compare batching` (16, 256) and `hf` (32, 128) use, and defaults.
@pytest.mark.parametrize(("batch", "max_output"), [(16, 256), (32, 128), (16, 512), (8, 512)])
@pytest.mark.parametrize("seed", [0, 1])
def test_long_tailed_lands_in_the_seeds_useful_work_range(batch: int, max_output: int, seed: int) -> None:
    items = long_tailed(1024, vocab_size=VOCAB, seed=seed, max_output=max_output)
    u = useful_work_fraction([it.output_len for it in items], batch)
    assert 0.2 <= u <= 0.4


def test_useful_work_fraction_by_hand() -> None:
    # Batches [1, 3] and [2, 2]: useful 8 token-steps out of 2*3 + 2*2 = 10 slot-steps.
    assert useful_work_fraction([1, 3, 2, 2], 2) == pytest.approx(0.8)
    assert useful_work_fraction([5, 5, 5], 3) == 1.0


def test_long_tailed_with_sigma_zero_asks_for_exactly_the_median() -> None:
    for median in (32, 128, 4000):
        items = long_tailed(16, vocab_size=VOCAB, median_output=median, sigma=0.0, max_output=median)
        assert {it.output_len for it in items} == {median}


def test_long_tailed_is_reproducible_and_valid() -> None:
    a = long_tailed(64, vocab_size=VOCAB, seed=3, max_output=100)
    b = long_tailed(64, vocab_size=VOCAB, seed=3, max_output=100)
    assert a == b
    assert all(1 <= it.output_len <= 100 for it in a)
    assert all(3 <= t < 256 for it in a for t in it.prompt_token_ids or ())
    hidden = long_tailed(64, vocab_size=VOCAB, seed=3, max_output=100, client_max_tokens=False)
    assert all(h.max_tokens is None for h in hidden)
    assert [h.target_len for h in hidden] == [it.max_tokens for it in a]


def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = arrival_times(4000, request_rate=20.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    gaps = np.diff(times)
    assert 1 / gaps.mean() == pytest.approx(20.0, rel=0.05)
    # Exponential gaps: coefficient of variation 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)


def test_bursty_arrivals_are_burstier_at_the_same_rate() -> None:
    gaps = np.diff(arrival_times(4000, request_rate=20.0, burstiness=0.25, seed=1))
    assert 1 / gaps.mean() == pytest.approx(20.0, rel=0.1)
    # Gamma with shape k: CV = 1/sqrt(k) = 2.
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.15)


def test_burst_groups_and_all_at_once() -> None:
    times = burst_arrivals(10, request_rate=5.0, burst_size=4, seed=0)
    assert times[0:4] == [0.0] * 4 and len(set(times[4:8])) == 1 and len(set(times[8:])) == 1
    assert times[4] > 0
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert offered_rate(with_arrivals(long_tailed(5, vocab_size=VOCAB), [0.0] * 5)) == math.inf


def test_shared_prefix_and_long_prompt_injection() -> None:
    items = shared_prefix(8, vocab_size=VOCAB, system_len=64, num_system_prompts=2, seed=0)
    ids = [it.prompt_token_ids or () for it in items]
    # Every prompt is one of the two system prompts plus its own suffix.
    assert len({p[:64] for p in ids}) == 2
    assert all(len(p) > 64 for p in ids) and len({p[64:] for p in ids}) == 8
    convoy = with_long_prompts(items, vocab_size=VOCAB, num_long=2, long_len=500, at_s=[1.0, 3.0])
    longs = [it for it in convoy if len(it.prompt_token_ids or ()) == 500]
    assert [it.arrival_s for it in longs] == [1.0, 3.0]
    assert [it.arrival_s for it in convoy] == sorted(it.arrival_s for it in convoy)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    items = [
        WorkItem((5, 6, 7), 12, arrival_s=0.0),
        WorkItem(None, None, arrival_s=1.5, prompt="hello", target_len=40),
        WorkItem((9,), 3, arrival_s=0.25),
    ]
    path = tmp_path / "trace.jsonl"
    save_jsonl(items, path)
    back = load_jsonl(path)
    assert back == sorted(items, key=lambda it: it.arrival_s)
    assert len(path.read_text().splitlines()) == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x", "max_tokens": 4, "bogus": 1}', "unknown field"),
        ('{"max_tokens": 4}', "either prompt_token_ids or a text prompt"),
        ('{"prompt_token_ids": [1, "a"], "max_tokens": 4}', "list of integers"),
        ('{"prompt": "x", "max_tokens": null}', "needs a target_len"),
        ("[1, 2]", "JSON object"),
        ("not json", "not JSON"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "max_tokens": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as exc:
        load_jsonl(path)
    assert ":2:" in str(exc.value)
