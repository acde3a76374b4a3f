from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_penalties,
    make_generator,
)

# Its expectations depend on the CPU's choices: `make test` runs it again under each CHUNKWISE_CPU_ISA.
pytestmark = pytest.mark.isa

CPU = torch.device("cpu")
# Chi-square critical values at p = 0.001 (df -> value), from the standard table.
CHI2_CRITICAL_0_001 = {3: 16.266, 5: 20.515}


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def race(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs both samplers of random rows: the CPU kernel's race and torch's (what CUDA runs)."""
    if request.param == "torch":
        monkeypatch.setattr("chunkwise.engine.sampling.sampler.exponential_race_available", lambda x: False)
    return str(request.param)


@pytest.fixture(autouse=True)
def _isolated_default_rng() -> Iterator[None]:
    # Unseeded rows draw from the global generator: pin it so every test is deterministic, and restore it.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def run(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> SamplerOutput:
    if outputs is None:
        outputs = [[] for _ in params]
    if generators is None:
        generators = [make_generator(p.seed, CPU) if p.seed is not None else None for p in params]
    batch = SamplingBatch.build(params, outputs, generators, CPU)
    return Sampler()(logits, batch)


def solo(
    logits_row: torch.Tensor,
    params: SamplingParams,
    output: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> int:
    out = run(logits_row.unsqueeze(0), [params], [output], [generator])
    return int(out.token_ids[0])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# --- batching and row isolation ---------------------------------------------------------------------


def test_greedy_rows_next_to_sampled_rows_match_their_solo_result() -> None:
    vocab = 64
    logits = random_logits(6, vocab, seed=1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.8, top_p=0.5),
        SamplingParams(temperature=1.3, top_k=1),
    ]
    outputs = [[], [1, 2], [int(logits[2].argmax()), 3], [], [4], []]
    batched = run(logits, params, outputs).token_ids.tolist()
    for row in (0, 2, 5):
        assert batched[row] == solo(logits[row], params[row], outputs[row])
    assert batched[0] == int(logits[0].argmax())
    assert batched[5] == int(logits[5].argmax())
    # The penalty moved row 2 off its raw argmax: proof that the penalty was applied to that row.
    assert batched[2] != int(logits[2].argmax())


def seeded_tokens(
    params: SamplingParams,
    row: int,
    companions: Sequence[SamplingParams],
    steps: int,
    vocab: int = 50,
) -> list[int]:
    """Tokens the seeded request at `row` samples over `steps` steps among `companions`."""
    own = make_generator(params.seed if params.seed is not None else 0, CPU)
    companion_generators = [make_generator(p.seed, CPU) if p.seed is not None else None for p in companions]
    tokens = []
    for step in range(steps):
        own_logits = random_logits(1, vocab, seed=1000 + step)
        others = random_logits(len(companions), vocab, seed=5000 + step)
        logits = torch.cat([others[:row], own_logits, others[row:]])
        all_params = [*companions[:row], params, *companions[row:]]
        generators = [*companion_generators[:row], own, *companion_generators[row:]]
        # The request's own history is fixed; the companions' differ, to tempt their penalties to leak.
        own_output = [(step * 7) % vocab] * step
        other_outputs = [[(step * 7 + i + 1) % vocab] * step for i in range(len(companions))]
        outputs = [*other_outputs[:row], own_output, *other_outputs[row:]]
        tokens.append(int(run(logits, all_params, outputs, generators).token_ids[row]))
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1234),
        SamplingParams(temperature=1.5, top_p=0.9, seed=99),
        SamplingParams(temperature=0.7, top_k=8, frequency_penalty=0.5, seed=2**40),
    ],
)
def test_seeded_row_is_independent_of_companions_and_row(params: SamplingParams) -> None:
    steps = 30
    alone = seeded_tokens(params, 0, [], steps)
    companions = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=3),
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.5, top_p=0.3, presence_penalty=2.0),
    ]
    assert seeded_tokens(params, 2, companions, steps) == alone
    assert seeded_tokens(params, 0, companions[::-1], steps) == alone
    assert seeded_tokens(params, 4, companions, steps) == alone
    assert seeded_tokens(params, 1, [SamplingParams(temperature=0.3)] * 9, steps) == alone
    # Not vacuous: the sequence varies, and another seed gives another sequence.
    assert len(set(alone)) > 1
    other_seed = SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        frequency_penalty=params.frequency_penalty,
        seed=(params.seed or 0) + 1,
    )
    assert seeded_tokens(other_seed, 0, [], steps) != alone


def test_same_seed_in_one_batch_gives_the_same_tokens() -> None:
    logits = random_logits(1, 100, seed=3, scale=1.0).expand(4, -1).contiguous()
    params = [SamplingParams(temperature=1.0, seed=42)] * 3 + [SamplingParams(temperature=1.0, seed=43)]
    first = run(logits, params).token_ids.tolist()
    assert first[0] == first[1] == first[2]
    assert first[0] == solo(logits[0], params[0], generator=make_generator(42, CPU))


def test_generator_persists_across_steps() -> None:
    logits = random_logits(1, 100, seed=4, scale=0.5)
    params = SamplingParams(temperature=1.0, seed=5)
    generator = make_generator(5, CPU)
    tokens = [solo(logits[0], params, generator=generator) for _ in range(20)]
    # Reusing the request's generator advances it; a fresh one per step would repeat the first token.
    assert len(set(tokens)) > 1
    fresh = [solo(logits[0], params, generator=make_generator(5, CPU)) for _ in range(5)]
    assert fresh == [tokens[0]] * 5


# --- truncation -------------------------------------------------------------------------------------


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(32, 40, seed=5)
    params = [
        SamplingParams(temperature=t, top_k=1, seed=s)
        for t, s in zip([0.5, 1.0, 2.0, 5.0] * 8, [None, 3] * 16)
    ]
    assert torch.equal(run(logits, params).token_ids, logits.argmax(dim=-1))


def test_top_k_never_samples_outside_the_top_k() -> None:
    vocab, k, draws = 30, 4, 4000
    logits = random_logits(1, vocab, seed=6, scale=0.5).expand(draws, -1).contiguous()
    params = [SamplingParams(temperature=5.0, top_k=k)] * draws
    tokens = set(run(logits, params).token_ids.tolist())
    top = set(logits[0].topk(k).indices.tolist())
    assert tokens == top


def test_top_p_samples_only_from_the_nucleus_in_proportion() -> None:
    probs = torch.tensor([0.04, 0.5, 0.1, 0.3, 0.06])
    draws = 8000
    logits = probs.log().expand(draws, -1).contiguous()
    # 0.5 < 0.75 <= 0.5 + 0.3: the nucleus is {1, 3}.
    tokens = run(logits, [SamplingParams(top_p=0.75)] * draws).token_ids
    assert set(tokens.tolist()) == {1, 3}
    assert abs(float((tokens == 1).float().mean()) - 0.5 / 0.8) < 0.03


def test_top_k_then_top_p_per_row() -> None:
    probs = torch.tensor([0.35, 0.3, 0.2, 0.1, 0.05])
    draws = 3000
    logits = probs.log().expand(2 * draws, -1).contiguous()
    # Row group A: top-k 3 renormalises to (0.412, 0.353, 0.235), so top-p 0.6 keeps {0, 1}.
    # Row group B: top-p 0.6 alone keeps {0, 1} as well, top-p 0.9 keeps {0, 1, 2, 3}.
    params = [SamplingParams(top_k=3, top_p=0.6)] * draws + [SamplingParams(top_p=0.9)] * draws
    tokens = run(logits, params).token_ids
    assert set(tokens[:draws].tolist()) == {0, 1}
    assert set(tokens[draws:].tolist()) == {0, 1, 2, 3}


# --- temperature ------------------------------------------------------------------------------------


def test_temperature_frequencies_match_softmax_of_scaled_logits() -> None:
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature, draws = 2.0, 20000
    logits = logits_row.expand(draws, -1).contiguous()
    tokens = run(logits, [SamplingParams(temperature=temperature)] * draws).token_ids
    counts = torch.bincount(tokens, minlength=6).double()
    expected = (logits_row.double() / temperature).softmax(-1)
    assert chi_square(counts, expected) < CHI2_CRITICAL_0_001[5]
    # The test has the power to notice a temperature that was not applied.
    assert chi_square(counts, logits_row.double().softmax(-1)) > 10 * CHI2_CRITICAL_0_001[5]


def test_mixed_temperatures_each_follow_their_own() -> None:
    logits_row = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = 10000
    logits = logits_row.expand(2 * draws, -1).contiguous()
    # Interleaved, so that a sampler reading one temperature for the batch would fail both halves.
    params = [SamplingParams(temperature=t) for _ in range(draws) for t in (0.5, 3.0)]
    tokens = run(logits, params).token_ids
    for offset, temperature in ((0, 0.5), (1, 3.0)):
        counts = torch.bincount(tokens[offset::2], minlength=4).double()
        expected = (logits_row.double() / temperature).softmax(-1)
        assert chi_square(counts, expected) < CHI2_CRITICAL_0_001[3]


def test_tiny_temperature_is_finite_and_near_greedy() -> None:
    logits = random_logits(8, 50, seed=8, scale=30.0)
    out = run(logits, [SamplingParams(temperature=1e-30)] * 8)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


# --- penalties --------------------------------------------------------------------------------------


def test_penalties_change_only_their_own_row_and_match_the_formula() -> None:
    vocab = 8
    logits = random_logits(3, vocab, seed=9)
    params = [
        SamplingParams(),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(presence_penalty=-1.0),
    ]
    outputs = [[2, 2, 5], [2, 2, 5, 7], [0, 0, 0]]
    batch = SamplingBatch.build(params, outputs, [None] * 3, CPU)
    penalised = apply_penalties(logits, batch)

    expected = logits.clone()
    # Row 1: token 2 seen twice, tokens 5 and 7 once each.
    expected[1, 2] -= 0.5 + 0.3 * 2
    expected[1, 5] -= 0.5 + 0.3 * 1
    expected[1, 7] -= 0.5 + 0.3 * 1
    # Row 2: a negative presence penalty raises token 0 once, however often it was seen.
    expected[2, 0] += 1.0
    assert torch.equal(penalised[0], logits[0])
    torch.testing.assert_close(penalised, expected)
    # The caller's logits are left alone.
    assert not torch.equal(penalised, logits)


def test_penalty_moves_the_greedy_choice_of_its_row_only() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, frequency_penalty=0.06),
    ]
    outputs = [[0], [0], [0, 0]]
    # Row 2: 2.0 - 0.06 * 2 = 1.88 < 1.9.
    assert run(logits, params, outputs).token_ids.tolist() == [1, 0, 1]


def test_penalties_count_generated_tokens_only_via_the_batch() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    assert run(logits, params, [[]]).token_ids.tolist() == [0]
    assert run(logits, params, [[0]]).token_ids.tolist() == [1]


# --- log-probs --------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = random_logits(4, 32, seed=10)
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=2.0, top_k=3, logprobs=5),
        SamplingParams(temperature=0.5, presence_penalty=2.0, logprobs=2, seed=1),
        SamplingParams(temperature=1.0),
    ]
    outputs = [[], [], [int(logits[2].argmax())], []]
    out = run(logits, params, outputs)
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs is not None
    assert out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (4, 5)
    expected_values, expected_ids = raw.topk(5, dim=-1)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(values, expected_values)
    assert abs(math.fsum(values[0].exp().tolist()) - float(expected_values[0].exp().sum())) < 1e-6


def test_logprobs_zero_gives_only_the_chosen_token_and_none_gives_nothing() -> None:
    logits = random_logits(2, 16, seed=11)
    only_chosen = run(logits, [SamplingParams(logprobs=0), SamplingParams()])
    assert only_chosen.logprobs is not None
    assert only_chosen.top_logprobs is None
    nothing = run(logits, [SamplingParams(), SamplingParams(temperature=0.0)])
    assert nothing.logprobs is None
    assert nothing.top_logprobs is None


# --- batch building and edge cases ------------------------------------------------------------------


def test_build_sets_fast_path_flags() -> None:
    greedy = SamplingBatch.build([SamplingParams(temperature=0.0, top_p=0.5)] * 2, [[], []], [None] * 2, CPU)
    assert greedy.all_greedy
    assert not greedy.any_top_k_or_p
    assert not greedy.any_penalty
    assert greedy.output_token_ids is None
    mixed = SamplingBatch.build(
        [SamplingParams(), SamplingParams(top_k=5, frequency_penalty=0.1)], [[1], [2, 3]], [None] * 2, CPU
    )
    assert not mixed.all_greedy
    assert mixed.any_top_k_or_p
    assert mixed.any_penalty
    # Only penalised rows carry their history to the device.
    assert mixed.output_token_ids == [[], [2, 3]]
    assert mixed.top_k.dtype == torch.int64
    assert mixed.temperature.dtype == torch.float32


def test_build_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.build([SamplingParams()], [[], []], [None], CPU)
    with pytest.raises(ValueError, match="seed=3"):
        SamplingBatch.build([SamplingParams(seed=3)], [[]], [None], CPU)


def test_greedy_seeded_row_does_not_consume_its_generator() -> None:
    generator = make_generator(11, CPU)
    state = generator.get_state()
    logits = random_logits(2, 20, seed=12)
    run(logits, [SamplingParams(temperature=0.0, seed=11), SamplingParams()], generators=[generator, None])
    assert torch.equal(generator.get_state(), state)


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(3, 20, seed=13)
    before = logits.clone()
    params = [
        SamplingParams(top_k=3, presence_penalty=1.0),
        SamplingParams(top_p=0.5, temperature=0.1),
        SamplingParams(temperature=0.0, frequency_penalty=-1.0),
    ]
    run(logits, params, [[0, 1], [2], [3]])
    assert torch.equal(logits, before)


def test_half_precision_logits_are_sampled_in_float32() -> None:
    logits = random_logits(3, 20, seed=14)
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 3
    out = run(logits.to(torch.bfloat16), params)
    assert torch.equal(out.token_ids, logits.to(torch.bfloat16).float().argmax(-1))
    assert out.logprobs is not None
    assert out.logprobs.dtype == torch.float32


def test_empty_batch() -> None:
    out = run(torch.empty(0, 10), [])
    assert out.token_ids.shape == (0,)


def test_logits_shape_is_checked() -> None:
    with pytest.raises(ValueError, match="logits"):
        run(torch.zeros(3, 10), [SamplingParams()] * 2)


# --- property: no parameter bleed -------------------------------------------------------------------

row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 2, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.4]),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
    presence_penalty=st.sampled_from([0.0, 1.5, -0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.4, -2.0]),
    logprobs=st.sampled_from([None, 0, 3]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(row_params, st.lists(st.integers(0, 23), max_size=6)),
        min_size=1,
        max_size=7,
    ),
    logits_seed=st.integers(0, 2**16),
    steps=st.integers(1, 3),
)
def test_random_mixes_never_bleed(
    rows: list[tuple[SamplingParams, list[int]]], logits_seed: int, steps: int
) -> None:
    vocab = 24
    params = [p for p, _ in rows]
    outputs = [o for _, o in rows]
    batch_generators = [make_generator(p.seed, CPU) if p.seed is not None else None for p in params]
    solo_generators = [make_generator(p.seed, CPU) if p.seed is not None else None for p in params]
    for step in range(steps):
        logits = random_logits(len(rows), vocab, seed=logits_seed + step)
        out = run(logits, params, outputs, batch_generators)
        raw = logits.log_softmax(dim=-1)
        if any(p.logprobs is not None for p in params):
            assert out.logprobs is not None
            torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
        for i, p in enumerate(params):
            token = int(out.token_ids[i])
            if p.greedy or p.seed is not None:
                assert token == solo(logits[i], p, outputs[i], solo_generators[i]), (i, p)
            # Unseeded rows are random, but only within their own top-k of their own penalised logits.
            if p.top_k > 0:
                own = SamplingBatch.build([dataclasses.replace(p, seed=None)], [outputs[i]], [None], CPU)
                penalised = apply_penalties(logits[i : i + 1], own)[0]
                assert token in set(penalised.topk(p.top_k).indices.tolist()), (i, p)
