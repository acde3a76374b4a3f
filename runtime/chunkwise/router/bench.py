"""Routing policies side by side on a shared-prefix, multi-tenant workload across local replicas.

    python -m chunkwise.router.bench [--replicas 4] [--policies round-robin,least-loaded,predicted-completion]

For each policy: fresh replicas (`chunkwise serve`, one per 127.0.0.x address, port 8000, a KV cache too
small to hold every tenant's prefix), a fresh `chunkwise router` in front of them, and the same open-loop
schedule of requests (Poisson arrivals, fixed seed). Each tenant has a long system prompt shared by all its
requests; each request adds a short question of its own. Requests stream, so the client measures its own
time to first token; the final chunk's usage says how many prompt tokens the replica found cached.

The report gives mean, p50 and p99 TTFT per policy, the replicas' prefix-cache hit ratio, how evenly the
requests were spread, and the ratios the goal is stated in (mean TTFT against round-robin, p99 against
least-loaded). Loopback only; every process the benchmark starts, it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPLICA_PORT = 8000
REPLICA_HEADER = "x-chunkwise-replica"


@dataclass(frozen=True)
class Workload:
    # Eight tenants' 3k-token prefixes need about 1,550 blocks; one replica holds 640 (--num-blocks), so a
    # replica sent every tenant keeps evicting, and one sent two tenants keeps both.
    tenants: int = 8
    prefix_tokens: int = 3072
    suffix_tokens: int = 32
    max_tokens: int = 8
    requests: int = 240
    rate: float = 6.0  # requests per second, Poisson
    zipf: float = 0.0  # tenant popularity skew; 0 = uniform
    seed: int = 0


@dataclass
class Outcome:
    tenant: int
    start: float
    ttft: float | None = None
    latency: float = 0.0
    status: int = 0
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass
class PolicyResult:
    policy: str
    requests: int
    errors: int
    mean_ttft: float
    p50_ttft: float
    p99_ttft: float
    mean_latency: float
    hit_ratio: float
    spread: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)


# -- the workload ------------------------------------------------------------------------------------------
def _text(rng: random.Random, n: int) -> str:
    # The byte tokenizer makes one token per ASCII byte (plus BOS): n characters are n tokens.
    words = ("fleet", "queue", "block", "cache", "prefill", "decode", "replica", "router", "token", "batch")
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def schedule(w: Workload) -> list[tuple[float, int, str]]:
    """(arrival offset in seconds, tenant, prompt) for every request, the same for every policy."""
    rng = random.Random(w.seed)
    prefixes = [f"[tenant {t}] " + _text(rng, w.prefix_tokens) for t in range(w.tenants)]
    weights = [1.0 / (t + 1) ** w.zipf for t in range(w.tenants)]
    out = []
    t = 0.0
    for i in range(w.requests):
        t += rng.expovariate(w.rate)
        tenant = rng.choices(range(w.tenants), weights)[0]
        out.append((t, tenant, prefixes[tenant] + f"\nQuestion {i}: " + _text(rng, w.suffix_tokens)))
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- processes ---------------------------------------------------------------------------------------------
def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _hosts(count: int, first: int) -> list[str]:
    hosts = [f"127.0.0.{i}" for i in range(first, 255) if _free(f"127.0.0.{i}", REPLICA_PORT)]
    if len(hosts) < count:
        raise RuntimeError(f"not enough free 127.0.0.x addresses for port {REPLICA_PORT}")
    return hosts[:count]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Process:
    def __init__(self, argv: list[str], log: Path) -> None:
        env = dict(os.environ)
        # One thread per process: the replicas share the machine's cores as pods share a node's.
        env.setdefault("OMP_NUM_THREADS", "1")
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.0/8,localhost"
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


def _wait(url: str, proc: _Process, timeout: float, healthy: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False) as c:
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"{url}: process exited with {proc.proc.returncode}")
            try:
                r = c.get(url + "/health", timeout=2)
                if r.status_code == 200 and (healthy is None or r.json().get("healthy") == healthy):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy within {timeout} s")


# -- one policy --------------------------------------------------------------------------------------------
async def _send(client: httpx.AsyncClient, url: str, prompt: str, w: Workload, out: Outcome) -> None:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": w.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Every token then makes an event, so the first event is the first token.
        "logprobs": 1,
    }
    t0 = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            out.status = resp.status_code
            out.replica = resp.headers.get(REPLICA_HEADER, "")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))
                if chunk.get("choices") and out.ttft is None:
                    out.ttft = time.monotonic() - t0
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage["prompt_tokens"]
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except httpx.HTTPError as e:
        out.status = 0
        out.error = f"{type(e).__name__}: {e}"
    out.latency = time.monotonic() - t0


async def _drive(url: str, w: Workload) -> list[Outcome]:
    plan = schedule(w)
    outcomes = [Outcome(tenant, at) for at, tenant, _ in plan]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(300.0), limits=limits) as client:
        start = time.monotonic()
        tasks = []
        for (at, _, prompt), out in zip(plan, outcomes):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_send(client, url, prompt, w, out)))
        await asyncio.gather(*tasks)
    return outcomes


def run_policy(policy: str, args: argparse.Namespace, w: Workload, logdir: Path) -> PolicyResult:
    hosts = _hosts(args.replicas, args.first_host)
    replica_urls = [f"http://{h}:{REPLICA_PORT}" for h in hosts]
    serve = [
        sys.executable,
        "-m",
        "chunkwise.cli",
        "serve",
        "--model",
        args.model,
        "--served-model-name",
        "bench",
    ]
    replicas = [
        _Process(
            [*serve, "--host", h, "--port", str(REPLICA_PORT), "--num-blocks", str(args.num_blocks),
             "--block-size", str(args.block_size), "--log-level", "warning"],
            logdir / f"{policy}-replica-{h}.log",
        )
        for h in hosts
    ]  # fmt: skip
    port = _free_port()
    router_url = f"http://127.0.0.1:{port}"
    router: _Process | None = None
    try:
        for url, p in zip(replica_urls, replicas):
            _wait(url, p, args.startup_timeout)
        router = _Process(
            [sys.executable, "-m", "chunkwise.cli", "router", "--host", "127.0.0.1", "--port", str(port),
             "--replicas", ",".join(replica_urls), "--policy", policy, "--block-size", str(args.block_size),
             "--prefix-cache-blocks", str(args.num_blocks), "--log-level", "warning"],
            logdir / f"{policy}-router.log",
        )  # fmt: skip
        _wait(router_url, router, 30, healthy=len(replica_urls))
        # Warm every engine (first forward passes are slow) with prompts no tenant shares.
        with httpx.Client(trust_env=False, timeout=60) as c:
            for url in replica_urls:
                for i in range(2):
                    c.post(
                        url + "/v1/completions",
                        json={"model": "bench", "prompt": f"warm {i} " * 40, "max_tokens": 4},
                    )
        t0 = time.monotonic()
        outcomes = asyncio.run(_drive(router_url, w))
        wall = time.monotonic() - t0
    finally:
        if router is not None:
            router.stop()
        for p in replicas:
            p.stop()
    ok = [o for o in outcomes if o.status == 200 and o.ttft is not None]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    return PolicyResult(
        policy=policy,
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        mean_ttft=sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        p50_ttft=percentile(ttfts, 0.5),
        p99_ttft=percentile(ttfts, 0.99),
        mean_latency=sum(o.latency for o in ok) / len(ok) if ok else float("nan"),
        hit_ratio=sum(o.cached_tokens for o in ok) / prompt_tokens if prompt_tokens else 0.0,
        spread=dict(sorted(Counter(o.replica.rsplit("/", 1)[-1] for o in ok).items())),
        wall_s=wall,
        error_samples=[f"{o.status} {o.error}".strip() for o in outcomes if o not in ok][:5],
    )


# -- report ------------------------------------------------------------------------------------------------
def format_results(results: list[PolicyResult]) -> str:
    lines = [
        f"{'policy':<22}{'mean TTFT':>11}{'p50':>9}{'p99':>9}{'mean e2e':>10}{'hit ratio':>11}{'errors':>8}  spread"
    ]
    for r in results:
        lines.append(
            f"{r.policy:<22}{r.mean_ttft * 1000:>9.1f}ms{r.p50_ttft * 1000:>7.1f}ms{r.p99_ttft * 1000:>7.1f}ms"
            f"{r.mean_latency * 1000:>8.1f}ms{r.hit_ratio:>11.2f}{r.errors:>8}  {r.spread}"
        )
        lines.extend(f"    failed: {e}" for e in r.error_samples)
    by = {r.policy: r for r in results}
    pc, rr, ll = by.get("predicted-completion"), by.get("round-robin"), by.get("least-loaded")
    if pc and rr:
        lines.append(f"mean TTFT, round-robin / predicted-completion: {rr.mean_ttft / pc.mean_ttft:.2f}x")
    if pc and ll:
        lines.append(f"p99 TTFT, least-loaded / predicted-completion: {ll.p99_ttft / pc.p99_ttft:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chunkwise.router.bench", description=__doc__.split("\n")[0])
    d = Workload()
    p.add_argument("--policies", default="round-robin,least-loaded,predicted-completion")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-blocks", type=int, default=640, help="KV blocks per replica (default 640)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tenants", type=int, default=d.tenants)
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    p.add_argument("--suffix-tokens", type=int, default=d.suffix_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--rate", type=float, default=d.rate, help="requests per second (Poisson)")
    p.add_argument("--zipf", type=float, default=d.zipf, help="tenant popularity skew (0: uniform)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--first-host", type=int, default=2, help="replicas on 127.0.0.<first-host>.. (default 2)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--logdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    w = Workload(
        tenants=args.tenants,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        max_tokens=args.max_tokens,
        requests=args.requests,
        rate=args.rate,
        zipf=args.zipf,
        seed=args.seed,
    )
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="chunkwise-router-bench-"))
    logdir.mkdir(parents=True, exist_ok=True)
    results = []
    for policy in [s.strip() for s in args.policies.split(",") if s.strip()]:
        print(f"running {policy} ...", file=sys.stderr, flush=True)
        results.append(run_policy(policy, args, w, logdir))
    print(format_results(results))
    if args.json:
        payload: dict[str, Any] = {"workload": asdict(w), "args": {k: str(v) for k, v in vars(args).items()}}
        payload["results"] = [asdict(r) for r in results]
        args.json.write_text(json.dumps(payload, indent=2))
    print(f"logs: {logdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
