"""Preemption: which running request gives way, and whether it is swapped to host or recomputed later.

Victim (docs/scheduling.md): never-preempted before preempted, then newest first. We generalise the flag to the count
(fewest preemptions first, then newest), so each preemption lowers a request's chance of the next one. The
progress guarantee is one rule: the oldest running request is never the victim while another request runs, so
it always progresses and finishes. That is the hard bound against livelock. `max_preemptions` is not a bound:
a request preempted that many times is passed over only while a candidate under the cap remains, and when every
candidate is at or over it one of them is preempted anyway. As the order already prefers the fewest
preemptions, the cap changes no choice: it restates the spreading that order does, and limits nothing.

Mode (cost, not habit): swap costs two host copies of the request's KV bytes (out now, back in on resume), each
a fixed cost per transfer (issuing the per-layer copies, a sync) plus its bytes over the copy bandwidth;
recompute costs a prefill of its tokens. Both grow linearly with context, but swap starts from a fixed cost
and recompute from zero, so recompute wins below a crossover length and swap above it. The constants are
measured on this machine at start-up (engine/loop/calibration.py). Recompute has no fixed term: its prefill
rides in a step that runs anyway for the other rows, and the measured rate (whole prefill steps, tokens / seconds) already folds in a step's overhead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from chunkwise.engine.datatypes.request import Request

Mode = Literal["swap", "recompute"]

log = logging.getLogger(__name__)


class VictimPolicy:
    """Which running request gives way: never the oldest while another runs (the progress guarantee), then
    the fewest preemptions so far, then the newest. A request preempted `max_preemptions` times is passed
    over while a candidate under that count remains; when none does, one at or over it is chosen anyway, so
    the count has no upper bound. (The fewest-first order already passes it over, so the cap adds nothing
    to that order; it would matter only under an order that did not prefer the fewest.)"""

    def __init__(self, max_preemptions: int = 4) -> None:
        self.max_preemptions = max_preemptions

    def victim(self, running: list[Request]) -> Request:
        if len(running) == 1:
            return running[0]
        # Ties (an n > 1 request's choices arrive together) broken by id, not by the running list's order,
        # which the scheduler reorders: the spared request must be the same one step after step.
        oldest = min(running, key=lambda r: (r.arrival_time, r.request_id))
        candidates = [r for r in running if r is not oldest]
        fresh = [r for r in candidates if r.preempt_count < self.max_preemptions]
        return max(fresh or candidates, key=lambda r: (-r.preempt_count, r.arrival_time))


class PriorityVictims(VictimPolicy):
    """The victim rule under --scheduling-policy priority: the lowest priority first (the largest value),
    and within it VictimPolicy's order (under the preemption cap first, fewest preemptions, newest). The
    progress guarantee is VictimPolicy's, over the queue's order: the best-ranked running request (best
    priority, then oldest) is never the victim while another runs, so it always progresses."""

    def victim(self, running: list[Request]) -> Request:
        if len(running) == 1:
            return running[0]
        best = min(running, key=lambda r: (r.priority, r.arrival_time, r.request_id))
        return self.lowest([r for r in running if r is not best])

    def lowest(self, candidates: list[Request]) -> Request:
        """The one to give way among `candidates`, none of them protected (they are all outranked by the
        request they give way to)."""
        cap = self.max_preemptions
        return max(
            candidates, key=lambda r: (r.priority, r.preempt_count < cap, -r.preempt_count, r.arrival_time)
        )


@dataclass
class PreemptionCostModel:
    """Chooses swap or recompute per victim from measured rates.

    kv_bytes_per_token: KV bytes one token holds over all layers.
    host_copy_bytes_per_s: measured device<->host copy bandwidth (one direction's bytes over its time).
    prefill_tokens_per_s: measured prefill throughput (updated from real steps).
    fixed_transfer_s: measured fixed cost of one transfer (one direction), whatever its size.
    Which mode a victim gets is the preemption policy's (sched/policies.py: CostChosen asks this model).
    """

    kv_bytes_per_token: int
    host_copy_bytes_per_s: float
    prefill_tokens_per_s: float
    fixed_transfer_s: float = 0.0

    def swap_cost_s(self, num_tokens: int) -> float:
        """Out now and back in on resume: two transfers."""
        return 2 * (self.fixed_transfer_s + num_tokens * self.kv_bytes_per_token / self.host_copy_bytes_per_s)

    def recompute_cost_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def mode(self, req: Request) -> Mode:
        """The cheaper way to preempt req at its context length."""
        n = req.num_computed_tokens
        return "swap" if self.swap_cost_s(n) < self.recompute_cost_s(n) else "recompute"

    def crossover_tokens(self) -> float:
        """The context length at which swap and recompute cost the same: recompute is chosen below it, swap
        above it. 0 when swap always wins, inf when it never does (its per-token cost is not below
        recompute's)."""
        per_token = 1 / self.prefill_tokens_per_s - 2 * self.kv_bytes_per_token / self.host_copy_bytes_per_s
        if per_token <= 0:
            return math.inf
        return max(0.0, 2 * self.fixed_transfer_s / per_token)

    def describe(self) -> str:
        """The measured figures, for the start-up log."""
        cross = self.crossover_tokens()
        if cross == 0:
            choice = "swap at every length"
        elif math.isinf(cross):
            choice = "recompute at every length"
        else:
            choice = f"recompute below {cross:.3g} tokens, swap above"
        return (
            f"swap = {self.fixed_transfer_s * 1e6:.1f} us + {self.host_copy_bytes_per_s / 1e9:.2f} GB/s per "
            f"transfer, {self.kv_bytes_per_token} KV bytes/token; recompute = "
            f"{self.prefill_tokens_per_s:.0f} tokens/s; auto: {choice}"
        )

    @staticmethod
    def warn_swap_space_full(req: Request, needed: int, free: int, capacity: int) -> None:
        """Said once per scheduler (it calls this on its first fallback): swap was chosen, the host swap space
        could not take the request's blocks, and it is recomputed instead."""
        log.warning(
            "preemption: swap chosen for request %s (%d tokens, %d blocks) but the host swap space is full "
            "(%d of %d blocks free): recomputing it instead, and any later such victim too. Raise "
            "--swap-space-bytes (swap_space_bytes) to swap them; chunkwise:preemption_fallbacks_total counts "
            "these fallbacks (this warning is not repeated)",
            req.request_id,
            req.num_computed_tokens,
            needed,
            free,
            capacity,
        )

    def observe_prefill(self, tokens: int, seconds: float, weight: float = 0.1) -> None:
        """Fold a measured prefill-heavy step into the rate (exponential moving average)."""
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            self.prefill_tokens_per_s += weight * (rate - self.prefill_tokens_per_s)
