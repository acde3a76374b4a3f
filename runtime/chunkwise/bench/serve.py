"""`chunkwise bench serve`: drive any OpenAI-compatible endpoint and report what its clients saw.

Requests go out at their arrival offsets (optionally capped at `max_concurrency` in flight, waiting for a
slot as `vllm bench serve` does), each as a streaming /v1/completions call with `stream_options.include_usage`
so the server's own token count is used. Timings are taken at the client: TTFT from sending to the first
chunk, ITL between chunks, latency to the last chunk (see chunkwise.bench.metrics for the definitions).
While it runs, the server's /metrics (if it has one) is scraped for the queue depth and KV-cache usage.

A run can be cut short (`cut_after_first_token_of`): once every listed request has its first chunk, and
every other request still streaming has had a chunk since, the client cancels what is still in flight (the
connection is closed, so the server aborts those requests) and marks those records `cut`. The convoy uses
this to keep its decoding streams alive, with a generous max_tokens, exactly as long as its window lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from chunkwise import metric_names
from chunkwise.bench.metrics import RequestRecord
from chunkwise.bench.results import RunResult
from chunkwise.bench.workloads import WorkItem

# Gauges read from /metrics (the vLLM names every chunkwise replica exports), summed over label sets.
_GAUGES = {
    metric_names.NUM_REQUESTS_RUNNING: "running",
    metric_names.NUM_REQUESTS_WAITING: "waiting",
    metric_names.KV_CACHE_USAGE: "kv",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_gauges(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in _GAUGES:
            key = _GAUGES[m.group(1)]
            try:
                out[key] = out.get(key, 0.0) + float(m.group(3))
            except ValueError:
                continue
    return out


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def payload(item: WorkItem, model: str, ignore_eos: bool = True, temperature: float = 0.0) -> dict[str, Any]:
    """The request body. A hidden target length cannot be hidden from an HTTP server: it is sent as
    max_tokens (with EOS ignored, so the output has exactly the workload's length)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(item.prompt_token_ids) if item.prompt_token_ids is not None else item.prompt,
        "max_tokens": item.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


class _Cut:
    """When to cut a run: once every watched request has its first chunk (or has ended without one), at
    time T, and every other request still streaming has had a chunk at or after T."""

    def __init__(self, watch: Collection[int]) -> None:
        self.pending_first = set(watch)
        self.window_end: float | None = None
        self.streaming: set[int] = set()
        self.behind: set[int] = set()
        self.done = asyncio.Event()
        if not self.pending_first:
            raise ValueError("a cut needs at least one request to watch")

    def chunk(self, i: int, now: float) -> None:
        self.streaming.add(i)
        if self.window_end is None:
            self.pending_first.discard(i)
            if not self.pending_first:
                self._close(now, i)
        else:
            self.behind.discard(i)
            self._check()

    def ended(self, i: int, now: float) -> None:
        self.streaming.discard(i)
        self.behind.discard(i)
        if self.window_end is None and i in self.pending_first:
            self.pending_first.discard(i)
            if not self.pending_first:
                self._close(now, i)
        self._check()

    def _close(self, now: float, i: int) -> None:
        self.window_end = now
        self.behind = self.streaming - {i}
        self._check()

    def _check(self) -> None:
        if self.window_end is not None and not self.behind:
            self.done.set()


async def _one(
    client: Any,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    t0: float,
    on_chunk: Callable[[float], None] | None = None,
) -> None:
    st = time.perf_counter()
    rec.start_s = st - t0
    last = st
    chunks = 0
    usage_tokens: int | None = None
    usage_prompt: int | None = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.success, rec.error = False, f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.success, rec.error = False, f"stream error: {obj['error']}"
                    return
                now = time.perf_counter()
                if obj.get("choices"):
                    if chunks == 0:
                        rec.ttft = now - st
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                    if on_chunk is not None:
                        on_chunk(now)
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    usage_prompt = usage.get("prompt_tokens")
    except asyncio.CancelledError:  # the run was cut: what was received so far is the record
        rec.cut = True
        rec.output_len = chunks
        if chunks:
            rec.latency = last - st
        raise
    except Exception as e:  # any transport failure is this request's failure, not the benchmark's
        rec.success, rec.error = False, f"{type(e).__name__}: {e}"
        return
    if chunks == 0:
        rec.success, rec.error = False, "no output chunk received"
        return
    rec.latency = last - st
    rec.output_len = usage_tokens if usage_tokens is not None else chunks
    if isinstance(usage_prompt, int):
        rec.prompt_len = usage_prompt


async def _scrape(
    client: Any, url: str, t0: float, out: list[tuple[float, float, float, float]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            resp = await client.get(url)
            if resp.status_code != 200:
                return
            g = parse_gauges(resp.text)
            out.append(
                (time.perf_counter() - t0, g.get("running", 0.0), g.get("waiting", 0.0), g.get("kv", 0.0))
            )
        except Exception:
            return  # no /metrics here: the run goes on without a timeline
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def run_serve_async(
    base_url: str,
    items: Sequence[WorkItem],
    *,
    model: str,
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    scrape_metrics: bool = True,
    progress: bool = True,
    name: str = "serve",
    cut_after_first_token_of: Collection[int] = (),
) -> RunResult:
    import httpx

    from chunkwise.bench.progress import Progress

    base = _base(base_url)
    url = f"{base}/v1/completions"
    records = [RequestRecord(prompt_len=len(it.prompt_token_ids or ())) for it in items]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = Progress(len(items), name) if progress else None
    timeline: list[tuple[float, float, float, float]] = []
    cut = _Cut(cut_after_first_token_of) if cut_after_first_token_of else None
    cut_s: float | None = None
    limits = httpx.Limits(
        max_connections=max_concurrency or max(1, len(items)), max_keepalive_connections=None
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        stop = asyncio.Event()
        t0 = time.perf_counter()
        scraper = None
        if scrape_metrics:
            scraper = asyncio.create_task(_scrape(client, f"{base}/metrics", t0, timeline, stop))

        def on_chunk(i: int) -> Callable[[float], None] | None:
            if cut is None:
                return None
            watch = cut
            return lambda now: watch.chunk(i, now)

        async def send(i: int) -> None:
            try:
                delay = items[i].arrival_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                body = payload(items[i], model, ignore_eos, temperature)
                if sem is None:
                    await _one(client, url, body, records[i], t0, on_chunk(i))
                else:
                    async with sem:
                        await _one(client, url, body, records[i], t0, on_chunk(i))
            except asyncio.CancelledError:
                rec = records[i]
                rec.cut = True
                if not rec.output_len:
                    rec.success, rec.error = False, "cut by the client before its first chunk"
                raise
            if cut is not None:
                cut.ended(i, time.perf_counter())
            if bar:
                bar.update()

        tasks = [asyncio.create_task(send(i)) for i in range(len(items))]

        async def cutter() -> None:
            nonlocal cut_s
            assert cut is not None
            await cut.done.wait()
            cut_s = time.perf_counter() - t0
            for task in tasks:
                task.cancel()  # a no-op on a task that has ended

        cutting = asyncio.create_task(cutter()) if cut is not None else None
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        if cutting is not None:
            cutting.cancel()
        duration = time.perf_counter() - t0
        stop.set()
        if scraper is not None:
            await scraper
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome
    if bar:
        bar.close()
    result = RunResult(name, records, [], duration, timeline=timeline)
    result.extra["endpoint"] = url
    if cut_s is not None:
        result.extra["cut_s"] = cut_s
    return result


def run_serve(base_url: str, items: Sequence[WorkItem], **kwargs: Any) -> RunResult:
    return asyncio.run(run_serve_async(base_url, items, **kwargs))
