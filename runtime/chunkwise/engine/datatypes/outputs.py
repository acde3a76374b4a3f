"""What the engine hands back: per-request outputs, as deltas while streaming and whole from LLM.generate."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely alternatives at this position: (token id, logprob), best first.
    top: list[tuple[int, float]] = field(default_factory=list)
    # 1 + how many tokens were more likely (prompt log-probs report it, as vLLM does); None if not computed.
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # The stop token id or stop string that ended it; with "error", what went wrong.
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    # With SamplingParams.prompt_logprobs: prompt tokens 1.. (the first has no predecessor), on the first
    # output only.
    prompt_logprobs: list[TokenLogprob] | None = None


class RequestFailed(RuntimeError):
    """A stream's request ended with finish_reason "error" (the engine could not serve it); the message is
    the output's stop_reason, which says why."""
