"""The engine on the built-in tiny model: per-request sampling, bad input, no leaks, streaming, abort."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkwise import LLM, SamplingParams
from chunkwise.engine import AsyncEngine, EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.loop.stream import RequestStream
from chunkwise.engine.worker.cuda_graphs import bucket_sizes


# float32 wherever outputs are compared token for token: "auto" is bf16 on a CPU with bf16 matrix units, whose
# results legitimately change with the batch and with prefix-cache hits.
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", max_num_batched_tokens=64, max_model_len=256, block_size=8, dtype="float32")


PROMPTS = ["the quick brown fox", "jumps over", "a lazy dog and then some more words", "x"]


def test_greedy_rows_are_unaffected_by_sampling_companions(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    solo = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in PROMPTS]
    wild = [
        SamplingParams(max_tokens=20, temperature=2.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.5, top_k=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_p=0.5, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, frequency_penalty=2.0, ignore_eos=True),
    ]
    mixed_prompts = [q for p in PROMPTS for q in (p, p + " companion")]
    mixed_params = [sp for i in range(len(PROMPTS)) for sp in (greedy, wild[i])]
    outs = llm.generate(mixed_prompts, mixed_params)
    assert [outs[2 * i].outputs[0].token_ids for i in range(len(PROMPTS))] == solo


def test_seeded_request_is_reproducible_whatever_its_companions(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(["seeded prompt"], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=1.3, ignore_eos=True) for n in (5, 30, 12)]
    outs = llm.generate(
        ["noise a", "seeded prompt", "noise bb", "noise ccc"], [others[0], seeded, *others[1:]]
    )
    assert outs[1].outputs[0].token_ids == alone
    # A different seed gives a different sequence, so the equality above is not vacuous.
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, seed=4321, ignore_eos=True)
    assert llm.generate(["seeded prompt"], other_seed)[0].outputs[0].token_ids != alone


def test_offline_api_contract(llm: LLM) -> None:
    outs = llm.generate(["one", "two two"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    assert outs[0].prompt == "one" and outs[0].prompt_token_ids == llm.get_tokenizer().encode("one")
    assert outs[0].outputs[0].text == llm.get_tokenizer().decode(outs[0].outputs[0].token_ids)
    by_ids = llm.generate(
        [outs[0].prompt_token_ids], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    )
    assert by_ids[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_stop_string_and_stop_token(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = llm.generate(["stop here"], greedy)[0].outputs[0]
    tok = llm.get_tokenizer()
    # A stop string taken from the middle of the greedy text ends the output just before it.
    text = full.text
    # Random bytes decode to replacement characters here and there; take a clean two-character window.
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    cut = llm.generate(
        ["stop here"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate(
        ["stop here"],
        SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    stop_id = full.token_ids[4]
    by_id = llm.generate(
        ["stop here"],
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert by_id.token_ids == full.token_ids[: first + 1] and by_id.stop_reason == stop_id
    assert tok.decode(by_id.token_ids) == by_id.text


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ("x" * 300, SamplingParams(), "max_model_len"),
        ("hi", SamplingParams(max_tokens=255), "exceeds max_model_len"),
        ([1, 2, 99999], SamplingParams(), "out of range"),
    ],
)
def test_bad_input_is_a_clear_value_error_and_the_engine_keeps_serving(
    llm: LLM, prompt: object, params: SamplingParams, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)  # type: ignore[list-item]
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    assert len(llm.generate(["still serving"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3


def test_bad_params_and_models_are_value_errors() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="tiny"):
        LLM("no-such-preset")
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM("tiny", max_num_seq=3)
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM("tiny", num_blocks=2, block_size=4, max_model_len=64)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(0, 4), st.integers(-1, 8)),
        min_size=1,
        max_size=10,
    )
)
def test_property_random_arrivals_and_aborts_leave_every_block_free(
    reqs: list[tuple[int, int, int, int]],
) -> None:
    engine = _small_engine()
    step = 0
    pending = list(enumerate(reqs))
    produced: dict[str, int] = {}
    while pending or engine.has_unfinished():
        for item in list(pending):
            i, (plen, mt, at, _) = item
            if at <= step:
                pending.remove(item)
                engine.add_request(
                    str(i),
                    [3 + (i * 7 + j) % 200 for j in range(plen)],
                    SamplingParams(max_tokens=mt, ignore_eos=True),
                )
                produced[str(i)] = 0
        engine.abort([str(i) for i, (_, _, _, ab) in enumerate(reqs) if ab == step])
        for out in engine.step():
            produced[out.request_id] += len(out.outputs[0].token_ids)
        engine.kv.pool.check_invariants()
        step += 1
        assert step < 500
    assert engine.kv.num_free_blocks == engine.num_blocks
    for i, (_, mt, _, ab) in enumerate(reqs):
        if ab == -1:
            assert produced[str(i)] == mt


_ENGINE: list[EngineCore] = []


def _small_engine() -> EngineCore:
    # One engine for every example (loading is the slow part); each example must leave it empty.
    if not _ENGINE:
        _ENGINE.append(
            EngineCore(
                engine_config_from_kwargs(
                    "tiny", num_blocks=24, block_size=4, max_model_len=80, max_num_batched_tokens=24
                )
            )
        )
    engine = _ENGINE[0]
    assert not engine.has_unfinished()
    return engine


def test_async_engine_streams_deltas_and_aborts_on_early_exit() -> None:
    engine = AsyncEngine(engine_config_from_kwargs("tiny", max_model_len=256, block_size=8, dtype="float32"))
    engine.start()

    async def main() -> None:
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        deltas = [o async for o in engine.generate("stream me", sp)]
        assert sum(len(d.outputs[0].token_ids) for d in deltas) == 12
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        reference = LLM("tiny", max_model_len=256, block_size=8, dtype="float32")
        ref = reference.generate(["stream me"], sp)[0].outputs[0]
        assert "".join(d.outputs[0].text for d in deltas) == ref.text
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        agen = engine.generate("abandon me", long)
        async for _ in agen:
            break
        await agen.aclose()  # the client went away
        for _ in range(200):
            if engine.core.kv.num_free_blocks == engine.core.num_blocks and not engine.core.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not engine.core.has_unfinished()
        assert engine.core.kv.num_free_blocks == engine.core.num_blocks

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving() -> None:
    engine = AsyncEngine(engine_config_from_kwargs("tiny", max_model_len=256, block_size=8))
    real_execute = engine.core.runner.execute
    calls = {"n": 0}

    def flaky_execute(so):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_execute(so)

    engine.core.runner.execute = flaky_execute  # type: ignore[method-assign]
    engine.start()
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="injected fault"):
            async for _ in engine.generate("this one meets the fault", sp):
                pass
        outs = [o async for o in engine.generate("this one is served", sp)]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 20
        assert engine.is_running and engine.error is None
        assert engine.core.kv.num_free_blocks == engine.core.num_blocks

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def _kill_the_loop(engine: AsyncEngine, when: Callable[[], bool] = lambda: True) -> None:
    """Make the engine thread die (as on an unexpected error) at its next inbox drain once `when()` holds."""
    drain = engine._drain_inbox

    def drain_or_die() -> bool:
        if when():
            raise RuntimeError("injected engine death")
        return drain()

    engine._drain_inbox = drain_or_die  # type: ignore[method-assign]
    engine._wake.set()


async def _answered(stream: RequestStream) -> Exception:
    """The error the stream ends with; a stream nobody answers fails the test (TimeoutError) instead."""
    with pytest.raises(RuntimeError) as err:
        await asyncio.wait_for(stream.__anext__(), 5)
    return err.value


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("end", ["shutdown", "death"])
def test_a_request_added_while_the_engine_ends_is_refused_or_answered(end: str) -> None:
    """add_request passes its first check, then (while it tokenizes) the engine shuts down or its thread dies
    and fails every stream. The request is then refused, or its stream answered: never registered after
    the streams were failed, for a client to wait on forever."""
    engine = AsyncEngine(engine_config_from_kwargs("tiny", max_model_len=256, block_size=8))
    engine.start()
    make_request = engine.core.make_request

    def end_the_engine_then_make_request(*args, **kwargs):  # type: ignore[no-untyped-def]
        if end == "shutdown":
            engine.shutdown()
        else:
            _kill_the_loop(engine)
            engine._thread.join(10)
            assert engine.error is not None
        return make_request(*args, **kwargs)

    engine.core.make_request = end_the_engine_then_make_request  # type: ignore[method-assign]

    async def main() -> None:
        try:
            stream = engine.add_request("too late", SamplingParams(max_tokens=4))
        except RuntimeError as e:
            assert str(e) == "the engine is not running"
            return
        await _answered(stream)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


ENDED_WITH = {
    "shutdown": "the engine was shut down",
    "death": "engine failed: RuntimeError('injected engine death')",
}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("end", ["shutdown", "death"])
def test_a_request_queued_but_never_drained_is_answered_when_the_engine_ends(end: str) -> None:
    """Accepted into the inbox, then the loop ends before draining it: its stream still gets the error."""
    engine = AsyncEngine(engine_config_from_kwargs("tiny", max_model_len=256, block_size=8))
    if end == "shutdown":
        engine._drain_inbox = lambda: False  # type: ignore[method-assign]  # the loop never drains
    else:
        _kill_the_loop(engine, when=lambda: bool(engine._pending))  # dies as the request is queued
    engine.start()

    async def main() -> None:
        stream = engine.add_request("never drained", SamplingParams(max_tokens=4))
        if end == "shutdown":
            engine.shutdown()
        error = await _answered(stream)
        assert str(error) == ENDED_WITH[end]

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_async_stop_strings_end_the_output_then_free_the_request() -> None:
    """The output thread finds the stop string and ends the stream at once; the scheduler learns of it through
    the inbox (at most a step later), frees its blocks, and the text is what the offline API gives."""
    engine = AsyncEngine(engine_config_from_kwargs("tiny", max_model_len=256, block_size=8, dtype="float32"))
    engine.start()
    ref_sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    reference = LLM("tiny", max_model_len=256, block_size=8, dtype="float32")
    ref = reference.generate(["stop me"], ref_sp)[0].outputs[0]
    stop = ref.text[10:13]  # a stop string the greedy output is known to reach
    assert stop and ref.text.find(stop) >= 0

    async def main() -> None:
        sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=[stop])
        deltas = [o async for o in engine.generate("stop me", sp)]
        last = deltas[-1].outputs[0]
        assert deltas[-1].finished and last.finish_reason == "stop" and last.stop_reason == stop
        assert "".join(d.outputs[0].text for d in deltas) == ref.text[: ref.text.find(stop)]
        for _ in range(200):
            if not engine.core.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not engine.core.has_unfinished()
        assert engine.core.kv.num_free_blocks == engine.core.num_blocks
        # It did not run on to max_tokens.
        assert engine.core.stats.num_decode_tokens < 60

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_reused_decode_sampling_batch_samples_as_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # Steady decode steps reuse the last step's sampling batch while the rows are the same requests. Rows
    # leaving (staggered max_tokens) and a penalty row (never cached) must not shift anyone's parameters:
    # every request, greedy or seeded, samples what it samples alone.
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.8, top_k=5, seed=8, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=1.2, seed=9, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.7, seed=10, ignore_eos=True),
    ]
    prompts = ["alpha beta", "gamma", "delta epsilon zeta", "eta", "theta iota"]
    llm = LLM("tiny", max_model_len=128, block_size=8, dtype="float32")
    runner = llm.engine.runner
    decode = runner._decode_sampling_batch
    reused = 0

    def spy(scheduled):  # type: ignore[no-untyped-def]
        nonlocal reused
        before = runner._decode_batch
        batch, grammar_rows = decode(scheduled)
        reused += before is not None and batch is before[1]
        return batch, grammar_rows

    monkeypatch.setattr(runner, "_decode_sampling_batch", spy)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert reused > 0  # the steady state did reuse batches
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone


# -- static batching's padding rows --------------------------------------------------------------------------
STATIC_PROMPTS = ["a b", "the quick brown fox", "x", "jumps over the lazy dog", "q r s"]
STATIC_LENGTHS = [3, 17, 1, 9, 5]


def _run_one_batch(
    batching: str,
    prompts: list[str],
    lengths: list[int],
    *,
    attention_backend: str = "torch",
    bucketed: bool = False,
    budget: int = 64,
) -> dict[str, object]:
    """One batch (every request admitted in the first step) on a fresh fp32 engine, watched step by step."""
    engine = EngineCore(
        engine_config_from_kwargs(
            "tiny",
            dtype="float32",
            batching=batching,
            attention_backend=attention_backend,
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            block_size=4,
            max_model_len=128,
        )
    )
    runner = engine.runner
    if bucketed:
        runner.use_decode_graphs(bucket_sizes(8), capture=False)
    forward_rows: list[int] = []  # rows each forward computed (unbucketed: real + padding)
    forward = runner.model.forward

    def counted(input_ids, positions, kv_caches, meta, *rest, **kw):  # type: ignore[no-untyped-def]
        forward_rows.append(meta.num_reqs)
        return forward(input_ids, positions, kv_caches, meta, *rest, **kw)

    runner.model.forward = counted  # type: ignore[method-assign]
    padding_blocks: set[int] = set()  # the cache blocks padding rows wrote into
    fill = runner.inputs.fill

    def watched_fill(rows, padding=(), **kw):  # type: ignore[no-untyped-def]
        step = fill(rows, padding, **kw) if padding else fill(rows, **kw)
        if padding:
            padding_blocks.update((step.meta.slot_mapping[-len(padding) :] // 4).tolist())
        return step

    runner.inputs.fill = watched_fill  # type: ignore[method-assign]
    free = engine.kv.num_free_blocks
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished_at: dict[str, int] = {}
    steps = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
            if out.finished:
                finished_at[out.request_id] = len(steps) + 1
                # Its output is out and its KV blocks are back in the pool at once: only its slot is held.
                assert out.request_id not in engine.kv.block_tables
        steps.append(engine.last_step)
        assert len(steps) < 200
    return {
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "finished_at": [finished_at[str(i)] for i in range(len(prompts))],
        "forward_rows": forward_rows,
        "padding_rows": [getattr(s, "num_padding_rows", 0) for s in steps],
        "steps": steps,
        "padding_blocks": padding_blocks,
        "sink": runner.sink_block,
        "free_before_after": (free, engine.kv.num_free_blocks),
        "stats": engine.stats,
    }


@pytest.mark.parametrize(("attention_backend", "bucketed"), [("torch", False), ("cpu", False), ("cpu", True)])
def test_static_batch_computes_a_padding_row_per_finished_request_and_changes_no_token(
    attention_backend: str, bucketed: bool
) -> None:
    cont = _run_one_batch("continuous", STATIC_PROMPTS, STATIC_LENGTHS, attention_backend=attention_backend)
    static = _run_one_batch(
        "static", STATIC_PROMPTS, STATIC_LENGTHS, attention_backend=attention_backend, bucketed=bucketed
    )
    n, longest = len(STATIC_LENGTHS), max(STATIC_LENGTHS)
    # Padding must not perturb the real rows: token for token what continuous batching gives (greedy, fp32).
    assert static["tokens"] == cont["tokens"]
    assert [len(t) for t in static["tokens"]] == STATIC_LENGTHS  # type: ignore[union-attr]
    # A finished request's output still streams in the step it finishes.
    assert static["finished_at"] == cont["finished_at"] == STATIC_LENGTHS
    if not bucketed:
        # Every forward of the batch computes all of its rows, real + padding, until the longest completes.
        assert static["forward_rows"] == [n] * longest
        assert cont["forward_rows"] == [sum(1 for ln in STATIC_LENGTHS if ln > s) for s in range(longest)]
    # One padding row per finished request per later step: n * max - sum, the (1 - U) of the batch.
    assert static["padding_rows"] == [sum(1 for ln in STATIC_LENGTHS if ln <= s) for s in range(longest)]
    stats = static["stats"]
    assert stats.num_padding_rows == n * longest - sum(STATIC_LENGTHS)  # type: ignore[attr-defined]
    assert stats.num_rows == sum(STATIC_LENGTHS)  # type: ignore[attr-defined]
    # Padding KV goes into the sink block only (no request's block), and no block is leaked.
    assert static["padding_blocks"] == {static["sink"]}
    free, after = static["free_before_after"]  # type: ignore[misc]
    assert after == free
    # Continuous batching never computes padding.
    assert cont["stats"].num_padding_rows == 0  # type: ignore[attr-defined]
    assert set(cont["padding_rows"]) == {0}  # type: ignore[arg-type]
    assert cont["padding_blocks"] == set()


def test_static_padding_rows_ride_along_prefill_chunks_and_change_no_token() -> None:
    # A small budget: the short request finishes with its first token while the long prompt still chunks, so
    # its padding row shares steps with a prefill chunk that samples nothing, and then with the one that does.
    prompts = ["x", "a long prompt that takes several chunks of sixteen tokens to prefill", "ab"]
    lengths = [1, 6, 3]
    cont = _run_one_batch("continuous", prompts, lengths, budget=16)
    static = _run_one_batch("static", prompts, lengths, budget=16)
    assert static["tokens"] == cont["tokens"]
    steps, padding = static["steps"], static["padding_rows"]
    assert any(s.num_prefill_tokens and p for s, p in zip(steps, padding))  # type: ignore[call-overload]
    assert static["padding_blocks"] == {static["sink"]}
    free, after = static["free_before_after"]  # type: ignore[misc]
    assert after == free
    assert cont["stats"].num_padding_rows == 0  # type: ignore[attr-defined]


def test_output_processor_reports_stop_strings_and_finishes_without_the_scheduler(llm: LLM) -> None:
    """A stop string ends a request's output in `process` and is handed back in `stopped` (the processor
    holds no scheduler); a request already ended there is skipped in a later batch, and `finished` names
    exactly the requests whose output ended, however many the batch skipped."""
    from chunkwise.engine import OutputProcessor, StepUpdate

    core = llm.engine
    tok = core.tokenizer
    proc = OutputProcessor(tok)
    a, _ = core.make_request("a", "x", SamplingParams(max_tokens=20, stop=["wor"]))
    b, _ = core.make_request("b", "x", SamplingParams(max_tokens=20))
    for r in (a, b):
        proc.add(r, "x")
        r.token_ids.extend(tok.encode(" hello world"))
    first = proc.process(StepUpdate.of([a, b]))
    assert first.stopped == [(a, "wor")] and first.finished == [a]
    out_a, out_b = first.outputs
    assert (
        out_a.finished and out_a.outputs[0].finish_reason == "stop" and out_a.outputs[0].stop_reason == "wor"
    )
    assert out_a.outputs[0].text == " hello " and not out_b.finished
    assert a.status.value == "waiting"  # nothing reached the scheduler's state
    b.token_ids.extend(tok.encode("!"))
    second = proc.process(StepUpdate([a, b], [len(a.token_ids), len(b.token_ids)], [False, True]))
    assert [o.request_id for o in second.outputs] == ["b"] and second.finished == [b]
    assert second.stopped == [] and second.outputs[0].finished


def test_a_dropped_engine_is_freed_without_the_garbage_collector() -> None:
    """An LLM dropped by its user gives its memory (the KV cache: 1 GiB by default on CPU) back at once.
    A collaborator holding a bound method of its owner (the applier the Scheduler's finish, the verifier the
    runner's generator lookup) made a reference cycle: every engine waited for a full collection, and a test
    worker building one per test grew to 11 GB. Mutant: StepApplier keeping `finish` from its constructor."""
    import gc
    import weakref

    llm = LLM(model="tiny", max_model_len=64, num_blocks=16)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, stop=["zz"])
    llm.generate([[5, 6, 7], [8, 9]], [sampled, SamplingParams(max_tokens=4, temperature=0.0)])
    core = llm.engine
    parts = {
        "engine": weakref.ref(core),
        "scheduler": weakref.ref(core.scheduler),
        "runner": weakref.ref(core.runner),
        "model": weakref.ref(core.runner.model),
    }
    del core
    gc.collect()  # what the engine's construction left, so that only the drop is measured
    enabled = gc.isenabled()
    gc.disable()
    try:
        del llm
        alive = sorted(name for name, ref in parts.items() if ref() is not None)
    finally:
        if enabled:
            gc.enable()
    assert alive == []
