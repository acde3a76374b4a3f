"""Bounded load through the router: a fixed number of concurrent clients, each looping until a deadline.

Every request streams, so the client sees its own time to first token; the replica that served it comes
back in the router's x-chunkwise-replica header.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

REPLICA_HEADER = "x-chunkwise-replica"


@dataclass(frozen=True)
class Result:
    start: float  # time.monotonic()
    ttft: float | None
    latency: float
    status: int
    replica: str
    tokens: int


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, model: str = "tiny"
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        # With logprobs every token is an event, even one whose bytes are not yet a whole character:
        # the first event is then the first token.
        "logprobs": 1,
    }
    start = time.monotonic()
    ttft: float | None = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        replica = resp.headers.get(REPLICA_HEADER, "")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                chunk = json.loads(line[6:])
            except ValueError:
                continue
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.monotonic() - start
                tokens += 1
    return Result(start, ttft, time.monotonic() - start, resp.status_code, replica, tokens)


async def run_clients(
    url: str,
    *,
    clients: int,
    stop: Callable[[], bool],
    max_tokens: int,
    prompt_bytes: int = 200,
    seed: int = 0,
    results: list[Result] | None = None,
) -> list[Result]:
    """`clients` loops, each sending one request at a time until `stop()` says so (checked between requests)."""
    out: list[Result] = [] if results is None else results
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz "

    async def loop(client: httpx.AsyncClient, i: int) -> None:
        while not stop():
            # Distinct prompts: routing is by load here, not by cached prefixes.
            prompt = f"client {i}: " + "".join(rng.choice(alphabet) for _ in range(prompt_bytes))
            try:
                result = await one_request(client, url, prompt, max_tokens)
            except httpx.HTTPError:
                result = Result(time.monotonic(), None, 0.0, 0, "", 0)
            out.append(result)
            if result.status != 200:
                await asyncio.sleep(0.2)  # a refused client retries after a pause, not in a hot loop

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(60.0), limits=limits) as client:
        await asyncio.gather(*(loop(client, i) for i in range(clients)))
    return out
