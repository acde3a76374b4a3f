"""The routing benchmark's agent and mixed workloads, its policy variants and its report (pure parts)."""

from __future__ import annotations

import argparse
import itertools
import math
import re
from collections import Counter

import pytest

from chunkwise.bench.routing import run as bench
from chunkwise.bench.routing.report import (
    Outcome,
    PolicyResult,
    Run,
    format_report,
    format_results,
    ratios,
    summarize,
)
from chunkwise.bench.routing.router import parser as router_parser
from chunkwise.bench.routing.workloads import AgentWorkload, MixedWorkload, Workload, schedule

SESSION = re.compile(r"\[session (\d+)\]")


def result(policy: str, p99: float, mean: float = 0.1) -> PolicyResult:
    return PolicyResult(policy, 10, 0, mean, mean / 2, p99, mean * 2, 0.5)


# -- agent ---------------------------------------------------------------------------------------------------
def test_agent_is_reproducible_open_loop_and_bounded() -> None:
    w = AgentWorkload(duration_s=30.0)
    plan = w.arrivals()
    assert plan == w.arrivals()  # every policy replays the same requests
    assert plan != AgentWorkload(duration_s=30.0, seed=1).arrivals()
    assert [a.at for a in plan] == sorted(a.at for a in plan)
    assert plan[0].at > 0 and plan[-1].at < 30.0
    # Sessions start at 2.5/s and have 2-6 turns: about 2.5 * 4 requests a second, fewer near the end.
    assert 5.0 < len(plan) / 30.0 < 11.0
    assert {a.kind for a in plan} == {"turn"}
    assert all(8 <= a.max_tokens <= 16 for a in plan)


def test_agent_sessions_grow_prompts_that_share_their_history() -> None:
    w = AgentWorkload(duration_s=60.0)
    sessions: dict[int, list] = {}
    for a in w.arrivals():
        match = SESSION.search(a.prompt)
        assert match is not None
        sessions.setdefault(int(match.group(1)), []).append(a)
    assert len(sessions) > 100
    for turns in sessions.values():
        assert 1 <= len(turns) <= 6  # 2-6, fewer when the session reaches the end of the schedule
        assert len({a.group for a in turns}) == 1
        system = turns[0].prompt.split("\n[session")[0]
        assert system.startswith(f"[tenant {turns[0].group}] system: ")
        assert 1536 <= len(system) <= 1536 + 30
        # The first prompt: system, session, one user message (32-160 tokens) and the reply's cue.
        assert 1536 + 32 < len(turns[0].prompt) < 1536 + 160 + 60
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.prompt.startswith(prev.prompt)  # a turn's prompt is the next one's prefix
            assert len(nxt.prompt) - len(prev.prompt) >= 32 + 32  # a reply and a user message more
            assert nxt.at - prev.at >= w.min_think_s
    assert max(len(t) for t in sessions.values()) == 6


def test_agent_tenant_popularity_is_zipf_skewed() -> None:
    per_tenant = Counter(a.group for a in AgentWorkload(duration_s=400.0).arrivals())
    total = sum(per_tenant.values())
    # 1/(k+1)^1.1 over 16 tenants: the first has 1/3.03 = 33% of the sessions, the 9th 2.9%.
    assert 0.26 < per_tenant[0] / total < 0.40
    assert per_tenant[0] > per_tenant[1] > per_tenant[4] > per_tenant[12]
    assert per_tenant[8] / total < 0.06
    uniform = Counter(a.group for a in AgentWorkload(duration_s=400.0, zipf=0.0).arrivals())
    assert len(uniform) == 16 and max(uniform.values()) < 2 * min(uniform.values())


# -- mixed ---------------------------------------------------------------------------------------------------
def test_mixed_is_reproducible_with_few_long_and_many_short_prompts() -> None:
    w = MixedWorkload(duration_s=300.0)
    plan = w.arrivals()
    assert plan == w.arrivals() and plan != MixedWorkload(duration_s=300.0, seed=3).arrivals()
    assert [a.at for a in plan] == sorted(a.at for a in plan) and plan[-1].at < 300.0
    assert 9.0 < len(plan) / 300.0 < 11.0  # Poisson at 10/s
    long = [a for a in plan if a.kind == "long"]
    short = [a for a in plan if a.kind == "short"]
    assert len(long) + len(short) == len(plan)
    assert 0.10 < len(long) / len(plan) < 0.14
    assert all(2048 < len(a.prompt) < 2944 + 100 for a in long)
    assert all(32 < len(a.prompt) < 256 + 20 for a in short)
    # Varied output lengths, from each kind's own set.
    assert {a.max_tokens for a in long} == {8, 16, 32}
    assert {a.max_tokens for a in short} == {16, 32, 64, 128}


def test_mixed_long_prompts_share_their_document_short_ones_share_nothing() -> None:
    plan = MixedWorkload(duration_s=300.0).arrivals()
    docs: dict[int, list[str]] = {}
    for a in plan:
        if a.kind == "long":
            docs.setdefault(a.group, []).append(a.prompt)
    assert sorted(docs) == list(range(8))
    for d, prompts in docs.items():
        head = prompts[0].split("\nQuestion")[0]
        assert head.startswith(f"[document {d}] ") and len(head) >= 2048
        assert all(p.startswith(head) for p in prompts)
    # The first 15 characters (with BOS, the first KV block) differ between any two short prompts.
    short = [a.prompt for a in plan if a.kind == "short"]
    assert len({p[:15] for p in short}) == len(short)


def test_tenants_workload_is_the_original_schedule() -> None:
    w = Workload(tenants=3, prefix_tokens=300, requests=20, max_tokens=5)
    assert [(a.at, a.group, a.prompt) for a in w.arrivals()] == schedule(w)
    assert {a.max_tokens for a in w.arrivals()} == {5}
    assert w.name == "tenants" and w.num_blocks == 640


# -- policies and flags ----------------------------------------------------------------------------------
def test_policy_variants_name_the_prefix_index() -> None:
    assert bench.variant("predicted-completion+estimate") == ("predicted-completion", ["--no-kv-events"])
    assert bench.variant("predicted-completion+kv-events") == ("predicted-completion", ["--kv-events"])
    assert bench.variant("predicted-completion") == ("predicted-completion", [])  # the router's default
    assert bench.variant("llm-d") == ("llm-d", ["--no-kv-events"])  # its index is its own decisions
    assert bench.variant("round-robin") == ("round-robin", [])
    with pytest.raises(ValueError, match="estimate, kv-events"):
        bench.variant("predicted-completion+exact")


def test_the_bench_router_takes_the_baselines_too() -> None:
    args = router_parser().parse_args(["--replicas", "http://127.0.0.2:8000", "--policy", "llm-d"])
    assert args.policy == "llm-d" and args.kv_events is True
    with pytest.raises(SystemExit):
        router_parser().parse_args(["--replicas", "http://x", "--policy", "random"])


def test_workload_flags() -> None:
    ns = argparse.Namespace(workload="all", seed=2, load_scale=2.0, duration_s=10.0)
    agent, mixed = bench.workloads(ns)
    assert isinstance(agent, AgentWorkload) and isinstance(mixed, MixedWorkload)
    assert agent.session_rate == 5.0 and mixed.rate == 20.0
    assert agent.duration_s == mixed.duration_s == 10.0 and agent.seed == mixed.seed == 2
    assert bench._replica_counts("4,8") == [4, 8]
    with pytest.raises(argparse.ArgumentTypeError):
        bench._replica_counts("4,0")


# -- report ----------------------------------------------------------------------------------------------
def test_summary_of_outcomes() -> None:
    outcomes = [
        Outcome(0, 0.0, ttft=0.1, latency=0.3, status=200, replica="http://127.0.0.2:8000", prompt_tokens=100,
                cached_tokens=80),
        Outcome(0, 0.1, ttft=0.3, latency=0.5, status=200, replica="http://127.0.0.3:8000", prompt_tokens=100,
                cached_tokens=0),
        Outcome(1, 0.2, status=0, error="ReadError: x"),
    ]  # fmt: skip
    r = summarize("llm-d", outcomes, 2.0, "agent", 4)
    assert (r.requests, r.errors, r.workload, r.replicas) == (3, 1, "agent", 4)
    assert r.mean_ttft == pytest.approx(0.2) and r.p99_ttft == 0.3 and r.p50_ttft == 0.1
    assert r.hit_ratio == pytest.approx(0.4)
    assert r.spread == {"127.0.0.2:8000": 1, "127.0.0.3:8000": 1}
    assert r.error_samples == ["0 ReadError: x"]


def test_ratios_against_the_llm_d_baseline() -> None:
    results = [
        result("llm-d", 1.5),
        result("predicted-completion+estimate", 1.2),
        result("predicted-completion+kv-events", 1.0),
    ]
    assert [(q.metric, q.baseline, q.policy, q.value) for q in ratios(results)] == [
        ("p99", "llm-d", "predicted-completion+estimate", pytest.approx(1.25)),
        ("p99", "llm-d", "predicted-completion+kv-events", pytest.approx(1.5)),
    ]
    text = format_results(results)
    assert "p99 TTFT, llm-d / predicted-completion+estimate: 1.25x\n" in text
    assert "p99 TTFT, llm-d / predicted-completion+kv-events: 1.50x (goal >= 1.3x: met)" in text
    results[2] = result("predicted-completion+kv-events", 1.25)
    assert "1.20x (goal >= 1.3x: not met)" in format_results(results)
    # Without the baseline there is nothing to compare with; a policy without answers gives no ratio.
    assert ratios(results[1:]) == []
    assert math.isnan(ratios([result("llm-d", 1.0), result("x", float("nan"))])[0].value)


def test_report_puts_the_ratios_side_by_side() -> None:
    runs = [
        Run("agent", 4, [result("llm-d", 0.9), result("predicted-completion+kv-events", 0.6)]),
        Run("mixed", 8, [result("llm-d", 2.0), result("predicted-completion+kv-events", 0.5)]),
    ]
    text = format_report(runs)
    assert "== agent, 4 replicas, 10 requests" in text and "== mixed, 8 replicas, 10 requests" in text
    table = text.split("== p99 TTFT, llm-d / policy\n")[1].splitlines()
    assert table[0].split() == ["policy", "agent", "x4", "mixed", "x8"]
    assert table[1].split() == ["predicted-completion+kv-events", "1.50x", "4.00x"]
