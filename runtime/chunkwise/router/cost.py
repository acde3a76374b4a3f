"""What serving a request at a replica is predicted to cost, the same for every routing policy.

The cost model is the predicted completion time of docs/scheduling.md ("Prefix-aware admission and routing"):

    T(r, replica) = T_queue + (|p| - |p ∩ cache|) / prefill_rate + l · TPOT

- T_queue: the prefill tokens queued ahead of r at the replica, over its prefill rate. Queued work is the
  router's own requests still before their first token (exact, and current to the last pick) plus the
  waiting requests the replica's last scrape showed beyond those (other routers' traffic), at the mean
  prompt size. When every slot of the replica's running batch is taken (its max_num_seqs, learned from
  scrapes that caught requests waiting), r must also wait for requests ahead to finish: each of the
  (requests at the replica - slots + 1) ahead of it frees a slot every mean service time / slots.
- |p ∩ cache|: the prompt's leading blocks in the replica's prefix index. The engine always computes at
  least the last prompt token, so a full hit still costs one.
- TPOT: the replica's measured inter-token latency, moved by the marginal cost of the decode rows added or
  gone since that measurement (one token each, at the prefill rate's per-token cost).
- l: max_tokens, or the router's default when the client sets none.
- LoRA: a request whose model is an adapter the replica does not hold on its device adds the time to bring it
  in (the replica's measured slot fills, else the fleet's, else a default), so a replica holding it wins while
  queues are comparable, and the prefix index is read under the adapter's own block hashes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chunkwise.router.args import DEFAULT_PREFILL_RATE, DEFAULT_TPOT_S
from chunkwise.router.estimates import fleet_mean
from chunkwise.router.prompt import RoutedRequest
from chunkwise.router.replica import Replica

# A TPOT prediction never drops below this fraction of the measured one (the rows-removed correction is
# an estimate; a replica does not get faster than its idle step).
MIN_TPOT_FRACTION = 0.5


# What bringing a LoRA adapter into a slot is taken to cost before any replica has measured one: reading a
# small adapter from local disk and copying it in.
DEFAULT_LORA_LOAD_S = 0.05


@dataclass(frozen=True)
class Prediction:
    cached_tokens: int
    queue_s: float
    prefill_s: float
    decode_s: float
    adapter_s: float = 0.0  # bringing the request's LoRA adapter onto the device (0: resident, or none)

    @property
    def ttft(self) -> float:
        return self.queue_s + self.adapter_s + self.prefill_s

    @property
    def completion(self) -> float:
        return self.queue_s + self.adapter_s + self.prefill_s + self.decode_s


@dataclass(frozen=True)
class Defaults:
    """Stand-ins until the fleet has measured itself."""

    prefill_rate: float = DEFAULT_PREFILL_RATE
    tpot_s: float = DEFAULT_TPOT_S
    prompt_tokens: float = 256.0
    output_tokens: float = 128.0


class CostModel:
    def __init__(self, block_size: int, defaults: Defaults = Defaults()) -> None:
        self.block_size = block_size
        self.defaults = defaults
        self.mean_prompt_tokens = defaults.prompt_tokens
        self.mean_output_tokens = defaults.output_tokens
        self._fleet: Callable[[], Sequence[Replica]] = tuple

    def bind(self, fleet: Callable[[], Sequence[Replica]]) -> None:
        """Where the fleet averages come from (every known replica, candidate or not)."""
        self._fleet = fleet

    def observe_request(self, uncached_tokens: int, output_tokens: int) -> None:
        """Running means of the work a request brings, for the requests the router cannot see."""
        if uncached_tokens > 0:
            self.mean_prompt_tokens = 0.9 * self.mean_prompt_tokens + 0.1 * uncached_tokens
        if output_tokens > 0:
            self.mean_output_tokens = 0.9 * self.mean_output_tokens + 0.1 * output_tokens

    def prefill_rate(self, replica: Replica) -> float:
        own = replica.estimates.prefill_rate
        if own is not None and own > 0:
            return own
        return fleet_mean((r.estimates.prefill_rate for r in self._fleet()), self.defaults.prefill_rate)

    def tpot(self, replica: Replica) -> float:
        fleet = fleet_mean((r.estimates.tpot for r in self._fleet()), self.defaults.tpot_s)
        own = replica.estimates.tpot
        if own is None or own <= 0:
            return fleet
        # Each idle scrape interval halves the weight of an old measurement against the fleet's.
        weight = 0.5**replica.estimates.staleness
        return weight * own + (1 - weight) * fleet

    def slots(self, replica: Replica) -> int | None:
        if replica.slots is not None:
            return replica.slots
        # Replicas of one service share their engine arguments: one that has been seen full speaks for all.
        known = [r.slots for r in self._fleet() if r.slots is not None]
        return round(sum(known) / len(known)) if known else None

    def cached_tokens(self, replica: Replica, request: RoutedRequest) -> int:
        hashes = request.block_hashes
        if request.adapter_block_hashes and self.is_adapter(replica, request):
            hashes = request.adapter_block_hashes  # an adapter's KV is its own (engine/cache/hashing.py)
        if not hashes:
            return 0
        matched = replica.cached_blocks(hashes) * self.block_size
        return min(matched, request.prompt_tokens - 1)

    @staticmethod
    def is_adapter(replica: Replica, request: RoutedRequest) -> bool:
        scrape = replica.scrape
        return scrape is not None and request.model is not None and request.model in scrape.lora_adapters

    def adapter_load_s(self, replica: Replica, request: RoutedRequest) -> float:
        """0 for the base model or an adapter on the replica's device; else the time to bring it in."""
        scrape = replica.scrape
        if request.model is None or scrape is None or request.model == scrape.model_name:
            return 0.0
        if request.model in scrape.lora_resident:
            return 0.0
        if request.model not in scrape.lora_adapters and request.model not in self.adapter_names():
            return 0.0  # not an adapter anywhere: the base model under another name, or a 404 to be
        own = replica.estimates.lora_load_s
        if own is not None:
            return own
        return fleet_mean((r.estimates.lora_load_s for r in self._fleet()), DEFAULT_LORA_LOAD_S)

    def adapter_names(self) -> set[str]:
        """Every adapter some replica serves."""
        return {n for r in self._fleet() if r.scrape is not None for n in r.scrape.lora_adapters}

    def predict(self, replica: Replica, request: RoutedRequest, now: float) -> Prediction:
        rate = self.prefill_rate(replica)
        load = replica.load(now)
        others_waiting, others_running = replica.others()
        cached = self.cached_tokens(replica, request)
        queued_tokens = load.pending_prefill_tokens + others_waiting * self.mean_prompt_tokens
        measured = self.tpot(replica)
        slots = self.slots(replica)
        rows_now = load.decoding + others_running + 1
        if slots is not None:
            rows_now = min(rows_now, slots)
        rows_then = replica.scrape.running if replica.scrape is not None else rows_now
        tpot = max(MIN_TPOT_FRACTION * measured, measured + (rows_now - rows_then) / rate)
        queue_s = queued_tokens / rate
        ahead = load.inflight + others_waiting + others_running
        if slots is not None and ahead >= slots:
            service = self.mean_prompt_tokens / rate + self.mean_output_tokens * tpot
            queue_s += (ahead - slots + 1) * service / slots
        return Prediction(
            cached_tokens=cached,
            queue_s=queue_s,
            prefill_s=(request.prompt_tokens - cached) / rate,
            decode_s=request.output_tokens * tpot,
            adapter_s=self.adapter_load_s(replica, request),
        )
