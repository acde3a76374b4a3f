"""Scheduler unit tests: the scheduler driven directly, with a stand-in for the model (token = step count)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chunkwise.cache.kv_cache_manager import KVCacheManager
from chunkwise.config import SchedulerConfig
from chunkwise.request import Request, RequestStatus
from chunkwise.sampling_params import SamplingParams
from chunkwise.sched.output import SchedulerOutput
from chunkwise.sched.preemption import PreemptionCostModel, VictimPolicy
from chunkwise.sched.scheduler import Scheduler


def make_sched(
    num_blocks: int = 64,
    block_size: int = 4,
    host_blocks: int = 0,
    mode: str = "recompute",
    prefix: bool = True,
    **cfg: object,
) -> Scheduler:
    cfg.setdefault("max_model_len", 256)
    kv = KVCacheManager(num_blocks, block_size, prefix, host_blocks)
    cost = PreemptionCostModel(64, 1e9, 1e4, forced=mode)  # type: ignore[arg-type]
    return Scheduler(SchedulerConfig(**cfg), kv, cost)  # type: ignore[arg-type]


_clock = [0.0]


def make_req(rid: str, prompt_len: int, max_tokens: int, base: int = 1, **params: object) -> Request:
    _clock[0] += 1.0
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Request(rid, [base + i for i in range(prompt_len)], sp, _clock[0], max_tokens=max_tokens)


def run_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = {sr.req_id: [7] for sr in out.scheduled if sr.samples}
    s.update_from_output(out, sampled)
    return out


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {sr.req_id: len(sr.token_ids) for sr in out.scheduled}


def test_chunked_prefill_splits_a_prompt_and_samples_only_at_its_end():
    s = make_sched(max_num_batched_tokens=16)
    s.add_request(make_req("a", 40, 2))
    outs = [run_step(s) for _ in range(4)]
    assert [plan(o) for o in outs] == [{"a": 16}, {"a": 16}, {"a": 8}, {"a": 1}]
    assert [o.scheduled[0].samples for o in outs] == [False, False, True, True]
    assert [o.scheduled[0].start_pos for o in outs] == [0, 16, 32, 40]
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == 64


def test_convoy_decode_rows_advance_every_step_while_a_long_prompt_prefills():
    s = make_sched(num_blocks=512, max_num_batched_tokens=32, max_model_len=2048, long_prompt_threshold=4096)
    s.add_request(make_req("d1", 4, 100))
    s.add_request(make_req("d2", 4, 100))
    run_step(s)  # both prompts prefill in one step
    s.add_request(make_req("long", 990, 1, base=5000))
    for _ in range(40):
        p = plan(run_step(s))
        assert sum(p.values()) <= 32
        assert p["d1"] == 1 and p["d2"] == 1
        if "long" not in p:
            break
        assert p["long"] == 30  # B = decode rows + chunk


def test_unchunked_prefill_runs_whole_prompts():
    s = make_sched(
        num_blocks=512, max_num_batched_tokens=256, enable_chunked_prefill=False, max_model_len=256
    )
    s.add_request(make_req("a", 200, 3))
    s.add_request(make_req("b", 100, 3, base=1000))
    assert plan(run_step(s)) == {"a": 200}  # b does not fit the rest of the budget: it waits, unsplit
    assert plan(run_step(s)) == {"a": 1, "b": 100}


def test_continuous_batching_admits_as_soon_as_a_slot_frees():
    s = make_sched(max_num_seqs=2)
    s.add_request(make_req("short", 4, 1))
    s.add_request(make_req("long", 4, 5))
    s.add_request(make_req("next", 4, 1))
    assert plan(run_step(s)) == {"short": 4, "long": 4}  # short finishes with its first token
    assert plan(run_step(s)) == {"long": 1, "next": 4}


def test_static_batching_waits_for_the_whole_batch():
    s = make_sched(max_num_seqs=2, batching="static")
    s.add_request(make_req("short", 4, 1))
    s.add_request(make_req("long", 4, 3))
    s.add_request(make_req("next", 4, 1))
    assert plan(run_step(s)) == {"short": 4, "long": 4}
    assert plan(run_step(s)) == {"long": 1}
    assert plan(run_step(s)) == {"long": 1}
    assert plan(run_step(s)) == {"next": 4}


def test_static_batch_forms_whole_even_when_the_first_step_budget_is_short():
    s = make_sched(max_num_seqs=3, batching="static", max_num_batched_tokens=8)
    for rid in "abc":
        s.add_request(make_req(rid, 6, 2))
    assert plan(run_step(s)) == {"a": 6, "b": 2}
    assert len(s.running) == 3


def test_reservation_holds_back_admission_for_expected_output():
    # 10 blocks of 4 tokens. Each request: 4 prompt tokens (1 block) + 16 output tokens (4 blocks) = 5 blocks.
    s = make_sched(num_blocks=10, max_num_seqs=8)
    for rid in "abc":
        s.add_request(make_req(rid, 4, 16))
    assert set(plan(run_step(s))) == {"a", "b"}  # c would overdraw what a and b were promised
    assert s.running[0].reserved_blocks == 5
    assert [r.request_id for r in s.waiting] == ["c"]


def test_victim_policy_prefers_fresh_and_newest_and_spares_the_oldest():
    def r(rid: str, arrival: float, count: int) -> Request:
        req = make_req(rid, 1, 1)
        req.arrival_time, req.preempt_count = arrival, count
        return req

    v = VictimPolicy(max_preemptions=2)
    old, mid, new = r("old", 1, 0), r("mid", 2, 0), r("new", 3, 1)
    assert v.victim([old, mid, new]).request_id == "mid"  # never-preempted first
    assert v.victim([old, r("n2", 3, 0), mid]).request_id == "n2"  # then newest
    assert v.victim([old, r("x", 5, 2), r("y", 4, 3)]).request_id == "x"  # all over the cap: fewest first
    assert v.victim([r("o", 1, 9), r("n", 2, 9)]).request_id == "n"  # the oldest is never the victim
    assert v.victim([old]).request_id == "old"


def test_recompute_preemption_requeues_at_the_head_and_finishes_exactly():
    # 6 blocks of 4: two requests of 4-token prompts growing to 4 + 12 tokens (4 blocks each) cannot both fit.
    s = make_sched(num_blocks=6, cold_start_output_tokens=0)
    a = make_req("a", 4, 12)
    b = make_req("b", 4, 12)
    s.add_request(a)
    s.add_request(b)
    # Admission reserves by max_tokens, so only a fits; force the overload by shrinking the reservation.
    a.output_length_estimate = b.output_length_estimate = 0
    steps = 0
    while s.has_unfinished():
        run_step(s)
        s.kv.pool.check_invariants()
        steps += 1
        assert steps < 100
    assert s.stats.num_preemptions_recompute >= 1
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert b.preempt_count >= 1 and a.preempt_count == 0  # the older request is never the victim
    assert s.kv.num_free_blocks == 6


def test_swap_preemption_restores_and_finishes():
    s = make_sched(num_blocks=6, host_blocks=8, mode="swap")
    a, b = make_req("a", 4, 12), make_req("b", 4, 12)
    s.add_request(a)
    s.add_request(b)
    a.output_length_estimate = b.output_length_estimate = 0
    swaps_out = swaps_in = 0
    while s.has_unfinished():
        out = run_step(s)
        swaps_out += len(out.swap_out)
        swaps_in += len(out.swap_in)
        s.kv.pool.check_invariants()
    assert s.stats.num_preemptions_swap >= 1 and s.stats.num_preemptions_recompute == 0
    assert swaps_out == swaps_in > 0
    assert b.num_output_tokens == 12 and s.kv.swap_space.num_free == 8


def test_swap_falls_back_to_recompute_when_host_space_is_short():
    s = make_sched(num_blocks=6, host_blocks=0, mode="swap")
    a, b = make_req("a", 4, 12), make_req("b", 4, 12)
    s.add_request(a)
    s.add_request(b)
    a.output_length_estimate = b.output_length_estimate = 0
    while s.has_unfinished():
        run_step(s)
    assert s.stats.num_preemptions_recompute >= 1 and s.stats.num_preemptions_swap == 0


def test_long_prompt_cap_lets_short_requests_pass_and_keeps_long_ones_in_order():
    s = make_sched(num_blocks=1024, max_num_batched_tokens=64, long_prompt_threshold=50, max_long_prefills=1)
    s.add_request(make_req("L1", 60, 1, base=1000))
    s.add_request(make_req("L2", 60, 1, base=2000))
    s.add_request(make_req("s1", 8, 1, base=3000))
    # A long prompt's chunk is capped at half the budget; L2 is over the cap while L1 prefills, so s1
    # behind it is admitted into the rest of the step.
    assert plan(run_step(s)) == {"L1": 32, "s1": 8}
    assert plan(run_step(s)) == {"L1": 28}
    # L1 has finished prefilling: L2, still ahead of everything that came later, goes next.
    assert plan(run_step(s)) == {"L2": 32}
    assert plan(run_step(s)) == {"L2": 28}
    assert not s.has_unfinished()


def test_prefix_cache_hit_skips_cached_blocks():
    s = make_sched(max_num_batched_tokens=64)
    s.add_request(make_req("a", 12, 1))
    run_step(s)
    b = make_req("b", 13, 1)
    s.add_request(b)
    out = run_step(s)
    assert plan(out) == {"b": 1} and out.scheduled[0].start_pos == 12
    assert b.num_cached_tokens == 12
    assert s.stats.prefix_cache_hits == 12 and s.stats.prefix_cache_queries == 25


def test_stop_token_and_eos_end_a_request():
    s = make_sched()
    r = make_req("a", 4, 10, stop_token_ids=[7])
    s.add_request(r)
    run_step(s)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
    e = make_req("e", 4, 10)
    e.eos_token_ids = (7,)
    s.add_request(e)
    run_step(s)
    assert e.finish_reason == "stop" and e.stop_reason is None


def test_abort_frees_blocks_in_any_state():
    s = make_sched(max_num_batched_tokens=8)
    s.add_request(make_req("run", 20, 5))
    s.add_request(make_req("wait", 4, 5))
    run_step(s)
    assert [r.request_id for r in s.abort(["run", "wait", "missing"])] == ["run", "wait"]
    assert s.kv.num_free_blocks == 64 and not s.has_unfinished()
    assert s.schedule().finished_req_ids == {"run", "wait"}


def test_a_request_larger_than_the_cache_is_refused_at_once():
    s = make_sched(num_blocks=4)
    import pytest

    with pytest.raises(ValueError, match="needs up to 5 KV blocks"):
        s.add_request(make_req("big", 8, 12))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 40),  # prompt length
            st.integers(1, 20),  # max tokens
            st.integers(0, 3),  # arrival step
            st.booleans(),  # shares a prefix
            st.integers(-1, 12),  # abort at step (-1: never)
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from(["recompute", "swap"]),
    st.integers(12, 40),
    st.integers(4, 64),
)
def test_property_no_leak_no_double_free_exact_lengths(reqs, mode, num_blocks, budget):
    s = make_sched(
        num_blocks=num_blocks, host_blocks=16, mode=mode, max_num_batched_tokens=budget, max_num_seqs=6
    )
    made: dict[str, tuple[Request, int]] = {}
    step = 0
    pending = list(enumerate(reqs))
    while pending or s.has_unfinished():
        for i, (plen, mt, at, shared, abort_at) in list(pending):
            if at <= step:
                pending.remove((i, (plen, mt, at, shared, abort_at)))
                r = make_req(f"r{i}", plen, mt, base=1 if shared else 100 * (i + 1))
                try:
                    s.add_request(r)
                except ValueError:
                    continue  # larger than the whole cache: refused up front
                # Under-reserve on purpose so preemption is exercised.
                r.output_length_estimate = 0
                made[r.request_id] = (r, abort_at)
        s.abort([rid for rid, (r, ab) in made.items() if ab == step])
        run_step(s)
        s.kv.pool.check_invariants()
        step += 1
        assert step < 2000, "no progress"
    assert s.kv.num_free_blocks == num_blocks and s.kv.swap_space.num_free == 16
    assert not s.running and not s.swapped and not len(s.waiting)
    for r, _abort_at in made.values():
        assert r.is_finished
        if r.finish_reason != "abort":
            assert r.num_output_tokens == r.max_tokens
        assert r.preempt_count <= 8


def test_waiting_queue_scans_a_bounded_window():
    from chunkwise.sched.queue import WaitingQueue

    q = WaitingQueue(long_prompt_threshold=100, max_long_prefills=1, scan_limit=3)
    reqs = [make_req(f"w{i}", 4, 1) for i in range(10)]
    for r in reqs:
        q.push(r)
    assert [r.request_id for r in q.candidates(0)] == ["w0", "w1", "w2"]


def test_estimate_is_taken_at_admission_not_arrival():
    s = make_sched(num_blocks=256, cold_start_output_tokens=100, max_num_seqs=1)
    s.add_request(make_req("first", 4, 3))
    late = Request("late", [9, 9, 9], SamplingParams(max_tokens=None, temperature=0.0), 99.0, max_tokens=200)
    s.add_request(late)
    assert late.output_length_estimate == 100  # cold start: no history yet
    for n in range(30):
        s.estimator.observe("", 8 + n % 3)
    while "first" in s.requests:
        run_step(s)
    run_step(s)
    assert late.status == RequestStatus.RUNNING and late.output_length_estimate == 10
