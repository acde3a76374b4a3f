"""Several choices in one response, with the official openai client against a real server on the tiny model:
a batch of prompts in /v1/completions, echo, and n > 1 (forked inside the engine, the prompt's KV shared)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.harness import ENGINE_KWARGS, MODEL, LiveServer


@pytest.fixture
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _alone(client: openai.OpenAI, prompt: str | list[int], max_tokens: int) -> str:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def test_a_batch_of_prompts_answers_each_as_if_alone(client: openai.OpenAI) -> None:
    prompts = ["abc", "Hello there", "x"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [_alone(client, p, 6) for p in prompts]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None
    # Byte tokenizer: BOS + one id per byte, each prompt counted once.
    assert r.usage.prompt_tokens == sum(1 + len(p.encode()) for p in prompts)
    assert r.usage.completion_tokens == 18


def test_a_batch_of_token_id_prompts(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=[[256, 97], [256, 98, 99]], max_tokens=4, temperature=0)
    assert [c.text for c in r.choices] == [_alone(client, [256, 97], 4), _alone(client, [256, 98, 99], 4)]
    assert r.usage is not None and r.usage.prompt_tokens == 5


def test_a_streamed_batch_interleaves_choices_by_index(client: openai.OpenAI) -> None:
    prompts = ["abc", "Hello there"]
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str | None] = {}
    usage = None
    stream = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert dict(texts) == {i: _alone(client, p, 5) for i, p in enumerate(prompts)}
    assert finishes == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens == 4 + 12


def test_echo_repeats_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    completion = _alone(client, "abc", 4)
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == "abc" + completion
    ids = client.completions.create(model=MODEL, prompt=[97, 98, 99], max_tokens=4, temperature=0, echo=True)
    assert ids.choices[0].text.startswith("abc")
    streamed = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == "abc" + completion


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client: openai.OpenAI) -> None:
    # lm-evaluation-harness's loglikelihood request: the prompt echoed with its tokens' log-probs.
    r = client.completions.create(
        model=MODEL, prompt="abcd", max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    # BOS + 4 bytes of prompt, then the one generated token; the first token has no log-prob.
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset is not None and lp.text_offset == sorted(lp.text_offset)
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) >= 1
    # vLLM's prompt_logprobs extension reports the same numbers, keyed by token id, with ranks.
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="abcd", max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    ).http_response.json()
    scores = raw["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == 5
    assert list(scores[1]) == [str(ord("a"))]
    assert [next(iter(s.values()))["logprob"] for s in scores[1:]] == pytest.approx(lp.token_logprobs[1:5])
    assert all(next(iter(s.values()))["rank"] >= 1 for s in scores[1:])


def test_chat_prompt_logprobs_ride_on_the_response(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 1, "return_token_ids": True},
    ).http_response.json()
    scores, ids = raw["prompt_logprobs"], raw["prompt_token_ids"]
    assert scores[0] is None and len(scores) == len(ids)
    assert all(str(t) in s for t, s in zip(ids[1:], scores[1:]))


def test_n_greedy_choices_are_the_single_answer_and_the_prompt_counts_once(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.text for c in r.choices} == {_alone(client, "Hello there", 6)}
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (12, 18)


def test_n_seeded_choices_differ_and_repeat(client: openai.OpenAI) -> None:
    def ask() -> list[str]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=3, seed=7
        )
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [c.message.content or "" for c in r.choices]

    first = ask()
    assert ask() == first
    assert len(set(first)) > 1


def test_n_with_a_streamed_batch_numbers_prompt_then_choice(client: openai.OpenAI) -> None:
    texts: dict[int, str] = defaultdict(str)
    stream = client.completions.create(
        model=MODEL, prompt=["abc", "Hello"], max_tokens=4, temperature=0, n=2, stream=True
    )
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    a, b = _alone(client, "abc", 4), _alone(client, "Hello", 4)
    assert dict(texts) == {0: a, 1: a, 2: b, 3: b}


def _kv_usage(live: LiveServer) -> float:
    text = httpx.get(live.url + "/metrics", trust_env=False).text
    m = re.search(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert m is not None
    return float(m.group(1))


def test_n_choices_hold_the_prompt_once(client: openai.OpenAI, live: LiveServer) -> None:
    # A 300-token prompt is 19 blocks of 16; three unshared copies would hold 57 of the 96 at once.
    prompt = "The KV blocks of one prompt are shared. " * 7 + "x" * 19
    assert len(prompt.encode()) + 1 == 300
    num_blocks, prompt_blocks = ENGINE_KWARGS["num_blocks"], 19
    seen: set[int] = set()
    usage = None
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=150, n=3, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if usage is None and seen == {0, 1, 2}:
            usage = _kv_usage(live)  # every choice is decoding: the prompt and three tails are held
    assert usage is not None
    used = round(usage * num_blocks)
    assert prompt_blocks <= used < 2 * prompt_blocks
