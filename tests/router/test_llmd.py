"""The llm-d-style baseline: each scorer, the approximate prefix index and their combination, against values
worked out by hand from llm-d's formulas (router/llmd.py cites where each comes from)."""

from __future__ import annotations

from collections import Counter

import pytest

from chunkwise.router.args import POLICY_NAMES
from chunkwise.router.cost import CostModel
from chunkwise.router.estimates import MetricsSample
from chunkwise.router.llmd import (
    DEFAULT_LRU_CAPACITY_PER_SERVER,
    DEFAULT_WEIGHTS,
    ApproxPrefixIndex,
    LlmD,
    clamp,
    kv_cache_utilization_scores,
    prefix_scores,
    prompt_blocks,
    queue_scores,
)
from chunkwise.router.policies import BASELINES, POLICIES, make_policy
from chunkwise.router.replica import Replica

from .conftest import BLOCK, URLS, MakeRouter, request

PROMPT = list(range(1, 70))  # 69 tokens: 4 full blocks of 16


def replica(url: str, waiting: float = 0, kv: float = 0.0, blocks: int | None = 1000) -> Replica:
    r = Replica(url, 1000)
    r.observe(MetricsSample(time=0, waiting=waiting, kv_usage=kv, cache_blocks=blocks), now=0.0)
    return r


def test_registered_as_a_baseline_with_llm_d_default_weights() -> None:
    policy = make_policy("llm-d", CostModel(BLOCK))
    assert isinstance(policy, LlmD) and policy.name == "llm-d"
    assert policy.weights == DEFAULT_WEIGHTS
    assert DEFAULT_WEIGHTS == {
        "queue-scorer": 2.0,
        "kv-cache-utilization-scorer": 2.0,
        "prefix-cache-scorer": 3.0,
    }
    assert "llm-d" in BASELINES and "llm-d" not in POLICIES
    assert tuple(POLICIES) == POLICY_NAMES  # `chunkwise router --policy` is unchanged


def test_queue_scorer_is_min_max_normalised_shortest_best() -> None:
    assert queue_scores([3, 1, 0, 1]) == pytest.approx([0.0, 2 / 3, 1.0, 2 / 3])
    assert queue_scores([5, 9]) == [1.0, 0.0]
    assert queue_scores([2, 2, 2]) == [1.0, 1.0, 1.0]  # all equal: neutral
    assert queue_scores([7]) == [1.0]


def test_kv_cache_utilization_scorer_is_one_minus_usage() -> None:
    assert kv_cache_utilization_scores([0.25, 0.9, 0.0]) == pytest.approx([0.75, 0.1, 1.0])
    # A score outside [0, 1] counts clamped (enforceScoreRange).
    assert [clamp(s) for s in kv_cache_utilization_scores([1.25, -0.5])] == [0.0, 1.0]


def test_prefix_scorer_is_the_matched_fraction_of_the_prompt_blocks() -> None:
    assert prefix_scores([3, 0, 1], 4) == [0.75, 0.0, 0.25]
    assert prefix_scores([0, 0], 0) == [0.0, 0.0]  # a prompt without one full block scores 0 everywhere


def test_prompt_blocks_group_kv_blocks_and_stop_at_the_cap() -> None:
    hashes = list(range(100, 110))
    assert prompt_blocks(hashes) == hashes
    # Four KV blocks to one llm-d block: the chained hash of each group's last block stands for it.
    assert prompt_blocks(hashes, blocks_per_chunk=4) == [103, 107]
    assert prompt_blocks(hashes, max_blocks=3) == [100, 101, 102]
    assert prompt_blocks(list(range(300))) == list(range(256))  # defaultMaxPrefixBlocks


def test_index_matches_the_longest_prefix_any_server_holds() -> None:
    index = ApproxPrefixIndex()
    index.add([1, 2, 3], "a", 10)
    index.add([1, 9], "b", 10)
    assert index.match_longest_prefix([1, 2, 3]) == {"a": 3, "b": 1}
    assert index.match_longest_prefix([1, 9, 4]) == {"a": 1, "b": 2}
    assert index.match_longest_prefix([7, 1, 2]) == {}  # the walk stops at the first hash no one holds
    # llm-d's walk goes on while *any* server holds the hash: "c" is credited for 3 though it lacks 2.
    index.add([1, 3], "c", 10)
    assert index.match_longest_prefix([1, 2, 3]) == {"a": 3, "b": 1, "c": 2}


def test_index_lru_evicts_in_prompt_order_root_first() -> None:
    index = ApproxPrefixIndex()
    index.add([1, 2, 3], "a", 3)
    index.add([4], "a", 3)  # the oldest entry is the prompt's first block
    assert index.held("a") == [2, 3, 4]
    assert index.get(1) == set()
    assert index.match_longest_prefix([1, 2, 3]) == {}  # without its root the prompt matches nothing
    index.add([2], "a", 3)  # a hash already held moves to the front
    index.add([5], "a", 3)
    assert index.held("a") == [4, 2, 5]
    assert index.get(3) == set()


def test_index_capacity_is_set_when_a_server_is_first_seen() -> None:
    index = ApproxPrefixIndex()
    index.add([1], "a", 2)
    index.add([2, 3, 4], "a", 100)  # later capacities are ignored, as the Go LRU is made once
    assert index.capacity("a") == 2 and index.held("a") == [3, 4]
    index.add([1], "b", 0)
    assert index.capacity("b") == DEFAULT_LRU_CAPACITY_PER_SERVER
    # A prompt longer than the LRU: the reverse map is written after the LRU, so it keeps the evicted hash.
    index.add([7, 8, 9], "c", 2)
    assert index.held("c") == [8, 9] and index.get(7) == {"c"}


def test_weighted_total_and_max_score_pick() -> None:
    policy = LlmD(CostModel(BLOCK))
    a = replica(URLS[0], waiting=4, kv=0.5)
    b = replica(URLS[1], waiting=0, kv=0.2)
    c = replica(URLS[2], waiting=2, kv=0.9)
    req = request(PROMPT)
    blocks = policy.blocks(req)
    assert len(blocks) == 4
    policy.index.add(blocks, a.url, 1000)
    policy.index.add(blocks[:1], c.url, 1000)
    scores = policy.score(req, [a, b, c])
    # queue: (4-w)/4; KV: 1-usage; prefix: matched/4; total = 2q + 2kv + 3p.
    assert [s.queue for s in scores] == [0.0, 1.0, 0.5]
    assert [s.kv_cache_utilization for s in scores] == pytest.approx([0.5, 0.8, 0.1])
    assert [s.prefix for s in scores] == [1.0, 0.0, 0.25]
    assert [s.total for s in scores] == pytest.approx([4.0, 3.6, 1.95])
    assert policy.choose(req, [a, b, c], 0.0) is a

    # A fuller KV cache at a: 0 + 2*0.2 + 3 = 3.4 < 3.6, so b, and b's LRU now holds the prompt too.
    a.observe(MetricsSample(time=1, waiting=4, kv_usage=0.8, cache_blocks=1000), now=1.0)
    assert policy.choose(req, [a, b, c], 1.0) is b
    assert policy.index.held(b.url) == blocks
    assert [s.total for s in policy.score(req, [a, b, c])] == pytest.approx([3.4, 6.6, 1.95])


def test_pick_records_the_prompt_with_the_chosen_servers_capacity() -> None:
    policy = LlmD(CostModel(BLOCK), blocks_per_chunk=4)
    r = replica(URLS[0], blocks=50)
    req = request(list(range(1, 130)))  # 129 tokens: 8 full KV blocks, 2 llm-d blocks
    assert policy.choose(req, [r], 0.0) is r
    assert policy.index.held(r.url) == [req.block_hashes[3], req.block_hashes[7]]
    assert policy.index.capacity(r.url) == 50
    unscraped = Replica(URLS[1], 1000)
    policy.choose(req, [unscraped], 0.0)
    assert policy.index.capacity(unscraped.url) == DEFAULT_LRU_CAPACITY_PER_SERVER


def test_ties_are_broken_at_random() -> None:
    policy = LlmD(CostModel(BLOCK), seed=3)
    cands = [replica(u, waiting=1, kv=0.3) for u in URLS]
    short = request([1, 2, 3])  # no full block: prefix 0 everywhere, every total equal
    chosen = Counter(policy.choose(short, cands, 0.0).url for _ in range(60))
    assert set(chosen) == set(URLS) and min(chosen.values()) >= 10


def test_in_the_router_a_burst_with_one_prefix_herds_to_one_replica(make_router: MakeRouter) -> None:
    # llm-d's default scorers read the scrape and its own index only, not the requests in flight: until
    # the next scrape shows a queue, every request with the prefix goes where the first one went.
    router = make_router("llm-d")
    for r in router.replicas.values():
        r.observe(MetricsSample(time=0, cache_blocks=1000), now=router.clock())
    urls = []
    for i in range(6):
        pick = router.pick(request([*PROMPT, 500 + i]))
        assert pick is not None
        urls.append(pick.replica.url)
    assert len(set(urls)) == 1
    # The scrape catches up: its queue and KV usage send the next request elsewhere (2 + 2 > 0 + 2 * 0.4 + 3).
    busy = router.replicas[urls[0]]
    busy.observe(MetricsSample(time=1, waiting=3, kv_usage=0.6, cache_blocks=1000), now=router.clock())
    pick = router.pick(request([*PROMPT, 999]))
    assert pick is not None and pick.replica.url != urls[0]
