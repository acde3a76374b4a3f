"""Per-request SLO headers: parsing, and the picker honouring them (redirect, shed, best effort)."""

from __future__ import annotations

import httpx
import pytest

from chunkwise.engine.tokenizer import ByteTokenizer
from chunkwise.router.prompt import PromptReader
from chunkwise.router.proxy import build_app
from chunkwise.router.replica import InFlight
from chunkwise.router.slo import MAX_RETRY_AFTER_S, Shed, Slo, SloHeaderError, parse_slo, retry_after

from .conftest import URLS, MakeRouter, request
from .fake_replicas import FakeFleet, body, make_router


def test_headers_parse_to_seconds_and_bad_values_are_the_clients_error() -> None:
    assert parse_slo({}) is None
    assert parse_slo({"x-sheddable": "true"}) is None  # nothing to judge
    assert parse_slo({"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "20", "x-sheddable": "true"}) == Slo(
        ttft_s=0.25, tpot_s=0.02, sheddable=True
    )
    assert parse_slo({"x-slo-tpot-ms": "5"}) == Slo(tpot_s=0.005)
    for bad in ({"x-slo-ttft-ms": "fast"}, {"x-slo-ttft-ms": "0"}, {"x-slo-tpot-ms": "-3"}):
        with pytest.raises(SloHeaderError, match="milliseconds"):
            parse_slo(bad)
    with pytest.raises(SloHeaderError, match="true or false"):
        parse_slo({"x-slo-ttft-ms": "100", "x-sheddable": "maybe"})


def test_retry_after_is_the_shortest_queue_rounded_up_and_bounded() -> None:
    assert retry_after([3.2, 0.4]) == 1
    assert retry_after([7.1, 9.0]) == 8
    assert retry_after([1e6]) == MAX_RETRY_AFTER_S


def _load(router: object, url: str, tokens: int) -> None:
    """A request of `tokens` prompt tokens still prefilling there: queue ahead of the next."""
    replica = router.replicas[url]  # type: ignore[attr-defined]
    replica.begin(
        InFlight(
            prompt_tokens=tokens,
            uncached_tokens=tokens,
            output_tokens=10,
            streaming=True,
            started_at=0,
            predicted_ttft=1.0,
            predicted_completion=1.0,
        ),
        (),
    )


def test_a_target_the_policys_choice_misses_moves_the_request_to_a_replica_that_meets_it(
    make_router: MakeRouter,
) -> None:
    router = make_router("round-robin", urls=URLS[:2])
    _load(router, URLS[0], 20_000)  # 2 s of prefill queued at 10k tokens/s
    # Round-robin's first choice is URLS[0]; a 500 ms TTFT target cannot be met there.
    pick = router.pick(request([1, 2, 3]), slo=Slo(ttft_s=0.5))
    assert pick is not None and pick.replica.url == URLS[1]
    assert router.metrics.slo_redirects._value.get() == 1
    # Without targets, the policy's choice stands.
    router2 = make_router("round-robin", urls=URLS[:2])
    _load(router2, URLS[0], 20_000)
    first = router2.pick(request([1, 2, 3]))
    assert first is not None and first.replica.url == URLS[0]


def test_no_replica_meets_the_target_a_sheddable_request_is_refused_another_is_served(
    make_router: MakeRouter,
) -> None:
    router = make_router("round-robin", urls=URLS[:2])
    for url in URLS[:2]:
        _load(router, url, 30_000)  # 3 s queued at each
    with pytest.raises(Shed) as shed:
        router.pick(request([1, 2, 3]), slo=Slo(ttft_s=0.5, sheddable=True))
    assert shed.value.retry_after_s == 3  # the shorter queue, rounded up
    assert "predicted TTFT" in shed.value.message
    # Nothing was accounted for the refused request.
    assert all(len(router.replicas[u].inflight) == 1 for u in URLS[:2])
    pick = router.pick(request([1, 2, 3]), slo=Slo(ttft_s=0.5))
    # Best effort: the policy's choice (round-robin's second, the refused request having taken the first).
    assert pick is not None and pick.replica.url == URLS[1]
    assert router.metrics.slo_best_effort._value.get() == 1


def test_a_tpot_target_is_judged_per_output_token(make_router: MakeRouter) -> None:
    router = make_router("round-robin", urls=URLS[:1])
    # The stand-in TPOT is 10 ms: a 5 ms target cannot be met, a 50 ms one can.
    with pytest.raises(Shed):
        router.pick(request([1, 2, 3], output_tokens=100), slo=Slo(tpot_s=0.005, sheddable=True))
    assert router.pick(request([1, 2, 3], output_tokens=100), slo=Slo(tpot_s=0.05, sheddable=True))


async def test_the_http_proxy_sheds_with_429_and_retry_after_and_rejects_bad_headers() -> None:
    fleet = FakeFleet()
    router = make_router(fleet, URLS[:1])
    await router.probe_all()
    app = build_app(router, PromptReader(ByteTokenizer(), 16, 64))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        shed = await c.post(
            "/v1/completions",
            content=body("x" * 4000, max_tokens=4),
            headers={"x-slo-ttft-ms": "0.001", "x-sheddable": "true"},
        )
        assert shed.status_code == 429
        assert int(shed.headers["retry-after"]) >= 1
        assert shed.json()["error"]["type"] == "rate_limit_exceeded"
        assert shed.json()["error"]["code"] == "slo_unattainable"
        bad = await c.post("/v1/completions", content=body(), headers={"x-slo-tpot-ms": "soon"})
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_request_error"
        assert "x-slo-tpot-ms" in bad.json()["error"]["message"]
        served = await c.post("/v1/completions", content=body(), headers={"x-slo-ttft-ms": "0.001"})
        assert served.status_code == 200  # not sheddable: sent to the best replica anyway
    assert fleet.served() == [URLS[0]]
    assert not router.replicas[URLS[0]].inflight
