"""Priorities and fair shares through the official openai client against a real server (tiny model)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import MODEL, LiveServer, start_server, wait_for


async def finish_times(
    server: LiveServer,
    first: list[dict[str, object]],
    queued: int,
    late: dict[str, object],
) -> tuple[list[float], float]:
    """Send `first` at once, wait until `queued` of them wait in the engine, then send `late`. Returns when
    each of `first` finished and when `late` did."""
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:

        async def one(kwargs: dict[str, object]) -> float:
            kw = dict(kwargs)
            body: dict[str, object] = {"ignore_eos": True}
            if "priority" in kw:
                body["priority"] = kw.pop("priority")
            await c.completions.create(model=MODEL, prompt="hello there", extra_body=body, **kw)  # type: ignore[call-overload]
            return time.monotonic()

        early = [asyncio.create_task(one(kw)) for kw in first]
        await asyncio.to_thread(wait_for, lambda: server.engine.scheduler_stats().num_waiting >= queued, 30)
        late_t = await one(late)
        return list(await asyncio.gather(*early)), late_t


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_a_high_priority_request_behind_queued_low_ones_finishes_first_only_under_priority(
    policy: str,
) -> None:
    server = start_server({"max_num_seqs": 1, "scheduling_policy": policy}, max_waiting=64)
    try:
        # Long enough that the first is still running when the last of them queues, even on a loaded machine.
        low: dict[str, object] = {"max_tokens": 120, "priority": 5}
        high: dict[str, object] = {"max_tokens": 4, "priority": 0}
        if policy == "fcfs":
            low = {"max_tokens": 120}
            high = {"max_tokens": 4}
        lows, high_t = await finish_times(server, [low] * 4, 3, high)
        queued_lows = sorted(lows)[1:]  # the first one was running when "high" arrived
        if policy == "priority":
            assert high_t < min(queued_lows)
        else:
            assert high_t > max(lows)
    finally:
        server.stop()


def test_fcfs_refuses_a_priority_with_400_naming_the_flag(live: LiveServer) -> None:
    with openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority") as refused:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": 2})
        assert refused.value.param == "priority"
        with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={"priority": -1},
            )
        with pytest.raises(openai.BadRequestError, match="priority"):
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": "high"})
        # 0 is every request's priority under fcfs: accepted.
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": 0})


@pytest.mark.parametrize("fairness", ["none", "vtc"])
async def test_a_tenant_behind_another_tenants_burst_is_served_next_only_with_vtc(fairness: str) -> None:
    server = start_server({"max_num_seqs": 1, "fairness": fairness}, max_waiting=64, tenant_header="x-org")
    try:
        burst: dict[str, object] = {"max_tokens": 64, "extra_headers": {"x-org": "acme"}}
        # The other tenant names itself by OpenAI's `user` field: the fallback when the header is absent.
        other: dict[str, object] = {"max_tokens": 24, "user": "globex"}
        bursts, other_t = await finish_times(server, [burst] * 6, 5, other)
        after = sum(1 for t in bursts if t > other_t)
        if fairness == "vtc":
            assert after >= 3, (bursts, other_t)
        else:
            assert after == 0
    finally:
        server.stop()


async def test_per_priority_metrics() -> None:
    server = start_server({"max_num_seqs": 1, "scheduling_policy": "priority"}, max_waiting=64)
    try:
        low: dict[str, object] = {"max_tokens": 80, "priority": 7}
        high: dict[str, object] = {"max_tokens": 2, "priority": 1}
        await finish_times(server, [low] * 2, 1, high)
        text = httpx.get(server.url + "/metrics").text
        samples = {
            (s.name, s.labels.get("priority")): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        assert samples[("chunkwise:time_to_first_token_by_priority_seconds_count", "7")] == 2
        assert samples[("chunkwise:time_to_first_token_by_priority_seconds_count", "1")] == 1
        assert samples[("chunkwise:request_queue_time_by_priority_seconds_count", "1")] == 1
        assert ("chunkwise:priority_preemptions_total", None) in samples
        assert ("chunkwise:num_requests_queued_by_priority", "7") not in samples  # nothing queued now
    finally:
        server.stop()


async def test_the_tenant_is_the_configured_header_else_the_user_field() -> None:
    server = start_server({"max_num_seqs": 1, "fairness": "vtc"}, max_waiting=64, tenant_header="x-org")
    try:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0, timeout=60
        ) as c:
            sent = {
                "header-and-user": {"extra_headers": {"x-org": "acme"}, "user": "someone"},
                "user-only": {"user": "globex"},
                "other-header": {"extra_headers": {"x-tenant-id": "ignored"}},
            }
            tasks = [
                asyncio.create_task(
                    c.completions.create(
                        model=MODEL,
                        prompt=name,
                        max_tokens=120,
                        extra_body={"ignore_eos": True},
                        **kw,  # type: ignore[arg-type]
                    )
                )
                for name, kw in sent.items()
            ]
            engine = server.engine
            await asyncio.to_thread(wait_for, lambda: len(engine.core.scheduler.requests) == 3, 30)
            tenants = sorted(str(r.tenant) for r in list(engine.core.scheduler.requests.values()))
            await asyncio.gather(*tasks)
        assert tenants == ["None", "acme", "globex"]
    finally:
        server.stop()


async def test_a_full_queue_refuses_the_low_band_and_still_takes_a_better_one() -> None:
    server = start_server({"max_num_seqs": 1, "scheduling_policy": "priority"}, max_waiting=2)
    try:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0, timeout=60
        ) as c:

            def create(priority: int, max_tokens: int):  # type: ignore[no-untyped-def]
                return c.completions.create(
                    model=MODEL,
                    prompt="fill",
                    max_tokens=max_tokens,
                    extra_body={"ignore_eos": True, "priority": priority},
                )

            stats = server.engine.scheduler_stats
            held = [asyncio.create_task(create(5, 60))]
            await asyncio.to_thread(wait_for, lambda: stats().num_running == 1, 30)
            held += [asyncio.create_task(create(5, 40)) for _ in range(2)]  # both wait: the queue is full
            await asyncio.to_thread(wait_for, lambda: stats().num_waiting == 2, 30)
            with pytest.raises(openai.RateLimitError, match="queue is full"):
                await create(5, 2)
            # Nothing of its band or better is queued: the full queue is all behind it.
            better = await create(0, 2)
            assert better.choices[0].finish_reason == "length"
            await asyncio.gather(*held)
    finally:
        server.stop()
