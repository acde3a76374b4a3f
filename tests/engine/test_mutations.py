"""Tests that each kill a mutation the rest of the suite let through (issue 28): a swapped request's host slots
kept after an abort, a parent's seats not held while its prompt is chunked, the decode fast path over the
token budget, a recompute victim requeued at the tail, per-request state that outlives its request, and the
preemption cap. Each test names the behaviour; its note names the mutant it fails against."""

from __future__ import annotations

import pytest

from chunkwise.engine import EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.datatypes.outputs import RequestOutput
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.datatypes.structured_output import StructuredOutput
from chunkwise.engine.sched.preemption import VictimPolicy
from chunkwise.engine.sched.scheduler import Scheduler
from chunkwise.engine.worker.draft_model import DraftModelProposer
from tests.engine.sched.test_scheduler import make_req, make_sched, plan, run_step


def family(rid: str, prompt: list[int], n: int, max_tokens: int, **params: object) -> Request:
    sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Request(rid, prompt, sp, 0.0, max_tokens=max_tokens)


def per_request_state(s: Scheduler, core: EngineCore | None = None) -> dict[str, int]:
    """The size of every map the engine keys by request, and the free counts of what requests borrow: after
    the requests are gone (and a step has passed their ids on), each is back where it started, however many
    requests were served."""
    kv = s.kv
    sizes = {
        "kv.block_tables": len(kv.block_tables),
        "kv._hashes": len(kv._hashes),
        "kv._num_registered": len(kv._num_registered),
        "kv._host_slots": len(kv._host_slots),
        "kv.pool.num_free": kv.pool.num_free,
        "kv.swap_space.num_free": kv.swap_space.num_free,
        "scheduler.requests": len(s.requests),
        "scheduler._families": len(s.forks.families),
        "scheduler._parents": len(s.forks.parents),
        "scheduler._finished_ids": len(s.composer.finished_ids),
        "scheduler.running": len(s.running),
        "scheduler.swapped": len(s.swapped),
        "scheduler.waiting": len(s.waiting),
    }
    if core is not None:
        runner = core.runner
        outputs = core.outputs
        assert outputs is not None
        sizes |= {
            "runner.generators._generators": len(
                runner.generators._generators
            ),  # seeded requests' torch.Generators
            "runner.prompt_scorer._scores": len(runner.prompt_scorer._scores),
            "runner.prompt_scorer._scored": len(runner.prompt_scorer._scored),
            "runner.inputs._table_state": len(runner.inputs._table_state),
            # Table rows taken (the table may grow: preempted requests keep theirs).
            "runner.inputs rows taken": len(runner.inputs._tables) - len(runner.inputs._free_table_rows),
            "runner.grammar._matchers": len(runner.grammar._matchers) if runner.grammar is not None else 0,
            "outputs.states": len(outputs.states),
            "outputs.groups": len(outputs.groups),
        }
        if isinstance(runner.proposer, DraftModelProposer):
            sizes["proposer._valid"] = len(runner.proposer._valid)
    return sizes


# -- a. an abort while SWAPPED returns the host slots -------------------------------------------------------
def test_aborting_a_swapped_request_returns_its_host_slots() -> None:
    """Mutant: KVCacheManager.free without its `_host_slots.pop` / `swap_space.free` lines (or
    Scheduler.finish not releasing a SWAPPED request): 5 of 8 slots stay taken."""
    s = make_sched(num_blocks=6, host_blocks=8, mode="swap")
    a, b = make_req("a", 4, 12), make_req("b", 4, 12)
    s.add_request(a)
    s.add_request(b)
    a.output_length_estimate = b.output_length_estimate = 0  # under-reserve: b must give way
    for _ in range(20):
        run_step(s)
        if b.status == RequestStatus.SWAPPED:
            break
    assert b.status == RequestStatus.SWAPPED and s.kv.swap_space.num_free == 8 - 3
    assert s.abort(["b"]) == [b] and b.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.swap_space.num_free == s.kv.swap_space.num_host_blocks == 8
    assert "b" not in s.kv._host_slots and not s.swapped
    s.kv.pool.check_invariants()
    while s.has_unfinished():
        run_step(s)
        s.kv.pool.check_invariants()
    assert a.num_output_tokens == 12
    assert s.kv.num_free_blocks == 6 and s.kv.swap_space.num_free == 8


# -- b. a parent's seats are held while its prompt is chunked ----------------------------------------------
def test_a_parent_chunking_its_prompt_holds_its_childrens_seats() -> None:
    """Mutant: Forks.seats returns 0 (admission forgets a running parent's n - 1 seats after
    the step that admitted it): o1, o2 join while p chunks and the fork runs 6 sequences with max_num_seqs 4."""
    # A 40-token prompt is long (>= 16): its chunk keeps to half of the 16-token budget while others wait, so
    # there is budget left to admit them during the 5 steps it prefills.
    s = make_sched(num_blocks=128, max_num_seqs=4, max_num_batched_tokens=16, long_prompt_threshold=16)
    s.add_request(family("p", list(range(1, 41)), n=3, max_tokens=4))
    others = [make_req(f"o{i}", 2, 6, base=100 * (i + 1)) for i in range(4)]
    for r in others:
        s.add_request(r)
    forked_at = None
    for step in range(60):
        out = run_step(s)
        # The children to come count as running: n - 1 seats per parent not yet forked.
        seats = sum(r.sampling_params.n - 1 for r in s.running if r.fork_hold)
        assert len(s.running) + seats <= 4, (step, [r.request_id for r in s.running])
        if forked_at is None and "p" in out.finished_req_ids:
            forked_at = step
        if not s.has_unfinished():
            break
    assert forked_at is not None and forked_at > 1  # p prefilled in chunks before it forked
    assert not s.has_unfinished() and all(r.num_output_tokens == 6 for r in others)
    assert s.kv.num_free_blocks == 128


# -- c. the decode fast path keeps to the token budget -----------------------------------------------------
def test_decode_steps_keep_to_the_token_budget_with_more_rows_than_it() -> None:
    """Mutant: StepComposer.decode_step without its `len(running) > max_num_batched_tokens` check: the
    fast path schedules all 8 children, 8 tokens in a step with a budget of 4."""
    # A fork puts 8 decoding rows in the batch at once, with a budget of 4 tokens.
    s = make_sched(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=4)
    s.add_request(family("p", [1, 2, 3], n=8, max_tokens=5))
    steps = 0
    while s.has_unfinished():
        out = run_step(s)
        assert out.num_batched_tokens <= 4, plan(out)
        assert sum(plan(out).values()) == out.num_batched_tokens
        steps += 1
        assert steps < 50
    assert not s.forks.families  # the family ended with its last child
    # 2 prompt tokens, then each child's last prompt token and 4 more: 8 x 5 tokens, at most 4 a step.
    assert s.stats.num_rows == 1 + 8 * 5 and steps == 1 + 8 * 5 // 4
    assert s.kv.num_free_blocks == 64


# -- d. a recompute victim keeps its place at the head -----------------------------------------------------
def test_a_recomputed_victim_is_readmitted_before_requests_queued_behind_it() -> None:
    """Mutant: `self.waiting.push_front(req)` -> `self.waiting.push(req)` in Scheduler._preempt: c, which
    arrived after b and waited for a seat, is admitted before the preempted b."""
    s = make_sched(num_blocks=6, max_num_seqs=2, cold_start_output_tokens=0)
    a, b, c = make_req("a", 4, 12), make_req("b", 4, 12), make_req("c", 4, 2, base=50)
    for r in (a, b, c):
        s.add_request(r)
        r.output_length_estimate = 0  # under-reserve, so that a and b outgrow the cache
    admitted: list[str] = []  # each move from the waiting queue into the batch, in order
    for _ in range(60):
        queued = {r.request_id for r in s.waiting}
        run_step(s)
        admitted += [r.request_id for r in (a, b, c) if r.request_id in queued and r not in s.waiting]
        if not s.has_unfinished():
            break
    assert b.preempt_count == 1 and s.stats.num_preemptions_recompute == 1
    # a, b at first; b again after its preemption (ahead of c, which arrived later), then c.
    assert admitted == ["a", "b", "b", "c"]
    assert [r.num_output_tokens for r in (a, b, c)] == [12, 12, 2]


# -- g. the preemption cap ---------------------------------------------------------------------------------
def _at(rid: str, arrival: float, count: int) -> Request:
    req = make_req(rid, 1, 1)
    req.arrival_time, req.preempt_count = arrival, count
    return req


def test_a_request_at_the_preemption_cap_is_passed_over_while_one_under_it_remains() -> None:
    """Preempted repeatedly: a request at max_preemptions gives way only when every candidate is at it."""
    v = VictimPolicy(max_preemptions=3)
    old = _at("old", 1, 0)
    # The newest is at the cap: the older one under it gives way instead, however often it gave way before.
    assert v.victim([old, _at("under", 2, 2), _at("capped", 3, 3)]).request_id == "under"
    assert v.victim([old, _at("capped", 2, 5), _at("under", 3, 0)]).request_id == "under"
    # Every candidate at or over the cap: one is preempted anyway (fewest first, then newest), never the oldest.
    assert v.victim([_at("o", 1, 9), _at("c3", 2, 3), _at("c4", 3, 4)]).request_id == "c3"
    assert v.victim([_at("o", 1, 9), _at("c3", 2, 3), _at("d3", 3, 3)]).request_id == "d3"


def test_under_sustained_pressure_the_cap_is_kept_while_it_can_be_and_the_oldest_progresses() -> None:
    """A tiny pool under-reserved for 8 requests: they are preempted repeatedly, some past a cap of 2. At every
    choice the oldest running request is spared while another runs, and a request at the cap is passed over
    while a candidate under it remains; every request finishes."""
    s = make_sched(num_blocks=10, cold_start_output_tokens=0, max_num_batched_tokens=16, max_model_len=64)
    cap = 2
    policy = VictimPolicy(max_preemptions=cap)
    reqs = [make_req(f"r{i}", 4 + i % 3, 28 - 2 * (i % 4), base=50 * i) for i in range(8)]
    for r in reqs:
        s.add_request(r)
        r.output_length_estimate = 0  # under-reserve, so that memory runs out mid-decode
    applied = 0  # choices with candidates both at and under the cap

    class Checked:
        def victim(self, running: list[Request]) -> Request:
            nonlocal applied
            chosen = policy.victim(running)
            if len(running) > 1:
                oldest = min(running, key=lambda r: r.arrival_time)
                assert chosen is not oldest
                counts = [r.preempt_count for r in running if r is not oldest]
                if min(counts) < cap:
                    assert chosen.preempt_count < cap, [(r.request_id, r.preempt_count) for r in running]
                    applied += max(counts) >= cap
            return chosen

    s.victims = Checked()
    for _ in range(1000):
        run_step(s)
        s.kv.pool.check_invariants()
        if not s.has_unfinished():
            break
    assert applied > 0
    assert max(r.preempt_count for r in reqs) > cap  # past the cap when no candidate was under it
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert s.kv.num_free_blocks == 10


# -- e, f. nothing per request outlives the request --------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_scheduler_keeps_nothing_per_request_after_serving_many(mode: str) -> None:
    """Mutants: KVCacheManager.forget without `self._hashes.pop(...)` (kv._hashes keeps an entry per request
    served); Scheduler.finish not calling kv.forget for a SWAPPED request (its host slots stay taken)."""
    s = make_sched(num_blocks=12, host_blocks=32, mode=mode, max_num_batched_tokens=16, max_num_seqs=6)
    start = per_request_state(s)
    seen: dict[str, Request] = {}  # every request and forked child, n = 1 each
    early: list[Request] = []
    peak = dict(start)  # each map's largest size after a step
    swapped_aborts = [0, 0, 0]
    for wave in range(3):
        base = 1000 * wave
        batch = [
            make_req(f"w{wave}-long", 13, 9, base=base + 1),
            make_req(f"w{wave}-stop", 6, 20, base=base + 100, stop_token_ids=[7]),  # stops at once
            make_req(f"w{wave}-abort", 9, 12, base=base + 200),
            make_req(f"w{wave}-shared", 13, 3, base=base + 1),  # a prefix-cache hit
            family(f"w{wave}-fam", list(range(base + 300, base + 311)), n=3, max_tokens=6),
            family(f"w{wave}-fam-early", list(range(base + 400, base + 426)), n=2, max_tokens=8),
            family(f"w{wave}-fam-late", list(range(base + 500, base + 507)), n=2, max_tokens=10),
        ]
        early.append(batch[5])
        for r in batch:
            s.add_request(r)
            r.output_length_estimate = 0  # under-reserve: preemptions happen
            if r.sampling_params.n == 1:
                seen[r.request_id] = r
        for step in range(200):
            if step == 3:
                s.abort([f"w{wave}-abort", f"w{wave}-fam-early"])  # the family before it forked
            if f"w{wave}-fam-late" in s.forks.families:
                s.abort([f"w{wave}-fam-late"])  # every child
            if s.swapped and not swapped_aborts[wave]:
                swapped_aborts[wave] = len(s.abort([s.swapped[-1].request_id]))
            run_step(s)
            s.kv.pool.check_invariants()
            seen |= {rid: r for rid, r in s.requests.items() if r.sampling_params.n == 1}
            now = per_request_state(s)
            peak = {k: max(v, now[k]) for k, v in peak.items()}
            if not s.has_unfinished():
                break
    preempted = s.stats.num_preemptions_swap if mode == "swap" else s.stats.num_preemptions_recompute
    assert preempted > 0
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in early)
    assert (sum(swapped_aborts) > 0) == (mode == "swap")
    # The mix reaches every map (swapped requests' only under swap).
    assert {k for k, v in peak.items() if v == 0} == (
        set() if mode == "swap" else {"kv._host_slots", "scheduler.swapped"}
    )
    assert sum(1 for r in seen.values() if r.parent_id is not None) >= 3 * 3  # each wave's fam, forked
    assert {r.finish_reason for r in seen.values()} == {"length", "stop", "abort"}
    for r in seen.values():
        assert r.is_finished
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens
    s.schedule()  # passes the last finished ids on (to the runner)
    assert per_request_state(s) == start


def _served_mix(wave: int) -> list[tuple[str, SamplingParams]]:
    """Greedy and seeded sampled requests, n = 1 and n > 1, prompt log-probs, a grammar: one wave."""
    return [
        (f"w{wave}-greedy", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        (f"w{wave}-seeded", SamplingParams(max_tokens=10, temperature=1.0, seed=wave, ignore_eos=True)),
        (f"w{wave}-seeded-n3", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)),
        (f"w{wave}-greedy-n2", SamplingParams(n=2, max_tokens=9, temperature=0.0, ignore_eos=True)),
        (
            f"w{wave}-scored",
            SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1, ignore_eos=True),
        ),
        (
            f"w{wave}-regex",
            SamplingParams(max_tokens=6, temperature=0.0, structured=StructuredOutput.regex("ab+c")),
        ),
        (f"w{wave}-abort-running", SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)),
        (
            f"w{wave}-abort-family",
            SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=5, ignore_eos=True),
        ),
        (f"w{wave}-abort-queued", SamplingParams(max_tokens=5, temperature=1.0, seed=9, ignore_eos=True)),
    ]


def _engine(mode: str, **kwargs: object) -> EngineCore:
    core = EngineCore(
        engine_config_from_kwargs(
            "tiny",
            dtype="float32",
            num_blocks=40,
            block_size=4,
            max_model_len=80,
            max_num_batched_tokens=24,
            max_num_seqs=8,
            swap_space_bytes=1 << 20,
            preemption_mode=mode,
            **kwargs,
        )
    )
    core.scheduler.admission.output_estimate = lambda req: 0  # type: ignore[method-assign]  # must preempt
    return core


def _serve(core: EngineCore, waves: int) -> tuple[dict[str, RequestOutput], str, int, dict[str, int]]:
    """Serve `waves` waves of the mix, with a stop string, aborts (queued, running, swapped, a family)
    and preemptions. Returns each request's last output, the stop string, how many requests were aborted
    while swapped, and the largest size each map of per_request_state reached after a step."""
    last: dict[str, RequestOutput] = {}
    swapped_aborts = 0
    peak = per_request_state(core.scheduler, core)
    # The greedy text of one prompt, so that a stop string taken from it is reached.
    core.add_request(
        "ref", "the quick brown fox", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    text = ""
    while core.has_unfinished():
        for o in core.step():
            text += o.outputs[0].text
    stop = next(ch for ch in text[len(text) // 2 :] if ch.isprintable() and ch != "\ufffd")
    for wave in range(waves):
        prompts = [f"wave {wave} request {i} " + "word " * (i % 5) for i in range(12)]
        mix = _served_mix(wave)
        mix.append(
            (f"w{wave}-stop", SamplingParams(max_tokens=12, temperature=0.0, stop=stop, ignore_eos=True))
        )
        for i, (rid, sp) in enumerate(mix):
            core.add_request(rid, "the quick brown fox" if rid.endswith("-stop") else prompts[i], sp)
        for o in core.abort([f"w{wave}-abort-queued"]):
            last[o.request_id] = o
        swapped_abort = False
        for step in range(300):
            if step == 4:
                for o in core.abort([f"w{wave}-abort-running", f"w{wave}-abort-family"]):
                    last[o.request_id] = o
            if not swapped_abort and core.scheduler.swapped:
                for o in core.abort([core.scheduler.swapped[0].request_id]):
                    last[o.request_id] = o
                swapped_abort = True
                swapped_aborts += 1
            for o in core.step():
                last[o.request_id] = o
            core.kv.pool.check_invariants()
            now = per_request_state(core.scheduler, core)
            peak = {k: max(v, now[k]) for k, v in peak.items()}
            if not core.has_unfinished():
                break
    core.step()  # passes the last finished ids on to the runner
    return last, stop, swapped_aborts, peak


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_engine_keeps_nothing_per_request_after_serving_many(mode: str) -> None:
    """Mutants: ModelRunner._forget without `self.generators.forget(rid)` (a seeded request's generator
    kept: runner.generators grows); KVCacheManager.forget without `self._hashes.pop(...)`."""
    core = _engine(mode)
    start = per_request_state(core.scheduler, core)
    last, stop, swapped_aborts, peak = _serve(core, waves=2)
    # The mix reaches every map (swapped requests' only under swap).
    assert {k for k, v in peak.items() if v == 0} == (
        set() if mode == "swap" else {"kv._host_slots", "scheduler.swapped"}
    )
    assert all(o.finished for o in last.values())
    assert {c.finish_reason for o in last.values() for c in o.outputs} == {"length", "stop", "abort"}
    assert [last[f"w{w}-stop"].outputs[0].stop_reason for w in range(2)] == [stop, stop]
    stats = core.stats
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    assert (swapped_aborts > 0) == (mode == "swap")
    assert per_request_state(core.scheduler, core) == start
    assert core.all_blocks_free()


def test_draft_model_speculation_keeps_nothing_per_request_after_serving_many() -> None:
    """The same with a draft model proposing: its per-request state (proposer._valid) goes with the request.
    Mutant: DraftModelProposer.forget dropping nothing."""
    core = _engine(
        "recompute", speculative_method="draft", speculative_model="tiny", adaptive_speculation=False
    )
    assert isinstance(core.runner.proposer, DraftModelProposer)
    start = per_request_state(core.scheduler, core)
    last, _, _, peak = _serve(core, waves=1)
    assert all(o.finished for o in last.values())
    assert core.stats.spec_num_draft_tokens > 0 and peak["proposer._valid"] > 0
    assert per_request_state(core.scheduler, core) == start
    assert core.all_blocks_free()
