"""Several choices in one response, with the official openai client against a real server on the tiny model:
a batch of prompts in /v1/completions, echo, and n > 1 (forked inside the engine, the prompt's KV shared)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import openai
import pytest

from tests.server.harness import MODEL, LiveServer


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


def test_echo_with_logprobs_is_a_clear_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True, logprobs=1)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "echo" and "log-probs" in body["message"]
