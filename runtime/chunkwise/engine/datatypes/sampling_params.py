"""Per-request sampling parameters, with vLLM's names and defaults. Validated once, on construction.

Kept free of torch: the server and the router build these without the model stack.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkwise.engine.datatypes.structured_output import StructuredOutput

# OpenAI's bounds; the number of top log-probs is capped like OpenAI's legacy completions API.
MAX_PENALTY = 2.0
MAX_LOGPROBS = 20
# Completions per request (`n`): each is a sequence of its own in the engine, sharing the prompt's KV.
MAX_N = 64
# torch.Generator.manual_seed's accepted range, checked here so a bad seed fails at the API edge.
_SEED_MIN = -(1 << 63)
_SEED_MAX = (1 << 64) - 1
_TOP_K_MAX = (1 << 31) - 1
# A request's priority: an int32, as vLLM's API documents it (it labels per-band metrics, so it stays small).
MIN_PRIORITY = -(1 << 31)
MAX_PRIORITY = (1 << 31) - 1


def _is_int(value: object) -> bool:
    # bool is an int subclass; `max_tokens=True` is a client bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Frozen so that a params object shared by many prompts stays per-request
    in effect: nothing downstream can change it for everyone. Use `dataclasses.replace` to derive one."""

    n: int = 1
    # None means "until max_model_len"; the engine resolves it per request.
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables; -1 (vLLM's spelling of "disabled") is normalised to 0.
    top_k: int = 0
    seed: int | None = None
    # Normalised to tuples: a str becomes a one-element tuple, None becomes ().
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: no log-probs; 0: only the sampled token's; k: also the top k of the distribution.
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Per-request opt-out of speculative decoding (when the engine runs with a speculative method).
    speculative: bool = True
    # vLLM's: the log-prob of every prompt token after the first (and this many alternatives). The prompt is
    # then computed whole: no prefix-cache hit can skip the positions it reports.
    prompt_logprobs: int | None = None
    # Structured outputs: the generated text is constrained to this JSON schema, regex, choice or grammar,
    # and ends (finish_reason "stop", at an EOS) where the grammar is complete.
    structured: StructuredOutput | None = None
    # vLLM's: under --scheduling-policy priority, lower is served first (and preempts higher running ones);
    # under fcfs only 0 is accepted (Scheduler.prepare refuses the rest, as vLLM does).
    priority: int = 0

    if TYPE_CHECKING:
        # The generated __init__ would type `stop` as the normalised tuple; callers may pass what vLLM
        # accepts. Must list the fields above in order with the same defaults (a test checks this).
        def __init__(
            self,
            n: int = 1,
            max_tokens: int | None = 16,
            temperature: float = 1.0,
            top_p: float = 1.0,
            top_k: int = 0,
            seed: int | None = None,
            stop: str | Sequence[str] | None = None,
            stop_token_ids: Sequence[int] | None = None,
            ignore_eos: bool = False,
            presence_penalty: float = 0.0,
            frequency_penalty: float = 0.0,
            logprobs: int | None = None,
            include_stop_str_in_output: bool = False,
            skip_special_tokens: bool = True,
            speculative: bool = True,
            prompt_logprobs: int | None = None,
            structured: StructuredOutput | None = None,
            priority: int = 0,
        ) -> None: ...

    def __post_init__(self) -> None:
        def set_(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if not 1 <= _check_int("n", self.n) <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n!r}")

        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1 or None, got {self.max_tokens!r}")

        temperature = _check_float("temperature", self.temperature)
        if temperature < 0 or math.isinf(temperature):
            raise ValueError(
                f"temperature must be finite and >= 0 (0 means greedy), got {self.temperature!r}"
            )
        set_("temperature", temperature)

        top_p = _check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        set_("top_p", top_p)

        top_k = _check_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if top_k > _TOP_K_MAX:
            # Past any vocabulary it means "disabled"; past int32 it would overflow the sampler's tensors.
            raise ValueError(f"top_k must be at most {_TOP_K_MAX}, got {self.top_k!r}")
        set_("top_k", max(top_k, 0))

        if self.seed is not None and not _SEED_MIN <= _check_int("seed", self.seed) <= _SEED_MAX:
            raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed!r}")

        set_("stop", _normalise_stop(self.stop))
        set_("stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
            set_(name, value)

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= _check_int(name, value) <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value!r}")

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            _check_bool(name, getattr(self, name))

        if not MIN_PRIORITY <= _check_int("priority", self.priority) <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")

        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput or None, got {self.structured!r}")

    # Cached: the step loop reads these for every row of every step (a frozen dataclass's fields never change).
    @functools.cached_property
    def greedy(self) -> bool:
        """Whether the token is always the argmax, so no randomness (and no seed) is involved."""
        return self.temperature == 0.0 or self.top_k == 1

    @functools.cached_property
    def has_penalty(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def child_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `seed` (n > 1): seed + index, as vLLM does,
    wrapped into the accepted range. Completion 0 draws what the same request with n=1 would."""
    span = _SEED_MAX - _SEED_MIN + 1
    return (seed + index - _SEED_MIN) % span + _SEED_MIN


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            # An empty stop string would match at every position and end every request at once.
            raise ValueError(f"stop must contain only non-empty strings, got {s!r} in {stop!r}")
    return tuple(stop)


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise ValueError(f"stop_token_ids must be a list of integers or None, got {ids!r}")
    for t in ids:
        if not _is_int(t) or t < 0:
            raise ValueError(f"stop_token_ids must contain only non-negative integers, got {t!r} in {ids!r}")
    return tuple(ids)
