"""chunkwise against transformers' generate on padded static batches, on the same weights
(`chunkwise bench compare hf`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from chunkwise.bench.clock import ClockName
from chunkwise.bench.compare.base import Comparison, _engine, ratio
from chunkwise.bench.results import RunResult
from chunkwise.bench.workloads import WorkItem

if TYPE_CHECKING:
    from chunkwise.bench.offline import EngineRun


def compare_hf(
    model: str,
    items: Sequence[WorkItem],
    *,
    concurrency: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    agreement_prompts: int = 3,
    agreement_tokens: int = 16,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    from chunkwise.bench.hf import greedy_agreement, load_hf_model, run_hf
    from chunkwise.bench.workloads import useful_work_fraction

    engine = _engine(model, {**(engine_args or {}), "max_num_seqs": concurrency})
    hf = load_hf_model(model, engine.config.dtype)
    agree = greedy_agreement(
        hf, engine, [it.token_ids() for it in items[:agreement_prompts]], agreement_tokens
    )
    log(f"greedy agreement (equal leading tokens / generated), transformers vs chunkwise: {agree}")
    from chunkwise.bench.offline import EngineRun

    run_hf(hf, items[: min(len(items), 2)], 2)  # warm-up
    results: dict[str, list[RunResult]] = {"transformers": [], "chunkwise": []}
    for rep in range(repeats):
        # generate() cannot be stepped from outside, but its streamer is called after every step: chunkwise
        # takes its turns there, so the two still alternate step by step; whichever finishes first leaves
        # the other to run alone.
        ours = EngineRun(engine, items, "chunkwise", salt=f"chunkwise-{rep}", progress=progress, clock=clock)
        ours.rc.pause()

        def turn(run: EngineRun = ours) -> None:
            if not run.done:
                run.rc.resume()
                run.advance()
                run.rc.pause()

        log(f"repeat {rep + 1}/{repeats}: transformers and chunkwise, step by step")
        theirs, _ = run_hf(hf, items, concurrency, progress=progress, clock=clock, between_steps=turn)
        while not ours.done:
            turn()
        results["transformers"].append(theirs)
        results["chunkwise"].append(ours.result())
    return Comparison(
        "hf",
        results,
        [
            ratio(
                f"chunkwise/transformers output throughput at concurrency {concurrency}",
                results,
                "chunkwise",
                "transformers",
                "output_throughput",
                "5x or more",
            ),
        ],
        notes=[
            "transformers: generate() on left-padded static batches of the given concurrency, each batch "
            "running to its longest max_tokens (EOS ignored), useful tokens counted",
        ],
        info={
            "greedy_agreement": [list(a) for a in agree],
            "concurrency": concurrency,
            "useful_work_fraction": useful_work_fraction([it.output_len for it in items], concurrency),
            "num_requests": len(items),
        },
    )
