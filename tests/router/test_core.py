"""The replica set, probes and ejection, with replicas faked at the HTTP transport."""

from __future__ import annotations

from .conftest import URLS, Clock
from .fake_replicas import FakeFleet, make_router


async def test_probe_marks_healthy_and_reads_metrics() -> None:
    fleet = FakeFleet()
    router = make_router(fleet, URLS[:2])
    assert not router.ready()  # nothing probed yet
    await router.probe_all()
    assert router.ready()
    assert all(r.healthy and r.scrape is not None for r in router.replicas.values())


async def test_unreachable_replica_is_ejected_and_retried_with_backoff() -> None:
    clock = Clock()
    fleet = FakeFleet(down={URLS[0]})
    router = make_router(fleet, URLS[:2], clock=clock)
    await router.probe_all()
    down = router.replicas[URLS[0]]
    assert [r.url for r in router.candidates(clock.now)] == [URLS[1]]
    assert down.backoff == 0.5
    # When its backoff ends it is probed again (requests still avoid it until a probe succeeds); still
    # down, so ejected again for twice as long.
    clock.now += 0.6
    assert not down.ejected(clock.now) and not down.candidate(clock.now)
    await router.probe_all()
    assert (down.healthy, down.backoff) == (False, 1.0)
    # Back up: one successful probe readmits it and forgets the backoff.
    fleet.down.clear()
    clock.now += 1.1
    await router.probe_all()
    assert (down.healthy, down.backoff) == (True, 0.0)
    assert len(router.candidates(clock.now)) == 2
    assert router.metrics.ejections.labels(URLS[0], "ConnectError")._value.get() == 1.0


async def test_loading_replica_is_asked_again_every_poll_interval() -> None:
    clock = Clock()
    fleet = FakeFleet(health={URLS[0]: 503})
    router = make_router(fleet, URLS[:2], clock=clock)
    for _ in range(4):
        await router.probe_all()
        clock.now += 0.5
    loading = router.replicas[URLS[0]]
    # Alive but not ready: no growing backoff, so it joins as soon as it is ready.
    assert (loading.healthy, loading.backoff) == (False, 0.5)
    fleet.health.clear()
    await router.probe_all()
    assert loading.candidate(clock.now)


async def test_discovery_updates_keep_busy_replicas_until_their_requests_finish() -> None:
    from .conftest import request

    router = make_router(FakeFleet(), URLS)
    await router.probe_all()
    pick = router.pick(request([1, 2, 3]))
    assert pick is not None
    leaving = pick.replica.url
    router.set_replicas([u for u in URLS if u != leaving])
    # No longer a candidate, but its request in flight is still accounted for.
    assert leaving not in [r.url for r in router.candidates(router.clock())]
    assert leaving in router.replicas
    router.finish(pick)
    assert leaving not in router.replicas
    # URLs are normalised: a trailing slash or a missing scheme is the same replica.
    router.set_replicas([u + "/" for u in URLS])
    assert sorted(router.replicas) == URLS
    router.set_replicas(["127.0.0.9:8000"])
    assert list(router.replicas) == ["http://127.0.0.9:8000"]
