"""The per-endpoint formatters, without a server: the exact JSON each endpoint streams and answers."""

from __future__ import annotations

import math

from chunkwise.engine.datatypes.outputs import CompletionOutput, RequestOutput, TokenLogprob
from chunkwise.server.formatters import (
    MIN_LOGPROB,
    ChatFormatter,
    Collected,
    CollectedResponse,
    CompletionFormatter,
    Prompt,
    ResponseHead,
    ResponseOptions,
    Usage,
)

HEAD = ResponseHead(id="x-1", created=7, model="m", prompts=(Prompt([1, 2], "p q"),))
TEXTS = {10: "ab", 11: "c", 12: "d"}
ENVELOPE = {"id": "x-1", "created": 7, "model": "m"}


def _delta(
    text: str,
    ids: list[int],
    lps: list[TokenLogprob] | None = None,
    finish: str | None = None,
    index: int = 0,
) -> CompletionOutput:
    return CompletionOutput(index=index, text=text, token_ids=ids, logprobs=lps, finish_reason=finish)


def _collected(head: ResponseHead, *choices: Collected) -> CollectedResponse:
    result = CollectedResponse(head)
    for c in choices:
        result.choices[c.index] = c
    return result


def test_completion_chunks_carry_prompt_ids_once_and_offsets_run_on() -> None:
    opts = ResponseOptions(stream=True, include_usage=True, logprobs=True, return_token_ids=True)
    fmt = CompletionFormatter(HEAD, opts, TEXTS.__getitem__)
    assert fmt.opening() == []
    first = fmt.chunk(0, _delta("ab", [10], [TokenLogprob(10, -0.5, [(11, -1.0), (10, -0.5)])]))
    second = fmt.chunk(0, _delta("c", [11], [TokenLogprob(11, -math.inf)], "length"))
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
    result = _collected(HEAD, Collected(text="abc", token_ids=[10, 11], finish_reason="stop"))
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
    chunk = fmt.chunk(0, _delta("c", [11], [TokenLogprob(11, -0.25, [(11, -0.25), (12, -2.0)])]))
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
    assert fmt.chunk(0, _delta("", [12], [], "stop"))["choices"][0]["delta"] == {}


def test_chat_answer_puts_prompt_ids_on_the_response() -> None:
    fmt = ChatFormatter(HEAD, ResponseOptions(return_token_ids=True), TEXTS.__getitem__)
    collected = _collected(HEAD, Collected(text="cd", token_ids=[11, 12], finish_reason="length"))
    answer = fmt.answer(collected, Usage(2, 2, 0))
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


BATCH = ResponseHead(id="x-1", created=7, model="m", prompts=(Prompt([1], "p"), Prompt([2, 3], "q r")), n=2)


TEXTS.update({1: "p", 2: "q", 3: " r"})


def test_a_batch_numbers_choices_by_prompt_then_choice_and_echo_opens_each() -> None:
    opts = ResponseOptions(stream=True, logprobs=True, return_token_ids=True, echo=True)
    fmt = CompletionFormatter(BATCH, opts, TEXTS.__getitem__)
    fmt.add_prompt_logprobs(1, [TokenLogprob(3, -2.0, [(2, -0.5)])])
    # The second prompt's choice 1 is choice 3; its first chunk echoes its own prompt, ids and text.
    first = fmt.chunk(1, _delta("c", [11], [TokenLogprob(11, -1.0)], index=1))["choices"][0]
    assert (first["index"], first["text"], first["prompt_token_ids"]) == (3, "q rc", [2, 3])
    # The echoed prompt's tokens open the log-probs (the first without one), offsets running on.
    assert first["logprobs"] == {
        "tokens": ["q", " r", "c"],
        "token_logprobs": [None, -2.0, -1.0],
        "top_logprobs": [None, {" r": -2.0, "q": -0.5}, {"c": -1.0}],
        "text_offset": [0, 1, 3],
    }
    # Offsets run per choice, not across choices.
    again = fmt.chunk(1, _delta("d", [12], [TokenLogprob(12, -1.0)], "stop", index=1))["choices"][0]
    assert (again["text"], again["logprobs"]["text_offset"], again["finish_reason"]) == ("d", [4], "stop")
    assert "prompt_token_ids" not in again
    other = fmt.chunk(0, _delta("ab", [10], [TokenLogprob(10, -1.0)], index=0))["choices"][0]
    assert (other["index"], other["text"], other["logprobs"]["text_offset"]) == (0, "pab", [0, 1])


def test_an_answer_lists_every_choice_in_index_order() -> None:
    fmt = CompletionFormatter(BATCH, ResponseOptions(), TEXTS.__getitem__)
    result = CollectedResponse(BATCH)
    for k, index, text in [(1, 1, "x"), (0, 0, "a"), (1, 0, "w"), (0, 1, "b")]:
        result.add(k, _output([_delta(text, [10], finish="stop", index=index)]))
    answer = fmt.answer(result, Usage(3, 4, 0))
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [(0, "a"), (1, "b"), (2, "w"), (3, "x")]
    assert not result.aborted and result.num_completion_tokens == 4


def test_chat_opens_every_choice_with_its_role() -> None:
    head = ResponseHead(id="x-1", created=7, model="m", prompts=(Prompt([1, 2], ""),), n=3)
    fmt = ChatFormatter(head, ResponseOptions(stream=True, return_token_ids=True), TEXTS.__getitem__)
    opening = fmt.opening()
    assert [c["choices"][0]["index"] for c in opening] == [0, 1, 2]
    assert [c["choices"][0]["delta"]["role"] for c in opening] == ["assistant"] * 3
    assert opening[0]["prompt_token_ids"] == [1, 2] and "prompt_token_ids" not in opening[1]
    assert fmt.chunk(0, _delta("c", [11], index=2))["choices"][0]["index"] == 2


def _output(outputs: list[CompletionOutput]) -> RequestOutput:
    return RequestOutput("r", None, [1], outputs, finished=False)
