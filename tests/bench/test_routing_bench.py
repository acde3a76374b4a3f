"""The routing benchmark's pure parts: the workload it replays and how it reports."""

from __future__ import annotations

from chunkwise.bench.routing.run import PolicyResult, Workload, format_results, percentile, schedule
from chunkwise.engine.tokenizer import ByteTokenizer


def test_schedule_is_reproducible_and_shares_prefixes_per_tenant() -> None:
    w = Workload(tenants=3, prefix_tokens=300, suffix_tokens=20, requests=30, rate=10.0, seed=4)
    plan = schedule(w)
    assert plan == schedule(w)  # every policy replays the same requests
    assert [round(t, 9) for t, _, _ in plan] == sorted(round(t, 9) for t, _, _ in plan)
    by_tenant: dict[int, list[str]] = {}
    for _, tenant, prompt in plan:
        by_tenant.setdefault(tenant, []).append(prompt)
    for tenant, prompts in by_tenant.items():
        head = prompts[0].split("\nQuestion")[0]
        assert head.startswith(f"[tenant {tenant}] ")
        assert all(p.startswith(head) for p in prompts)
        # About prefix_tokens tokens for the byte tokenizer (one per ASCII character, plus BOS).
        assert abs(len(ByteTokenizer().encode(head)) - 300) < 20
    assert schedule(Workload(seed=5))[0] != schedule(Workload(seed=4))[0]


def test_percentile_and_report() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.99) == 4.0
    results = [
        PolicyResult("round-robin", 10, 0, 0.5, 0.4, 1.2, 0.6, 0.3, {"a": 5, "b": 5}),
        PolicyResult("least-loaded", 10, 0, 0.4, 0.3, 1.0, 0.5, 0.3),
        PolicyResult(
            "predicted-completion", 10, 1, 0.1, 0.05, 0.8, 0.2, 0.9, error_samples=["0 ReadError: x"]
        ),
    ]
    text = format_results(results)
    assert "mean TTFT, round-robin / predicted-completion: 5.00x" in text
    assert "p99 TTFT, least-loaded / predicted-completion: 1.25x" in text
    assert "failed: 0 ReadError: x" in text
