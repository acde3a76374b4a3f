"""The speculation bench's step-by-step interleaving (chunkwise.bench.spec): each engine runs the whole
workload and is timed over its own steps, so its outputs are what it makes alone."""

from __future__ import annotations

from chunkwise.bench.spec import _engine, _run, _run_interleaved


def test_interleaved_engines_each_run_the_whole_workload_and_are_timed_apart() -> None:
    engines = {
        "none": _engine("tiny", dtype="float32"),
        "fixed": _engine(
            "tiny",
            dtype="float32",
            speculative_method="ngram",
            num_speculative_tokens=3,
            adaptive_speculation=False,
        ),
    }
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10]]
    alone = _run(_engine("tiny", dtype="float32"), prompts, 12)
    together = _run_interleaved(engines, prompts, 12)
    for seconds, n, outputs in together.values():
        assert outputs == alone[2] and n == alone[1] == 24 and seconds > 0
    # The speculating engine drafted, and made the same tokens.
    assert engines["fixed"].stats.spec_num_draft_tokens > 0
