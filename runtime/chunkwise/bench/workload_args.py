"""The workload flags every `chunkwise bench` command (and `chunkwise replay`) shares, and the workload
they describe: add_workload_args, build_workload, describe."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkwise.bench.workloads import WorkItem


WORKLOADS = ("long-tailed", "agent", "convoy", "trace")


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def _seconds_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated seconds, got {text!r}") from None


def add_workload_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="long-tailed", help="the request shapes")
    g.add_argument("--trace", default=None, help="JSONL trace (with --workload trace)")
    g.add_argument("--num-requests", type=int, default=64, help="requests (streams, for convoy)")
    g.add_argument("--min-prompt", type=int, default=16, help="shortest prompt (tokens)")
    g.add_argument("--max-prompt", type=int, default=128, help="longest prompt (tokens)")
    g.add_argument("--median-output", type=int, default=32, help="median output length (long-tailed)")
    g.add_argument(
        "--sigma", type=float, default=1.0, help="log-normal sigma of output lengths (0: all equal)"
    )
    g.add_argument("--max-output", type=int, default=512, help="longest output")
    g.add_argument("--hide-lengths", action="store_true", help="the client gives no max_tokens (replay only)")
    g.add_argument("--system-len", type=int, default=1024, help="shared system prompt length (agent)")
    g.add_argument("--num-system-prompts", type=int, default=1, help="distinct system prompts (agent)")
    g.add_argument("--long-len", type=int, default=3000, help="injected long prompt length (convoy)")
    g.add_argument("--num-long", type=int, default=2, help="long prompts injected (convoy)")
    g.add_argument(
        "--long-at", type=_seconds_list, default=[2.0, 6.0], help="injection offsets in seconds (convoy)"
    )
    g.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests/s (default inf: all at once)"
    )
    g.add_argument("--burstiness", type=_rate, default=1.0, help="gamma shape of gaps: 1 Poisson, <1 bursty")
    g.add_argument("--burst-size", type=int, default=1, help="requests arriving together in each burst")
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    if defaults:
        p.set_defaults(**defaults)


def build_workload(ns: argparse.Namespace, vocab_size: int = 258) -> list[WorkItem]:
    from chunkwise.bench import workloads as w

    if ns.workload == "trace":
        if not ns.trace:
            raise SystemExit("--workload trace needs --trace FILE.jsonl")
        return w.load_jsonl(ns.trace)
    prompt = (ns.min_prompt, ns.max_prompt)
    if ns.workload == "agent":
        items = w.shared_prefix(
            ns.num_requests,
            vocab_size=vocab_size,
            system_len=ns.system_len,
            num_system_prompts=ns.num_system_prompts,
            suffix_len=prompt,
            output_len=(max(1, ns.median_output // 2), ns.median_output * 3 // 2),
            seed=ns.seed,
        )
    else:
        items = w.long_tailed(
            ns.num_requests,
            vocab_size=vocab_size,
            prompt_len=prompt,
            median_output=ns.median_output,
            sigma=ns.sigma,
            max_output=ns.max_output,
            seed=ns.seed,
            client_max_tokens=not ns.hide_lengths,
        )
    if ns.burst_size > 1:
        times = w.burst_arrivals(len(items), ns.request_rate, ns.burst_size, ns.seed)
    else:
        times = w.arrival_times(len(items), ns.request_rate, ns.burstiness, ns.seed)
    items = w.with_arrivals(items, times)
    if ns.workload == "convoy":
        items = w.with_long_prompts(
            items,
            vocab_size=vocab_size,
            num_long=ns.num_long,
            long_len=ns.long_len,
            at_s=ns.long_at,
            seed=ns.seed,
        )
    return items


def describe(items: Sequence[WorkItem]) -> str:
    from chunkwise.bench.workloads import offered_rate

    outs = sorted(it.output_len for it in items)
    prompts = sorted(len(it.prompt_token_ids or ()) for it in items)
    rate = offered_rate(items)
    return (
        f"{len(items)} requests; prompt tokens median {prompts[len(prompts) // 2]} max {prompts[-1]}; "
        f"output tokens median {outs[len(outs) // 2]} max {outs[-1]}; "
        f"arrivals {'all at once' if math.isinf(rate) else f'{rate:.2f}/s'}"
    )
