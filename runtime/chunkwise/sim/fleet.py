"""The live router over simulated replicas: `chunkwise router`'s own Router, policies, cost model and prefix
indexes (router/), fed on the virtual clock as the real router is fed over HTTP.

What the real router learns from a replica's /metrics and /v1/kv_events, the simulated one learns from the
simulated replica at the same intervals:

- a scrape every `scrape_interval_s` of virtual time gives each replica's view a MetricsSample built from
  the replica's scheduler gauges (waiting, running, KV usage) and its counters (steps, step seconds,
  scheduled tokens, inter-token gaps), so the router learns each replica's speed as it does live;
- with the exact prefix index, the same scrape reads the replica's KV events since the last read (the
  engine's own KVEventLog, flushed at the end of every step), through the same KVEventIndex;
- in between, the router's in-flight accounting (a pick, a first token, an end) is exact and immediate.

The policies are the live ones (router/policies.py, and the llm-d baseline of router/llmd.py), chosen by
name; nothing here decides where a request goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from chunkwise.router.args import DEFAULT_MAX_TOKENS, DEFAULT_POLL_INTERVAL_S, POLICY_NAMES
from chunkwise.router.core import Pick, Router
from chunkwise.router.cost import CostModel
from chunkwise.router.estimates import MetricsSample
from chunkwise.router.llmd import LlmD
from chunkwise.router.prompt import COMPLETIONS, RoutedRequest
from chunkwise.sim.replica import SimReplica

ROUTER_NAMES = (*POLICY_NAMES, LlmD.name)
PREFIX_INDEXES = ("exact", "estimate")
# llm-d's endpoint picker refreshes each endpoint's metrics every 50 ms (its default refresh interval);
# chunkwise's router polls at its --poll-interval-seconds default.
LLMD_SCRAPE_INTERVAL_S = 0.05


def default_scrape_interval_s(policy: str) -> float:
    """Each router scrapes as it does by default when deployed."""
    return LLMD_SCRAPE_INTERVAL_S if policy == LlmD.name else DEFAULT_POLL_INTERVAL_S


@dataclass(frozen=True)
class RouterSpec:
    """Which router a replay runs, and how it reads the replicas."""

    policy: str = "round-robin"
    prefix_index: str = "exact"  # exact: the replicas' KV events; estimate: what the router sent them
    scrape_interval_s: float | None = None  # None: the router's own default

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_NAMES:
            raise ValueError(f"unknown router {self.policy!r}; choose one of {', '.join(ROUTER_NAMES)}")
        if self.prefix_index not in PREFIX_INDEXES:
            raise ValueError(
                f"unknown prefix index {self.prefix_index!r}; choose one of {', '.join(PREFIX_INDEXES)}"
            )
        if self.scrape_interval_s is not None and not self.scrape_interval_s > 0:
            raise ValueError(f"scrape_interval_s must be positive, got {self.scrape_interval_s}")

    @property
    def interval_s(self) -> float:
        return self.scrape_interval_s or default_scrape_interval_s(self.policy)

    @property
    def index_name(self) -> str:
        # llm-d's default scorers read neither of our indexes: it keeps its own, fed by its picks.
        return "approximate (llm-d's own)" if self.policy == LlmD.name else self.prefix_index

    @property
    def name(self) -> str:
        return f"{self.policy} ({self.index_name} index)"

    @property
    def label(self) -> str:
        """`policy` or `policy+index` (the routing benchmark's notation), for tables."""
        return self.policy if self.policy == LlmD.name else f"{self.policy}+{self.prefix_index}"

    @classmethod
    def parse(cls, text: str, default_index: str = "exact") -> RouterSpec:
        """`policy` or `policy+exact|estimate`."""
        policy, _, index = text.partition("+")
        return cls(policy=policy, prefix_index=index or default_index)


def _url(index: int) -> str:
    return f"sim://replica-{index:05d}"  # zero-padded: the router orders candidates by URL


class SimRouter:
    def __init__(self, spec: RouterSpec, block_size: int) -> None:
        self.spec = spec
        self.now = 0.0
        self.router = Router(
            policy=spec.policy,
            cost=CostModel(block_size),
            # Never sends anything: the simulated replicas are read directly, not over HTTP.
            client=httpx.AsyncClient(),
            poll_interval_s=spec.interval_s,
            clock=lambda: self.now,
            kv_events=spec.prefix_index == "exact",
        )
        self._index: dict[str, int] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    def set_replicas(self, replicas: Sequence[SimReplica]) -> None:
        """The replicas discovery lists (ready, not draining); the others finish what they hold."""
        self._index.update((_url(r.index), r.index) for r in replicas)
        self.router.set_replicas(_url(r.index) for r in replicas)

    def route(
        self, now: float, num_prompt_tokens: int, block_hashes: Sequence[int], max_tokens: int | None
    ) -> tuple[int, Pick] | None:
        """The replica the policy picks, and the pick to report the request's progress on; None when no
        replica is listed."""
        self.now = now
        request = RoutedRequest(
            path=COMPLETIONS,
            prompt_tokens=num_prompt_tokens,
            block_hashes=tuple(block_hashes),
            output_tokens=max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
            stream=True,
        )
        pick = self.router.pick(request)
        if pick is None:
            return None
        return self._index[pick.replica.url], pick

    def first_token(self, now: float, pick: Pick) -> None:
        self.now = now
        self.router.first_token(pick)

    def finish(self, now: float, pick: Pick) -> None:
        self.now = now
        self.router.finish(pick)

    def scrape(self, now: float, replicas: Sequence[SimReplica]) -> None:
        """What one poll of every replica tells the router (its /health, /metrics and KV events)."""
        self.now = now
        for rep in replicas:
            view = self.router.replicas.get(_url(rep.index))
            if view is None:
                continue
            view.observe(metrics_sample(rep, now), now)
            if self.spec.prefix_index == "exact":
                log = rep.kv_events
                assert log is not None, "the exact index needs replicas made with kv_events=True"
                view.begin_kv_read()
                try:
                    since = log.since(view.kv.seq) if view.kv.seq is not None else None
                    if since is None or not view.kv.apply_events(since.epoch, since.seq, since.events):
                        snap = log.snapshot()
                        view.kv.load_hashes(snap.epoch, snap.seq, snap.hashes, snap.host_hashes)
                finally:
                    view.end_kv_read()
            view.recovered()


def metrics_sample(rep: SimReplica, now: float) -> MetricsSample:
    """The replica's /metrics as the router parses it (router/estimates.py), from the simulated engine."""
    s = rep.gauges()
    c = rep.counters
    return MetricsSample(
        time=now,
        waiting=float(s.num_waiting),
        running=float(s.num_running),
        kv_usage=s.kv_usage,
        step_seconds=c.step_seconds,
        steps=float(c.steps),
        iteration_tokens=float(c.scheduled_tokens),
        itl_seconds=c.itl_seconds,
        itl_count=float(c.itl_count),
        cache_blocks=rep.num_blocks,
    )
