"""No accepted request waits forever: a request that could never be admitted is refused at arrival, a lone
head is admitted whatever its estimate says, and a watchdog fails what still cannot progress; speculation
never takes a step's budget from a waiting prompt."""

from __future__ import annotations

import pytest

from chunkwise import LLM, SamplingParams
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.sched.draft_length import AdaptiveDraftLength, StepCostModel
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler


def make_sched(
    num_blocks: int = 16, block_size: int = 4, spec: AdaptiveDraftLength | None = None, **cfg: object
) -> Scheduler:
    cfg.setdefault("max_model_len", 64)
    kv = KVCacheManager(num_blocks, block_size, True, 0)
    config = SchedulerConfig(**cfg)  # type: ignore[arg-type]
    return Scheduler.from_config(config, kv, PreemptionCostModel(64, 1e9, 1e4), draft_length=spec)


def req(
    rid: str, prompt_len: int, max_tokens: int | None, n: int = 1, at: float = 0.0, base: int = 1
) -> Request:
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0)
    return Request(
        rid, [base + i for i in range(prompt_len)], params, at, max_tokens=max_tokens or 64 - prompt_len
    )


def step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    s.update_from_output(
        out, {sr.req_id: [7] * (1 + sr.num_spec_tokens) for sr in out.scheduled if sr.samples}
    )
    return {sr.req_id: len(sr.token_ids) + sr.num_spec_tokens for sr in out.scheduled}


def run_all(s: Scheduler, limit: int = 500) -> int:
    steps = 0
    while s.has_unfinished():
        step(s)
        steps += 1
        assert steps < limit, "requests left waiting"
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    return steps


# -- refused at arrival, by admission's own arithmetic -----------------------------------------------------
def test_a_family_past_the_cache_is_refused_naming_n_and_what_would_fit() -> None:
    s = make_sched(num_blocks=16)  # 64 tokens
    big = req("big", 5, 30, n=4)  # the prompt's full block once, then 4 x (9 - 1) blocks of its own
    with pytest.raises(ValueError, match=r"^n \(4\) and max_tokens \(30\) need 33 KV blocks") as e:
        s.add_request(big)
    message = str(e.value)
    assert "holds 16 blocks; it would fit with max_tokens at most 11 or n at most 1" in message
    assert not s.has_unfinished()
    # What it named does fit, and runs.
    s.add_request(req("n4", 5, 11, n=4))
    s.add_request(req("behind", 3, 2, at=1.0))
    run_all(s)


def test_a_request_within_its_limit_is_never_refused_for_rounding_or_drafts() -> None:
    """The reservation formula rounds prompt and output apart and widens the output by the drafts, which can ask for
    more than max_model_len's blocks; a request never holds more than its own limit, so it is reserved that."""
    spec = AdaptiveDraftLength(3, StepCostModel(1.0, 1e-6), adaptive=False)
    s = make_sched(num_blocks=16, spec=spec)  # exactly max_model_len = 64 tokens
    lone = req("lone", 5, 59)  # 2 + ceil(62 / 4) = 18 blocks by the formula
    s.add_request(lone)
    assert lone.reserved_blocks == 0 and s.admission.blocks_needed(lone, 0) == 16
    s.add_request(req("behind", 3, 4, at=1.0))
    run_all(s)
    assert lone.status is RequestStatus.FINISHED_LENGTH and lone.num_tokens == 64


# -- a lone head is admitted whatever its estimate says ----------------------------------------------------
def _grown_family(s: Scheduler, at: float) -> Request:
    """An n = 2 request without max_tokens, accepted on a small estimate of its route's outputs (7 blocks),
    whose estimate has grown past the cache (31 blocks) by the time admission looks at it again."""
    s.estimator.cold_start = 8
    head = req("head", 8, None, n=2, at=at)
    s.add_request(head)
    assert s.admission.blocks_needed(head, 0) == 7
    s.estimator.cold_start = 10_000
    return head


def test_with_nothing_running_the_head_is_admitted_even_past_its_reservation() -> None:
    s = make_sched(num_blocks=16)
    head = _grown_family(s, at=0.0)
    s.add_request(req("behind", 3, 2, at=1.0))
    assert "head" in step(s)  # alone, it would wait forever for blocks nobody holds
    assert s.admission.blocks_needed(head, 0) == 31 > s.kv.pool.num_blocks
    run_all(s)  # its two choices run, preempting each other as they grow; the oldest always goes on


def test_with_others_running_an_oversized_head_still_waits_for_them() -> None:
    s = make_sched(num_blocks=16)
    s.add_request(req("first", 4, 20))
    step(s)
    _grown_family(s, at=1.0)
    assert "head" not in step(s)  # FIFO under reservation: first's blocks will come back
    run_all(s)


# -- the watchdog --------------------------------------------------------------------------------------------
def test_the_watchdog_fails_a_request_nothing_can_admit_instead_of_spinning() -> None:
    s = make_sched(num_blocks=16, max_num_seqs=4)
    leaked = s.kv.pool.allocate(15)  # a bug elsewhere: blocks no request holds
    stuck = req("stuck", 8, 4)
    s.add_request(stuck)
    s.add_request(req("small", 2, 1, at=1.0))
    out = s.schedule()
    assert out.is_empty and out.failed == [stuck]
    assert stuck.status is RequestStatus.FINISHED_ERROR and stuck.finish_reason == "error"
    assert isinstance(stuck.stop_reason, str) and "no progress" in stuck.stop_reason
    assert s.stats.num_stalled_requests == 1
    assert s.update_from_output(out, {}) == [stuck]  # reported with the step's updates
    assert step(s) == {"small": 2}  # the next request runs in the one block left
    assert not s.has_unfinished()
    s.kv.pool.free(leaked)
    assert s.kv.num_free_blocks == 16


def test_the_watchdog_ends_an_unforked_family_and_the_llm_returns() -> None:
    llm = LLM("tiny", dtype="float32", max_model_len=64, num_blocks=8, enable_prefix_caching=False)
    pool = llm.engine.kv.pool
    leaked = pool.allocate(7)
    sp = SamplingParams(n=2, max_tokens=4, temperature=0.0, ignore_eos=True)
    out, ok = llm.generate(
        ["a prompt of some length, a few blocks long", "x"], [sp, SamplingParams(max_tokens=3)]
    )
    assert [c.finish_reason for c in out.outputs] == ["error", "error"]
    assert "no progress" in str(out.outputs[0].stop_reason)
    assert ok.outputs[0].finish_reason in ("length", "stop")
    pool.free(leaked)
    assert llm.engine.all_blocks_free()
    assert llm.engine.stats.num_stalled_requests == 1


# -- the three reproductions, end to end ------------------------------------------------------------
@pytest.mark.parametrize("engine_args", [{}, {"speculative_method": "ngram", "num_speculative_tokens": 3}])
def test_a_cache_of_exactly_max_model_len_serves_a_request_that_fills_it(
    engine_args: dict[str, object],
) -> None:
    llm = LLM("tiny", dtype="float32", max_model_len=128, num_blocks=8, **engine_args)  # 8 x 16 = 128 tokens
    prompt = [5, 6, 7, 8, 9]
    full = SamplingParams(max_tokens=123, temperature=0.0, ignore_eos=True)
    unset = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)  # what max_model_len leaves
    outs = llm.generate(
        [prompt, prompt, [1, 2]], [full, unset, SamplingParams(max_tokens=4, ignore_eos=True)]
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [123, 123, 4]
    assert llm.engine.all_blocks_free()


def test_a_family_that_fits_runs_and_one_that_cannot_is_refused_before_anything_is_queued() -> None:
    llm = LLM("tiny", dtype="float32", max_model_len=256, num_blocks=64)
    fits = SamplingParams(n=4, max_tokens=200, temperature=0.0, ignore_eos=True)
    small = SamplingParams(max_tokens=3, ignore_eos=True)
    family, after = llm.generate(["hello", "world"], [fits, small])
    assert [len(c.token_ids) for c in family.outputs] == [200] * 4 and len(after.outputs[0].token_ids) == 3
    too_big = SamplingParams(n=5, max_tokens=200, temperature=0.0, ignore_eos=True)  # 5 x 13 blocks > 64
    with pytest.raises(
        ValueError, match=r"^n \(5\) and max_tokens \(200\) need 65 KV blocks.* or n at most 4$"
    ):
        llm.generate(["hello", "world"], [too_big, small])
    assert not llm.engine.has_unfinished() and llm.engine.all_blocks_free()
    [again] = llm.generate(["world"], small)
    assert len(again.outputs[0].token_ids) == 3


# -- speculation takes what admission leaves ------------------------------------------------------------------
def test_drafts_never_starve_a_waiting_prompt() -> None:
    spec = AdaptiveDraftLength(3, StepCostModel(1.0, 1e-9), adaptive=False)
    s = make_sched(num_blocks=1024, spec=spec, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=32)
    for i in range(16):
        s.add_request(req(f"d{i}", 3, 100, at=float(i), base=10 * i))
    step(s)  # 16 prompts of 3 tokens
    assert step(s) == {f"d{i}": 4 for i in range(16)}  # 16 x (1 + 3) = 64: the whole budget drafts
    s.add_request(req("late", 4, 2, at=99.0, base=500))
    plan = step(s)
    assert plan["late"] == 4  # admitted at once, not after the decodes finish
    assert all(plan[f"d{i}"] == 1 + 2 for i in range(16))  # (64 - 16 - 4) // 16 = 2 drafts each
    assert sum(plan.values()) == 16 * 3 + 4 <= 64


def test_an_unset_max_model_len_is_cut_to_what_the_cache_holds(caplog: pytest.LogCaptureFixture) -> None:
    """`chunkwise serve --model tiny --num-blocks 64` starts (tiny has 8192 positions, the cache 1,024
    tokens) and says so; a max_model_len the operator set stays an error when the cache cannot hold it."""
    llm = LLM("tiny", dtype="float32", num_blocks=64)
    assert llm.engine.max_model_len == 64 * 16
    assert "max_model_len 1024: the KV cache (64 blocks of 16 tokens) holds fewer tokens" in caplog.text
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len 2048 tokens"):
        LLM("tiny", dtype="float32", num_blocks=64, max_model_len=2048)


def test_rows_past_the_budget_take_turns() -> None:
    """More running rows than the step budget (an n = 8 request, 4 tokens a step): the choices take turns,
    instead of the first four taking every step until they finish."""
    s = make_sched(num_blocks=64, max_model_len=64, max_num_batched_tokens=4, max_num_seqs=8)
    s.add_request(req("fam", 1, 20, n=8))
    tokens: dict[str, int] = {}
    for _ in range(20):
        for rid, n in step(s).items():
            tokens[rid] = tokens.get(rid, 0) + n
    counts = sorted(tokens.values())
    assert len(counts) == 8 and counts[-1] - counts[0] <= 1, tokens
    run_all(s)
