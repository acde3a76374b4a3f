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
# chunkwise.bench.traces.TRACE_FORMATS, spelled out here so that parsing flags imports no numpy.
TRACE_FORMATS = ("chunkwise", "azure", "mooncake")


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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


# Set on the namespace when --num-requests is on the command line: a trace is then capped to that many
# requests; the parser's (or a command's) default never caps one.
NUM_REQUESTS_GIVEN = "num_requests_given"


class _NumRequests(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, NUM_REQUESTS_GIVEN, True)


def add_workload_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="long-tailed", help="the request shapes")
    g.add_argument(
        "--trace",
        default=None,
        help="trace file (with --workload trace): chunkwise JSONL, Azure LLM inference CSV or Mooncake JSONL",
    )
    g.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        default=None,
        help="the --trace file's format (default: guessed: .csv azure; JSONL with hash_ids mooncake, "
        "with prompt/prompt_token_ids chunkwise)",
    )
    g.add_argument(
        "--trace-time-scale",
        type=_rate,
        default=1.0,
        help="divide the trace's arrival times by this (2: twice as fast; inf: all at once; default 1)",
    )
    g.add_argument(
        "--trace-block-tokens",
        type=_positive_int,
        default=512,
        help="tokens per Mooncake hash id (default 512, Mooncake's block size)",
    )
    g.add_argument(
        "--trace-skip-empty",
        action="store_true",
        help="drop trace rows with 0 prompt or 0 output tokens (default: refuse them, naming the line)",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        action=_NumRequests,
        default=64,
        help="requests (streams, for convoy); with --workload trace, the earliest N of the trace when "
        "given (default there: the whole trace)",
    )
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
    g.add_argument(
        "--rate-curve",
        choices=("flat", "day"),
        default="flat",
        help="flat: the rate is --request-rate throughout; day: it follows a day, from 0.2x at the start "
        "(night) to 1.8x at half the period, mean --request-rate",
    )
    g.add_argument(
        "--curve-period-seconds",
        type=_rate,
        default=3600.0,
        help="the day's length in seconds with --rate-curve day (3600: a day compressed into an hour)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    if defaults:
        p.set_defaults(**defaults)


def build_workload(ns: argparse.Namespace, vocab_size: int = 258) -> list[WorkItem]:
    from chunkwise.bench import workloads as w

    if ns.workload == "trace":
        return _trace(ns, vocab_size)
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
    if getattr(ns, "rate_curve", "flat") == "day" and not math.isinf(ns.request_rate):
        times = w.day_shaped(times, ns.curve_period_seconds)
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


def _trace(ns: argparse.Namespace, vocab_size: int) -> list[WorkItem]:
    from chunkwise.bench.traces import load_trace

    if not ns.trace:
        raise SystemExit("--workload trace needs --trace FILE (chunkwise JSONL, Azure CSV or Mooncake JSONL)")
    cap = ns.num_requests if getattr(ns, NUM_REQUESTS_GIVEN, False) else None
    try:
        items = load_trace(
            ns.trace,
            getattr(ns, "trace_format", None),
            vocab_size=vocab_size,
            seed=ns.seed,
            block_tokens=getattr(ns, "trace_block_tokens", 512),
            time_scale=getattr(ns, "trace_time_scale", 1.0),
            max_requests=cap,
            skip_empty=getattr(ns, "trace_skip_empty", False),
            client_max_tokens=not getattr(ns, "hide_lengths", False),
        )
    except (OSError, ValueError) as e:
        raise SystemExit(f"--trace: {e}") from None
    if not items:
        raise SystemExit(f"--trace {ns.trace}: no requests in the trace")
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
