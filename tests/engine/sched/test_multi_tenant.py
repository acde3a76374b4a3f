"""--scheduling-policy priority and --fairness vtc, the scheduler driven directly (token = 7 every step)."""

from __future__ import annotations

import pytest

from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.sched.fairness import VirtualTokenCounter
from chunkwise.engine.sched.output import QueuedWork, work_ahead_of
from chunkwise.engine.sched.preemption import PreemptionCostModel, PriorityVictims
from chunkwise.engine.sched.queue import OrderedQueue
from chunkwise.engine.sched.scheduler import Scheduler

_clock = [0.0]


def make_sched(num_blocks: int = 64, block_size: int = 4, host_blocks: int = 0, **cfg: object) -> Scheduler:
    cfg.setdefault("max_model_len", 256)
    cfg.setdefault("preemption_mode", "recompute")
    kv = KVCacheManager(num_blocks, block_size, True, host_blocks)
    return Scheduler.from_config(SchedulerConfig(**cfg), kv, PreemptionCostModel(64, 1e9, 1e4))  # type: ignore[arg-type]


def make_req(
    rid: str, prompt_len: int, max_tokens: int, priority: int = 0, tenant: str | None = None, base: int = 1
) -> Request:
    _clock[0] += 1.0
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)
    return Request(
        rid, [base + i for i in range(prompt_len)], sp, _clock[0], max_tokens=max_tokens, tenant=tenant
    )


def run_step(s: Scheduler) -> list[Request]:
    out = s.schedule()
    sampled = {sr.req_id: [7] for sr in out.scheduled if sr.samples}
    return s.update_from_output(out, sampled)


def finish_order(s: Scheduler, max_steps: int = 10_000) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        order += [r.request_id for r in run_step(s) if r.is_finished]
    assert not s.has_unfinished(), "the scheduler did not finish its requests"
    s.kv.pool.check_invariants()
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    return order


# -- priority ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_high_priority_request_behind_queued_low_ones_finishes_before_them_only_under_priority(
    policy: str,
) -> None:
    s = make_sched(max_num_seqs=1, scheduling_policy=policy)
    low = [make_req(f"low{i}", 8, 4, priority=5 if policy == "priority" else 0) for i in range(4)]
    for r in low:
        s.add_request(r)
    run_step(s)  # low0 runs; low1..3 queue
    s.add_request(make_req("high", 8, 4, priority=0))
    order = finish_order(s)
    later = order[order.index("high") + 1 :]
    if policy == "priority":
        # Ahead of every low-priority request still queued when it arrived.
        assert {"low1", "low2", "low3"} <= set(later), order
    else:
        assert order[-1] == "high", order


def test_fcfs_refuses_a_nonzero_priority_by_name() -> None:
    s = make_sched()
    with pytest.raises(ValueError, match="priority 3 needs --scheduling-policy priority"):
        s.add_request(make_req("a", 8, 4, priority=3))
    assert not s.has_unfinished()


def test_a_higher_priority_newcomer_preempts_the_lowest_running_request_for_its_seat() -> None:
    s = make_sched(max_num_seqs=2, scheduling_policy="priority")
    s.add_request(make_req("mid", 8, 50, priority=1))
    s.add_request(make_req("low", 8, 50, priority=9))
    run_step(s)
    assert {r.request_id for r in s.running} == {"mid", "low"}
    s.add_request(make_req("high", 8, 4, priority=0))
    run_step(s)  # "low" gives way (the lowest), "mid" keeps running
    assert s.requests["low"].status is RequestStatus.PREEMPTED
    assert s.requests["mid"].status is RequestStatus.RUNNING
    assert s.stats.num_priority_preemptions == 1
    assert s.stats.preemptions_by_priority == {9: 1}
    run_step(s)
    assert s.requests["high"].status is RequestStatus.RUNNING
    order = finish_order(s)
    assert order.index("high") < order.index("low")


def test_priority_preempts_for_memory_and_not_an_equal_or_better_request() -> None:
    # 16 blocks of 4 tokens: two 24-token prompts with 8 output tokens reserve 8 blocks each.
    s = make_sched(num_blocks=16, scheduling_policy="priority", cold_start_output_tokens=8)
    s.add_request(make_req("a", 24, 8, priority=2, base=100))
    s.add_request(make_req("b", 24, 8, priority=2, base=200))
    run_step(s)
    s.add_request(make_req("equal", 24, 8, priority=2, base=300))
    run_step(s)
    assert s.stats.num_priority_preemptions == 0  # an equal priority waits its turn
    s.add_request(make_req("urgent", 24, 8, priority=1, base=400))
    run_step(s)
    assert s.stats.num_priority_preemptions == 1
    order = finish_order(s)
    assert order.index("urgent") < order.index("equal")


def test_no_preemption_when_even_all_lower_requests_would_not_make_room() -> None:
    # "big" (better priority) holds most of the cache; freeing "small" would not fit the newcomer.
    s = make_sched(num_blocks=20, scheduling_policy="priority", max_model_len=80)
    s.add_request(make_req("big", 56, 8, priority=0, base=100))
    s.add_request(make_req("small", 4, 4, priority=5, base=200))
    run_step(s)
    s.add_request(make_req("new", 40, 8, priority=1, base=300))
    run_step(s)
    assert s.stats.num_priority_preemptions == 0
    assert s.requests["small"].status is RequestStatus.RUNNING
    finish_order(s)


def test_a_preempted_request_keeps_its_place_in_the_queue() -> None:
    q = OrderedQueue(long_prompt_threshold=1000, max_long_prefills=1)
    early = make_req("early", 4, 4, priority=3)
    later = [make_req(f"later{i}", 4, 4, priority=3) for i in range(3)]
    better = make_req("better", 4, 4, priority=1)
    for r in later:
        q.push(r)
    q.push(better)
    q.push_front(early)  # back from preemption: it arrived before "later*"
    assert [r.request_id for r in q] == ["better", "early", "later0", "later1", "later2"]
    q.remove(later[1])
    assert [r.request_id for r in q.candidates(0)] == ["better", "early", "later0", "later2"]


def test_priority_victims_take_the_lowest_and_spare_the_best_ranked() -> None:
    v = PriorityVictims()
    best = make_req("best", 4, 4, priority=0)
    mid = make_req("mid", 4, 4, priority=3)
    low_old = make_req("low_old", 4, 4, priority=7)
    low_new = make_req("low_new", 4, 4, priority=7)
    assert v.victim([best, mid, low_old, low_new]) is low_new
    low_new.preempt_count = 2
    assert v.victim([best, mid, low_old, low_new]) is low_old  # fewest preemptions first within a band
    # The best-ranked running request is never the victim while another runs: no livelock.
    assert v.victim([best, mid]) is mid


def test_the_swapped_resume_in_priority_order_and_never_ahead_of_a_waiting_request_that_outranks_them() -> (
    None
):
    s = make_sched(
        num_blocks=16, host_blocks=64, preemption_mode="swap", scheduling_policy="priority", max_num_seqs=1
    )
    s.add_request(make_req("low", 8, 30, priority=5, base=100))
    run_step(s)
    s.add_request(make_req("high", 8, 4, priority=0, base=200))
    run_step(s)
    assert s.requests["low"].status is RequestStatus.SWAPPED
    out = s.schedule()
    assert not out.swap_in  # "high" goes first, "low" stays on host
    s.update_from_output(out, {sr.req_id: [7] for sr in out.scheduled if sr.samples})
    assert s.requests["high"].status is RequestStatus.RUNNING
    order = finish_order(s)
    assert order == ["high", "low"]


def test_shedding_counts_only_the_bands_served_before_or_with_the_newcomer() -> None:
    bands = {0: QueuedWork(1, 10, 5), 3: QueuedWork(4, 100, 50), 7: QueuedWork(9, 1000, 500)}
    assert work_ahead_of(bands, 0) == QueuedWork(1, 10, 5)
    assert work_ahead_of(bands, 5) == QueuedWork(5, 110, 55)
    assert work_ahead_of(bands, 9) == QueuedWork(14, 1110, 555)
    s = make_sched(max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_req("run", 8, 4, priority=0))
    run_step(s)
    s.add_request(make_req("low", 8, 4, priority=9))
    assert s.load(100.0, priority=0).num_waiting == 0
    assert s.load(100.0, priority=9).num_waiting == 1
    assert s.snapshot().bands == {9: QueuedWork(1, 8, 4)}


def test_per_band_gauges() -> None:
    s = make_sched(max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_req("a", 8, 4, priority=2))
    s.add_request(make_req("b", 8, 4, priority=4))
    s.add_request(make_req("c", 8, 4, priority=4))
    run_step(s)
    g = s.gauges()
    assert g.running_by_priority == {2: 1}
    assert g.queued_by_priority == {4: 2}


# -- fairness ----------------------------------------------------------------------------------------------


def steady_tenant_first_tokens(fairness: str, policy: str = "fcfs") -> tuple[list[int], int]:
    """Tenant "burst" queues 40 requests at once, then tenant "steady" sends one request every 12 steps (each
    runs 9: within its half of the two seats).
    Returns the steps each steady request waited for its first token, and the steps the run took."""
    s = make_sched(num_blocks=256, max_num_seqs=2, fairness=fairness, scheduling_policy=policy)
    for i in range(40):
        s.add_request(make_req(f"burst{i}", 16, 8, tenant="burst", base=1000 + 100 * i))
    arrived: dict[str, int] = {}
    waited: list[int] = []
    step = 0
    while s.has_unfinished() or len(arrived) < 10:
        if step % 12 == 0 and len(arrived) < 10:
            rid = f"steady{len(arrived)}"
            s.add_request(make_req(rid, 16, 8, tenant="steady", base=50_000 + 100 * len(arrived)))
            arrived[rid] = step
        out = s.schedule()
        sampled = {sr.req_id: [7] for sr in out.scheduled if sr.samples}
        for r in s.update_from_output(out, sampled):
            if r.request_id in arrived and r.num_output_tokens == 1:
                waited.append(step - arrived[r.request_id])
        step += 1
        assert step < 5000
    s.kv.pool.check_invariants()
    return waited, step


def test_vtc_keeps_a_steady_tenant_from_starving_behind_another_tenants_burst() -> None:
    fair, _ = steady_tenant_first_tokens("vtc")
    fifo, _ = steady_tenant_first_tokens("none")
    assert len(fair) == len(fifo) == 10
    # FIFO: the steady tenant waits behind the whole burst; VTC: about one request's time.
    assert max(fair) <= 12, fair
    assert max(fifo) >= 5 * max(fair), (fair, fifo)


def test_vtc_within_priority() -> None:
    # Fairness orders tenants within a priority band, never across: a better band goes first anyway.
    s = make_sched(max_num_seqs=1, fairness="vtc", scheduling_policy="priority")
    s.add_request(make_req("a0", 8, 4, priority=1, tenant="a"))
    run_step(s)
    s.add_request(make_req("b_low", 8, 4, priority=5, tenant="b"))
    s.add_request(make_req("a_high", 8, 4, priority=1, tenant="a"))
    order = finish_order(s)
    assert order.index("a_high") < order.index("b_low")


def test_vtc_lifts_a_returning_tenant_to_the_waiting_minimum_and_forgets_those_below_it() -> None:
    vtc = VirtualTokenCounter()
    vtc.counters = {"a": 100.0, "b": 40.0}
    vtc.activate("c", ["a", "b"])  # new: starts at the smallest waiting counter, not at 0
    assert vtc.service("c") == 40.0
    vtc.charge(make_req("x", 4, 4, tenant="c"), 10, prefill=False)  # decode tokens weigh 2
    assert vtc.service("c") == 60.0
    vtc.deactivate("b", ["a", "c"])  # 40 <= 60: lifted to at least that on return anyway
    assert "b" not in vtc.counters
    vtc.deactivate("a", ["c"])  # 100 > 60: kept, or it would come back with banked credit
    assert vtc.service("a") == 100.0


def test_vtc_charges_an_admission_before_the_next_pick_of_the_same_step() -> None:
    s = make_sched(max_num_seqs=2, fairness="vtc")
    for i in range(3):
        s.add_request(make_req(f"a{i}", 8, 4, tenant="a", base=100 + 10 * i))
    for i in range(3):
        s.add_request(make_req(f"b{i}", 8, 4, tenant="b", base=200 + 10 * i))
    run_step(s)
    assert {r.request_id for r in s.running} == {"a0", "b0"}


def test_priority_victims_spare_the_best_ranked_even_when_it_has_the_fewest_preemptions() -> None:
    v = PriorityVictims()
    oldest = make_req("oldest", 4, 4, priority=0)
    newer = make_req("newer", 4, 4, priority=0)
    newer.preempt_count = 3
    assert v.victim([oldest, newer]) is newer


def test_vtc_candidates_take_the_best_band_then_the_least_served_tenant_and_keep_the_long_prompt_cap() -> (
    None
):
    vtc = VirtualTokenCounter()
    q = OrderedQueue(long_prompt_threshold=100, max_long_prefills=1, fairness=vtc)
    reqs = {
        "a0": make_req("a0", 8, 4, tenant="a"),
        "b0": make_req("b0", 8, 4, tenant="b"),
        "c0": make_req("c0", 8, 4, tenant="c"),
        "a1": make_req("a1", 8, 4, tenant="a"),
        "b_long": make_req("b_long", 120, 4, tenant="b"),
        "b2": make_req("b2", 8, 4, tenant="b"),
        "c1": make_req("c1", 8, 4, tenant="c"),
    }
    for r in reqs.values():
        q.push(r)
    vtc.counters = {"a": 100.0, "b": 10.0, "c": 50.0}
    order = [r.request_id for r in q.candidates(0)]
    # Nothing is charged while only iterating: b's whole list, then c's, then a's.
    assert order == ["b0", "b_long", "b2", "c0", "c1", "a0", "a1"]
    # One long prefill already running: the long prompt is passed over, b's next request is not.
    assert [r.request_id for r in q.candidates(1)] == ["b0", "b2", "c0", "c1", "a0", "a1"]
    # A charge made for an admission (as Admitter does) reorders the rest of the same pass.
    picked = []
    for r in q.candidates(0):
        picked.append(r.request_id)
        vtc.charge(r, 60, prefill=True)
    assert picked[:3] == ["b0", "c0", "b_long"]
    assert len(q) == 7 and len(list(q)) == 7
