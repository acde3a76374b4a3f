"""Stop strings completed by the very token that ends the request (its max_tokens, a stop token id, the
flush of an incomplete character, the last token of a speculative step): the text is cut at the stop string
and the request ends "stop" with the string as its stop_reason, exactly as when a later token ends it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest

from chunkwise import LLM, SamplingParams
from chunkwise.engine import AsyncEngine, EngineCore, OutputProcessor, StepUpdate
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.datatypes.outputs import CompletionOutput, RequestOutput
from chunkwise.engine.datatypes.request import Request
from chunkwise.engine.tokenizer import Tokenizer

PROMPT = "stop here"
MAX_TOKENS = 30
ENGINE = {"max_model_len": 256, "block_size": 8, "dtype": "float32"}  # float32: reruns repeat the reference


def greedy(max_tokens: int = MAX_TOKENS, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", **ENGINE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[int]:
    """The greedy output's token ids, from which each test picks the token its stop string ends at."""
    return llm.generate([PROMPT], greedy())[0].outputs[0].token_ids


def stop_ending_at(tok: Tokenizer, ids: list[int], k: int, flushed: bool) -> str | None:
    """A two-character stop string that the text first reaches with token k (1-based), or None. The tiny
    model's tokenizer is the byte one: a token is a UTF-8 byte.

    Not flushed: token k is one ASCII character, so every run completes the string exactly at token k.
    Flushed: token k starts a multi-byte character, so only a run that ends there (the detokenizer's flush
    turning it into U+FFFD) completes the string, with its last token."""
    tail = ids[k - 1]
    if flushed != (0xC2 <= tail <= 0xF4):
        return None
    if not flushed and tail >= 0x80:
        return None
    text = tok.decode(ids[:k])
    stop = text[-2:]
    if len(stop) < 2 or "\ufffd" in stop[:-1] or (not flushed and "\ufffd" in stop):
        return None
    return stop if text.find(stop) == len(text) - 2 else None


def pick(
    tok: Tokenizer, ids: list[int], flushed: bool = False, ok: Callable[[int], bool] = lambda k: True
) -> tuple[int, str]:
    for k in range(3, len(ids)):
        stop = stop_ending_at(tok, ids, k, flushed)
        if stop is not None and ok(k):
            return k, stop
    raise AssertionError(f"no token of the reference output {ids} ends a usable stop string")


def first_at(ids: list[int], k: int) -> bool:
    """Whether token k (1-based) first appears there: as a stop token id it ends the request at k."""
    return ids.index(ids[k - 1]) == k - 1


def expected_text(tok: Tokenizer, ids: list[int], k: int, stop: str, include: bool) -> str:
    text = tok.decode(ids[:k])
    return text if include else text[: -len(stop)]


def assert_stopped(out: CompletionOutput, text: str, stop: str, token_ids: list[int]) -> None:
    assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", stop)
    # The text ends at the stop string; the tokens are the steps' (as in vLLM).
    assert out.token_ids == token_ids


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop_str_in_output"])
@pytest.mark.parametrize("ends_by", ["max_tokens", "stop_token", "a_later_token"])
def test_stop_string_completed_by_the_last_token_ends_the_output_there(
    llm: LLM, reference: list[int], ends_by: str, include: bool
) -> None:
    tok = llm.get_tokenizer()
    k, stop = pick(tok, reference, ok=lambda k: ends_by != "stop_token" or first_at(reference, k))
    sp = {
        "max_tokens": greedy(k, stop=[stop], include_stop_str_in_output=include),
        "stop_token": greedy(
            stop=[stop], stop_token_ids=[reference[k - 1]], include_stop_str_in_output=include
        ),
        # The case that always worked: the stop string is found before the request ends.
        "a_later_token": greedy(k + 1, stop=[stop], include_stop_str_in_output=include),
    }[ends_by]
    out = llm.generate([PROMPT], sp)[0]
    assert out.finished
    assert_stopped(out.outputs[0], expected_text(tok, reference, k, stop, include), stop, reference[:k])
    assert not llm.engine.has_unfinished() and llm.engine.all_blocks_free()


@pytest.mark.parametrize("ends_by", ["max_tokens", "stop_token"])
def test_stop_string_completed_by_the_final_flush(llm: LLM, reference: list[int], ends_by: str) -> None:
    """The last token leaves a character incomplete; the flush at the end makes it U+FFFD, which completes
    the stop string (as the EOS token's flush would)."""
    tok = llm.get_tokenizer()
    k, stop = pick(
        tok, reference, flushed=True, ok=lambda k: ends_by != "stop_token" or first_at(reference, k)
    )
    assert stop.endswith("\ufffd")
    sp = (
        greedy(k, stop=[stop])
        if ends_by == "max_tokens"
        else greedy(stop=[stop], stop_token_ids=[reference[k - 1]])
    )
    out = llm.generate([PROMPT], sp)[0].outputs[0]
    assert_stopped(out, expected_text(tok, reference, k, stop, False), stop, reference[:k])


def test_each_choice_of_n_is_cut_where_its_last_token_completes_the_stop_string(
    llm: LLM, reference: list[int]
) -> None:
    tok = llm.get_tokenizer()
    k, stop = pick(tok, reference)
    out = llm.generate([PROMPT], greedy(k, n=3, stop=[stop]))[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    for choice in out.outputs:
        assert_stopped(choice, expected_text(tok, reference, k, stop, False), stop, reference[:k])
    assert not llm.engine.has_unfinished() and llm.engine.all_blocks_free()


def deltas(core: EngineCore, rid: str, prompt: str, sp: SamplingParams) -> list[RequestOutput]:
    core.add_request(rid, prompt, sp)
    outs: list[RequestOutput] = []
    while core.has_unfinished():
        outs.extend(core.step())
    return outs


def test_stop_string_inside_the_last_speculative_step() -> None:
    """A speculative step accepts several tokens and the last of them ends the request: a stop string
    completed by one of its earlier tokens still cuts the text there."""
    llm = LLM(
        "tiny",
        **ENGINE,  # type: ignore[arg-type]
        speculative_method="ngram",
        num_speculative_tokens=4,
        adaptive_speculation=False,  # drafts every step, whatever this machine's timings say
    )
    core, tok = llm.engine, llm.get_tokenizer()
    prompt = "one two three four five six " * 6  # repetitive: drafts are accepted
    steps = deltas(core, "ref", prompt, greedy(40))
    ids = [t for d in steps for t in d.outputs[0].token_ids]
    # A multi-token step ending at token `end`, and a stop string ending at one of its tokens before the last.
    bounds = itertools.accumulate((len(d.outputs[0].token_ids) for d in steps), initial=0)
    candidates = (
        (end, k, stop)
        for start, end in itertools.pairwise(bounds)
        for k in range(start + 1, end)
        if (stop := stop_ending_at(tok, ids, k, flushed=False)) is not None
    )
    found = next(candidates, None)
    assert found is not None, f"no multi-token step of {[len(d.outputs[0].token_ids) for d in steps]} fits"
    end, k, stop = found
    run = deltas(core, "cut", prompt, greedy(end, stop=[stop]))
    last = run[-1]
    # The precondition: the request ended with a multi-token step holding token k.
    assert len(last.outputs[0].token_ids) >= end - k + 1 and last.finished
    text = "".join(d.outputs[0].text for d in run)
    assert (text, last.outputs[0].finish_reason, last.outputs[0].stop_reason) == (
        expected_text(tok, ids, k, stop, False),
        "stop",
        stop,
    )
    assert not core.has_unfinished() and core.all_blocks_free()


def test_async_stop_on_the_last_token_needs_no_release() -> None:
    """On AsyncEngine the stream ends "stop" at the stop string, and the output thread sends the scheduler
    nothing to release: the step that completed the string had already finished the request."""
    engine = AsyncEngine(engine_config_from_kwargs("tiny", **ENGINE))  # type: ignore[arg-type]
    released: list[str] = []
    finish_by_stop = engine._finish_by_stop

    def record(req: Request, stop: str) -> None:
        released.append(req.request_id)
        finish_by_stop(req, stop)

    engine._finish_by_stop = record  # type: ignore[method-assign]
    engine.start()
    tok = engine.tokenizer

    async def main() -> None:
        ref = [o async for o in engine.generate(PROMPT, greedy())]
        ids = [t for o in ref for t in o.outputs[0].token_ids]
        k, stop = pick(tok, ids)
        outs = [o async for o in engine.generate(PROMPT, greedy(k, stop=[stop]), request_id="cut")]
        last = outs[-1].outputs[0]
        assert outs[-1].finished and (last.finish_reason, last.stop_reason) == ("stop", stop)
        assert "".join(o.outputs[0].text for o in outs) == expected_text(tok, ids, k, stop, False)
        assert released == []
        # The engine goes on serving.
        more = [o async for o in engine.generate(PROMPT, greedy(3))]
        assert more[-1].finished and sum(len(o.outputs[0].token_ids) for o in more) == 3

    try:
        asyncio.run(main())
        assert engine.is_running and engine.error is None
        assert engine.core.all_blocks_free()
    finally:
        engine.shutdown()


def test_output_processor_cuts_at_a_stop_string_the_finishing_step_completes(llm: LLM) -> None:
    """The processor alone: a stop string completed in a step that also ends the request (several tokens,
    the last an EOS whose own text completes the string) ends the output there; `stopped` stays empty, for
    the scheduler has already released the request."""
    core = llm.engine
    tok = core.tokenizer
    eos = core.eos_token_ids[0]
    proc = OutputProcessor(tok)
    a, _ = core.make_request("a", "x", SamplingParams(max_tokens=20, stop=["wor"]))
    b, _ = core.make_request(
        "b", "x", SamplingParams(max_tokens=20, stop=["</s>"], skip_special_tokens=False)
    )
    for r in (a, b):
        proc.add(r, "x")
    a.token_ids.extend([*tok.encode(" hello world", add_special_tokens=False), eos])
    b.token_ids.extend([*tok.encode(" hi", add_special_tokens=False), eos])
    done = proc.process(StepUpdate([a, b], [len(a.token_ids), len(b.token_ids)], [True, True]))
    assert done.stopped == [] and done.finished == [a, b]
    assert [
        (o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in done.outputs
    ] == [
        (" hello ", "stop", "wor"),
        (" hi", "stop", "</s>"),
    ]
    assert done.outputs[0].outputs[0].token_ids == a.output_token_ids
