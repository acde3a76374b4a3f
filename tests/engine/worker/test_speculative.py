"""Speculative decoding: proposals, verification, the adaptive draft length, and exactness end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkwise import LLM, SamplingParams
from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.sched.draft_length import AdaptiveDraftLength, StepCostModel
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler
from chunkwise.engine.worker.ngram import NgramProposer
from chunkwise.engine.worker.rejection import verify_greedy, verify_sampled
from tests.hf_models import hf_greedy, save_random_llama


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert p.lookup([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the most recent match of [5, 6]
    assert p.lookup([1, 2, 3], 4) == []
    assert p.lookup([1, 2, 1], 0) == []


def test_verify_greedy_accepts_the_matching_run_then_the_target_token():
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert verify_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert verify_greedy([8, 5, 6, 7], [4, 5, 6]) == [8]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# 99.9th percentile of chi-square with 5 degrees of freedom.
CHI2_5_999 = 20.52


@pytest.mark.parametrize("draft_kind", ["deterministic", "distribution"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    draft = torch.tensor([0.40, 0.05, 0.05, 0.10, 0.10, 0.30])
    counts = torch.zeros(6)
    n = 20000
    for _ in range(n):
        if draft_kind == "deterministic":
            d = 0  # an n-gram proposer always guesses token 0
            out = verify_sampled(torch.stack([target, target]), [d], None, gen)
        else:
            d = int(torch.multinomial(draft, 1, generator=gen))
            out = verify_sampled(torch.stack([target, target]), [d], draft[None], gen)
        counts[out[0]] += 1
    assert _chi_square(counts, target) < CHI2_5_999
    # The test has power: the draft's own distribution is far outside the bound.
    assert _chi_square(counts, draft) > 10 * CHI2_5_999


def test_adaptive_draft_length_falls_to_zero_under_saturation():
    # A step with a large fixed cost (weight reads) and a small per-token cost: drafting pays at batch 1.
    # The model's preference from its prior alone (choose() measures a plain step at a load before it
    # trusts the model there: tests/engine/sched/test_adaptive_draft.py drives it through measured steps).
    cost = StepCostModel(fixed_s=0.020, per_token_s=0.0001)
    policy = AdaptiveDraftLength(max_k=5, cost=cost, prior_acceptance=0.8)
    ks = [policy.preferred(n, min(5, 4096 // n - 1)) for n in (1, 8, 64, 256, 1024)]
    assert ks[0] >= 3
    assert ks == sorted(ks, reverse=True)  # more load, shorter drafts
    assert ks[-1] == 0  # per-token cost dominates: drafting gains nothing
    assert policy.choose(num_decode_rows=3000, budget=4096) == 0  # the budget forbids it
    assert policy.choose(num_decode_rows=600, budget=1024) == 0
    # Low acceptance: drafting wastes compute even at batch 1.
    assert AdaptiveDraftLength(5, cost, prior_acceptance=0.02).preferred(1, 5) == 0
    fixed = AdaptiveDraftLength(max_k=5, cost=cost, adaptive=False)
    assert fixed.choose(num_decode_rows=100, budget=1024) == 5


def test_step_cost_model_learns_plain_steps_and_what_drafts_add():
    # The prior (a forward-only probe) is far off; whole steps replace it: a plain step's plane in rows and
    # prompt tokens, and per row asked to draft, its host work plus a cost per drafted token.
    cost = StepCostModel(fixed_s=0.001, per_token_s=0.00001)

    def plain(rows: int, prompt: int = 0) -> float:
        return 0.005 + 0.0002 * rows + 0.00005 * prompt

    for _ in range(100):
        # (A step mostly prompt weighs little: its own regime; the prompt term is learnt from decode steps
        # that carry a short chunk.)
        for rows, prompt in ((1, 0), (10, 0), (100, 0), (50, 40)):
            cost.observe(plain(rows, prompt), rows, prompt)
        for k in (1, 2, 3, 4):
            cost.observe(plain(32) + 32 * (0.0003 + 0.00002 * k), 32, asked=32, drafted=32 * k)
    assert cost.plain_seconds(32) == pytest.approx(plain(32), rel=0.02)
    assert cost.plain_seconds(1, 100) == pytest.approx(plain(1, 100), rel=0.02)
    assert cost.draft_seconds(2) == pytest.approx(0.0003 + 0.00002 * 2, rel=0.05)
    # Steps mostly prompt are another regime (attention over long prompts, far from linear): a run of them
    # must not move what a decode step is expected to cost, which drafting is judged against.
    for rows in range(4, 32, 4):
        prompt = 40 * rows
        cost.observe(plain(rows + 1) + 1e-7 * prompt**2, rows + 1, prompt)
    assert cost.plain_seconds(32) == pytest.approx(plain(32), rel=0.05)


def _spec_sched(max_k: int = 3, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(64, 4)
    cost = PreemptionCostModel(64, 1e9, 1e4)
    policy = AdaptiveDraftLength(max_k, StepCostModel(1.0, 1e-6), adaptive=False)
    return Scheduler.from_config(
        SchedulerConfig(max_model_len=200, max_num_batched_tokens=budget), kv, cost, draft_length=policy
    )


def test_scheduler_budgets_and_reserves_drafts_and_rolls_back_rejections():
    s = _spec_sched(max_k=3)
    req = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10, temperature=0.0), 0.0, max_tokens=10)
    s.add_request(req)
    out = s.schedule()
    assert out.scheduled[0].num_spec_tokens == 0  # prefill first
    # Reservation: the formula (docs/scheduling.md) says 5 prompt tokens (2 blocks) + 10 output + 3 draft tokens (4 blocks),
    # but drafts stop at max_tokens, so the request never holds more than its 15 tokens: 4 blocks.
    assert s.admission.reservation(req, 10) == 4 and req.reserved_blocks == 4
    req.length_limit = 200  # as if it could run on: the formula's own answer
    assert s.admission.reservation(req, 10) == 2 + 4
    req.length_limit = 15
    s.update_from_output(out, {"a": [9]})
    out = s.schedule()
    sr = out.scheduled[0]
    assert sr.num_spec_tokens == 3 and sr.token_ids == [9] and out.num_batched_tokens == 4
    assert len(s.kv.block_tables["a"]) == 3  # room for positions 5..8
    # The runner drafted 3 tokens; the target accepted 1 and then sampled its own: 2 new tokens.
    s.update_from_output(out, {"a": [11, 12]}, {"a": 3})
    assert req.token_ids[-3:] == [9, 11, 12]
    assert req.num_computed_tokens == req.num_tokens - 1  # the rejected drafts' KV no longer counts
    assert s.stats.spec_num_draft_tokens == 3 and s.stats.spec_num_accepted_tokens == 1
    # Drafts never run past max_tokens: with 7 of 10 outputs made, 3 are left: 1 verified + 2 drafts.
    req.token_ids.extend([13] * 4)
    req.num_computed_tokens = req.num_tokens - 1
    assert s.schedule().scheduled[0].num_spec_tokens == 2


def test_per_request_opt_out_and_penalties_decode_plainly():
    s = _spec_sched()
    plain = Request("p", [1, 2], SamplingParams(max_tokens=5, speculative=False), 0.0, max_tokens=5)
    pen = Request("q", [1, 3], SamplingParams(max_tokens=5, presence_penalty=1.0), 1.0, max_tokens=5)
    s.add_request(plain)
    s.add_request(pen)
    s.update_from_output(s.schedule(), {"p": [7], "q": [7]})
    assert [sr.num_spec_tokens for sr in s.schedule().scheduled] == [0, 0]


REPETITIVE = [f"{'one two three four five six ' * 6}", f"{'la la la land ' * 8}", "abcabcabcabcabcabcabc"]


def test_ngram_speculation_gives_identical_greedy_output_and_accepts_drafts():
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    base = LLM("tiny", max_model_len=512, dtype="float32")
    # A fixed draft length: the adaptive one may draft nothing on a loaded machine (its cost model is timed).
    spec = LLM(
        "tiny",
        dtype="float32",
        max_model_len=512,
        speculative_method="ngram",
        num_speculative_tokens=4,
        adaptive_speculation=False,
    )
    want = [o.outputs[0].token_ids for o in base.generate(REPETITIVE, sp)]
    got = [o.outputs[0].token_ids for o in spec.generate(REPETITIVE, sp)]
    assert got == want
    stats = spec.engine.stats
    assert stats.spec_num_draft_tokens > 0
    assert spec.engine.kv.num_free_blocks == spec.engine.num_blocks


def test_ngram_speculation_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_random_llama(tmp_path, "gqa")
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7 + [12], list(range(20, 60))]
    max_new = [24, 16, 20]
    expected = hf_greedy(model_dir, prompts, max_new)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=3,
        block_size=4,
        adaptive_speculation=False,  # drafts every step, whatever this machine's timings say
    )
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_new]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == expected
    assert llm.engine.stats.spec_num_draft_tokens > 0


def test_seeded_sampling_stays_reproducible_with_speculation_on():
    # The draft length adapts to measured timings, which would change how many random draws a seeded request
    # consumes; seeded sampled requests therefore decode plainly and stay bit-reproducible.
    sp = SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True)
    base = LLM("tiny", max_model_len=512, dtype="float32")
    plain = base.generate(REPETITIVE[:1], sp)[0].outputs[0].token_ids
    llm = LLM("tiny", max_model_len=512, dtype="float32", speculative_method="ngram")
    a = llm.generate(REPETITIVE[:1], sp)[0].outputs[0].token_ids
    assert a == plain and len(a) == 40


def test_unseeded_sampling_with_speculation_ends_exactly():
    llm = LLM("tiny", max_model_len=512, speculative_method="ngram", adaptive_speculation=False)
    sp = SamplingParams(max_tokens=37, temperature=0.7, ignore_eos=True)
    outs = llm.generate(REPETITIVE, sp)
    assert [len(o.outputs[0].token_ids) for o in outs] == [37, 37, 37]
    assert llm.engine.stats.spec_num_draft_tokens > 0


def test_draft_model_that_is_the_target_has_every_draft_accepted():
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = ["draft me", "and me too, with a longer prompt"]
    plain = LLM("tiny", max_model_len=256, dtype="float32")
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    llm = LLM(
        "tiny",
        dtype="float32",
        max_model_len=256,
        speculative_method="draft",
        speculative_model="tiny",
        num_speculative_tokens=3,
        adaptive_speculation=False,
    )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == base
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_draft_model_speculation_matches_transformers(tmp_path: Path) -> None:
    target = save_random_llama(tmp_path, "gqa")
    draft = save_random_llama(tmp_path, "mqa", seed=1)
    prompts = [list(range(10, 30)), [7, 8, 9] * 5]
    max_new = [18, 12]
    expected = hf_greedy(target, prompts, max_new)
    llm = LLM(
        str(target),
        dtype="float32",
        speculative_method="draft",
        speculative_model=str(draft),
        num_speculative_tokens=3,
        adaptive_speculation=False,
        block_size=4,
        max_model_len=256,
    )
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_new]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == expected
    assert llm.engine.stats.spec_num_draft_tokens > 0


def test_draft_model_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs speculative_model"):
        LLM("tiny", speculative_method="draft")
    with pytest.raises(ValueError, match="must share a tokenizer"):
        LLM("tiny", speculative_method="draft", speculative_model=str(save_random_llama(tmp_path, "gqa")))


def test_rejection_sampling_over_several_drafts_keeps_each_positions_distribution() -> None:
    """Every position decided at once (sampled_decisions): the first token is distributed as the first
    position's target; given the first draft accepted, the second as the second position's; given both, the
    bonus as the last row's. A wrong position's replacement or bonus shows as another row's distribution."""
    gen = torch.Generator().manual_seed(1)
    first = torch.tensor([0.30, 0.05, 0.10, 0.25, 0.20, 0.10])
    second = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.10, 0.30])
    bonus = torch.tensor([0.10, 0.40, 0.05, 0.05, 0.30, 0.10])
    target = torch.stack([first, second, bonus])
    counts = [torch.zeros(6), torch.zeros(6), torch.zeros(6)]
    for _ in range(30000):
        out = verify_sampled(target, [0, 2], None, gen)  # drafts: token 0, then token 2
        for i, tok in enumerate(out):
            counts[i][tok] += 1
    assert _chi_square(counts[0], first) < CHI2_5_999
    assert _chi_square(counts[1], second) < CHI2_5_999
    # Both drafts accepted: the bonus token, from the last row.
    assert counts[2].sum() > 1000 and _chi_square(counts[2], bonus) < CHI2_5_999
    assert _chi_square(counts[1], bonus) > 10 * CHI2_5_999
