"""Serving metrics with the definitions of `vllm bench serve`, shared by the HTTP client, the offline runs and
the simulator, so the three reports mean the same thing.

Per request (times in seconds from when the request was sent, or arrived, to when a chunk was received):
- TTFT: until the first chunk of output;
- E2E latency: until the last chunk;
- TPOT (time per output token, the first excluded): (e2e - ttft) / (output tokens - 1), for requests with more
  than one output token;
- ITL (inter-token latency): every gap between consecutive chunks, pooled over all requests. A chunk may carry
  several tokens (a server that holds back text, or speculative decoding), exactly as in vLLM.

Per run: request throughput = completed / duration; output throughput = output tokens / duration; total token
throughput adds prompt tokens; goodput = requests meeting every given SLO (TTFT, TPOT, E2E, in ms) / duration,
where a request with at most one output token counts TPOT as 0 (vLLM's convention). Percentiles are numpy's
linear interpolation, as in vLLM. Failed requests count in `failed` and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = ("ttft", "tpot", "e2el")
_MS = 1000.0


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    success: bool = True
    error: str = ""
    # When the request was sent (seconds since the run started) and how many times it was preempted.
    start_s: float = 0.0
    num_preemptions: int = 0
    # The client cancelled it while it was still streaming, when the run was cut (bench.serve's
    # `cut_after_first_token_of`): its output_len and latency stop at the last chunk received.
    cut: bool = False

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def chunk_times(self) -> list[float]:
        """When each chunk arrived, in seconds since the run started: start + TTFT, then each ITL gap."""
        t = self.start_s + self.ttft
        out = [t]
        for gap in self.itl:
            t += gap
            out.append(t)
        return out


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds), as `--goodput` in vLLM."""
    out: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"SLO {spec!r}: expected KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {spec!r}: {value!r} is not a number") from None
        if not ms > 0:
            raise ValueError(f"SLO {spec!r}: must be positive")
        out[key] = ms
    return out


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    # vLLM reports 0 for a metric with no samples (e.g. TPOT when every output is one token).
    arr = np.asarray(values_s, dtype=float) * _MS if len(values_s) else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(arr.std()),
        f"max_{name}_ms": float(arr.max()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict[str, Any]:
    """The run's report: a flat dict of numbers, with vLLM's key names where vLLM has one."""
    if not duration_s > 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [g for r in ok for g in r.itl]
    report: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "num_preemptions": sum(r.num_preemptions for r in records),
    }
    if slos_ms:
        good = sum(1 for r in ok if meets_slos(r, slos_ms))
        report["request_goodput"] = good / duration_s
        report["slos_ms"] = dict(slos_ms)
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        report.update(_stats(name, values, percentiles))
    cut = sum(1 for r in ok if r.cut)
    if cut:
        report["cut"] = cut
    errors = sorted({r.error for r in records if not r.success and r.error})
    if errors:
        report["errors"] = errors[:10]
    return report


def meets_slos(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * _MS <= v for k, v in slos_ms.items())


def format_report(report: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A text table in the layout of `vllm bench serve`."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    row("Benchmark duration (s):", report["duration"])
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", report["request_throughput"])
    if "request_goodput" in report:
        row("Request goodput (req/s):", report["request_goodput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    for name, header in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f"{header:-^60}")
        row(f"Mean {name.upper()} (ms):", report[f"mean_{name}_ms"])
        for key in sorted(
            (k for k in report if k.startswith("p") and k.endswith(f"_{name}_ms")),
            key=lambda k: float(k[1:].split("_")[0]),
        ):
            row(f"P{key[1:].split('_')[0]} {name.upper()} (ms):", report[key])
    lines.append("=" * 60)
    return "\n".join(lines)
