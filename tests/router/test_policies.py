"""Policies and the cost model: exact picks on hand-set replica state."""

from __future__ import annotations

from collections import Counter

import pytest

from chunkwise.engine.cache.hashing import block_extra, hash_prefix_blocks
from chunkwise.router.args import POLICY_NAMES
from chunkwise.router.cost import DEFAULT_LORA_LOAD_S, CostModel, Defaults
from chunkwise.router.estimates import MetricsSample
from chunkwise.router.policies import POLICIES, make_policy
from chunkwise.router.prompt import RoutedRequest
from chunkwise.router.replica import Replica

from .conftest import BLOCK, URLS, Clock, MakeRouter, request

SYSTEM = list(range(1, 993))  # 992 tokens: 62 full blocks


def picks(router: object, n: int, tokens: list[int], **kw: object) -> list[str]:
    out = []
    for i in range(n):
        p = router.pick(request([*tokens, 1000 + i], **kw))  # type: ignore[attr-defined]
        assert p is not None
        out.append(p.replica.url)
    return out


def test_policy_names_match_the_flags() -> None:
    assert tuple(POLICIES) == POLICY_NAMES
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random", CostModel(BLOCK))


def test_round_robin_cycles_in_url_order(make_router: MakeRouter) -> None:
    router = make_router("round-robin")
    assert picks(router, 6, [1, 2, 3]) == URLS + URLS


def test_least_loaded_spreads_a_burst_by_its_own_accounting(make_router: MakeRouter) -> None:
    router = make_router("least-loaded")
    # Nothing finishes in between: without accounting at pick time all six would go to one replica.
    assert Counter(picks(router, 6, [5])) == {u: 2 for u in URLS}


def test_least_loaded_counts_other_routers_traffic_from_the_scrape(make_router: MakeRouter) -> None:
    router = make_router("least-loaded")
    busy = router.replicas[URLS[0]]
    busy.observe(MetricsSample(time=0, waiting=3, running=2), now=router.clock())
    assert Counter(picks(router, 4, [5])) == {URLS[1]: 2, URLS[2]: 2}


def test_prefix_affinity_follows_the_prefix_whatever_the_load(make_router: MakeRouter) -> None:
    router = make_router("prefix-affinity")
    first = picks(router, 1, SYSTEM)[0]
    # Every later request with the same system prompt goes there, however many are in flight.
    assert set(picks(router, 5, SYSTEM)) == {first}
    # A prompt without that prefix goes to the least loaded of the others.
    assert picks(router, 1, [7] * 100)[0] != first


def test_cost_model_is_the_seed_formula(make_router: MakeRouter) -> None:
    router = make_router()
    r = router.replicas[URLS[0]]
    r.observe(MetricsSample(time=0, running=0), now=router.clock())
    r.estimates.prefill_rate = 20_000.0
    r.estimates.tpot = 0.005
    r.index.insert(request(SYSTEM).block_hashes)
    req = request([*SYSTEM, *range(2000, 2010)], output_tokens=40)  # 1002 tokens, 992 cached
    p = router.cost.predict(r, req, router.clock())
    assert p.cached_tokens == 992
    assert p.queue_s == 0.0
    assert p.prefill_s == pytest.approx(10 / 20_000)
    # One decode row (itself) against the measurement's zero rows: one token's marginal cost more.
    assert p.decode_s == pytest.approx(40 * (0.005 + 1 / 20_000))
    assert p.completion == pytest.approx(p.prefill_s + p.decode_s)
    # A full hit still computes the last token, as the engine does.
    assert router.cost.cached_tokens(r, request(SYSTEM)) == len(SYSTEM) - 1


def test_unmeasured_replicas_borrow_the_fleet_average(make_router: MakeRouter) -> None:
    router = make_router()
    a, b, c = (router.replicas[u] for u in URLS)
    assert router.cost.prefill_rate(a) == 10_000.0  # the defaults
    b.estimates.prefill_rate, c.estimates.prefill_rate = 4000.0, 6000.0
    b.estimates.tpot = 0.03
    assert router.cost.prefill_rate(a) == 5000.0
    assert router.cost.tpot(a) == 0.03
    assert router.cost.prefill_rate(b) == 4000.0


def test_predicted_completion_prefers_the_cache_while_queues_are_comparable(make_router: MakeRouter) -> None:
    router = make_router()
    first = router.pick(request(SYSTEM))
    assert first is not None
    home = first.replica.url
    router.finish(first)
    # Requests arriving one at a time, each done before the next: every one goes home for the hit.
    for i in range(5):
        p = router.pick(request([*SYSTEM, 3000 + i]))
        assert p is not None and p.replica.url == home and p.prediction.cached_tokens == 992
        router.first_token(p)
        router.finish(p)


def test_predicted_completion_abandons_a_saturated_cache_holder(make_router: MakeRouter) -> None:
    router = make_router()
    home_url = picks(router, 1, SYSTEM)[0]
    home = router.replicas[home_url]
    # The first request is still prefilling its 993 tokens. At 10k tokens/s that queue (0.1 s) equals the
    # cache's advantage: the next same-prefix requests queue behind it until another replica is cheaper.
    urls = picks(router, 8, SYSTEM)
    assert urls.count(home_url) < len(urls)
    assert home.load(router.clock()).prefilling >= 1
    spread = Counter(urls)
    assert len(spread) == len(URLS)


def test_predicted_completion_counts_other_routers_queue(make_router: MakeRouter) -> None:
    router = make_router()
    a = router.replicas[URLS[0]]
    a.index.insert(request(SYSTEM).block_hashes)
    # Another router has 50 requests waiting at `a` (at the mean prompt size, 100 tokens: 0.5 s of queue).
    a.observe(MetricsSample(time=0, waiting=50), now=router.clock())
    p = router.pick(request([*SYSTEM, 1]))
    assert p is not None and p.replica is not a


def test_non_streaming_request_leaves_prefill_when_its_predicted_ttft_passes(make_router: MakeRouter) -> None:
    clock = Clock()
    router = make_router(clock=clock)
    p = router.pick(request(list(range(3000)), stream=False))
    assert p is not None
    assert p.replica.load(clock.now).pending_prefill_tokens == 3000
    clock.now += p.prediction.ttft + 0.001
    assert p.replica.load(clock.now).pending_prefill_tokens == 0
    assert p.replica.load(clock.now).decoding == 1
    router.finish(p)
    assert p.replica.load(clock.now).inflight == 0


def test_streaming_request_leaves_prefill_at_its_first_token(make_router: MakeRouter) -> None:
    clock = Clock()
    router = make_router(clock=clock)
    p = router.pick(request(list(range(3000)), stream=True))
    assert p is not None
    clock.now += 100  # long past the prediction: a stream's first token is seen, not guessed
    assert p.replica.load(clock.now).prefilling == 1
    router.first_token(p)
    assert p.replica.load(clock.now).prefilling == 0


def test_scrape_counts_only_other_routers_requests_as_others() -> None:
    r = Replica("http://x", 100)
    clock = Clock()
    cost = CostModel(BLOCK, Defaults())
    from chunkwise.router.replica import InFlight

    own = InFlight(10, 10, 5, True, clock.now, 1.0, 2.0)
    r.begin(own, ())
    r.observe(MetricsSample(time=0, waiting=4, running=2), now=clock.now)
    assert r.others() == (3.0, 2.0)  # one of the 4 waiting is the router's own, still prefilling
    assert cost.prefill_rate(r) == Defaults().prefill_rate


def test_predicted_completion_waits_for_a_slot_when_the_batch_is_full(make_router: MakeRouter) -> None:
    router = make_router()
    a, b = router.replicas[URLS[0]], router.replicas[URLS[1]]
    # A scrape that caught `a` with 2 running and 1 waiting: it runs 2 at a time (its max_num_seqs).
    a.observe(MetricsSample(time=0, running=2, waiting=1), now=router.clock())
    assert (a.slots, router.cost.slots(b)) == (2, 2)  # the fleet shares what one replica showed
    a.index.insert(request(SYSTEM).block_hashes)
    idle = router.cost.predict(b, request([*SYSTEM, 1]), router.clock())
    full = router.cost.predict(a, request([*SYSTEM, 1]), router.clock())
    # `a` has the prefix cached but three requests ahead and two slots: two must finish first.
    service = router.cost.mean_prompt_tokens / 10_000 + router.cost.mean_output_tokens * 0.01
    assert full.queue_s == pytest.approx(2 * service / 2 + 100 / 10_000)
    assert full.completion > idle.completion
    p = router.pick(request([*SYSTEM, 2]))
    assert p is not None and p.replica is not a


def test_a_stale_tpot_drifts_to_the_fleets(make_router: MakeRouter) -> None:
    router = make_router()
    a, b, _ = (router.replicas[u] for u in URLS)
    a.estimates.tpot, b.estimates.tpot = 0.09, 0.01
    assert router.cost.tpot(a) == pytest.approx(0.09)
    # Measured slow once, then idle for two intervals: a quarter of the old measurement is left.
    a.estimates.staleness = 2
    assert router.cost.tpot(a) == pytest.approx(0.25 * 0.09 + 0.75 * 0.05)


def test_a_replica_holding_the_requests_adapter_wins_while_queues_are_comparable(
    make_router: MakeRouter,
) -> None:
    router = make_router(urls=URLS[:2])
    holding, cold = router.replicas[URLS[1]], router.replicas[URLS[0]]
    served = frozenset({"sql", "chat"})
    for r, resident in ((holding, frozenset({"sql"})), (cold, frozenset({"chat"}))):
        r.observe(
            MetricsSample(time=0, model_name="base", lora_adapters=served, lora_resident=resident),
            now=router.clock(),
        )
    req = RoutedRequest(path="/v1/completions", prompt_tokens=50, output_tokens=10, model="sql")
    # Cold: the default load time until some replica has measured one; the holder pays nothing.
    assert router.cost.predict(holding, req, router.clock()).adapter_s == 0.0
    assert router.cost.predict(cold, req, router.clock()).adapter_s == DEFAULT_LORA_LOAD_S
    # The base model and a name no replica serves as an adapter cost nothing to bring in anywhere.
    for model in ("base", None, "gpt-x"):
        plain = RoutedRequest(path="/v1/completions", prompt_tokens=50, output_tokens=10, model=model)
        assert router.cost.predict(cold, plain, router.clock()).adapter_s == 0.0
    # URLS[0] (cold) comes first, so without the adapter's term the tie would go to it.
    assert router.pick(req).replica is holding  # type: ignore[union-attr]
    # A measured fill replaces the default: 0.4 s over two fills since the last scrape.
    cold.observe(
        MetricsSample(
            time=1,
            model_name="base",
            lora_adapters=served,
            lora_resident=served,
            lora_loads=2,
            lora_load_seconds=0.4,
        ),
        now=router.clock(),
    )
    assert cold.estimates.lora_load_s == pytest.approx(0.2)


def test_an_adapters_prompt_is_matched_under_its_own_block_hashes(make_router: MakeRouter) -> None:
    router = make_router()
    r = router.replicas[URLS[0]]
    r.observe(MetricsSample(time=0, model_name="base", lora_adapters=frozenset({"sql"})), now=router.clock())
    adapter_hashes = tuple(hash_prefix_blocks(SYSTEM, BLOCK, block_extra(None, "sql")))
    r.index.insert(adapter_hashes)  # what the engine caches for the adapter's requests
    base = request(SYSTEM)
    as_sql = RoutedRequest(
        path=base.path,
        prompt_tokens=base.prompt_tokens,
        block_hashes=base.block_hashes,
        output_tokens=base.output_tokens,
        model="sql",
        adapter_block_hashes=adapter_hashes,
    )
    assert router.cost.cached_tokens(r, as_sql) == len(SYSTEM) - 1
    assert router.cost.cached_tokens(r, base) == 0  # the base model's blocks of it are not cached there


def _fleet_state(router: object, rng: object) -> None:
    """Hand-set, varied state on every replica: scrapes, learned speed, requests in flight of both kinds."""
    import random

    from chunkwise.router.replica import InFlight

    assert isinstance(rng, random.Random)
    for i, r in enumerate(router.replicas.values()):  # type: ignore[attr-defined]
        r.observe(
            MetricsSample(
                time=0,
                waiting=rng.randint(0, 4),
                running=rng.randint(0, 6),
                kv_usage=rng.random(),
                cache_blocks=64,
            ),
            now=router.clock(),  # type: ignore[attr-defined]
        )
        r.estimates.prefill_rate = rng.choice([None, 4000.0 + 1000 * i])
        r.estimates.tpot = rng.choice([None, 0.01 * (i + 1)])
        for k in range(rng.randint(0, 3)):
            r.begin(InFlight(200, 100 + k, 20, k % 2 == 0, 0.0, 0.5, 1.0), ())


def test_predict_all_is_predict_at_each_replica_and_follows_every_change(make_router: MakeRouter) -> None:
    """predict_all keeps per-replica state between picks (a pick predicts every replica); it must equal
    predict at each replica after whatever changed: a pick, a first token, an end, a scrape, an estimate."""
    import random

    from chunkwise.router.replica import InFlight

    router = make_router()
    rng = random.Random(7)
    _fleet_state(router, rng)
    cands = list(router.replicas.values())
    req = request([*SYSTEM, 5])

    def check() -> None:
        # Against a cost model that has kept nothing: the same fleet and running means, no state.
        fresh = CostModel(BLOCK, router.cost.defaults)
        fresh.bind(router.replicas.values)
        fresh.mean_prompt_tokens = router.cost.mean_prompt_tokens
        fresh.mean_output_tokens = router.cost.mean_output_tokens
        now = router.clock()
        assert router.cost.predict_all(cands, req, now) == [fresh.predict(r, req, now) for r in cands]

    check()
    before = router.cost.predict_all(cands, req, router.clock())
    p = router.pick(req)
    assert p is not None
    check()
    after = router.cost.predict_all(cands, req, router.clock())
    i = cands.index(p.replica)
    assert after[i] != before[i]  # the chosen replica's new request is in its queue now
    router.first_token(p)
    check()
    router.finish(p)
    check()
    cands[0].observe(MetricsSample(time=1, waiting=9, running=9, kv_usage=0.99, cache_blocks=64), now=1.0)
    check()
    cands[1].estimates.tpot = 0.5  # an estimate moved (a scrape, or a test): the fleet's means move too
    check()
    cands[2].begin(InFlight(50, 50, 5, False, router.clock(), 0.2, 0.4), ())  # one on a predicted clock
    check()


def test_a_replica_whose_kv_cache_is_full_predicts_a_wait_for_blocks(make_router: MakeRouter) -> None:
    """The queue term counts waiting for KV blocks: what the cache holds (its last scrape), the prompts sent
    since and this request must fit, or requests ahead must finish first."""
    router = make_router()
    full, empty = router.replicas[URLS[0]], router.replicas[URLS[1]]
    for r, usage in ((full, 0.95), (empty, 0.0)):
        r.observe(MetricsSample(time=0, kv_usage=usage, cache_blocks=64), now=router.clock())
    req = request(list(range(1, 400)), output_tokens=100)  # 499 tokens of 1024 the cache holds
    now = router.clock()
    at_full, at_empty = router.cost.predict(full, req, now), router.cost.predict(empty, req, now)
    assert at_empty.queue_s == 0.0
    assert at_full.queue_s > 0.0
    # 0.95 * 1024 + 499 - 1024 tokens over the cache, at a whole cache's turnover per cache's worth.
    service = router.cost.mean_prompt_tokens / router.cost.prefill_rate(full) + (
        router.cost.mean_output_tokens * at_full.decode_s / 100
    )
    assert at_full.queue_s == pytest.approx((0.95 * 1024 + 499 - 1024) / 1024 * service)


def test_predicted_completion_counts_what_a_miss_delays_at_a_busy_replica(make_router: MakeRouter) -> None:
    """Both replicas hold three requests. At `home` (which caches the system prompt) they are still
    prefilling 1,500 tokens, so the request's own completion is sooner at `away`; but its 1,002-token miss
    there would stall the three requests running at `away` for as long as it prefills, while at `home` it
    computes 10 tokens. The pick adds the least completion time summed over everyone: home."""
    from chunkwise.router.replica import InFlight

    router = make_router(urls=URLS[:2])
    home, away = router.replicas[URLS[0]], router.replicas[URLS[1]]
    home.index.insert(request(SYSTEM).block_hashes)
    now = router.clock()
    for _ in range(3):
        home.begin(InFlight(600, 500, 10, True, now, 0.1, 0.2), ())
        running = InFlight(600, 500, 10, True, now, 0.1, 0.2)
        away.begin(running, ())
        away.first_token(running, now)
    req = request([*SYSTEM, *range(2000, 2010)])
    at_home, at_away = router.cost.predict(home, req, now), router.cost.predict(away, req, now)
    assert at_away.completion < at_home.completion  # on its own completion alone, away wins
    assert at_away.delay_to_others_s == pytest.approx(3 * at_away.prefill_s)
    assert at_home.completion + at_home.delay_to_others_s < at_away.completion + at_away.delay_to_others_s
    p = router.pick(req)
    assert p is not None and p.replica is home
