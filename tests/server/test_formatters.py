"""The per-endpoint formatters, without a server: the exact JSON each endpoint streams and answers."""

from __future__ import annotations

import math

from chunkwise.outputs import CompletionOutput, TokenLogprob
from chunkwise.server.formatters import (
    MIN_LOGPROB,
    ChatFormatter,
    Collected,
    CompletionFormatter,
    ResponseHead,
    ResponseOptions,
    Usage,
)

HEAD = ResponseHead(id="x-1", created=7, model="m", prompt_token_ids=[1, 2])
TEXTS = {10: "ab", 11: "c", 12: "d"}
ENVELOPE = {"id": "x-1", "created": 7, "model": "m"}


def _delta(text: str, ids: list[int], lps: list[TokenLogprob] | None = None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=ids, logprobs=lps)


def test_completion_chunks_carry_prompt_ids_once_and_offsets_run_on() -> None:
    opts = ResponseOptions(stream=True, include_usage=True, logprobs=True, return_token_ids=True)
    fmt = CompletionFormatter(HEAD, opts, TEXTS.__getitem__)
    assert fmt.opening() == []
    first = fmt.chunk(_delta("ab", [10], [TokenLogprob(10, -0.5, [(11, -1.0), (10, -0.5)])]), None)
    second = fmt.chunk(_delta("c", [11], [TokenLogprob(11, -math.inf)]), "length")
    assert first == {
        **ENVELOPE,
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "ab",
                "logprobs": {
                    "tokens": ["ab"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{"ab": -0.5, "c": -1.0}],
                    "text_offset": [0],
                },
                "finish_reason": None,
                "prompt_token_ids": [1, 2],
                "token_ids": [10],
            }
        ],
        "usage": None,
    }
    choice = second["choices"][0]
    assert "prompt_token_ids" not in choice
    assert choice["logprobs"]["text_offset"] == [2]
    assert choice["logprobs"]["token_logprobs"] == [MIN_LOGPROB]
    assert choice["finish_reason"] == "length"
    assert fmt.usage_chunk(Usage(2, 2, 0)) == {
        **ENVELOPE,
        "object": "text_completion",
        "choices": [],
        "usage": {
            "prompt_tokens": 2,
            "completion_tokens": 2,
            "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def test_completion_answer_without_extras() -> None:
    fmt = CompletionFormatter(HEAD, ResponseOptions(), TEXTS.__getitem__)
    result = Collected(text="abc", token_ids=[10, 11], finish_reason="stop", num_cached_tokens=1)
    answer = fmt.answer(result, Usage(2, 2, 1))
    assert list(answer) == ["id", "object", "created", "model", "choices", "usage"]
    assert answer["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "stop"}]
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_chat_stream_opens_with_the_role_and_slices_top_logprobs() -> None:
    opts = ResponseOptions(stream=True, logprobs=True, top_logprobs=1, return_token_ids=True)
    fmt = ChatFormatter(HEAD, opts, TEXTS.__getitem__)
    assert fmt.opening() == [
        {
            **ENVELOPE,
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": [1, 2],
        }
    ]
    chunk = fmt.chunk(_delta("c", [11], [TokenLogprob(11, -0.25, [(11, -0.25), (12, -2.0)])]), None)
    assert chunk["choices"] == [
        {
            "index": 0,
            "delta": {"content": "c"},
            "logprobs": {
                "content": [
                    {
                        "token": "c",
                        "logprob": -0.25,
                        "bytes": [99],
                        "top_logprobs": [{"token": "c", "logprob": -0.25, "bytes": [99]}],
                    }
                ]
            },
            "finish_reason": None,
            "token_ids": [11],
        }
    ]
    assert "prompt_token_ids" not in chunk and "usage" not in chunk
    # A step whose text is held back (a stop string may follow) still gets a chunk, with an empty delta.
    assert fmt.chunk(_delta("", [12], []), "stop")["choices"][0]["delta"] == {}


def test_chat_answer_puts_prompt_ids_on_the_response() -> None:
    fmt = ChatFormatter(HEAD, ResponseOptions(return_token_ids=True), TEXTS.__getitem__)
    answer = fmt.answer(Collected(text="cd", token_ids=[11, 12], finish_reason="length"), Usage(2, 2, 0))
    assert list(answer) == ["id", "object", "created", "model", "choices", "usage", "prompt_token_ids"]
    assert answer["object"] == "chat.completion"
    assert answer["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "cd"},
            "logprobs": None,
            "finish_reason": "length",
            "token_ids": [11, 12],
        }
    ]
    assert answer["prompt_token_ids"] == [1, 2]
