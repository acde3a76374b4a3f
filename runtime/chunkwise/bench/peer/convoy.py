"""The convoy mode: both OpenAI-compatible servers up and pinned, driven in turn by the same streaming
client, decoding streams with long prompts injected while they decode. The streams ask for far more tokens
than the window needs and the client cuts the run once the last long prompt has its first token, so they
run through the whole window on a fast engine and a slow one alike; convoy_metrics checks that they did.

The servers, their processes and their warm-up are servers.py's, shared with the served mode (served.py)."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from chunkwise.bench.compare import Ratio
from chunkwise.bench.peer.base import (
    ENGINES,
    IDLE_CPU_NOTE_FRACTION,
    PAUSE_NOTE,
    EngineName,
    Peer,
    PeerError,
    PeerReport,
    _peer_cpu,
    alternation,
    paused,
)
from chunkwise.bench.peer.servers import SERVED_MODEL_NAME, Server, ServerFactory, _warmup_items
from chunkwise.bench.workloads import WorkItem

if TYPE_CHECKING:
    from chunkwise.bench.results import RunResult


def convoy_metrics(result: RunResult, items: Sequence[WorkItem], long_len: int) -> dict[str, Any]:
    """What a convoy does to a client, measured inside its window: from the first long prompt's arrival
    (when the client sent it) to the last long prompt's first token. A request of at least `long_len` prompt
    tokens is one of the injected long prompts; the others are the decoding streams.

    Every stream must still be running through the window (its last token after each long prompt's arrival
    and after the window's end; a stream the client cut when the window closed was running): a stream that
    had ended would report a plain decode ITL, or none, as a convoy figure. PeerError otherwise.

    The streams' gaps between consecutive chunks are pooled (as vLLM pools ITL); a gap is in the window when
    it overlaps it (ends after its start and begins before its end), so the stall that ends with the last
    long prompt's first token counts. Reported: p99 and max ITL inside the window, the median ITL of the
    gaps outside it (the steady decode), and each long prompt's TTFT."""
    import numpy as np

    if len(result.records) != len(items):
        raise ValueError(f"{len(result.records)} records for {len(items)} requests")
    failed = [r.error for r in result.records if not r.success]
    if failed:
        raise PeerError(f"{result.name}: {len(failed)} request(s) failed: {sorted(set(failed))[:3]}")
    is_long = [len(it.prompt_token_ids or ()) >= long_len for it in items]
    streams = [(i, r) for i, (r, long) in enumerate(zip(result.records, is_long)) if not long]
    longs = [r for r, long in zip(result.records, is_long) if long]
    if not longs or not streams:
        raise ValueError(f"a convoy needs streams and long prompts (of {long_len} tokens or more)")
    arrivals = sorted(r.start_s for r in longs)
    start, end = arrivals[0], max(r.start_s + r.ttft for r in longs)
    window: list[float] = []
    steady: list[float] = []
    for i, r in streams:
        times = r.chunk_times()
        if not r.cut:
            last = times[-1]
            for a in arrivals:
                if last <= a:
                    raise PeerError(
                        f"{result.name}: stream {i} finished at {last:.2f} s, before a long prompt arrived "
                        f"at {a:.2f} s: its {r.output_len} tokens are too few to outlive the window; raise "
                        f"--median-output and --max-output"
                    )
            if last < end:
                raise PeerError(
                    f"{result.name}: stream {i} finished at {last:.2f} s, before the last long prompt's "
                    f"first token at {end:.2f} s: its {r.output_len} tokens are too few to outlive the "
                    f"window; raise --median-output and --max-output"
                )
        for t_prev, t_next in itertools.pairwise(times):
            (window if t_next > start and t_prev < end else steady).append(t_next - t_prev)
    if not window:
        raise PeerError(
            f"{result.name}: no stream received a token inside the window {start:.2f}-{end:.2f} s"
        )
    gaps = np.asarray(window, dtype=float) * 1000
    ttft = [r.ttft * 1000 for r in longs]
    return {
        "num_streams": len(streams),
        "num_long": len(longs),
        "window_s": [start, end],
        "num_window_gaps": len(window),
        "num_steady_gaps": len(steady),
        "window_p99_itl_ms": float(np.percentile(gaps, 99)),
        "window_max_itl_ms": float(gaps.max()),
        "steady_p50_itl_ms": float(np.median(steady)) * 1000 if steady else 0.0,
        "long_ttft_ms": ttft,
        "mean_long_ttft_ms": statistics.fmean(ttft),
        "num_cut": sum(1 for r in result.records if r.cut),
        "min_stream_tokens": min(r.output_len for _, r in streams),
    }


# (base URL, items, name) -> the client's record of the run.
ServeFn = Callable[[str, Sequence[WorkItem], str], "RunResult"]


def http_serve(progress: bool, long_len: int | None = None) -> ServeFn:
    """The streaming client (chunkwise.bench.serve). With `long_len`, a run is cut once every prompt of at
    least `long_len` tokens has its first token (and every stream one more chunk): the convoy's window is
    over, and the streams, given a generous max_tokens, need not run to their end."""

    def serve(url: str, items: Sequence[WorkItem], name: str) -> RunResult:
        from chunkwise.bench.serve import run_serve

        longs = (
            [i for i, it in enumerate(items) if len(it.prompt_token_ids or ()) >= long_len]
            if long_len is not None
            else []
        )
        # No /metrics scraping: both servers see nothing but the workload's requests.
        return run_serve(
            url,
            items,
            model=SERVED_MODEL_NAME,
            progress=progress,
            name=name,
            scrape_metrics=False,
            cut_after_first_token_of=longs,
        )

    return serve


# After a cut run the server must abort the cancelled streams. It counts as quiet once its process tree
# uses less than this share of one CPU over an interval (an idle vLLM server polls at about a fifth).
QUIET_CPU_FRACTION = 0.5
QUIET_TIMEOUT_S = 15.0


def wait_quiet(server: Peer, interval_s: float = 0.5, timeout_s: float = QUIET_TIMEOUT_S) -> bool:
    """Whether the server's CPU use falls below QUIET_CPU_FRACTION within `timeout_s` (True where its CPU
    time cannot be read)."""
    deadline = time.monotonic() + timeout_s
    before = server.cpu_seconds()
    while True:
        time.sleep(interval_s)
        after = server.cpu_seconds()
        if before is None or after is None or after - before < QUIET_CPU_FRACTION * interval_s:
            return True
        if time.monotonic() > deadline:
            return False
        before = after


def compare_convoy(
    make_workload: Callable[[int], list[WorkItem]],
    dtypes: Sequence[str],
    repeats: int,
    long_len: int,
    start_server: ServerFactory,
    serve: ServeFn,
    log: Callable[[str], None] = print,
    quiet_interval_s: float = 0.5,
) -> PeerReport:
    """Both servers up (one dtype at a time), warmed up, then the convoy workload against each in
    alternating order (convoy_metrics); ratios of the streams' p99 ITL inside the window, of their steady
    median ITL outside it and of the long prompts' mean TTFT. After a run the client cut, the server must
    come back to quiet (it aborted the cut streams) before the next run, or the report notes it."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    workloads = [make_workload(rep) for rep in range(repeats)]
    for items in workloads:
        if not any(len(it.prompt_token_ids or ()) >= long_len for it in items):
            raise ValueError(f"the convoy workload has no prompt of {long_len} tokens or more")
    runs: list[dict[str, Any]] = []
    ratios: list[Ratio] = []
    info: dict[str, Any] = {"startup_seconds": {}, "long_len": long_len}
    notes: list[str] = []
    t0 = time.monotonic()
    for dtype in dtypes:
        servers: dict[EngineName, Server] = {}
        try:
            for engine in ENGINES:
                servers[engine] = start_server(engine, dtype)
                info["startup_seconds"][f"{engine}/{dtype}"] = servers[engine].ready.get("startup_seconds")
                serve(servers[engine].url, _warmup_items(), f"{engine} warm-up")
            metrics: dict[EngineName, list[dict[str, Any]]] = {e: [] for e in ENGINES}
            for rep, order in enumerate(alternation(repeats)):
                items = workloads[rep]
                for engine in order:
                    (peer,) = [e for e in ENGINES if e != engine]
                    log(
                        f"[{time.monotonic() - t0:6.0f} s] repeat {rep + 1}/{repeats}, {dtype}: {engine} serving the convoy"
                    )
                    with paused(servers[peer]):
                        before = servers[peer].cpu_seconds()
                        result = serve(servers[engine].url, items, f"{engine} {dtype}")
                        peer_cpu = _peer_cpu(before, servers[peer].cpu_seconds())
                    m = convoy_metrics(result, items, long_len)
                    if m["num_cut"] and not wait_quiet(servers[engine], quiet_interval_s):
                        notes.append(
                            f"the {engine} server was still busy {QUIET_TIMEOUT_S:.0f} s after the client cut "
                            f"its streams (repeat {rep + 1}, {dtype}): it may not abort requests whose client "
                            f"went away, and its next run would share the CPU with them"
                        )
                        log(f"  {notes[-1]}")
                    metrics[engine].append(m)
                    runs.append(
                        {
                            "engine": engine,
                            "dtype": dtype,
                            "repeat": rep,
                            **m,
                            "peer_cpu_seconds": peer_cpu,
                            "report": result.report(),
                        }
                    )
                    ttfts = ", ".join(f"{t:.0f}" for t in m["long_ttft_ms"])
                    log(
                        f"  {engine} {dtype}: streams' ITL in the window p99 {m['window_p99_itl_ms']:.1f} ms, "
                        f"max {m['window_max_itl_ms']:.1f} ms; steady p50 {m['steady_p50_itl_ms']:.1f} ms; "
                        f"long prompts' TTFT {ttfts} ms"
                    )
                    if peer_cpu is not None and peer_cpu > IDLE_CPU_NOTE_FRACTION * result.duration_s:
                        notes.append(
                            f"the idle {peer} server, paused, still used {peer_cpu:.2f} s of CPU during {engine}'s "
                            f"{result.duration_s:.1f} s run (repeat {rep + 1}, {dtype})"
                        )

            def values(key: str, m: dict[EngineName, list[dict[str, Any]]] = metrics) -> list[float]:
                return [c[key] / max(v[key], 1e-12) for c, v in zip(m["chunkwise"], m["vllm"])]

            n = metrics["chunkwise"][0]["num_streams"]
            ratios += [
                Ratio(
                    f"chunkwise/vLLM p99 ITL of the {n} streams inside the window, {dtype} (lower is better)",
                    values("window_p99_itl_ms"),
                    clock="wall",
                ),
                Ratio(
                    f"chunkwise/vLLM steady p50 ITL of the {n} streams outside the window, {dtype} "
                    "(lower is better)",
                    values("steady_p50_itl_ms"),
                    clock="wall",
                ),
                Ratio(
                    f"chunkwise/vLLM mean TTFT of the long prompts, {dtype} (lower is better)",
                    values("mean_long_ttft_ms"),
                    clock="wall",
                ),
            ]
        finally:
            for s in servers.values():
                s.close()
    notes.append(PAUSE_NOTE)
    notes.append(
        "the window runs from the first long prompt's arrival to the last long prompt's first token; the "
        "streams run through it (checked) and the client cuts them when it closes"
    )
    notes.append("ratios are chunkwise over vLLM on client-side latencies: below 1 means chunkwise is faster")
    return PeerReport("convoy", ratios, runs, info, notes)
