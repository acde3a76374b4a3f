"""Structured outputs in the engine: the grammar mask in the batched sampler (rows without a grammar
bit-exact, masked tokens never drawn), the runner's per-request matchers (speculative drafts checked,
preemption survived, state freed), and the compiler's cache."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from chunkwise import LLM, SamplingParams
from chunkwise.engine.datatypes.structured_output import StructuredOutput
from chunkwise.engine.sampling.sampler import (
    GrammarMask,
    Sampler,
    SamplingBatch,
    make_generator,
    unpack_bitmask,
)
from chunkwise.engine.sampling.structured.compiler import GrammarCompiler, StructuredOutputError
from chunkwise.engine.sampling.structured.state import GrammarRow, GrammarState
from chunkwise.engine.tokenizer import ByteTokenizer

VOCAB = ByteTokenizer.VOCAB_SIZE
EOS = ByteTokenizer.EOS
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(), VOCAB, (EOS,))


def _allowed(mask: GrammarMask) -> torch.Tensor:
    return unpack_bitmask(mask.bits, VOCAB)


# -- the sampler ------------------------------------------------------------------------------------------
def _params(n: int) -> list[SamplingParams]:
    # Greedy, sampled, seeded and top-k/top-p rows, so every path of the sampler has a masked row.
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(temperature=0.0))
        elif kind == 1:
            out.append(SamplingParams(temperature=0.9))
        elif kind == 2:
            out.append(SamplingParams(temperature=1.3, seed=100 + i))
        else:
            out.append(SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=200 + i))
    return out


def _batch(params: list[SamplingParams]) -> SamplingBatch:
    gens = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    return SamplingBatch.build(params, [[] for _ in params], gens, "cpu")


def test_a_mixed_batch_leaves_unconstrained_rows_bit_exact(compiler: GrammarCompiler) -> None:
    n = 8
    params = _params(n)
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    constrained = [1, 2, 4, 7]  # a greedy row, a sampled one, a seeded one, a top-k/top-p one
    state = GrammarState(compiler, torch.device("cpu"))
    spec = StructuredOutput.json_schema(PERSON)
    mask = state.mask([GrammarRow(r, f"r{r}", spec) for r in constrained])

    torch.manual_seed(1)
    plain = Sampler()(logits.clone(), _batch(params))
    torch.manual_seed(1)
    masked = Sampler()(logits.clone(), _batch(params), mask)
    free = [r for r in range(n) if r not in constrained]
    # The seeded rows draw from their own generators, the others from the default one seeded alike.
    assert plain.token_ids[free].tolist() == masked.token_ids[free].tolist()
    # Every constrained row took a token its grammar allows (JSON starts with "{").
    assert all(masked.token_ids[r].item() == ord("{") for r in constrained)
    assert any(plain.token_ids[r].item() != ord("{") for r in constrained)


def test_masked_tokens_are_never_sampled(compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler, torch.device("cpu"))
    spec = StructuredOutput.regex(r"[a-c]+x?")
    rows = 64
    for i in range(rows):
        assert state.matcher(f"r{i}", spec).consume_tokens(list(b"ab"))
    mask = state.mask([GrammarRow(i, f"r{i}", spec) for i in range(rows)])
    allowed = _allowed(mask)[0]
    assert sorted(allowed.nonzero().flatten().tolist()) == [*b"abcx", EOS]
    # The disallowed tokens get by far the largest logits: a leak would show in 64 rows x 20 draws.
    logits = torch.zeros(rows, VOCAB)
    logits[:, ~allowed] = 30.0
    for _ in range(20):
        out = Sampler()(logits, _batch([SamplingParams(temperature=2.0)] * rows), mask)
        assert allowed[out.token_ids].all()
    greedy = Sampler()(logits, _batch([SamplingParams(temperature=0.0)] * rows), mask)
    assert allowed[greedy.token_ids].all()


def test_eos_only_where_the_grammar_accepts(compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler, torch.device("cpu"))
    spec = StructuredOutput.choice(["yes", "yesno"])
    m = state.matcher("r", spec)
    assert not _allowed(state.mask([GrammarRow(0, "r", spec)]))[0, EOS]
    m.consume_tokens(list(b"yes"))
    assert _allowed(state.mask([GrammarRow(0, "r", spec)]))[0, EOS]  # complete, or go on to "yesno"
    m.consume_tokens(list(b"no"))
    allowed = _allowed(state.mask([GrammarRow(0, "r", spec)]))[0]
    assert allowed.nonzero().flatten().tolist() == [EOS]  # complete: only EOS


# -- speculative drafts -------------------------------------------------------------------------------------
def test_drafts_are_cut_at_the_first_rejected_token_and_verify_masks_follow_them(
    compiler: GrammarCompiler,
) -> None:
    state = GrammarState(compiler, torch.device("cpu"))
    spec = StructuredOutput.regex(r"ab+c")
    assert state.valid_prefix("r", spec, list(b"abbxc")) == list(b"abb")
    assert state.valid_prefix("r", spec, list(b"x")) == []
    masks = state.draft_masks("r", spec, list(b"abb"))
    allowed = _allowed(masks)
    assert masks.rows.tolist() == [0, 1, 2, 3]
    assert allowed[0].nonzero().flatten().tolist() == [ord("a")]
    assert allowed[1].nonzero().flatten().tolist() == [ord("b")]
    assert sorted(allowed[3].nonzero().flatten().tolist()) == [ord("b"), ord("c")]
    # The matcher is back where it was: nothing consumed.
    assert state.valid_prefix("r", spec, list(b"abc")) == list(b"abc")


def _constrained(n: int = 4, max_tokens: int = 120) -> list[SamplingParams]:
    spec = StructuredOutput.json_schema(PERSON)
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=spec) for _ in range(n)]


PROMPTS = [
    'Example: {"name": "ab", "age": 1, "ok": true} {"name": "ab", "age": 1, "ok": true} ',
    "Person record:",
    'JSON {"name": "',
    "x" * 40,
]


def _texts(llm: LLM, params: list[SamplingParams]) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def test_speculation_gives_the_same_constrained_greedy_output() -> None:
    expected = _texts(LLM("tiny", max_model_len=512, dtype="float32"), _constrained())
    spec = LLM(
        "tiny",
        dtype="float32",
        max_model_len=512,
        speculative_method="ngram",
        num_speculative_tokens=4,
        adaptive_speculation=False,
    )
    got = _texts(spec, _constrained())
    assert got == expected
    assert spec.engine.stats.spec_num_draft_tokens > 0
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)


def test_a_draft_model_speculating_unconstrained_drafts_gives_the_same_constrained_output() -> None:
    """The target as its own draft model proposes its unconstrained greedy tokens: the grammar cuts them
    at the first it rejects, and what is left verifies to the same constrained output."""
    expected = _texts(LLM("tiny", max_model_len=512, dtype="float32"), _constrained())
    llm = LLM(
        "tiny",
        dtype="float32",
        max_model_len=512,
        speculative_method="draft",
        speculative_model="tiny",
        num_speculative_tokens=3,
        adaptive_speculation=False,
    )
    assert _texts(llm, _constrained()) == expected
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0


def test_sampled_constrained_requests_with_speculation_stay_valid() -> None:
    # Unseeded: a seeded sampled request never speculates (sched/scheduler.py, _may_speculate).
    llm = LLM(
        "tiny",
        max_model_len=512,
        speculative_method="ngram",
        num_speculative_tokens=4,
        adaptive_speculation=False,
    )
    spec = StructuredOutput.json_schema(PERSON)
    params = [SamplingParams(max_tokens=150, temperature=1.0, structured=spec) for _ in range(len(PROMPTS))]
    for out in llm.generate(PROMPTS, params):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert llm.engine.stats.spec_num_draft_tokens > 0


def test_a_constrained_request_survives_preemption_by_recompute() -> None:
    expected = _texts(LLM("tiny", max_model_len=160, dtype="float32"), _constrained(max_tokens=60))
    llm = LLM(
        "tiny",
        dtype="float32",
        max_model_len=160,
        block_size=4,
        num_blocks=40,
        max_num_batched_tokens=32,
        preemption_mode="recompute",
        cold_start_output_tokens=0,
    )
    llm.engine.scheduler.admission.output_estimate = lambda req: 0  # type: ignore[method-assign]
    got = _texts(llm, _constrained(max_tokens=60))
    assert llm.engine.stats.num_preemptions_recompute > 0
    assert got == expected


def test_matchers_are_freed_and_grammars_compiled_once() -> None:
    llm = LLM("tiny", max_model_len=256)
    _texts(llm, _constrained(max_tokens=40))
    grammar = llm.engine.runner.grammar
    assert grammar is not None
    llm.engine.step()  # the finished requests reach the runner with the next step
    assert len(grammar) == 0
    assert llm.engine.structured.num_compiled == 1


def test_ignore_eos_still_ends_where_the_grammar_does() -> None:
    llm = LLM("tiny", max_model_len=256)
    spec = StructuredOutput.choice(["alpha", "beta"])
    (out,) = llm.generate(["?"], SamplingParams(max_tokens=50, ignore_eos=True, structured=spec))
    assert out.outputs[0].text in ("alpha", "beta") and out.outputs[0].finish_reason == "stop"


# -- the compiler ---------------------------------------------------------------------------------------------
def test_bad_specs_raise_a_value_error_naming_structured_outputs(compiler: GrammarCompiler) -> None:
    for spec in (
        StructuredOutput.json_schema({"type": "nope"}),
        StructuredOutput.regex("(a"),
        StructuredOutput.grammar("start: missing"),
    ):
        with pytest.raises(StructuredOutputError, match=r"^structured_outputs: invalid"):
            compiler.check(spec)
    with pytest.raises(ValueError):
        StructuredOutput.json_schema("{nope")
    with pytest.raises(ValueError):
        StructuredOutput.choice([])


def test_the_cache_is_an_lru_bounded_in_size() -> None:
    compiler = GrammarCompiler(ByteTokenizer(), VOCAB, (EOS,), cache_size=2)
    a, b, c = (StructuredOutput.regex(p) for p in ("a+", "b+", "c+"))
    compiler.check(a)
    compiler.check(b)
    compiler.check(a)  # a is now the most recent
    compiler.check(c)  # evicts b
    assert compiler.num_compiled == 3
    compiler.check(a)
    assert compiler.num_compiled == 3
    compiler.check(b)
    assert compiler.num_compiled == 4


def test_equal_schemas_are_one_key_and_keep_their_property_order() -> None:
    assert StructuredOutput.json_schema({"a": 1, "b": 2}) == StructuredOutput.json_schema('{"a": 1,  "b": 2}')
    # The order of "properties" is the order the output writes them in: not a key to normalise away.
    assert StructuredOutput.json_schema({"b": 2, "a": 1}) != StructuredOutput.json_schema({"a": 1, "b": 2})


def test_the_spec_is_free_of_torch_and_llguidance() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import chunkwise.engine.datatypes.sampling_params, chunkwise.engine.sampling.structured; "
        "from chunkwise import StructuredOutput; StructuredOutput.json_object(); "
        "bad = {'torch', 'llguidance'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pylm_tokenizer_builds() -> None:
    from chunkwise.engine.model.bundled import bundled_path
    from chunkwise.engine.model.loader import read_checkpoint

    path = bundled_path("pylm")
    assert path is not None
    config, tok = read_checkpoint(path)
    compiler = GrammarCompiler(tok, config.vocab_size, tok.eos_token_ids)
    m = compiler.matcher(StructuredOutput.json_schema(PERSON))
    ids = tok.encode('{"name": "x", "age": 3, "ok": false}', add_special_tokens=False)
    assert m.consume_tokens(ids) and m.is_accepting()


def test_each_of_n_choices_follows_the_grammar_with_its_own_matcher() -> None:
    llm = LLM("tiny", max_model_len=256)
    spec = StructuredOutput.json_schema(PERSON)
    (out,) = llm.generate(
        ["Person:"], SamplingParams(n=3, max_tokens=120, temperature=1.0, seed=5, structured=spec)
    )
    texts = [c.text for c in out.outputs]
    assert len(texts) == 3 and len(set(texts)) > 1  # each child samples its own answer
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)
    llm.engine.step()
    grammar = llm.engine.runner.grammar
    assert grammar is not None and len(grammar) == 0


def test_an_engine_without_llguidance_serves_plain_requests_and_refuses_structured_ones() -> None:
    """llguidance is imported on first use: a machine without it (the GPU bench's) loads and generates, and a
    structured request is refused at admission with the fix, not an ImportError at start-up."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['llguidance'] = None  # import llguidance raises ImportError from here on\n"
        "from chunkwise.engine.datatypes.config import engine_config_from_kwargs\n"
        "from chunkwise.engine import EngineCore\n"
        "from chunkwise.engine.datatypes.sampling_params import SamplingParams\n"
        "from chunkwise.engine.datatypes.structured_output import StructuredOutput\n"
        "core = EngineCore(engine_config_from_kwargs('tiny', max_model_len=64))\n"
        "core.add_request('a', [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))\n"
        "while core.has_unfinished():\n"
        "    core.step()\n"
        "print('plain ok')\n"
        "try:\n"
        "    core.add_request('b', [5], SamplingParams(max_tokens=3, structured=StructuredOutput('regex', 'a+')))\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "plain ok" in out.stdout
    assert "refused: structured outputs need the llguidance package" in out.stdout, out.stdout
