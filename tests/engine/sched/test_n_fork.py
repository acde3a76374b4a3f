"""n > 1 (sched/fork.py): one request, n completions over one computation of the prompt's KV, shared blocks,
the partial last block copied on write, one request id to the outside."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkwise import LLM, SamplingParams
from chunkwise.engine import AsyncEngine, EngineCore
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig, engine_config_from_kwargs
from chunkwise.engine.datatypes.outputs import RequestOutput
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.loop.metrics import EngineMetrics
from chunkwise.engine.sched.fork import child_request_id
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler

# Its expectations depend on the CPU's choices: `make test` runs it again under each CHUNKWISE_CPU_ISA.
pytestmark = pytest.mark.isa

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "x",
    "a lazy dog and then some more words, and more",
]


def greedy(max_tokens: int = 16, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def token_ids(out: RequestOutput) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


# -- the scheduler's bookkeeping ----------------------------------------------------------------------------
def make_sched(
    num_blocks: int = 16,
    caching: bool = False,
    max_num_seqs: int = 8,
    host_blocks: int = 0,
    mode: str = "auto",
) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, caching, host_blocks)
    config = SchedulerConfig(
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=max_num_seqs,
        preemption_mode=mode,  # type: ignore[arg-type]
    )
    return Scheduler.from_config(config, kv, PreemptionCostModel(1, 1e9, 1e4))


def step(s: Scheduler, token: int = 7):  # type: ignore[no-untyped-def]
    out = s.schedule()
    s.update_from_output(out, {sr.req_id: [token] for sr in out.scheduled if sr.samples})
    s.kv.pool.check_invariants()
    return out


@pytest.mark.parametrize("caching", [False, True])
def test_fork_shares_the_full_blocks_and_copies_the_partial_one_for_all_children_but_the_first(
    caching: bool,
) -> None:
    s = make_sched(caching=caching)
    parent = Request("p", list(range(1, 11)), SamplingParams(n=3, max_tokens=8), 0.0, max_tokens=8)
    s.add_request(parent)
    # The parent computes the prompt but its last token (9 of 10: blocks 0, 1 full, 2 holding one token)
    # and samples nothing.
    out = step(s)
    [row] = out.scheduled
    assert (row.req_id, len(row.token_ids), row.samples) == ("p", 9, False)
    assert s.kv.block_tables["p"] == [0, 1, 2] and s.kv.num_free_blocks == 13
    # The next step forks: block 2 is copied into 3 and 4 before the forward; each child computes token 9
    # into its own copy and samples its first token.
    out = step(s, token=50)
    assert list(out.block_copies) == [(2, 3), (2, 4)]
    ids = [child_request_id("p", i) for i in range(3)]
    assert [sr.req_id for sr in out.scheduled] == ids
    assert all(sr.token_ids == [10] and sr.start_pos == 9 and sr.samples for sr in out.scheduled)
    tables = [s.kv.block_tables[c] for c in ids]
    assert tables == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    ref = s.kv.pool.ref_cnt
    assert [ref[b] for b in range(5)] == [3, 3, 1, 1, 1]
    assert s.kv.num_free_blocks == 11  # the prompt's 2 full blocks once, a partial block per child
    assert "p" in out.finished_req_ids  # the runner drops the parent's state
    assert "p" not in s.requests and all(s.requests[c].parent_id == "p" for c in ids)
    children = [s.requests[c] for c in ids]
    assert [c.index for c in children] == [0, 1, 2]
    assert all(c.token_ids == [*range(1, 11), 50] for c in children)
    # Position 12 (the third step from here) needs a new block per child: its own.
    for _ in range(3):
        step(s)
    assert [s.kv.block_tables[c][3:] for c in ids] == [[5], [6], [7]]
    # Aborting the request by its id aborts every child and frees every block.
    aborted = s.abort(["p"])
    assert aborted == children and all(c.status == RequestStatus.FINISHED_ABORTED for c in children)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 16
    s.kv.pool.check_invariants()
    assert not s.forks.families and not s.forks.parents


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_parent_preempted_before_the_fork_forks_when_it_comes_back(mode: str) -> None:
    s = make_sched(host_blocks=8, mode=mode)
    parent = Request("p", list(range(1, 11)), SamplingParams(n=2, max_tokens=3), 0.0, max_tokens=3)
    s.add_request(parent)
    step(s)
    swap_out: list[tuple[int, int]] = []
    s._preempt(parent, swap_out)
    assert parent.status == (RequestStatus.SWAPPED if mode == "swap" else RequestStatus.PREEMPTED)
    assert len(swap_out) == (3 if mode == "swap" else 0)
    out = step(s)  # back: swapped in, or its prompt but the last token recomputed
    assert all(not sr.samples for sr in out.scheduled) and "p" in s.requests
    out = step(s)
    assert len(out.scheduled) == 2 and all(sr.samples for sr in out.scheduled)
    for _ in range(4):
        step(s)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 16
    assert s.kv.swap_space.num_free == 8


def test_a_prompt_ending_on_a_block_boundary_forks_without_copies() -> None:
    s = make_sched()
    s.add_request(Request("p", list(range(1, 10)), SamplingParams(n=2, max_tokens=2), 0.0, max_tokens=2))
    step(s)  # 8 tokens: two full blocks
    out = step(s)
    assert not out.block_copies
    assert [s.kv.block_tables[child_request_id("p", i)] for i in range(2)] == [[0, 1, 2], [0, 1, 3]]


def test_fork_without_a_free_block_leaves_the_child_to_compute_the_partial_block() -> None:
    s = make_sched(num_blocks=4)
    parent = Request("p", list(range(1, 11)), SamplingParams(n=2, max_tokens=1), 0.0, max_tokens=1)
    s.add_request(parent)
    step(s)
    s.kv.pool.allocate(1)  # the last free block: nothing left for the copy
    assert s._fork(parent) == []  # no copies
    c0, c1 = (s.requests[child_request_id("p", i)] for i in range(2))
    assert (c0.num_computed_tokens, c1.num_computed_tokens) == (9, 8)
    assert s.kv.block_tables[c1.request_id] == [0, 1]


def test_one_token_prompt_forks_with_nothing_shared() -> None:
    s = make_sched()
    s.add_request(Request("p", [5], SamplingParams(n=3, max_tokens=2), 0.0, max_tokens=2))
    for _ in range(6):
        step(s)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 16


def test_admission_reserves_the_prompt_once_and_counts_the_childrens_seats() -> None:
    s = make_sched(num_blocks=64, max_num_seqs=4)
    parent = Request("p", list(range(1, 11)), SamplingParams(n=3, max_tokens=8), 0.0, max_tokens=8)
    s.add_request(parent)
    # 2 shared full blocks, then per child blocks 2..4 (tokens 8..17): 2 + 3 x 3.
    assert s.admission.blocks_needed(parent, 0) == 11
    other = Request("o", [1, 2], SamplingParams(n=2, max_tokens=8), 1.0, max_tokens=8)
    s.add_request(other)
    # Load shedding sees each queued family's n outputs to come, its prompt once.
    snap = s.snapshot()
    assert (snap.num_queued, snap.queued_prefill_tokens, snap.queued_decode_tokens) == (2, 12, 3 * 8 + 2 * 8)
    step(s)
    # The parent holds three of the four seats; the other family needs two more.
    assert [r.request_id for r in s.running] == ["p"]
    with pytest.raises(ValueError, match=r"n \(5\) exceeds max_num_seqs \(4\)"):
        s.add_request(Request("big", [1], SamplingParams(n=5), 2.0, max_tokens=16))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(Request("p", [1], SamplingParams(), 2.0, max_tokens=16))
    for _ in range(40):
        if not s.has_unfinished():
            break
        step(s)
        assert len(s.running) <= 4
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


# -- the engine ---------------------------------------------------------------------------------------------
# float32 wherever outputs are compared token for token: "auto" is bf16 on a CPU with bf16 matrix units, whose
# results legitimately change with the batch and with prefix-cache hits (a second seeded run hits the cache).
EXACT = "float32"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", max_num_batched_tokens=64, max_model_len=256, block_size=8, dtype=EXACT)


def test_greedy_choices_equal_the_n1_greedy_output(llm: LLM) -> None:
    solo = [llm.generate([p], greedy(20))[0].outputs[0].token_ids for p in PROMPTS]
    outs = llm.generate(PROMPTS, greedy(20, n=3))
    assert [token_ids(o) for o in outs] == [[s] * 3 for s in solo]
    assert all(c.finish_reason == "length" and c.text for o in outs for c in o.outputs)
    assert llm.engine.all_blocks_free()


@pytest.mark.parametrize(
    "engine_args",
    [
        {"enable_prefix_caching": False},
        # Chunked prefill: the 50-token prompt takes several steps before the fork.
        {"max_num_batched_tokens": 16},
        {"enable_prefix_caching": False, "max_num_batched_tokens": 16, "block_size": 4},
        {"batching": "static", "max_num_seqs": 16},
    ],
)
def test_greedy_choices_under_other_engine_settings(engine_args: dict[str, object]) -> None:
    prompts = [*PROMPTS, "z" * 50]
    ref = LLM("tiny", max_model_len=256, block_size=8, dtype=EXACT)
    solo = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy(12))]
    llm = LLM("tiny", **{"max_model_len": 256, "block_size": 8, "dtype": EXACT, **engine_args})  # type: ignore[arg-type]
    outs = llm.generate(prompts, greedy(12, n=3))
    assert [token_ids(o) for o in outs] == [[s] * 3 for s in solo]
    assert llm.engine.all_blocks_free()


def test_n_beyond_max_num_seqs_is_refused_up_front() -> None:
    llm = LLM("tiny", max_model_len=64, block_size=8, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"n \(5\) exceeds max_num_seqs \(4\)"):
        llm.generate(["x"], SamplingParams(n=5))
    assert not llm.engine.has_unfinished()


def test_seeded_choices_are_the_same_alone_and_in_a_batch_and_differ_from_each_other(llm: LLM) -> None:
    seeded = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    alone = token_ids(llm.generate(["seeded prompt"], seeded)[0])
    assert len({tuple(t) for t in alone}) == 3  # different children draw differently
    others = [SamplingParams(max_tokens=n, temperature=1.3, ignore_eos=True) for n in (5, 30)]
    outs = llm.generate(
        ["noise a", "seeded prompt", "noise bb", "seeded prompt"], [others[0], seeded, others[1], seeded]
    )
    assert token_ids(outs[1]) == alone and token_ids(outs[3]) == alone
    # Child i draws with seed + i: child 0 is the n=1 request with the same seed, child 1 the one with seed + 1.
    for i in (0, 1):
        one = SamplingParams(max_tokens=20, temperature=1.0, seed=99 + i, ignore_eos=True)
        assert llm.generate(["seeded prompt"], one)[0].outputs[0].token_ids == alone[i]
    assert llm.engine.all_blocks_free()


def test_each_choice_carries_its_own_logprobs(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    [one] = llm.generate(["logprobs"], sp)
    [three] = llm.generate(["logprobs"], SamplingParams(**{**_fields(sp), "n": 3, "logprobs": 2}))
    ref = one.outputs[0].logprobs
    assert ref is not None and len(ref) == 6
    for c in three.outputs:
        assert c.logprobs is not None
        assert [(t.token_id, len(t.top)) for t in c.logprobs] == [(t.token_id, 2) for t in ref]
        assert [t.logprob for t in c.logprobs] == pytest.approx([t.logprob for t in ref], abs=1e-5)


def test_prompt_logprobs_come_once_on_the_first_output() -> None:
    """The parent scores the prompt before the fork (its last prompt token predicts no prompt token): the
    request's first output carries them, as n=1's does; no later output repeats them."""
    core = EngineCore(
        engine_config_from_kwargs(
            "tiny", max_num_batched_tokens=8, max_model_len=128, block_size=4, dtype=EXACT
        )
    )
    prompt = list(range(3, 23))
    core.add_request(
        "one", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    )
    core.add_request(
        "three",
        prompt,
        SamplingParams(n=3, max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
    )
    outs: dict[str, list[RequestOutput]] = {"one": [], "three": []}
    while core.has_unfinished():
        for o in core.step():
            outs[o.request_id].append(o)
    ref = outs["one"][0].prompt_logprobs
    assert ref is not None and len(ref) == len(prompt) - 1
    got = outs["three"][0].prompt_logprobs
    assert got is not None
    assert [(t.token_id, t.rank) for t in got] == [(t.token_id, t.rank) for t in ref]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in ref], abs=1e-5)
    assert all(o.prompt_logprobs is None for o in outs["three"][1:])
    assert core.all_blocks_free()


def test_stop_strings_apply_per_choice(llm: LLM) -> None:
    sp = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    free = [c.text for c in llm.generate(["stop per choice"], sp)[0].outputs]
    stop = free[1][8:10]
    assert stop
    stopped = llm.generate(["stop per choice"], SamplingParams(**{**_fields(sp), "stop": [stop]}))[0]
    for text, c in zip(free, stopped.outputs):
        cut = text.find(stop)
        if cut == -1:
            assert (c.text, c.finish_reason) == (text, "length")
        else:
            assert (c.text, c.finish_reason, c.stop_reason) == (text[:cut], "stop", stop)
    assert stopped.outputs[1].finish_reason == "stop"
    assert llm.engine.all_blocks_free()


def test_abort_after_one_choice_stopped_aborts_only_the_others() -> None:
    core = EngineCore(engine_config_from_kwargs("tiny", max_model_len=256, block_size=8, dtype=EXACT))
    sp = SamplingParams(n=3, max_tokens=60, temperature=1.0, seed=7, ignore_eos=True)
    core.add_request("free", "stop per choice", sp)
    free: dict[int, str] = {0: "", 1: "", 2: ""}
    while core.has_unfinished():
        for o in core.step():
            for c in o.outputs:
                free[c.index] += c.text
    stop = free[1][8:10]

    def first_stop(i: int) -> int:  # where choice i meets the stop string (its end if never)
        k = free[i].find(stop)
        return len(free[i]) if k == -1 else k

    # Choice 1 meets it first in its text (and, with this seed, stops while the others run on).
    assert stop and first_stop(1) < min(first_stop(0), first_stop(2))
    core.add_request("r", "stop per choice", SamplingParams(**{**_fields(sp), "stop": [stop]}))
    done: set[int] = set()
    while not done:
        for o in core.step():
            assert not o.finished
            done |= {c.index for c in o.outputs if c.finish_reason is not None}
    assert done == {1}
    [out] = core.abort(["r"])
    assert out.finished and [(c.index, c.finish_reason) for c in out.outputs] == [(0, "abort"), (2, "abort")]
    assert core.all_blocks_free() and not core.has_unfinished()


def _fields(sp: SamplingParams) -> dict[str, object]:
    return {f: getattr(sp, f) for f in ("n", "max_tokens", "temperature", "seed", "ignore_eos")}


def test_the_prompt_is_held_once_and_each_childs_partial_block_is_its_own() -> None:
    core = EngineCore(
        engine_config_from_kwargs(
            "tiny", num_blocks=64, max_model_len=256, block_size=8, enable_prefix_caching=False
        )
    )
    prompt = list(range(1, 101))  # 100 tokens: 12 full blocks, and 3 tokens in block 12 before the fork
    core.add_request("r", prompt, greedy(16, n=3))
    outs: list[RequestOutput] = []
    while any(r.parent_id is None for r in core.scheduler.requests.values()):
        outs.extend(core.step())  # the parent's prefill, then the fork and the children's first tokens
    table_blocks = [core.kv.block_tables[child_request_id("r", i)] for i in range(3)]
    # Forked: 12 shared blocks and one partial block per child (the parent's, two copies).
    assert core.kv.num_free_blocks == 64 - (12 + 3)
    assert all(t[:12] == table_blocks[0][:12] for t in table_blocks)
    assert len({t[12] for t in table_blocks}) == 3
    ref = core.kv.pool.ref_cnt
    assert all(ref[b] == 3 for b in table_blocks[0][:12]) and all(ref[t[12]] == 1 for t in table_blocks)
    while core.has_unfinished():
        outs.extend(core.step())
        if core.has_unfinished():
            # 100 + k tokens per child, 99 + k computed: the shared 12, and ceil((99 + k) / 8) - 12 blocks
            # of its own each.
            k = core.scheduler.requests[child_request_id("r", 0)].num_output_tokens
            own = -(-(99 + k) // 8) - 12
            assert core.kv.num_free_blocks == 64 - (12 + 3 * own)
            assert core.stats.kv_usage == pytest.approx((12 + 3 * own) / 64)
    assert core.all_blocks_free()
    # One request id outside: deltas of every choice that progressed, finished only on the last output.
    assert {o.request_id for o in outs} == {"r"}
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 48


def test_abort_before_and_after_the_fork_frees_everything() -> None:
    core = EngineCore(
        engine_config_from_kwargs("tiny", max_num_batched_tokens=16, max_model_len=256, block_size=8)
    )
    prompt = list(range(1, 60))
    core.add_request("early", prompt, greedy(40, n=3))
    core.step()  # a prefill chunk of the parent: not forked yet
    assert "early" in core.scheduler.requests
    [out] = core.abort(["early"])
    assert out.finished and [(c.index, c.finish_reason) for c in out.outputs] == [
        (i, "abort") for i in range(3)
    ]
    assert core.all_blocks_free() and not core.has_unfinished()

    core.add_request("late", prompt, greedy(40, n=3))
    for _ in range(12):
        core.step()
    assert core.scheduler.forks.families.get("late")
    [out] = core.abort(["late"])
    assert out.request_id == "late" and out.finished
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(i, "abort") for i in range(3)]
    assert core.all_blocks_free() and not core.has_unfinished()
    assert core.abort(["late"]) == []


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_children_still_give_the_greedy_outputs(mode: str) -> None:
    prompts = ["preempt me please, a longer prompt", "another prompt here", "third one"]
    ref = LLM("tiny", max_model_len=256, block_size=4, dtype=EXACT)
    solo = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy(40))]
    tight = LLM(
        "tiny",
        dtype=EXACT,
        max_model_len=256,
        block_size=4,
        num_blocks=64,
        preemption_mode=mode,
        swap_space_bytes=1 << 22,
        enable_prefix_caching=False,
        max_num_batched_tokens=32,
    )
    # Admission trusts max_tokens; under-promise so that the running children outgrow the cache.
    sched = tight.engine.scheduler
    sched.admission.output_estimate = lambda req: 0  # type: ignore[method-assign]
    victims: list[Request] = []
    real_preempt = sched._preempt

    def preempt(req: Request, swap_out: list[tuple[int, int]]) -> None:
        victims.append(req)
        real_preempt(req, swap_out)

    sched._preempt = preempt  # type: ignore[method-assign]
    outs = tight.generate(prompts, greedy(40, n=3))
    assert any(v.parent_id is not None for v in victims)  # forked children gave way, not only parents
    assert [token_ids(o) for o in outs] == [[s] * 3 for s in solo]
    stats = tight.engine.stats
    preempted = stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute
    assert preempted > 0
    assert tight.engine.all_blocks_free()


def test_speculative_ngram_children_equal_non_speculative() -> None:
    prompts = ["abc abc abc abc abc", "one two one two one two"]
    plain = LLM("tiny", max_model_len=256, block_size=8, dtype=EXACT)
    spec = LLM(
        "tiny",
        dtype=EXACT,
        max_model_len=256,
        block_size=8,
        speculative_method="ngram",
        num_speculative_tokens=3,
        adaptive_speculation=False,  # drafts whatever this machine's timings say
    )
    ref = [token_ids(o) for o in plain.generate(prompts, greedy(24, n=3))]
    assert [token_ids(o) for o in spec.generate(prompts, greedy(24, n=3))] == ref
    assert spec.engine.stats.spec_num_draft_tokens > 0
    assert spec.engine.all_blocks_free()


def test_draft_model_children_draft_on_their_own() -> None:
    """The draft model is the target: every draft is accepted only if each child's draft KV (its own catch-up
    over the shared prompt blocks) is right."""
    prompts = ["draft me", "and me too, with a longer prompt"]
    base = [
        o.outputs[0].token_ids
        for o in LLM("tiny", max_model_len=256, dtype=EXACT).generate(prompts, greedy(20))
    ]
    llm = LLM(
        "tiny",
        dtype=EXACT,
        max_model_len=256,
        speculative_method="draft",
        speculative_model="tiny",
        num_speculative_tokens=3,
        adaptive_speculation=False,
    )
    assert [token_ids(o) for o in llm.generate(prompts, greedy(20, n=3))] == [[b] * 3 for b in base]
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert llm.engine.all_blocks_free()


def test_async_stream_is_one_request_with_indexed_choices_and_close_aborts_all() -> None:
    engine = AsyncEngine(engine_config_from_kwargs("tiny", max_model_len=256, block_size=8, dtype=EXACT))
    engine.start()
    ref = (
        LLM("tiny", max_model_len=256, block_size=8, dtype=EXACT)
        .generate(["stream n"], greedy(10))[0]
        .outputs[0]
    )

    async def main() -> None:
        stream = engine.add_request("stream n", greedy(10, n=3), request_id="s")
        assert stream.num_prompt_tokens == len(engine.tokenizer.encode("stream n"))  # the prompt, once
        outs = [o async for o in stream]
        assert all(o.request_id == "s" for o in outs)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        texts = ["", "", ""]
        for o in outs:
            assert sorted(c.index for c in o.outputs) == [c.index for c in o.outputs]
            for c in o.outputs:
                texts[c.index] += c.text
        assert texts == [ref.text] * 3
        long = engine.add_request("abandon n", greedy(200, n=3))
        async for _ in long:
            break
        long.close()
        for _ in range(300):
            if not engine.core.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not engine.core.has_unfinished()
        assert engine.core.all_blocks_free()

    metrics = EngineMetrics("m")
    engine.add_observer(metrics.on_step)
    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    # Usage counts the prompt once, the choices' tokens all, and one request per stream.
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for x in f.samples
    }
    prompt_len = len(engine.tokenizer.encode("stream n")) + len(engine.tokenizer.encode("abandon n"))
    assert samples[("vllm:prompt_tokens_total", (("model_name", "m"),))] == prompt_len
    generated = samples[("vllm:generation_tokens_total", (("model_name", "m"),))]
    assert 3 * 10 < generated < 3 * 10 + 3 * 200
    success = {k[1]: v for k, v in samples.items() if k[0] == "vllm:request_success_total" and v}
    assert success == {
        (("finished_reason", "length"), ("model_name", "m")): 1,
        (("finished_reason", "abort"), ("model_name", "m")): 1,
    }


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_families_arrivals_and_aborts_leave_every_block_free(mode: str) -> None:
    """n in 1..4, prompts of 1..30 tokens, arrivals and aborts at random steps, in a cache that must preempt:
    every block comes back, each unaborted request gives n whole choices."""
    rng = random.Random(21)
    core = EngineCore(
        engine_config_from_kwargs(
            "tiny",
            dtype=EXACT,
            num_blocks=40,
            block_size=4,
            max_model_len=80,
            max_num_batched_tokens=24,
            swap_space_bytes=1 << 20,
            preemption_mode=mode,
        )
    )
    core.scheduler.admission.output_estimate = lambda req: 0  # type: ignore[method-assign]  # must preempt
    reqs = [
        (rng.randint(1, 30), rng.randint(1, 16), rng.randint(0, 12), rng.choice([-1, -1, rng.randint(0, 20)]))
        for _ in range(14)
    ]
    ns = [rng.randint(1, 4) for _ in reqs]

    def prompt(i: int) -> list[int]:
        return [3 + (i * 7 + j) % 200 for j in range(reqs[i][0])]

    pending = list(range(len(reqs)))
    produced: dict[str, list[list[int]]] = {}
    finished: set[str] = set()
    for step_no in range(600):
        for i in list(pending):
            _, mt, at, _ = reqs[i]
            if at <= step_no:
                pending.remove(i)
                # Odd ones sample (seeded), even ones are greedy: checked token for token below.
                sp = SamplingParams(
                    n=ns[i], max_tokens=mt, ignore_eos=True, seed=i, temperature=1.0 if i % 2 else 0.0
                )
                core.add_request(str(i), prompt(i), sp)
                produced[str(i)] = [[] for _ in range(ns[i])]
        for out in core.abort([str(i) for i, r in enumerate(reqs) if r[3] == step_no]) + core.step():
            assert out.request_id not in finished
            for c in out.outputs:
                produced[out.request_id][c.index].extend(c.token_ids)
            if out.finished:
                finished.add(out.request_id)
        core.kv.pool.check_invariants()
        if not pending and not core.has_unfinished():
            break
    assert not core.has_unfinished() and core.all_blocks_free()
    assert core.kv.swap_space.num_free == core.kv.swap_space.num_host_blocks
    assert finished == set(produced)
    stats = core.stats
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    ref = LLM("tiny", block_size=4, max_model_len=80, dtype=EXACT)
    for i, (_, mt, _, ab) in enumerate(reqs):
        if ab == -1:
            assert [len(t) for t in produced[str(i)]] == [mt] * ns[i], i
            if i % 2 == 0:
                [solo] = ref.generate([prompt(i)], greedy(mt))
                assert produced[str(i)] == [solo.outputs[0].token_ids] * ns[i], i
