"""How each endpoint shapes its answers: a streamed delta chunk, the last (usage) chunk, a whole answer,
log-probs and usage. The serving path (serving.py) is the same for both endpoints; only these shapes differ.

A formatter is built per response and keeps per-choice state across its chunks (the completions log-probs'
`text_offset` runs on from chunk to chunk; only a choice's first chunk carries its prompt's token ids, or
its echoed prompt). A response holds `n` choices per prompt; choice `prompt_index * n + i` is the engine's
output `i` of that prompt, as OpenAI numbers a batch of prompts.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkwise.engine.datatypes.outputs import CompletionOutput, RequestOutput, TokenLogprob
from chunkwise.server.tools import ToolCall, ToolParsing, ToolStream

# JSON has no infinities: a -inf logprob (a token the sampler could never pick) is reported as this.
MIN_LOGPROB = -9999.0

# A token id -> its text, as the log-prob objects show it (cached by the server state).
TokenText = Callable[[int], str]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


@dataclass(frozen=True)
class ResponseOptions:
    """What the client asked to see besides the text, read from the body by its endpoint."""

    stream: bool = False
    # Streaming only: every chunk carries "usage": null, and a last chunk with no choices carries the usage.
    include_usage: bool = False
    logprobs: bool = False
    # Chat's alternatives per token; a completion shows every alternative the engine returns.
    top_logprobs: int = 0
    return_token_ids: bool = False
    # Completions: each choice's text starts with its prompt's (and, with logprobs, so do its log-probs).
    echo: bool = False
    # vLLM's prompt_logprobs: each choice (a chat response) carries its prompt tokens' log-probs.
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class ChatOptions(ResponseOptions):
    """A chat answer's options, with how its text is read for tool calls (None: it is all content)."""

    tools: ToolParsing | None = None


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str  # what echo repeats: the prompt as sent, or its ids decoded


@dataclass(frozen=True)
class ResponseHead:
    """What every chunk and answer of one response carries."""

    id: str
    created: int
    model: str
    prompts: tuple[Prompt, ...]
    n: int = 1  # choices per prompt

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class Collected:
    """One choice's whole output, joined from its deltas (a non-streamed answer)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, c: CompletionOutput) -> None:
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason


class CollectedResponse:
    """Every choice of a response, from the outputs of its prompts' engine requests."""

    def __init__(self, head: ResponseHead) -> None:
        self.n = head.n
        self.choices = [Collected(index=i) for i in range(head.num_choices)]
        self._cached = [0] * len(head.prompts)

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        for c in out.outputs:
            self.choices[prompt_index * self.n + c.index].add(c)
        self._cached[prompt_index] = out.num_cached_tokens

    @property
    def aborted(self) -> bool:
        return any(c.finish_reason == "abort" for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        return sum(self._cached)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class Formatter(ABC):
    """One response's JSON objects; subclasses say how a choice and its log-probs look."""

    chunk_object: str
    answer_object: str

    def __init__(self, head: ResponseHead, options: ResponseOptions, token_text: TokenText) -> None:
        self.head = head
        self.options = options
        self.token_text = token_text
        # Per prompt: its tokens' log-probs once the engine has scored it (the first output carries them).
        self.prompt_scores: list[list[TokenLogprob] | None] = [None] * len(head.prompts)

    def add_prompt_logprobs(self, prompt_index: int, scores: list[TokenLogprob] | None) -> None:
        if scores is not None:
            self.prompt_scores[prompt_index] = scores

    def _vllm_prompt_logprobs(self, prompt_index: int) -> list[dict[str, Any] | None]:
        """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
        with the token itself and its alternatives."""
        shaped: list[dict[str, Any] | None] = [None]
        for lp in self.prompt_scores[prompt_index] or []:
            entry = {str(lp.token_id): self._vllm_entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, (tid, v) in enumerate(lp.top, start=1):
                entry.setdefault(str(tid), self._vllm_entry(tid, v, rank))
            shaped.append(entry)
        return shaped

    def _vllm_entry(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": self.token_text(token_id)}

    def opening(self) -> list[dict[str, Any]]:
        """The chunks streamed before any output."""
        return []

    def chunk(self, prompt_index: int, delta: CompletionOutput) -> dict[str, Any]:
        """A streamed chunk for one choice's delta of one step (its finish_reason only on its last)."""
        return self._chunk(self._delta_choice(prompt_index * self.head.n + delta.index, delta))

    def answer(self, result: CollectedResponse, usage: Usage) -> dict[str, Any]:
        """The whole answer of a non-streamed request."""
        choices = [self._whole_choice(c) for c in result.choices]
        return {**self._envelope(self.answer_object, choices), "usage": usage.as_dict()}

    @abstractmethod
    def _delta_choice(self, index: int, delta: CompletionOutput) -> dict[str, Any]: ...

    @abstractmethod
    def _whole_choice(self, result: Collected) -> dict[str, Any]: ...

    @abstractmethod
    def _shape_logprobs(self, index: int, lps: Sequence[TokenLogprob]) -> Any: ...

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage.as_dict()}

    def logprobs(self, index: int, lps: Sequence[TokenLogprob] | None) -> Any:
        return self._shape_logprobs(index, lps or []) if self.options.logprobs else None

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        h = self.head
        return {"id": h.id, "object": obj, "created": h.created, "model": h.model, "choices": choices}

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        data = {**self._envelope(self.chunk_object, [choice]), **extra}
        if self.options.include_usage:
            data["usage"] = None
        return data


class _CompletionLogprobs:
    """The legacy completions log-prob object of one choice, grown delta by delta."""

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text
        self.offset = 0  # where the next token's text starts in the completion

    def add(self, lps: Sequence[TokenLogprob], prompt: Prompt | None = None) -> dict[str, Any]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        if prompt is not None:
            # Echo: the prompt's first token has no log-prob (nothing precedes it), as OpenAI shows it.
            first = self.token_text(prompt.token_ids[0])
            for key, value in (("tokens", first), ("token_logprobs", None), ("top_logprobs", None)):
                out[key].append(value)
            out["text_offset"].append(self.offset)
            self.offset += len(first)
        for lp in lps:
            text = self.token_text(lp.token_id)
            top = {text: _finite(lp.logprob)}
            for tid, v in lp.top:
                top.setdefault(self.token_text(tid), _finite(v))
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


class CompletionFormatter(Formatter):
    """/v1/completions: choices carry "text"; a choice's first chunk carries its prompt's ids (and its
    prompt's text, with echo)."""

    chunk_object = answer_object = "text_completion"

    def __init__(self, head: ResponseHead, options: ResponseOptions, token_text: TokenText) -> None:
        super().__init__(head, options, token_text)
        self._logprobs = [_CompletionLogprobs(token_text) for _ in range(head.num_choices)]
        self._started = [False] * head.num_choices

    def _shape_logprobs(self, index: int, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self._logprobs[index].add(lps)

    def _echoed_logprobs(self, index: int, lps: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        prompt = self.head.prompt_of(index)
        scores = self.prompt_scores[index // self.head.n] or []
        return self._logprobs[index].add([*scores, *(lps or [])], prompt=prompt)

    def _choice(
        self,
        index: int,
        text: str,
        lps: Sequence[TokenLogprob] | None,
        finish_reason: str | None,
        token_ids: list[int],
    ) -> dict[str, Any]:
        first = not self._started[index]
        self._started[index] = True
        echo = first and self.options.echo
        if echo and self.options.logprobs:
            # The echoed prompt's own tokens open the log-probs, their offsets running into the completion's.
            logprobs = self._echoed_logprobs(index, lps)
        else:
            logprobs = self.logprobs(index, lps)
        if echo:
            text = self.head.prompt_of(index).text + text
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if first and self.options.prompt_logprobs:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(index // self.head.n)
        if self.options.return_token_ids:
            if first:
                choice["prompt_token_ids"] = self.head.prompt_of(index).token_ids
            choice["token_ids"] = token_ids
        return choice

    def _delta_choice(self, index: int, delta: CompletionOutput) -> dict[str, Any]:
        return self._choice(index, delta.text, delta.logprobs, delta.finish_reason, delta.token_ids)

    def _whole_choice(self, result: Collected) -> dict[str, Any]:
        return self._choice(
            result.index, result.text, result.logprobs, result.finish_reason, result.token_ids
        )


class ChatFormatter(Formatter):
    """/v1/chat/completions: a role chunk opens each choice's stream; choices carry a "delta" or a
    "message"; the prompt's ids ride on the response (the first opening chunk when streaming)."""

    chunk_object = "chat.completion.chunk"
    answer_object = "chat.completion"

    def __init__(self, head: ResponseHead, options: ResponseOptions, token_text: TokenText) -> None:
        super().__init__(head, options, token_text)
        self._scores_sent = False
        # Tool calls: how the text is read (ChatOptions.tools), and each choice's streamed answer.
        self._tools = options.tools if isinstance(options, ChatOptions) else None
        self._tool_streams: dict[int, ToolStream] = {}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def _shape_logprobs(self, index: int, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in lps:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top[: self.options.top_logprobs]]
            content.append(entry)
        return {"content": content}

    def _prompt_ids(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.head.prompts[0].token_ids} if self.options.return_token_ids else {}

    def _prompt_logprobs(self) -> dict[str, Any]:
        return {"prompt_logprobs": self._vllm_prompt_logprobs(0)} if self.options.prompt_logprobs else {}

    def chunk(self, prompt_index: int, delta: CompletionOutput) -> dict[str, Any]:
        # Streamed, the prompt's log-probs ride on the first chunk after the opening (they come with the
        # first output, after the role chunks went out).
        extra = {} if self._scores_sent else self._prompt_logprobs()
        self._scores_sent = True
        return self._chunk(self._delta_choice(prompt_index * self.head.n + delta.index, delta), **extra)

    def opening(self) -> list[dict[str, Any]]:
        chunks = []
        for index in range(self.head.num_choices):
            delta = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            chunks.append(self._chunk(choice, **(self._prompt_ids() if index == 0 else {})))
        return chunks

    def _delta_choice(self, index: int, delta: CompletionOutput) -> dict[str, Any]:
        text, finish_reason = delta.text, delta.finish_reason
        calls: list[ToolCall] = []
        if self._tools is not None:
            stream = self._tool_streams.get(index)
            if stream is None:
                stream = self._tool_streams[index] = self._tools.stream()
            text = stream.feed(text)
            if finish_reason is not None:
                rest, calls = stream.finish(complete=finish_reason == "stop")
                text += rest
        message: dict[str, Any] = {"content": text} if text else {}
        if calls:
            message["tool_calls"] = [c.as_delta(i) for i, c in enumerate(calls)]
            finish_reason = "tool_calls"
        choice: dict[str, Any] = {
            "index": index,
            "delta": message,
            "logprobs": self.logprobs(index, delta.logprobs),
            "finish_reason": finish_reason,
        }
        if self.options.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice

    def _whole_choice(self, result: Collected) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish_reason = result.finish_reason
        if self._tools is not None and finish_reason == "stop":
            content, calls = self._tools.extract(result.text)
            if calls:
                message = {**message, "content": content, "tool_calls": [c.as_dict() for c in calls]}
                finish_reason = "tool_calls"
        choice: dict[str, Any] = {
            "index": result.index,
            "message": message,
            "logprobs": self.logprobs(result.index, result.logprobs),
            "finish_reason": finish_reason,
        }
        if self.options.return_token_ids:
            choice["token_ids"] = result.token_ids
        return choice

    def answer(self, result: CollectedResponse, usage: Usage) -> dict[str, Any]:
        return {**super().answer(result, usage), **self._prompt_ids(), **self._prompt_logprobs()}
