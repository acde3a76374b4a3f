"""A quantized model against its full-precision self (`chunkwise bench compare quantization`): the same
checkpoint and dtype with and without --quantization, taking turns on one decode-heavy workload (speed), and
how far apart their outputs are (quality): greedy agreement from the same prompts, and the log-probability
each gives held-out text, token by token.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from chunkwise.bench.clock import ClockName
from chunkwise.bench.compare.base import Comparison, _engine, _runner, interleave, ratio
from chunkwise.bench.workloads import WorkItem


def compare_quantization(
    model: str,
    items: Sequence[WorkItem],
    *,
    quantization: str,
    max_num_seqs: int,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> Comparison:
    args = {**(engine_args or {}), "max_num_seqs": max_num_seqs}
    full = _engine(model, args)
    quant = _engine(model, {**args, "quantization": quantization})
    results = interleave(
        [
            ("full", _runner(full, items, "full", progress, clock)),
            (quantization, _runner(quant, items, quantization, progress, clock)),
        ],
        repeats,
        log,
    )
    q = quantization
    return Comparison(
        "quantization",
        results,
        [
            ratio(f"{q}/full output throughput", results, q, "full", "output_throughput", "1.6x (issue 35)"),
            ratio(f"full/{q} mean TPOT", results, "full", q, "mean_tpot_ms"),
        ],
        info={
            "quantization": quant.loaded.quantization.description if quant.loaded.quantization else None,
            "dtype": str(full.config.dtype),
            "max_num_seqs": max_num_seqs,
            "num_requests": len(items),
        },
    )


def held_out_windows(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` token ids from the bundled pylm's held-out split (Python standard library
    files it was not trained on; engine/model/bundled/pylm_corpus.py)."""
    from chunkwise.engine.model.bundled.pylm_corpus import split_corpus, stdlib_dir

    _, held = split_corpus(stdlib_dir())
    windows: list[list[int]] = []
    for _, text in sorted(held.items()):
        ids = tokenizer.encode(text)
        for start in range(0, len(ids) - length, length * 4):
            windows.append(ids[start : start + length])
            if len(windows) == count:
                return windows
    return windows


def quantization_quality(
    model: str,
    quantization: str,
    *,
    dtype: str,
    prompts: int = 32,
    prompt_len: int = 64,
    max_tokens: int = 32,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Greedy agreement (equal leading tokens over generated, and continuations equal throughout) from held-out
    prompts, and per-token log-probabilities of held-out text under both (mean difference, mean absolute
    difference, and each one's perplexity)."""
    import math

    from chunkwise import LLM, SamplingParams

    full = LLM(model, dtype=dtype)
    quant = LLM(model, dtype=dtype, quantization=quantization)
    windows = held_out_windows(full.engine.loaded.tokenizer, prompts, prompt_len + max_tokens)
    if not windows:
        raise ValueError(f"{model}: no held-out text long enough for the quality check")
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    heads = [w[:prompt_len] for w in windows]
    a = [o.outputs[0].token_ids for o in full.generate(heads, greedy)]
    b = [o.outputs[0].token_ids for o in quant.generate(heads, greedy)]

    def leading(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))

    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    lp_full = [t.logprob for o in full.generate(windows, score) for t in o.prompt_logprobs or []]
    lp_quant = [t.logprob for o in quant.generate(windows, score) for t in o.prompt_logprobs or []]
    diffs = [q - f for f, q in zip(lp_full, lp_quant)]
    result = {
        "prompts": float(len(windows)),
        "greedy_leading_agreement": statistics.mean(leading(x, y) / max_tokens for x, y in zip(a, b)),
        "greedy_identical_fraction": statistics.mean(float(x == y) for x, y in zip(a, b)),
        "scored_tokens": float(len(diffs)),
        "mean_logprob_diff": statistics.mean(diffs),
        "mean_abs_logprob_diff": statistics.mean(abs(d) for d in diffs),
        "perplexity_full": math.exp(-statistics.mean(lp_full)),
        f"perplexity_{quantization}": math.exp(-statistics.mean(lp_quant)),
    }
    log(
        f"quality over {len(windows)} held-out windows: greedy leading agreement "
        f"{result['greedy_leading_agreement']:.1%}, identical continuations {result['greedy_identical_fraction']:.1%}; "
        f"log-prob {quantization} - full: mean {result['mean_logprob_diff']:+.4f}, mean |.| "
        f"{result['mean_abs_logprob_diff']:.4f} nats over {len(diffs)} tokens; perplexity "
        f"{result['perplexity_full']:.3f} -> {result[f'perplexity_{quantization}']:.3f}"
    )
    return result
