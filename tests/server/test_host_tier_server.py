"""The prefix cache's host tier over a real server (--kv-offloading-size), through the official openai client:
a prompt evicted from a small device cache comes back with usage.prompt_tokens_details.cached_tokens from the
host tier; /v1/kv_events says where its blocks went (medium cpu), and /metrics counts the tier's work."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from chunkwise.engine.cache.events import hash_hex
from chunkwise.engine.cache.hashing import hash_prefix_blocks
from tests.server.harness import MODEL, LiveServer, start_server, wait_for
from tests.server.test_metrics import samples

PROMPT = "a long system prompt the agent sends every time!"  # 48 bytes: 12 blocks of 4
OTHERS = [f"#{i} is another user's prompt, none shares a block" for i in range(3)]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = start_server(
        {"num_blocks": 24, "block_size": 4, "max_model_len": 64, "kv_offloading_size": 0.001, "seed": 0}
    )
    yield live
    live.stop()


def complete(client: OpenAI, live: LiveServer, prompt: str) -> int:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0)
    wait_for(lambda: not live.engine.core.has_unfinished())
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


def test_an_evicted_prompt_is_served_from_the_host_tier(server: LiveServer) -> None:
    client = OpenAI(base_url=server.base_url, api_key="none")
    after = httpx.get(f"{server.url}/v1/kv_events/snapshot").json()["seq"]
    assert complete(client, server, PROMPT) == 0
    for other in OTHERS:  # more blocks than the device cache holds: the prompt's are evicted
        complete(client, server, other)
    ids = server.engine.tokenizer.encode(PROMPT)
    hashes = [hash_hex(h) for h in hash_prefix_blocks(ids, 4)]
    assert not set(hashes) & set(map(hash_hex, server.engine.core.kv.pool._cached))
    # Its blocks left the device for host memory, and the events say so.
    events = httpx.get(f"{server.url}/v1/kv_events", params={"after": after}).json()["events"]
    on_host = {h for e in events for h in e["stored_host"]} - {h for e in events for h in e["removed_host"]}
    assert set(hashes) <= on_host
    snapshot = httpx.get(f"{server.url}/v1/kv_events/snapshot").json()
    assert set(hashes) <= set(snapshot["host_hashes"]) and not set(hashes) & set(snapshot["hashes"])
    # Asked again: every full block but the one holding the last token comes back from the host tier.
    cached = complete(client, server, PROMPT)
    assert cached == (len(ids) - 1) // 4 * 4 > 0
    metrics = samples(httpx.get(f"{server.url}/metrics").text)
    label = (("model_name", MODEL),)
    assert metrics["chunkwise:host_prefix_cache_hits_total"][label] == cached
    assert metrics["chunkwise:host_prefix_cache_restored_blocks_total"][label] == cached // 4
    assert metrics["chunkwise:host_prefix_cache_offloaded_blocks_total"][label] > 0
    assert 0 < metrics["chunkwise:host_prefix_cache_usage_perc"][label] <= 1
