"""Preemption: which running request gives way, and whether it is swapped to host or recomputed later.

Victim (the seed): never-preempted before preempted, then newest first. We generalise the flag to the count,
so each preemption lowers a request's chance of the next one, and two guards make livelock impossible: the
oldest running request is never the victim while another exists (so it always progresses and finishes), and a
request preempted `max_preemptions` times is passed over while any other candidate remains.

Mode (cost, not habit): swap costs two host copies of the request's KV bytes; recompute costs a prefill of its
tokens. Both grow linearly with context, with different constants, measured on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from chunkwise.request import Request

Mode = Literal["swap", "recompute"]


class VictimPolicy:
    def __init__(self, max_preemptions: int = 4) -> None:
        self.max_preemptions = max_preemptions

    def victim(self, running: list[Request]) -> Request:
        if len(running) == 1:
            return running[0]
        oldest = min(running, key=lambda r: r.arrival_time)
        candidates = [r for r in running if r is not oldest]
        fresh = [r for r in candidates if r.preempt_count < self.max_preemptions]
        return max(fresh or candidates, key=lambda r: (-r.preempt_count, r.arrival_time))


@dataclass
class PreemptionCostModel:
    """Chooses swap or recompute per victim from measured rates.

    kv_bytes_per_token: KV bytes one token holds over all layers.
    host_copy_bytes_per_s: measured device<->host copy bandwidth.
    prefill_tokens_per_s: measured prefill throughput (updated from real steps).
    """

    kv_bytes_per_token: int
    host_copy_bytes_per_s: float
    prefill_tokens_per_s: float
    forced: Literal["auto", "swap", "recompute"] = "auto"

    def swap_cost_s(self, num_tokens: int) -> float:
        return 2 * num_tokens * self.kv_bytes_per_token / self.host_copy_bytes_per_s

    def recompute_cost_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def mode(self, req: Request) -> Mode:
        if self.forced != "auto":
            return self.forced
        n = req.num_computed_tokens
        return "swap" if self.swap_cost_s(n) < self.recompute_cost_s(n) else "recompute"

    def observe_prefill(self, tokens: int, seconds: float, weight: float = 0.1) -> None:
        """Fold a measured prefill-heavy step into the rate (exponential moving average)."""
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            self.prefill_tokens_per_s += weight * (rate - self.prefill_tokens_per_s)
