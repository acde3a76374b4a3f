"""The routing benchmark's workloads: open-loop schedules of completion requests, the same for every policy.

Each workload is a frozen dataclass whose `arrivals()` gives every request (arrival offset, prompt, output
length) from its seed alone, and whose `num_blocks` is the KV cache each replica gets: too small to hold
every tenant's (or document's) prefix, so that where a request goes decides whether its prefix is cached.
Prompts are ASCII, so for the built-in models' byte tokenizer n characters are n tokens (plus BOS).

- `tenants`: the original benchmark. A few tenants, each with one long system prompt; each request adds a
  short question of its own. Poisson arrivals, optionally Zipf-skewed tenant popularity.
- `agent`: many sessions, each of a tenant chosen with Zipf-skewed popularity; a session is a few turns
  whose prompts grow (system prompt, then every earlier user message and reply, then the new message), so
  consecutive turns share ever longer prefixes; short outputs. Sessions start as a Poisson process; a
  session's next turn follows a think time after the previous one.
- `mixed`: Poisson arrivals of many short, unrelated prompts and a few long ones (2-3k tokens: a question
  about one of a handful of documents, so long prompts share their document's prefix), with varied output
  lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start
    group: int  # tenant (tenants, agent) or document (mixed's long prompts); -1 for none
    prompt: str
    max_tokens: int
    kind: str = ""  # "turn" (agent), "long" or "short" (mixed)


class BenchWorkload(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def seed(self) -> int: ...

    def arrivals(self) -> list[Arrival]: ...


def text(rng: random.Random, n: int) -> str:
    """n characters of words, from `rng`."""
    words = ("fleet", "queue", "block", "cache", "prefill", "decode", "replica", "router", "token", "batch")
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of rank k (0-based) proportional to 1 / (k + 1)^s; s = 0 is uniform."""
    return [1.0 / (k + 1) ** s for k in range(n)]


# -- tenants: the original workload --------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    # Eight tenants' 3k-token prefixes need about 1,550 blocks; one replica holds 640 (num_blocks), so a
    # replica sent every tenant keeps evicting, and one sent two tenants keeps both.
    tenants: int = 8
    prefix_tokens: int = 3072
    suffix_tokens: int = 32
    max_tokens: int = 8
    requests: int = 240
    rate: float = 6.0  # requests per second, Poisson
    zipf: float = 0.0  # tenant popularity skew; 0 = uniform
    seed: int = 0
    num_blocks: int = 640

    @property
    def name(self) -> str:
        return "tenants"

    def arrivals(self) -> list[Arrival]:
        return [Arrival(t, tenant, prompt, self.max_tokens) for t, tenant, prompt in schedule(self)]


def schedule(w: Workload) -> list[tuple[float, int, str]]:
    """(arrival offset in seconds, tenant, prompt) for every request, the same for every policy."""
    rng = random.Random(w.seed)
    prefixes = [f"[tenant {t}] " + text(rng, w.prefix_tokens) for t in range(w.tenants)]
    weights = zipf_weights(w.tenants, w.zipf)
    out = []
    t = 0.0
    for i in range(w.requests):
        t += rng.expovariate(w.rate)
        tenant = rng.choices(range(w.tenants), weights)[0]
        out.append((t, tenant, prefixes[tenant] + f"\nQuestion {i}: " + text(rng, w.suffix_tokens)))
    return out


# -- agent: skewed shared prefixes, growing multi-turn prompts ----------------------------------------------
@dataclass(frozen=True)
class AgentWorkload:
    # 16 tenants' 1.5k-token system prompts need 1,536 blocks, a replica holds 448 (about 4.5 of them, less
    # the sessions' own histories): with 4 replicas the fleet barely holds every prefix once, with 8 twice.
    tenants: int = 16
    system_tokens: int = 1536
    zipf: float = 1.1  # the first tenant gets about a third of the sessions
    session_rate: float = 2.5  # sessions started per second, Poisson
    turns: tuple[int, int] = (2, 6)  # turns per session, uniform
    think_s: float = 2.0  # mean of the exponential part of the gap between a session's turns
    min_think_s: float = 1.0  # ... plus this, so a turn rarely comes before the previous one is answered
    user_tokens: tuple[int, int] = (32, 160)
    reply_tokens: tuple[int, int] = (32, 128)  # the earlier replies written into the history
    max_tokens: tuple[int, int] = (8, 16)
    duration_s: float = 45.0  # no request arrives later
    seed: int = 0
    num_blocks: int = 448

    @property
    def name(self) -> str:
        return "agent"

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        systems = [f"[tenant {t}] system: " + text(rng, self.system_tokens) for t in range(self.tenants)]
        weights = zipf_weights(self.tenants, self.zipf)
        out: list[Arrival] = []
        start = 0.0
        session = 0
        while True:
            start += rng.expovariate(self.session_rate)
            if start >= self.duration_s:
                break
            tenant = rng.choices(range(self.tenants), weights)[0]
            history = systems[tenant] + f"\n[session {session}]"
            at = start
            for _ in range(rng.randint(*self.turns)):
                if at >= self.duration_s:
                    break
                prompt = history + "\nuser: " + text(rng, rng.randint(*self.user_tokens)) + "\nassistant:"
                out.append(Arrival(at, tenant, prompt, rng.randint(*self.max_tokens), "turn"))
                history = prompt + " " + text(rng, rng.randint(*self.reply_tokens))
                at += self.min_think_s + rng.expovariate(1.0 / self.think_s)
            session += 1
        out.sort(key=lambda a: a.at)
        return out


# -- mixed: few long prompts among many short ones ---------------------------------------------------------
@dataclass(frozen=True)
class MixedWorkload:
    # 8 documents of 2-3k tokens need about 1,300 blocks, a replica holds 512 (about 3 of them).
    rate: float = 10.0  # requests per second, Poisson
    long_fraction: float = 0.12
    documents: int = 8
    document_tokens: tuple[int, int] = (2048, 2944)
    question_tokens: tuple[int, int] = (16, 64)
    short_tokens: tuple[int, int] = (32, 256)
    long_max_tokens: tuple[int, ...] = (8, 16, 32)
    short_max_tokens: tuple[int, ...] = (16, 32, 64, 128)
    duration_s: float = 45.0
    seed: int = 0
    num_blocks: int = 512

    @property
    def name(self) -> str:
        return "mixed"

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        docs = [
            f"[document {d}] " + text(rng, rng.randint(*self.document_tokens)) for d in range(self.documents)
        ]
        out: list[Arrival] = []
        t = 0.0
        i = 0
        while True:
            t += rng.expovariate(self.rate)
            if t >= self.duration_s:
                break
            if rng.random() < self.long_fraction:
                d = rng.randrange(self.documents)
                prompt = docs[d] + f"\nQuestion {i}: " + text(rng, rng.randint(*self.question_tokens))
                out.append(Arrival(t, d, prompt, rng.choice(self.long_max_tokens), "long"))
            else:
                # Its own first block: a short prompt shares no prefix with any other.
                prompt = f"[chat {i}] " + text(rng, rng.randint(*self.short_tokens))
                out.append(Arrival(t, -1, prompt, rng.choice(self.short_max_tokens), "short"))
            i += 1
        return out


WORKLOADS = ("tenants", "agent", "mixed")
# What `--workload all` runs.
ALL = ("agent", "mixed")
