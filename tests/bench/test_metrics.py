"""Metric definitions (those of `vllm bench serve`) against hand-computed examples."""

from __future__ import annotations

import pytest

from chunkwise.bench.metrics import RequestRecord, format_report, parse_slos, summarize


def _records() -> list[RequestRecord]:
    # A: 4 tokens, chunks at 0.1, 0.2, 0.4, 0.7 s -> TTFT 0.1, ITL 0.1 0.2 0.3, TPOT (0.7-0.1)/3 = 0.2.
    a = RequestRecord(prompt_len=10, output_len=4, ttft=0.1, latency=0.7, itl=[0.1, 0.2, 0.3])
    # B: 1 token at 0.5 s -> no TPOT, no ITL.
    b = RequestRecord(prompt_len=20, output_len=1, ttft=0.5, latency=0.5)
    # C: 3 tokens in 2 chunks (the second carries two tokens): TPOT (1.0-0.3)/2 = 0.35, one ITL gap 0.7.
    c = RequestRecord(prompt_len=30, output_len=3, ttft=0.3, latency=1.0, itl=[0.7])
    failed = RequestRecord(prompt_len=99, success=False, error="HTTP 429")
    return [a, b, c, failed]


def test_summary_by_hand() -> None:
    r = summarize(_records(), duration_s=2.0)
    assert r["completed"] == 3 and r["failed"] == 1
    assert r["total_input_tokens"] == 60 and r["total_output_tokens"] == 8
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(4.0)
    assert r["total_token_throughput"] == pytest.approx(34.0)
    assert r["mean_ttft_ms"] == pytest.approx(300.0)
    assert r["median_ttft_ms"] == pytest.approx(300.0)
    # numpy's linear interpolation over [100, 300, 500]: p90 = 300 + 0.8 * 200.
    assert r["p90_ttft_ms"] == pytest.approx(460.0)
    assert r["mean_tpot_ms"] == pytest.approx(275.0)
    assert r["p50_tpot_ms"] == pytest.approx(275.0)
    # ITL pools every gap: [100, 200, 300, 700].
    assert r["mean_itl_ms"] == pytest.approx(325.0)
    assert r["p50_itl_ms"] == pytest.approx(250.0)
    assert r["p99_itl_ms"] == pytest.approx(300 + 0.97 * 400)
    assert r["max_itl_ms"] == pytest.approx(700.0)
    assert r["mean_e2el_ms"] == pytest.approx(2200.0 / 3)
    assert r["errors"] == ["HTTP 429"]


def test_goodput_counts_requests_meeting_every_slo() -> None:
    # TTFT <= 400 ms keeps A and C; TPOT <= 300 ms keeps A and B (one token: TPOT counts as 0).
    r = summarize(_records(), 2.0, parse_slos(["ttft:400", "tpot:300"]))
    assert r["request_goodput"] == pytest.approx(0.5)  # only A, over 2 s
    assert summarize(_records(), 2.0, {"e2el": 800.0})["request_goodput"] == pytest.approx(1.0)


def test_metrics_without_samples_are_zero() -> None:
    r = summarize([RequestRecord(prompt_len=1, output_len=1, ttft=0.2, latency=0.2)], 1.0)
    assert r["mean_tpot_ms"] == 0.0 and r["p99_itl_ms"] == 0.0
    assert r["mean_ttft_ms"] == pytest.approx(200.0)


@pytest.mark.parametrize("spec", ["ttft", "speed:5", "ttft:abc", "tpot:-1"])
def test_bad_slos_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="SLO"):
        parse_slos([spec])


def test_text_report_has_vllm_sections() -> None:
    text = format_report(summarize(_records(), 2.0, {"ttft": 400.0}))
    for needle in ("Successful requests:", "Request goodput (req/s):", "P99 TTFT (ms):", "Mean ITL (ms):"):
        assert needle in text
