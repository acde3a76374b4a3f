"""How each endpoint shapes its answers: a streamed delta chunk, the last (usage) chunk, a whole answer,
log-probs and usage. The serving path (serving.py) is the same for both endpoints; only these shapes differ.

A formatter is built per response and may keep state across its chunks (the completions log-probs'
`text_offset` runs on from chunk to chunk; only the first chunk repeats the prompt's token ids).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkwise.outputs import CompletionOutput, RequestOutput, TokenLogprob

if TYPE_CHECKING:
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


@dataclass(frozen=True)
class ResponseHead:
    """What every chunk and answer of one response carries."""

    id: str
    created: int
    model: str
    prompt_token_ids: list[int]


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
    """One request's whole output, joined from its deltas (a non-streamed answer)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = c.finish_reason


class Formatter(ABC):
    """One response's JSON objects; subclasses say how a choice and its log-probs look."""

    chunk_object: str
    answer_object: str

    def __init__(self, head: ResponseHead, options: ResponseOptions, token_text: TokenText) -> None:
        self.head = head
        self.options = options
        self.token_text = token_text

    def opening(self) -> list[dict[str, Any]]:
        """The chunks streamed before any output."""
        return []

    @abstractmethod
    def chunk(self, delta: CompletionOutput, finish_reason: str | None) -> dict[str, Any]:
        """A streamed chunk for one step's delta (`finish_reason` only on the last)."""

    @abstractmethod
    def answer(self, result: Collected, usage: Usage) -> dict[str, Any]:
        """The whole answer of a non-streamed request."""

    @abstractmethod
    def _shape_logprobs(self, lps: Sequence[TokenLogprob]) -> Any: ...

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage.as_dict()}

    def logprobs(self, lps: Sequence[TokenLogprob] | None) -> Any:
        return self._shape_logprobs(lps or []) if self.options.logprobs else None

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        h = self.head
        return {"id": h.id, "object": obj, "created": h.created, "model": h.model, "choices": choices}

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        data = {**self._envelope(self.chunk_object, [choice]), **extra}
        if self.options.include_usage:
            data["usage"] = None
        return data

    def _answer(self, choice: dict[str, Any], usage: Usage, **extra: Any) -> dict[str, Any]:
        return {**self._envelope(self.answer_object, [choice]), "usage": usage.as_dict(), **extra}


class _CompletionLogprobs:
    """The legacy completions log-prob object, grown delta by delta."""

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text
        self.offset = 0  # where the next token's text starts in the completion

    def add(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
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
    """/v1/completions: choices carry "text"; the prompt's ids ride on the first choice."""

    chunk_object = answer_object = "text_completion"

    def __init__(self, head: ResponseHead, options: ResponseOptions, token_text: TokenText) -> None:
        super().__init__(head, options, token_text)
        self._logprobs = _CompletionLogprobs(token_text)
        self._first = True

    def _shape_logprobs(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self._logprobs.add(lps)

    def _choice(
        self, text: str, lps: Sequence[TokenLogprob] | None, finish_reason: str | None, token_ids: list[int]
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": self.logprobs(lps),
            "finish_reason": finish_reason,
        }
        if self.options.return_token_ids:
            if self._first:
                choice["prompt_token_ids"] = self.head.prompt_token_ids
            choice["token_ids"] = token_ids
        self._first = False
        return choice

    def chunk(self, delta: CompletionOutput, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk(self._choice(delta.text, delta.logprobs, finish_reason, delta.token_ids))

    def answer(self, result: Collected, usage: Usage) -> dict[str, Any]:
        choice = self._choice(result.text, result.logprobs, result.finish_reason, result.token_ids)
        return self._answer(choice, usage)


class ChatFormatter(Formatter):
    """/v1/chat/completions: a role chunk opens the stream; choices carry a "delta" or a "message"; the
    prompt's ids ride on the response (the opening chunk when streaming)."""

    chunk_object = "chat.completion.chunk"
    answer_object = "chat.completion"

    def __init__(self, head: ResponseHead, options: ResponseOptions, token_text: TokenText) -> None:
        super().__init__(head, options, token_text)
        # Tool calls (server/tools.py's ChatOptions): how the text is read, and the streamed answer so far.
        self._tools: ToolParsing | None = getattr(options, "tools", None)
        self._tool_stream: ToolStream | None = self._tools.stream() if self._tools is not None else None

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def _shape_logprobs(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in lps:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top[: self.options.top_logprobs]]
            content.append(entry)
        return {"content": content}

    def _prompt_ids(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.head.prompt_token_ids} if self.options.return_token_ids else {}

    def opening(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return [self._chunk(choice, **self._prompt_ids())]

    def chunk(self, delta: CompletionOutput, finish_reason: str | None) -> dict[str, Any]:
        text = delta.text
        calls: list[ToolCall] = []
        if self._tool_stream is not None:
            text = self._tool_stream.feed(text)
            if finish_reason is not None:
                rest, calls = self._tool_stream.finish(complete=finish_reason == "stop")
                text += rest
        message: dict[str, Any] = {"content": text} if text else {}
        if calls:
            message["tool_calls"] = [c.as_delta(i) for i, c in enumerate(calls)]
            finish_reason = "tool_calls"
        choice: dict[str, Any] = {
            "index": 0,
            "delta": message,
            "logprobs": self.logprobs(delta.logprobs),
            "finish_reason": finish_reason,
        }
        if self.options.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return self._chunk(choice)

    def answer(self, result: Collected, usage: Usage) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish_reason = result.finish_reason
        if self._tools is not None and finish_reason == "stop":
            content, calls = self._tools.extract(result.text)
            if calls:
                message = {**message, "content": content, "tool_calls": [c.as_dict() for c in calls]}
                finish_reason = "tool_calls"
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": self.logprobs(result.logprobs),
            "finish_reason": finish_reason,
        }
        if self.options.return_token_ids:
            choice["token_ids"] = result.token_ids
        return self._answer(choice, usage, **self._prompt_ids())
