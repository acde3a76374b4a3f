"""Benchmark workloads as plain data, reproducible from a seed, with no torch.

A workload is a list of `WorkItem`s: a prompt (token ids or text), the output length the client asks for
(`max_tokens`, or None when it gives none and the engine's output-length estimator decides the reservation),
an arrival offset in seconds, and, when `max_tokens` is None, the hidden length at which the request ends
(the simulator stops it there; an HTTP client cannot, so `bench serve` sends `max_tokens=target_len`).

Shapes (what is asked): `long_tailed` (log-normal output lengths, the useful-work fraction of docs/scheduling.md of 0.2-0.4
under static batching), `shared_prefix` (agent traffic: a few long system prompts shared by many requests),
`with_long_prompts` (the convoy case: prompts of thousands of tokens injected into running traffic).
Arrivals (when): `arrival_times` (all at once, Poisson, or gamma-bursty with vLLM's `burstiness` meaning)
and `burst_arrivals` (groups of requests at the same instant). Traces: `save_jsonl` / `load_jsonl`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Text -> token ids (a chunkwise tokenizer's bound `encode` fits).
Encoder = Callable[[str], Sequence[int]]

# Token ids below this are kept out of generated prompts: the byte tokenizer's control bytes and, in the
# built-in models, nothing that could be a special token.
_FIRST_PROMPT_TOKEN = 3
# The byte tokenizer's specials (BOS 256, EOS 257) are kept out of generated prompts too.
_BYTE_VOCAB = 256


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: tuple[int, ...] | None
    # None: the client gives no max_tokens (admission uses its estimate) and the request ends at target_len.
    max_tokens: int | None
    arrival_s: float = 0.0
    prompt: str | None = None
    target_len: int | None = None
    lora: str | None = None  # the LoRA adapter it runs (None: the base model)
    tenant: str | None = None  # whom it is served for (--fairness vtc; None: the default tenant)
    priority: int = 0  # --scheduling-policy priority: lower first

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("a work item has either prompt_token_ids or a text prompt, not both or neither")
        if self.max_tokens is None and self.target_len is None:
            raise ValueError("a work item without max_tokens needs a target_len (where it ends)")
        for name in ("max_tokens", "target_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not self.arrival_s >= 0:
            raise ValueError(f"arrival_s must be >= 0, got {self.arrival_s}")

    @property
    def output_len(self) -> int:
        """How many tokens the request produces: its max_tokens, else its hidden target."""
        if self.max_tokens is not None:
            return self.max_tokens
        assert self.target_len is not None
        return self.target_len

    def token_ids(self, encode: Encoder | None = None) -> list[int]:
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        assert self.prompt is not None
        if encode is None:
            raise ValueError("a text prompt needs a tokenizer here")
        return list(encode(self.prompt))


def _prompt(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(_FIRST_PROMPT_TOKEN, min(vocab_size, _BYTE_VOCAB), n))


def useful_work_fraction(lengths: Sequence[int], batch_size: int) -> float:
    """U = sum(l) / (n * max l), over consecutive static batches of n, weighted by batch work.

    Weighting by n * max l (the slots a static batch occupies) makes U the fraction of all static slot-steps
    that produce a token, which is what bounds continuous/static throughput.
    """
    if not lengths:
        raise ValueError("no lengths")
    useful = slots = 0
    for i in range(0, len(lengths), batch_size):
        batch = lengths[i : i + batch_size]
        useful += sum(batch)
        slots += len(batch) * max(batch)
    return useful / slots


def long_tailed(
    num_requests: int,
    *,
    vocab_size: int,
    prompt_len: tuple[int, int] = (16, 128),
    median_output: int = 32,
    sigma: float = 1.0,
    max_output: int = 512,
    seed: int = 0,
    client_max_tokens: bool = True,
) -> list[WorkItem]:
    """Log-normal output lengths: a yes/no answer and a long summary at the same endpoint.

    With sigma 1.0, median 32, cap 512 and batches of 16-32, U under static batching lands at 0.2-0.3, the
    regime of docs/scheduling.md. `client_max_tokens=False` hides the lengths (target_len) from admission.
    """
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(math.log(median_output), sigma, num_requests)
    # exp(log(m)) can land a hair below m (128 -> 127.99999999999997): without the nudge, truncation would
    # make sigma 0 ask for one token less than the median (127 for vLLM's --random-output-len 128).
    lengths = np.clip((draws + 1e-9).astype(int), 1, max_output)
    items = []
    for n_out in lengths:
        n_in = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        prompt = _prompt(rng, n_in, vocab_size)
        if client_max_tokens:
            items.append(WorkItem(prompt, int(n_out)))
        else:
            items.append(WorkItem(prompt, None, target_len=int(n_out)))
    return items


def shared_prefix(
    num_requests: int,
    *,
    vocab_size: int,
    system_len: int = 1024,
    num_system_prompts: int = 1,
    suffix_len: tuple[int, int] = (16, 64),
    output_len: tuple[int, int] = (16, 48),
    seed: int = 0,
) -> list[WorkItem]:
    """Agent traffic: every request is one of a few long system prompts (drawn at random, so no arrival
    pattern lines up with a round-robin router) plus its own short user turn."""
    rng = np.random.default_rng(seed)
    systems = [_prompt(rng, system_len, vocab_size) for _ in range(num_system_prompts)]
    items = []
    for _ in range(num_requests):
        system = systems[int(rng.integers(num_system_prompts))]
        suffix = _prompt(rng, int(rng.integers(suffix_len[0], suffix_len[1] + 1)), vocab_size)
        n_out = int(rng.integers(output_len[0], output_len[1] + 1))
        items.append(WorkItem(system + suffix, n_out))
    return items


def two_tenants(
    *,
    vocab_size: int,
    burst_requests: int,
    steady_requests: int,
    steady_interval_s: float,
    prompt_len: int = 128,
    output_len: int = 32,
    seed: int = 0,
) -> list[WorkItem]:
    """One tenant's burst against another's steady stream: tenant "burst" sends `burst_requests` at once at
    time 0, tenant "steady" one request every `steady_interval_s` from then on. Every prompt is its own (no
    prefix shared), every output `output_len` tokens."""
    rng = np.random.default_rng(seed)
    items = [
        WorkItem(_prompt(rng, prompt_len, vocab_size), output_len, tenant="burst")
        for _ in range(burst_requests)
    ]
    items += [
        WorkItem(
            _prompt(rng, prompt_len, vocab_size), output_len, arrival_s=k * steady_interval_s, tenant="steady"
        )
        for k in range(steady_requests)
    ]
    return sorted(items, key=lambda it: it.arrival_s)


def with_long_prompts(
    items: Sequence[WorkItem],
    *,
    vocab_size: int,
    num_long: int,
    long_len: int,
    at_s: Sequence[float],
    output_len: int = 8,
    seed: int = 0,
) -> list[WorkItem]:
    """Inject `num_long` prompts of `long_len` tokens at the offsets `at_s` (cycled) into a workload."""
    rng = np.random.default_rng(seed + 7919)
    extra = [
        WorkItem(_prompt(rng, long_len, vocab_size), output_len, arrival_s=float(at_s[i % len(at_s)]))
        for i in range(num_long)
    ]
    return sorted([*items, *extra], key=lambda it: it.arrival_s)


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Arrival offsets as `vllm bench serve` draws them: gamma inter-arrival gaps with shape `burstiness`
    and mean 1/request_rate. burstiness 1 is a Poisson process; below 1 it is burstier; rate inf sends all
    at once."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    rng = np.random.default_rng(seed + 104729)
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num_requests)
    # The first request goes at once, as in vLLM (its gap is the wait before the second).
    return [0.0, *np.cumsum(gaps[:-1]).tolist()] if num_requests else []


def day_shaped(times: Sequence[float], period_s: float, amplitude: float = 0.8) -> list[float]:
    """Arrival times re-timed so that the rate follows a day: rate(t) = r (1 - amplitude cos(2 pi t / P)),
    a trough of (1 - amplitude) r at t = 0 (night), a peak of (1 + amplitude) r at P/2, mean r, where r is
    the mean rate of `times`. Each arrival keeps its place in the process (the time warp maps the cumulative
    count), so burstiness is kept too."""
    if not period_s > 0:
        raise ValueError(f"period_s must be positive, got {period_s}")
    if not 0 <= amplitude < 1:
        raise ValueError(f"amplitude must be in [0, 1), got {amplitude}")
    if len(times) < 2 or times[-1] <= times[0]:
        return list(times)
    # Cumulative intensity, in units of the mean rate: L(t) = t - amplitude P / (2 pi) sin(2 pi t / P);
    # arrival i at s_i under the flat rate goes to the t with L(t) = s_i (L is increasing: its slope is
    # 1 - amplitude cos(.) > 0). Solved on a grid, then interpolated.
    end = times[-1] * 1.0 + period_s
    grid = np.linspace(0.0, end, max(4096, int(64 * end / period_s)))
    cumulative = grid - amplitude * period_s / (2 * math.pi) * np.sin(2 * math.pi * grid / period_s)
    return np.interp(np.asarray(times, dtype=float), cumulative, grid).tolist()


def burst_arrivals(num_requests: int, request_rate: float, burst_size: int, seed: int = 0) -> list[float]:
    """Groups of `burst_size` requests arriving at the same instant, groups Poisson at the mean rate."""
    if burst_size < 1:
        raise ValueError(f"burst_size must be at least 1, got {burst_size}")
    groups = arrival_times(-(-num_requests // burst_size), request_rate / burst_size, 1.0, seed)
    return [groups[i // burst_size] for i in range(num_requests)]


def with_arrivals(items: Sequence[WorkItem], times: Sequence[float]) -> list[WorkItem]:
    if len(times) != len(items):
        raise ValueError(f"{len(items)} items but {len(times)} arrival times")
    return [dataclasses.replace(it, arrival_s=float(t)) for it, t in zip(items, times)]


def offered_rate(items: Sequence[WorkItem]) -> float:
    """Requests per second the arrivals offer (inf when they all arrive at once)."""
    span = max(it.arrival_s for it in items) - min(it.arrival_s for it in items)
    return (len(items) - 1) / span if span > 0 else math.inf


# -- JSONL traces ------------------------------------------------------------------------------------------
# One request per line: {"prompt": "..."} or {"prompt_token_ids": [...]}, "max_tokens" (int or null),
# "arrival_s" (offset in seconds from the start of the trace), and "target_len" where max_tokens is null.


def item_to_json(item: WorkItem) -> dict[str, object]:
    out: dict[str, object] = {}
    if item.prompt_token_ids is not None:
        out["prompt_token_ids"] = list(item.prompt_token_ids)
    else:
        out["prompt"] = item.prompt
    out["max_tokens"] = item.max_tokens
    out["arrival_s"] = item.arrival_s
    if item.target_len is not None:
        out["target_len"] = item.target_len
    if item.lora is not None:
        out["lora"] = item.lora
    return out


def item_from_json(obj: dict[str, object], where: str = "") -> WorkItem:
    known = {"prompt", "prompt_token_ids", "max_tokens", "arrival_s", "target_len", "lora"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"{where}unknown field(s) {unknown}; known: {sorted(known)}")
    ids = obj.get("prompt_token_ids")
    prompt = obj.get("prompt")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(t, int) for t in ids)):
        raise ValueError(f"{where}prompt_token_ids must be a list of integers")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}prompt must be a string")
    max_tokens = obj.get("max_tokens")
    target = obj.get("target_len")
    arrival = obj.get("arrival_s", 0.0)
    if max_tokens is not None and not isinstance(max_tokens, int):
        raise ValueError(f"{where}max_tokens must be an integer or null")
    if target is not None and not isinstance(target, int):
        raise ValueError(f"{where}target_len must be an integer")
    if not isinstance(arrival, int | float):
        raise ValueError(f"{where}arrival_s must be a number")
    lora = obj.get("lora")
    if lora is not None and not isinstance(lora, str):
        raise ValueError(f"{where}lora must be an adapter name")
    try:
        return WorkItem(
            tuple(ids) if ids is not None else None,
            max_tokens,
            float(arrival),
            prompt=prompt,
            target_len=target,
            lora=lora,
        )
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None


def save_jsonl(items: Iterable[WorkItem], path: str | Path) -> None:
    with open(path, "w") as f:
        for it in items:
            f.write(json.dumps(item_to_json(it), separators=(",", ":")) + "\n")


def load_jsonl(path: str | Path) -> list[WorkItem]:
    items = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
            items.append(item_from_json(obj, f"{path}:{lineno}: "))
    return sorted(items, key=lambda it: it.arrival_s)
