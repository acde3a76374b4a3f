"""The load-shedding policy: a pure function of the published load snapshot."""

from __future__ import annotations

import pytest

from chunkwise.engine.sched.shedding import (
    MAX_RETRY_AFTER_S,
    Decision,
    LoadSnapshot,
    ServiceRate,
    SheddingPolicy,
    decide,
    retry_after_s,
)

POLICY = SheddingPolicy(max_waiting=4, queue_delay_slo_s=2.0)


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        # Empty queue: admitted, no delay.
        (LoadSnapshot(0, 0, 0, 100.0), Decision(True, None, 0.0, 0)),
        # 150 tokens at 100 tok/s = 1.5 s <= 2 s: admitted.
        (LoadSnapshot(2, 50, 100, 100.0), Decision(True, None, 1.5, 0)),
        # Exactly at the objective: admitted (the rule is "exceeds").
        (LoadSnapshot(2, 100, 100, 100.0), Decision(True, None, 2.0, 0)),
        # 250 tokens at 100 tok/s = 2.5 s > 2 s: refused, retry after ceil(2.5) = 3 s.
        (LoadSnapshot(2, 100, 150, 100.0), Decision(False, "slo", 2.5, 3)),
        # Queue full wins over the delay rule, and a short predicted delay still says retry after >= 1 s.
        (LoadSnapshot(4, 10, 0, 100.0), Decision(False, "queue_full", 0.1, 1)),
        (LoadSnapshot(5, 1000, 0, 100.0), Decision(False, "queue_full", 10.0, 10)),
        # Rate not measured yet: no delay can be predicted, only the bound applies.
        (LoadSnapshot(3, 10**6, 10**6, 0.0), Decision(True, None, 0.0, 0)),
        # An absurd prediction is capped.
        (LoadSnapshot(3, 10**9, 0, 1.0), Decision(False, "slo", 1e9, MAX_RETRY_AFTER_S)),
    ],
)
def test_decide(load: LoadSnapshot, expected: Decision) -> None:
    got = decide(POLICY, load)
    assert (got.admitted, got.reason, got.retry_after_s) == (
        expected.admitted,
        expected.reason,
        expected.retry_after_s,
    )
    assert got.predicted_delay_s == pytest.approx(expected.predicted_delay_s)


def test_disabled_rules_admit_everything() -> None:
    assert decide(SheddingPolicy(), LoadSnapshot(10**6, 10**9, 10**9, 1.0)).admitted
    assert decide(SheddingPolicy(max_waiting=1), LoadSnapshot(0, 10**9, 0, 1.0)).admitted
    assert not decide(SheddingPolicy(queue_delay_slo_s=1.0), LoadSnapshot(0, 10**9, 0, 1.0)).admitted


def test_plus_counts_requests_not_yet_seen_by_the_loop() -> None:
    load = LoadSnapshot(1, 10, 20, 50.0).plus(2, 30, 40)
    assert load == LoadSnapshot(3, 40, 60, 50.0)
    assert load.queued_tokens == 100 and load.predicted_delay_s == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("delay", "expected"),
    [(0.0, 1), (0.2, 1), (1.0, 1), (1.01, 2), (59.5, 60), (1e12, 600), (float("inf"), 600)],
)
def test_retry_after(delay: float, expected: int) -> None:
    assert retry_after_s(delay) == expected


@pytest.mark.parametrize(
    "kwargs", [{"max_waiting": 0}, {"queue_delay_slo_s": 0.0}, {"queue_delay_slo_s": -1.0}]
)
def test_policy_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SheddingPolicy(**kwargs)  # type: ignore[arg-type]


def test_decision_messages_name_the_reason() -> None:
    assert "full" in decide(POLICY, LoadSnapshot(4, 0, 0, 1.0)).message
    assert "objective" in decide(POLICY, LoadSnapshot(0, 300, 0, 100.0)).message


def test_service_rate_ema() -> None:
    rate = ServiceRate(alpha=0.5)
    assert rate.tokens_per_s == 0.0
    rate.observe(100, 1.0)  # the first observation is taken as is
    assert rate.tokens_per_s == pytest.approx(100.0)
    rate.observe(300, 1.0)  # tokens EMA 200, seconds EMA 1
    assert rate.tokens_per_s == pytest.approx(200.0)
    rate.observe(0, 1.0)  # empty steps are ignored
    rate.observe(10, 0.0)
    assert rate.tokens_per_s == pytest.approx(200.0)
    # Duration-weighted: a long step of 1000 tokens over 3 s moves the ratio of EMAs, (200+1000)/2 / (1+3)/2.
    rate.observe(1000, 3.0)
    assert rate.tokens_per_s == pytest.approx(600.0 / 2.0)


def test_service_rate_prior_fades() -> None:
    rate = ServiceRate(initial_tokens_per_s=10_000.0, alpha=0.5)
    assert rate.tokens_per_s == pytest.approx(10_000.0)
    for _ in range(40):
        rate.observe(10, 0.01)  # 1000 tok/s measured
    assert rate.tokens_per_s == pytest.approx(1000.0, rel=1e-3)
    with pytest.raises(ValueError):
        ServiceRate(alpha=0.0)
