"""One client cannot wedge a replica: a request no amount of waiting could admit is a 400 naming what to lower,
answered at once, and the scheduler's watchdog turns a request that still cannot progress into a 500, not a
hang; either way the next request is served."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.harness import MODEL, LiveServer, start_server
from tests.server.test_metrics import samples


@pytest.fixture(scope="module")
def small_cache() -> Iterator[LiveServer]:
    # 64 blocks of 16 tokens, as `chunkwise serve --model tiny --num-blocks 64 --max-model-len 512`.
    server = start_server({"num_blocks": 64, "max_model_len": 512})
    yield server
    server.stop()


@pytest.fixture
def client(small_cache: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=small_cache.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def served(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="next", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_family_past_the_whole_cache_is_a_400_naming_n_at_once(client: openai.OpenAI, stream: bool) -> None:
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        r = client.completions.create(
            model=MODEL, prompt="hello", n=4, max_tokens=400, temperature=0.8, stream=stream
        )
        if stream:
            list(r)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 5
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "n"
    assert err["message"].startswith("n (4) and max_tokens (400) need 104 KV blocks")
    assert (
        "KV cache holds 64 blocks; it would fit with max_tokens at most 250 or n at most 2" in err["message"]
    )
    served(client)


def test_what_the_400_names_is_served(client: openai.OpenAI) -> None:
    for n, max_tokens in ((4, 250), (2, 400)):
        r = client.completions.create(
            model=MODEL,
            prompt="hello",
            n=n,
            max_tokens=max_tokens,
            temperature=0.8,
            extra_body={"ignore_eos": True},
        )
        assert [c.finish_reason for c in r.choices] == ["length"] * n
        assert r.usage is not None and r.usage.completion_tokens == n * max_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_watchdog_fails_is_a_500_and_counted(
    small_cache: LiveServer, client: openai.OpenAI, stream: bool
) -> None:
    pool = small_cache.engine.core.kv.pool
    before = samples(httpx.get(f"{small_cache.url}/metrics").text)
    # Between steps (nothing in flight): blocks no request holds, as a bug elsewhere would leave them.
    assert small_cache.engine.num_unfinished == 0
    leaked = pool.allocate(pool.num_free - 1)
    try:
        if stream:
            with pytest.raises(openai.APIError) as e:
                list(client.completions.create(model=MODEL, prompt="x" * 40, max_tokens=2, stream=True))
        else:
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model=MODEL, prompt="x" * 40, max_tokens=2)
        assert "no progress" in str(e.value)
        served(client)  # one block is enough for it
    finally:
        pool.free(leaked)
    after = samples(httpx.get(f"{small_cache.url}/metrics").text)
    stalled = "chunkwise:stalled_requests_total"
    assert sum(after[stalled].values()) - sum(before[stalled].values()) == 1
    errors = {
        k: v for k, v in after["vllm:request_success_total"].items() if ("finished_reason", "error") in k
    }
    assert sum(errors.values()) >= 1
    served(client)
