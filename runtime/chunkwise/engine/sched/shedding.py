"""Load shedding at the door: refuse a request at once rather than let it wait past its useful life.

Two rules, checked when a request arrives (before anything is queued):

- the waiting queue is bounded: when `max_waiting` requests are already accepted and not yet running, refuse
  ("queue_full");
- the predicted queueing delay, the work queued ahead of the newcomer divided by the measured service rate,

      delay = (queued prefill tokens + queued decode tokens) / service tokens per second

  must not exceed the SLO ("slo"). Queued prefill tokens are the waiting requests' uncomputed tokens (a
  recompute-preempted request counts its whole prompt + output again); queued decode tokens are their
  estimated remaining outputs (max_tokens when the client gave one, else admission's quantile estimate). The
  service rate is an exponential moving average of tokens per second over recent steps.

A refusal carries a Retry-After: the predicted delay rounded up, at least 1 second (and at most
`MAX_RETRY_AFTER_S`, so one absurd measurement cannot tell clients to go away for an hour).

Everything here is pure: the engine loop publishes a `LoadSnapshot` after each step and the server calls
`decide(policy, snapshot)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

RejectReason = Literal["queue_full", "slo"]
REJECT_REASONS: tuple[RejectReason, ...] = ("queue_full", "slo")
MAX_RETRY_AFTER_S = 600


@dataclass(frozen=True)
class LoadSnapshot:
    """The queue as the admission check sees it: requests accepted and not yet running."""

    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    queued_decode_tokens: int = 0
    # Measured tokens per second (0: not measured yet, so no delay can be predicted).
    service_tokens_per_s: float = 0.0

    def plus(self, num_requests: int, prefill_tokens: int, decode_tokens: int) -> LoadSnapshot:
        return LoadSnapshot(
            self.num_waiting + num_requests,
            self.queued_prefill_tokens + prefill_tokens,
            self.queued_decode_tokens + decode_tokens,
            self.service_tokens_per_s,
        )

    @property
    def queued_tokens(self) -> int:
        return self.queued_prefill_tokens + self.queued_decode_tokens

    @property
    def predicted_delay_s(self) -> float:
        """Seconds of work queued ahead of a newcomer at the measured rate (0 when the rate is unknown)."""
        if self.queued_tokens <= 0 or self.service_tokens_per_s <= 0:
            return 0.0
        return self.queued_tokens / self.service_tokens_per_s


@dataclass(frozen=True)
class SheddingPolicy:
    """None disables a rule: `SheddingPolicy()` admits everything."""

    max_waiting: int | None = None
    queue_delay_slo_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {self.max_waiting}")
        if self.queue_delay_slo_s is not None and not self.queue_delay_slo_s > 0:
            raise ValueError(f"queue_delay_slo_s must be positive, got {self.queue_delay_slo_s}")


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: RejectReason | None
    predicted_delay_s: float
    # Seconds a refused client should wait before retrying (0 when admitted).
    retry_after_s: int

    @property
    def message(self) -> str:
        if self.reason == "queue_full":
            return "the server's waiting queue is full; retry later"
        if self.reason == "slo":
            return (
                f"the server is overloaded: predicted queueing delay {self.predicted_delay_s:.1f}s exceeds "
                "its queueing-delay objective; retry later"
            )
        return "admitted"


def retry_after_s(delay_s: float) -> int:
    if not math.isfinite(delay_s):
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(delay_s)))


def decide(policy: SheddingPolicy, load: LoadSnapshot) -> Decision:
    """Admit or refuse one newcomer given the load already accepted (the newcomer itself not included)."""
    delay = load.predicted_delay_s
    if policy.max_waiting is not None and load.num_waiting >= policy.max_waiting:
        return Decision(False, "queue_full", delay, retry_after_s(delay))
    if policy.queue_delay_slo_s is not None and delay > policy.queue_delay_slo_s:
        return Decision(False, "slo", delay, retry_after_s(delay))
    return Decision(True, None, delay, 0)


class Overloaded(Exception):
    """Raised by the engine's admission check when `decide` refuses a request."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.message)
        self.decision = decision


class ServiceRate:
    """Tokens per second over recent steps: EMAs of tokens and of seconds per step, and their ratio.

    Averaging the two separately weights each step by its duration, so a burst of tiny idle-ish steps does
    not swamp the rate measured on full ones. `initial_tokens_per_s` (e.g. the start-up prefill
    measurement) acts as a prior worth about one second of work.
    """

    def __init__(self, initial_tokens_per_s: float = 0.0, alpha: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._tokens = max(0.0, initial_tokens_per_s)
        self._seconds = 1.0 if initial_tokens_per_s > 0 else 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if self._seconds == 0.0:
            self._tokens, self._seconds = float(tokens), seconds
            return
        a = self.alpha
        self._tokens += a * (tokens - self._tokens)
        self._seconds += a * (seconds - self._seconds)

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else 0.0
