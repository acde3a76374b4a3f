"""The official openai client against a real uvicorn serving the tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.harness import MODEL, LiveServer


@pytest.fixture
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _ascii_stop(text: str) -> str:
    """A printable ASCII character of `text` past its start, to use as a stop string."""
    for ch in text[1:]:
        if 33 <= ord(ch) < 127:
            return ch
    raise AssertionError(f"no printable ASCII character in {text!r}")


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "chunkwise"
    # Full precision; a quantized model's card names it (test_quantized_server.py).
    extra = models[0].model_extra or {}
    assert "quantization" in extra and extra["quantization"] is None


def test_completion_length_and_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=7, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.object == "text_completion"
    assert r.usage is not None
    # Byte tokenizer: BOS + one id per byte.
    assert r.usage.prompt_tokens == 1 + len(b"Hello there")
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_greedy_is_deterministic_and_token_prompt(client: openai.OpenAI) -> None:
    a = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0)
    b = client.completions.create(model=MODEL, prompt=[256, 97, 98, 99], max_tokens=12, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert b.usage is not None and b.usage.prompt_tokens == 4


def test_prefix_cache_hit_is_reported(client: openai.OpenAI) -> None:
    prompt = "A long shared prefix that spans more than two KV blocks of sixteen tokens each."
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 32 <= cached < r.usage.prompt_tokens


def test_stop_string(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
    stop = _ascii_stop(full)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    # The same through the streaming path, and through chat's `stop`.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_completion(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 6
    # The documented template for the byte model: BOS + "<|role|>\ncontent\n"... + "<|assistant|>\n".
    rendered = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert r.usage.prompt_tokens == 1 + len(rendered.encode())
    same = client.completions.create(model=MODEL, prompt=rendered, max_tokens=6, temperature=0)
    assert same.choices[0].text == choice.message.content


def test_chat_max_completion_tokens_and_stop(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=40,
        temperature=0,
    )
    text = full.choices[0].message.content or ""
    assert full.usage is not None and full.usage.completion_tokens == 40
    stop = _ascii_stop(text)
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=40,
        temperature=0,
        stop=[stop],
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]


def test_completion_stream_with_usage(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Stream me",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # Content chunks carry usage null; the last chunk has no choices and the usage.
    *content, last = chunks
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == 1 + len(b"Stream me")
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert content[-1].choices[0].finish_reason == "length"


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == full.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 8


def test_stream_without_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0, stream=True)
    )
    assert all(len(c.choices) == 1 and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Log", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        assert token in top and 1 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()))


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 4
    for entry in lp.content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt="Seeded", max_tokens=16, temperature=1.0, seed=seed)
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(1, 5)}) > 1


def test_sampling_extensions_accepted(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="Penalised",
        max_tokens=8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 5, "ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 8


def test_n_past_its_bound_is_a_clear_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=65)
    assert e.value.status_code == 400
    body = e.value.body
    assert isinstance(body, dict) and "n must be in [1, 64]" in body["message"] and body["param"] == "n"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    # OpenAI's and vLLM's status for a model nobody serves.
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "model_not_found"
