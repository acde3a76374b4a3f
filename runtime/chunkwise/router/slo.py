"""Per-request latency targets: read from headers, judged against the cost model's predictions.

A client (or the gateway in front of the router) states what the request needs with llm-d's SLO header
names, plus one saying whether it may be refused:

    x-slo-ttft-ms: 500       time to first token, milliseconds
    x-slo-tpot-ms: 50        time per output token after the first, milliseconds
    x-sheddable: true        refuse it (429 with Retry-After) rather than serve it late

The picker keeps the policy's choice when that replica is predicted to meet the targets; otherwise it takes
the replica with the earliest predicted completion among those that do. When none does, a sheddable request
is refused, and any other goes to the policy's choice: best effort, since refusing it would not make it
faster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
SHEDDABLE_HEADER = "x-sheddable"
# A shed request is told to come back no sooner than this, nor later than the cap.
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class SloHeaderError(ValueError):
    """A target header that is not a positive number of milliseconds (the client's mistake: a 400)."""


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    sheddable: bool = False

    def met_by(self, ttft_s: float, tpot_s: float) -> bool:
        return (self.ttft_s is None or ttft_s <= self.ttft_s) and (
            self.tpot_s is None or tpot_s <= self.tpot_s
        )


class Shed(Exception):
    """No replica is predicted to meet a sheddable request's targets: refuse it, say when to retry."""

    def __init__(self, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.message = message


def _millis(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise SloHeaderError(f"{name} must be a number of milliseconds, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise SloHeaderError(f"{name} must be a positive number of milliseconds, got {raw!r}")
    return value / 1000.0


def parse_slo(headers: Mapping[str, str]) -> Slo | None:
    """The request's targets, or None when it states none. Header names are matched lower-case, as HTTP/2
    and Envoy deliver them; `headers` must be keyed that way."""
    ttft, tpot = _millis(headers, TTFT_HEADER), _millis(headers, TPOT_HEADER)
    raw = headers.get(SHEDDABLE_HEADER, "").strip().lower()
    if raw not in ("", "true", "false"):
        raise SloHeaderError(f"{SHEDDABLE_HEADER} must be true or false, got {raw!r}")
    if ttft is None and tpot is None:
        return None  # x-sheddable alone asks for nothing to be judged
    return Slo(ttft_s=ttft, tpot_s=tpot, sheddable=raw == "true")


def retry_after(waits_s: list[float]) -> int:
    """Seconds until the least loaded replica has worked off what is queued there, bounded."""
    soonest = min(waits_s, default=0.0)
    return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, math.ceil(soonest)))
