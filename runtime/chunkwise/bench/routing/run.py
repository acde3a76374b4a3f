"""Routing policies side by side across local replicas, on shared-prefix workloads.

    python -m chunkwise.bench.routing.run [--workload tenants|agent|mixed|all] [--replicas 4[,8]]
        [--policies round-robin,least-loaded,predicted-completion]

For each workload, replica count and policy: fresh replicas (`chunkwise serve`, one per 127.0.0.x address,
port 8000, a KV cache too small to hold every prefix of the workload), a fresh router in front of them, and
the same open-loop schedule of requests (fixed seed; bench/routing/workloads.py). Requests stream, so the
client measures its own time to first token; the final chunk's usage says how many prompt tokens the
replica found cached.

A policy is a router policy, optionally with the prefix index it routes on: `NAME+estimate` (the router's
own estimate, `--no-kv-events`) or `NAME+kv-events` (the exact index from the replicas' KV events,
`--kv-events`, the router's default). `llm-d` is the llm-d-style baseline (router/llmd.py), whose prefix
index is fed by its own decisions: it reads no KV events.

The report gives mean, p50 and p99 TTFT per policy, errors, the replicas' prefix-cache hit ratio, how the
requests were spread, and the ratios the goals are stated in (bench/routing/report.py). Loopback only; every
process the benchmark starts, it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from chunkwise.bench.routing.report import (
    Outcome,
    PolicyResult,
    Run,
    format_report,
    format_results,
    percentile,
    ratios,
    summarize,
)
from chunkwise.bench.routing.workloads import (
    ALL,
    WORKLOADS,
    AgentWorkload,
    Arrival,
    BenchWorkload,
    MixedWorkload,
    Workload,
    schedule,
)

__all__ = ["PolicyResult", "Workload", "format_results", "main", "percentile", "schedule", "variant"]

REPLICA_PORT = 8000
REPLICA_HEADER = "x-chunkwise-replica"
# The prefix index a policy variant routes on: the router's flag for it.
INDEX_FLAGS = {"estimate": "--no-kv-events", "kv-events": "--kv-events"}
# llm-d's default prefix scorer indexes its own decisions (router/llmd.py): KV events would only cost probes.
POLICY_FLAGS = {"llm-d": ["--no-kv-events"]}


def variant(name: str) -> tuple[str, list[str]]:
    """`POLICY[+estimate|+kv-events]` -> (the router's --policy, its other flags)."""
    policy, _, index = name.partition("+")
    if index and index not in INDEX_FLAGS:
        raise ValueError(f"{name}: the index after '+' is one of {', '.join(INDEX_FLAGS)}")
    return policy, [INDEX_FLAGS[index]] if index else list(POLICY_FLAGS.get(policy, []))


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
async def _send(client: httpx.AsyncClient, url: str, arrival: Arrival, out: Outcome) -> None:
    body = {
        "model": "bench",
        "prompt": arrival.prompt,
        "max_tokens": arrival.max_tokens,
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


async def _drive(url: str, plan: list[Arrival]) -> list[Outcome]:
    outcomes = [Outcome(a.group, a.at) for a in plan]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(300.0), limits=limits) as client:
        start = time.monotonic()
        tasks = []
        for arrival, out in zip(plan, outcomes):
            delay = start + arrival.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_send(client, url, arrival, out)))
        await asyncio.gather(*tasks)
    return outcomes


def run_policy(
    name: str, args: argparse.Namespace, w: BenchWorkload, replicas: int, logdir: Path
) -> PolicyResult:
    """One policy variant on one workload: fresh replicas and router, the schedule, then everything stopped."""
    began = time.monotonic()
    policy, flags = variant(name)
    num_blocks = args.num_blocks or w.num_blocks
    tag = f"{w.name}-{replicas}-{name}"
    hosts = _hosts(replicas, args.first_host)
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
    procs = [
        _Process(
            [*serve, "--host", h, "--port", str(REPLICA_PORT), "--num-blocks", str(num_blocks),
             "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
             "--log-level", "warning"],
            logdir / f"{tag}-replica-{h}.log",
        )
        for h in hosts
    ]  # fmt: skip
    port = _free_port()
    router_url = f"http://127.0.0.1:{port}"
    router: _Process | None = None
    plan = w.arrivals()
    try:
        for url, proc in zip(replica_urls, procs):
            _wait(url, proc, args.startup_timeout)
        # bench/routing/router.py: `chunkwise router` with the baselines among its policies.
        router = _Process(
            [sys.executable, "-m", "chunkwise.bench.routing.router", "--host", "127.0.0.1", "--port", str(port),
             "--replicas", ",".join(replica_urls), "--policy", policy, *flags,
             "--poll-interval-seconds", str(args.poll_interval_seconds), "--block-size", str(args.block_size),
             "--prefix-cache-blocks", str(num_blocks), "--log-level", "warning"],
            logdir / f"{tag}-router.log",
        )  # fmt: skip
        _wait(router_url, router, 30, healthy=len(replica_urls))
        # Warm every engine (first forward passes are slow) with prompts no request shares.
        with httpx.Client(trust_env=False, timeout=60) as c:
            for url in replica_urls:
                for i in range(2):
                    c.post(
                        url + "/v1/completions",
                        json={"model": "bench", "prompt": f"warm {i} " * 40, "max_tokens": 4},
                    )
        t0 = time.monotonic()
        outcomes = asyncio.run(_drive(router_url, plan))
        wall = time.monotonic() - t0
    finally:
        if router is not None:
            router.stop()
        for proc in procs:
            proc.stop()
    result = summarize(name, outcomes, wall, w.name, replicas)
    result.run_s = time.monotonic() - began
    return result


# -- the command -------------------------------------------------------------------------------------------
def _replica_counts(text: str) -> list[int]:
    try:
        counts = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of counts: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"replica counts must be positive: {text!r}")
    return counts


def workloads(args: argparse.Namespace) -> list[BenchWorkload]:
    """The workloads the flags ask for; --load-scale and --duration-s shape agent and mixed."""
    names = list(ALL) if args.workload == "all" else [args.workload]
    out: list[BenchWorkload] = []
    for name in names:
        if name == "tenants":
            out.append(
                Workload(
                    tenants=args.tenants,
                    prefix_tokens=args.prefix_tokens,
                    suffix_tokens=args.suffix_tokens,
                    max_tokens=args.max_tokens,
                    requests=args.requests,
                    rate=args.rate,
                    zipf=args.zipf,
                    seed=args.seed,
                )
            )
            continue
        w: AgentWorkload | MixedWorkload
        if name == "agent":
            w = AgentWorkload(seed=args.seed)
            w = dataclasses.replace(w, session_rate=w.session_rate * args.load_scale)
        else:
            w = MixedWorkload(seed=args.seed)
            w = dataclasses.replace(w, rate=w.rate * args.load_scale)
        if args.duration_s is not None:
            w = dataclasses.replace(w, duration_s=args.duration_s)
        out.append(w)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m chunkwise.bench.routing.run", description=__doc__.split("\n")[0]
    )
    d = Workload()
    p.add_argument(
        "--workload", choices=[*WORKLOADS, "all"], default="tenants", help=f"all: {', '.join(ALL)}"
    )
    p.add_argument(
        "--policies",
        default="round-robin,least-loaded,predicted-completion",
        help="comma-separated: a router policy or the llm-d baseline, optionally +estimate or +kv-events",
    )
    p.add_argument(
        "--replicas", type=_replica_counts, default=[4], help="replica counts, run in turn (e.g. 4,8)"
    )
    p.add_argument("--model", default="tiny")
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per replica (default: the workload's)"
    )
    p.add_argument("--block-size", type=int, default=16)
    # Every workload's longest prompt and output fit; a replica's KV cache must hold one such request.
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--poll-interval-seconds", type=float, default=0.5, help="the router's, every policy's")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("tenants workload")
    g.add_argument("--tenants", type=int, default=d.tenants)
    g.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    g.add_argument("--suffix-tokens", type=int, default=d.suffix_tokens)
    g.add_argument("--max-tokens", type=int, default=d.max_tokens)
    g.add_argument("--requests", type=int, default=d.requests)
    g.add_argument("--rate", type=float, default=d.rate, help="requests per second (Poisson)")
    g.add_argument("--zipf", type=float, default=d.zipf, help="tenant popularity skew (0: uniform)")
    g = p.add_argument_group("agent and mixed workloads")
    g.add_argument("--load-scale", type=float, default=1.0, help="multiplies the arrival rate (default 1)")
    g.add_argument("--duration-s", type=float, default=None, help="seconds of arrivals (default 45)")
    p.add_argument("--first-host", type=int, default=2, help="replicas on 127.0.0.<first-host>.. (default 2)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--logdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.policies.split(",") if s.strip()]
    from chunkwise.router.policies import BASELINES, POLICIES

    for name in names:
        try:
            policy, _ = variant(name)
        except ValueError as e:
            p.error(str(e))
        if policy not in POLICIES and policy not in BASELINES:
            p.error(f"{name}: unknown policy; choose from {', '.join([*POLICIES, *BASELINES])}")
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="chunkwise-router-bench-"))
    logdir.mkdir(parents=True, exist_ok=True)
    chosen = workloads(args)
    runs: list[Run] = []
    began = time.monotonic()
    for w in chosen:
        for count in args.replicas:
            run = Run(w.name, count, [])
            runs.append(run)
            for name in names:
                print(f"running {w.name}, {count} replicas, {name} ...", file=sys.stderr, flush=True)
                run.results.append(run_policy(name, args, w, count, logdir))
                r = run.results[-1]
                print(
                    f"  {r.requests} requests in {r.wall_s:.0f} s ({r.run_s:.0f} s with start and stop; "
                    f"{time.monotonic() - began:.0f} s so far)",
                    file=sys.stderr,
                    flush=True,
                )
    print(format_report(runs))
    if args.json:
        payload: dict[str, Any] = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "workloads": {w.name: asdict(w) for w in chosen},  # type: ignore[call-overload]
            "runs": [
                {
                    "workload": run.workload,
                    "replicas": run.replicas,
                    "results": [asdict(r) for r in run.results],
                    "ratios": [asdict(q) for q in ratios(run.results)],
                }
                for run in runs
            ],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    print(f"logs: {logdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
