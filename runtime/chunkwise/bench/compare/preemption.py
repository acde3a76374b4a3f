"""Forced swap against forced recompute preemption by context length, and where the cheaper mode changes
(`chunkwise bench compare preemption`)."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkwise.bench.clock import CLOCKS, ClockName
from chunkwise.bench.compare.base import _engine
from chunkwise.engine.datatypes.config import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from chunkwise.engine import EngineCore


@dataclass
class PreemptionTiming:
    context: int
    mode: str
    extra_seconds: list[float]


def _forced_preemption(engine: EngineCore, context: int, tag: str, clock: ClockName = "wall") -> float:
    """One forced preemption of a request of `context` tokens; returns the time it added.

    Two requests fill the cache exactly: O (older, short prompt) and V (the victim, `context` tokens). Both
    reserve one block of output (cold-start estimate 1), so when O outgrows its reservation the cache is
    full and the scheduler preempts V (the newest). O is then aborted, so V resumes at the next step. The
    preemption's cost is the extra time of the step that preempted V (the swap-out copies, for swap) plus
    the extra time of the step that resumed it (the swap-in, or the re-prefill), each against the step right
    after it, which holds the same decode rows without the preemption work.
    """
    bs = engine.kv.block_size
    stats = engine.stats
    prompt_o = [3 + i % 250 for i in range(2 * bs)]
    prompt_v = [5 + (i * 13) % 250 for i in range(context)]
    from chunkwise.engine.datatypes.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    o = f"{tag}-o"
    v = f"{tag}-v"
    engine.add_request(o, prompt_o, sp, cache_salt=tag)
    engine.add_request(v, prompt_v, sp, cache_salt=tag)
    before = stats.num_preemptions_swap + stats.num_preemptions_recompute

    read = CLOCKS[clock]

    def step() -> float:
        t0 = read()
        engine.step()
        return read() - t0

    guard = 0
    t_pre = step()
    while stats.num_preemptions_swap + stats.num_preemptions_recompute == before:
        t_pre = step()
        guard += 1
        if guard > 4 * bs:
            raise RuntimeError("no preemption happened; the cache is not as tight as planned")
    t_after_pre = step()
    engine.abort([o])
    t_resume = step()
    t_after_resume = step()
    engine.abort([v])
    while engine.has_unfinished():
        engine.step()
    return (t_pre - t_after_pre) + (t_resume - t_after_resume)


def compare_preemption(
    model: str,
    contexts: Sequence[int],
    *,
    repeats: int,
    engine_args: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    clock: ClockName = "wall",
) -> tuple[list[PreemptionTiming], dict[str, Any]]:
    """Time forced swap and forced recompute preemptions of several context lengths on the real engine."""
    timings: list[PreemptionTiming] = []
    predicted: dict[str, list[float]] = {"swap": [], "recompute": []}
    rates: dict[str, float] = {}
    bs = DEFAULT_BLOCK_SIZE
    for ctx in contexts:
        # O: 2 prompt blocks + 1 reserved; V: ctx tokens + 1 reserved block; nothing else.
        num_blocks = 2 + 1 + -(-ctx // bs) + 1
        engines = {}
        for mode in ("swap", "recompute"):
            engines[mode] = _engine(
                model,
                {
                    **(engine_args or {}),
                    "preemption_mode": mode,
                    "enable_prefix_caching": False,
                    "num_blocks": num_blocks,
                    "kv_cache_memory_bytes": None,
                    "block_size": bs,
                    "max_model_len": num_blocks * bs,
                    "max_num_batched_tokens": num_blocks * bs,
                    "long_prompt_threshold": num_blocks * bs + 1,
                    "cold_start_output_tokens": 1,
                },
            )
        got: dict[str, list[float]] = {"swap": [], "recompute": []}
        for rep in range(repeats):
            order = ("swap", "recompute") if rep % 2 == 0 else ("recompute", "swap")
            for mode in order:
                eng = engines[mode]
                got[mode].append(_forced_preemption(eng, ctx, f"{mode}-{ctx}-{rep}", clock))
                counts = (eng.stats.num_preemptions_swap, eng.stats.num_preemptions_recompute)
                if (mode == "swap") != (counts[0] > 0) or (mode == "recompute") != (counts[1] > 0):
                    raise RuntimeError(f"forced {mode} preemption took another path: {counts}")
            log(
                f"context {ctx}: swap {got['swap'][-1] * 1000:.1f} ms, recompute {got['recompute'][-1] * 1000:.1f} ms"
            )
        cm = engines["swap"].cost_model
        predicted["swap"].append(cm.swap_cost_s(ctx))
        predicted["recompute"].append(engines["recompute"].cost_model.recompute_cost_s(ctx))
        rates = {
            "host_copy_bytes_per_s": cm.host_copy_bytes_per_s,
            "prefill_tokens_per_s": engines["recompute"].cost_model.prefill_tokens_per_s,
            "kv_bytes_per_token": cm.kv_bytes_per_token,
        }
        for mode in ("swap", "recompute"):
            timings.append(PreemptionTiming(ctx, mode, got[mode]))
        engines.clear()
        gc.collect()
    return timings, {"predicted_s": predicted, "rates": rates, "contexts": list(contexts)}


def crossover(contexts: Sequence[int], swap_s: Sequence[float], recompute_s: Sequence[float]) -> float | None:
    """The context length where the cheaper mode changes, interpolated linearly between the two measured
    lengths around the first change; None when one mode is cheaper at every measured length."""
    pts = sorted(zip(contexts, swap_s, recompute_s))
    for (l0, s0, r0), (l1, s1, r1) in itertools.pairwise(pts):
        d0, d1 = s0 - r0, s1 - r1
        if d0 == 0:
            return float(l0)
        if (d0 < 0) != (d1 < 0):
            return l0 + (l1 - l0) * d0 / (d0 - d1)
    return None
