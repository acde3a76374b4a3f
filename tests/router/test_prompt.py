"""The router tokenizes and hashes a prompt exactly as the engine and server do, or prefix matches fail."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from chunkwise.engine.cache.hashing import hash_prefix_blocks
from chunkwise.engine.tokenizer import ByteTokenizer
from chunkwise.router.prompt import PromptReader, RoutedRequest, load_tokenizer
from chunkwise.server.protocol import ChatCompletionRequest
from chunkwise.server.serving import chat_prompt_ids

BLOCK = 16


def read(path: str, body: Any, default_output_tokens: int = 100) -> RoutedRequest:
    reader = PromptReader(ByteTokenizer(), BLOCK, default_output_tokens)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return reader.read(path, raw)


def test_completion_prompt_is_hashed_like_the_engine() -> None:
    prompt = "You are a helpful assistant. " * 4 + "What is a KV cache?"
    routed = read("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 7})
    ids = ByteTokenizer().encode(prompt)  # the engine's encode: BOS, then the UTF-8 bytes
    assert ids[0] == ByteTokenizer.BOS
    assert routed.prompt_tokens == len(ids)
    assert list(routed.block_hashes) == hash_prefix_blocks(ids, BLOCK)
    assert len(routed.block_hashes) == len(ids) // BLOCK
    assert (routed.output_tokens, routed.stream, routed.model) == (7, False, "tiny")


def test_token_id_prompts_and_one_element_batches() -> None:
    ids = list(range(40))
    assert read("/v1/completions", {"prompt": ids}).prompt_tokens == 40
    assert read("/v1/completions", {"prompt": [ids]}).block_hashes == tuple(hash_prefix_blocks(ids, BLOCK))
    one = read("/v1/completions", {"prompt": ["abc"]})
    assert one.prompt_tokens == len(ByteTokenizer().encode("abc"))


def test_chat_prompt_matches_the_server_rendering() -> None:
    messages = [
        {"role": "system", "content": "You are terse. " * 5},
        {"role": "user", "content": [{"type": "text", "text": "Explain paging."}]},
    ]
    body = {"model": "tiny", "messages": messages, "stream": True, "max_completion_tokens": 9}
    routed = read("/v1/chat/completions", body)
    engine = SimpleNamespace(tokenizer=ByteTokenizer())
    server_ids = chat_prompt_ids(engine, ChatCompletionRequest.model_validate(body))  # type: ignore[arg-type]
    assert routed.prompt_tokens == len(server_ids)
    assert list(routed.block_hashes) == hash_prefix_blocks(server_ids, BLOCK)
    assert (routed.output_tokens, routed.stream) == (9, True)


@pytest.mark.parametrize(
    ("path", "body", "output_tokens"),
    [
        ("/v1/completions", {"prompt": "hi"}, 16),  # OpenAI's default for completions
        ("/v1/completions", {"prompt": "hi", "max_tokens": None}, 100),  # "as long as fits": the default
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 100),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, 3),
    ],
)
def test_output_length(path: str, body: dict[str, Any], output_tokens: int) -> None:
    assert read(path, body).output_tokens == output_tokens


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"",
        {"prompt": ""},
        {"prompt": ["a", "b"]},  # a batch: the server refuses it, with its own error
        {"prompt": 5},
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "wizard", "content": "unknown role"}]},
    ],
)
def test_unreadable_bodies_route_without_prefix(body: Any) -> None:
    chat = isinstance(body, dict) and "messages" in body
    routed = read("/v1/chat/completions" if chat else "/v1/completions", body)
    assert (routed.prompt_tokens, routed.block_hashes) == (0, ())


def test_tokenizer_choice() -> None:
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer("/nonexistent/model/dir")
