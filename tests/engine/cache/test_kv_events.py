"""KV-cache events: applied in order they reproduce the engine's prefix cache exactly, step after step,
under eviction pressure, preemption and aborts; a reader that fell behind is told to resync."""

from __future__ import annotations

import random

from chunkwise.engine import EngineCore
from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.datatypes.sampling_params import SamplingParams


def test_a_step_that_stores_and_drops_a_hash_reports_its_last_state() -> None:
    log = KVEventLog(max_events=2)
    log.record(1, True)
    log.record(2, True)
    log.record(1, False)  # stored and dropped in the same step: dropped
    log.flush()
    log.flush()  # nothing changed: no event
    log.record(1, True)
    log.record(2, False)
    log.flush()
    since = log.since(0)
    assert since is not None and since.seq == 2
    assert [(e.seq, e.stored, e.removed) for e in since.events] == [(1, (2,), (1,)), (2, (1,), (2,))]
    assert set(log.snapshot().hashes) == {1} and log.snapshot().seq == 2
    log.record(3, True)
    log.flush()
    # Only two events are kept: a reader at 0 has missed one and must resync; at 1 it may go on.
    assert log.since(0) is None
    follow = log.since(1)
    assert follow is not None and [e.seq for e in follow.events] == [2, 3]
    assert log.since(4) is None  # ahead of the log: another engine's numbers


def test_events_reproduce_the_cache_exactly_under_pressure() -> None:
    # 40 blocks of 4 tokens for prompts that share prefixes and run to max_model_len: the cache fills,
    # evicts and preempts.
    engine = EngineCore(
        engine_config_from_kwargs(
            "tiny", num_blocks=40, block_size=4, max_model_len=64, max_num_seqs=6, cold_start_output_tokens=1
        )
    )
    log = engine.kv_events
    assert log is not None
    pool = engine.kv.pool
    rng = random.Random(3)
    shared = [[rng.randrange(3, 200) for _ in range(rng.choice([8, 12, 20]))] for _ in range(4)]
    mirror: set[int] = set()
    seq = 0
    removed_seen = 0
    for step in range(150):
        if step < 110 and rng.random() < 0.6:
            prompt = rng.choice(shared) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))]
            # No max_tokens: admission reserves only its estimate (1 token), so decodes outgrow the cache.
            sp = SamplingParams(max_tokens=None, temperature=0.0)
            engine.add_request(f"r{step}", prompt, sp)
        if step % 37 == 5 and engine.scheduler.running:
            engine.abort([rng.choice(engine.scheduler.running).request_id])
        if engine.has_unfinished():
            engine.step()
        since = log.since(seq)
        assert since is not None
        for event in since.events:
            mirror.update(event.stored)
            mirror.difference_update(event.removed)
            removed_seen += len(event.removed)
        seq = since.seq
        assert mirror == set(pool._cached), step
        assert set(log.snapshot().hashes) == mirror
    assert pool.num_evictions > 0 and removed_seen > 0
    assert engine.stats.num_preemptions_recompute + engine.stats.num_preemptions_swap > 0


def test_no_events_with_a_zero_buffer() -> None:
    assert EngineCore(engine_config_from_kwargs("tiny", kv_events_buffer=0)).kv_events is None
