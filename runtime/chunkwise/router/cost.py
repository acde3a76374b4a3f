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

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from chunkwise.router.args import DEFAULT_PREFILL_RATE, DEFAULT_TPOT_S
from chunkwise.router.estimates import fleet_generation, fleet_mean
from chunkwise.router.prompt import RoutedRequest
from chunkwise.router.replica import Replica

# A TPOT prediction never drops below this fraction of the measured one (the rows-removed correction is
# an estimate; a replica does not get faster than its idle step).
MIN_TPOT_FRACTION = 0.5

# A prompt block in a replica's host tier (--kv-offloading-size), counted as this fraction of a cached block:
# restoring it is a host-to-device copy, far cheaper than its prefill but not free, and it takes a device block.
HOST_HIT_WEIGHT = 0.5


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
    # What the request's prefill costs the requests already at the replica: each waits while it runs.
    delay_to_others_s: float = 0.0

    @property
    def ttft(self) -> float:
        return self.queue_s + self.adapter_s + self.prefill_s

    @property
    def completion(self) -> float:
        return self.queue_s + self.adapter_s + self.prefill_s + self.decode_s


@dataclass(frozen=True)
class _FleetMeans:
    prefill_rate: float
    tpot: float
    slots: int | None
    lora_load_s: float


@dataclass(frozen=True)
class _ReplicaState:
    rate: float
    tpot: float
    pending_tokens: int
    others_waiting: float
    ahead: float
    slots: int | None
    kv_capacity_tokens: int
    kv_held_tokens: float


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
        self._fleet: Callable[[], Collection[Replica]] = tuple
        # The fleet's means as of (fleet generation, fleet size): see _means.
        self._means_key: tuple[int, int] | None = None
        self._means: _FleetMeans | None = None
        self._states: dict[str, tuple[tuple[int, int, int], _ReplicaState]] = {}

    def bind(self, fleet: Callable[[], Collection[Replica]]) -> None:
        """Where the fleet averages come from (every known replica, candidate or not)."""
        self._fleet = fleet

    def observe_request(self, uncached_tokens: int, output_tokens: int) -> None:
        """Running means of the work a request brings, for the requests the router cannot see."""
        if uncached_tokens > 0:
            self.mean_prompt_tokens = 0.9 * self.mean_prompt_tokens + 0.1 * uncached_tokens
        if output_tokens > 0:
            self.mean_output_tokens = 0.9 * self.mean_output_tokens + 0.1 * output_tokens

    def _fleet_means(self) -> _FleetMeans:
        """Every replica's estimates averaged; recomputed only when a scrape changed one or the fleet's
        size changed (a pick predicts every replica: recomputing per prediction is quadratic in replicas)."""
        fleet = self._fleet()
        key = (fleet_generation(), len(fleet))
        if self._means is None or key != self._means_key:
            known = [r.slots for r in fleet if r.slots is not None]
            self._means = _FleetMeans(
                prefill_rate=fleet_mean(
                    (r.estimates.prefill_rate for r in fleet), self.defaults.prefill_rate
                ),
                tpot=fleet_mean((r.estimates.tpot for r in fleet), self.defaults.tpot_s),
                slots=round(sum(known) / len(known)) if known else None,
                lora_load_s=fleet_mean((r.estimates.lora_load_s for r in fleet), DEFAULT_LORA_LOAD_S),
            )
            self._means_key = key
        return self._means

    def prefill_rate(self, replica: Replica) -> float:
        return self._prefill_rate(replica, self._fleet_means())

    def tpot(self, replica: Replica) -> float:
        return self._tpot(replica, self._fleet_means())

    def slots(self, replica: Replica) -> int | None:
        if replica.slots is not None:
            return replica.slots
        # Replicas of one service share their engine arguments: one that has been seen full speaks for all.
        return self._fleet_means().slots

    @staticmethod
    def _prefill_rate(replica: Replica, means: _FleetMeans) -> float:
        own = replica.estimates.prefill_rate
        return own if own is not None and own > 0 else means.prefill_rate

    @staticmethod
    def _tpot(replica: Replica, means: _FleetMeans) -> float:
        own = replica.estimates.tpot
        if own is None or own <= 0:
            return means.tpot
        # Each idle scrape interval halves the weight of an old measurement against the fleet's.
        weight = 0.5**replica.estimates.staleness
        return weight * own + (1 - weight) * means.tpot

    def cached_tokens(self, replica: Replica, request: RoutedRequest) -> int:
        hashes = request.block_hashes
        if request.adapter_block_hashes and self.is_adapter(replica, request):
            hashes = request.adapter_block_hashes  # an adapter's KV is its own (engine/cache/hashing.py)
        if not hashes:
            return 0
        device = replica.cached_blocks(hashes)
        # A block in the replica's host tier is copied back, not prefilled: worth a fraction of a device hit.
        host = replica.host_blocks(hashes, device)
        matched = int((device + HOST_HIT_WEIGHT * host) * self.block_size)
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
        return self._fleet_means().lora_load_s

    def adapter_names(self) -> set[str]:
        """Every adapter some replica serves."""
        return {n for r in self._fleet() if r.scrape is not None for n in r.scrape.lora_adapters}

    def predict(self, replica: Replica, request: RoutedRequest, now: float) -> Prediction:
        return self._predict(replica, request, now, self._fleet_means())

    def predict_all(
        self, replicas: Sequence[Replica], request: RoutedRequest, now: float
    ) -> list[Prediction]:
        """`predict` at each replica (one pick's worth: the fleet's means are read once)."""
        means = self._fleet_means()
        return [self._predict(r, request, now, means) for r in replicas]

    def _state(self, replica: Replica, now: float, means: _FleetMeans) -> _ReplicaState:
        """What a prediction at `replica` reads that does not depend on the request. Kept until the
        replica's accounting or scrape, or the fleet's means, change: a pick predicts every replica, and
        between two picks only the chosen one changes."""
        key = (replica.version, fleet_generation(), len(self._fleet()))
        cached = self._states.get(replica.url)
        if cached is not None and cached[0] == key and not replica.has_unstreamed:
            return cached[1]
        rate = self._prefill_rate(replica, means)
        load = replica.load(now)
        others_waiting, others_running = replica.others()
        measured = self._tpot(replica, means)
        slots = replica.slots if replica.slots is not None else means.slots
        rows_now = load.decoding + others_running + 1
        if slots is not None:
            rows_now = min(rows_now, slots)
        scrape = replica.scrape
        rows_then = scrape.running if scrape is not None else rows_now
        capacity = scrape.cache_blocks * self.block_size if scrape is not None and scrape.cache_blocks else 0
        state = _ReplicaState(
            rate=rate,
            tpot=max(MIN_TPOT_FRACTION * measured, measured + (rows_now - rows_then) / rate),
            pending_tokens=load.pending_prefill_tokens,
            others_waiting=others_waiting,
            ahead=load.inflight + others_waiting + others_running,
            slots=slots,
            kv_capacity_tokens=capacity,
            kv_held_tokens=scrape.kv_usage * capacity if scrape is not None else 0.0,
        )
        self._states[replica.url] = (key, state)
        return state

    def _predict(
        self, replica: Replica, request: RoutedRequest, now: float, means: _FleetMeans
    ) -> Prediction:
        st = self._state(replica, now, means)
        rate, tpot, slots = st.rate, st.tpot, st.slots
        cached = self.cached_tokens(replica, request)
        queue_s = (st.pending_tokens + st.others_waiting * self.mean_prompt_tokens) / rate
        service = self.mean_prompt_tokens / rate + self.mean_output_tokens * tpot
        if slots is not None and st.ahead >= slots:
            queue_s += (st.ahead - slots + 1) * service / slots
        capacity = st.kv_capacity_tokens
        if capacity:
            # Waiting for KV blocks: a replica admits a request only when its blocks fit. The cache held
            # what the last scrape says; the requests sent since and not yet prefilled will take their
            # prompts, and this one its prompt and output. What exceeds the cache must first be freed by
            # requests ahead finishing: a batch's turnover (`service`) for a whole cache's worth.
            excess = (
                st.kv_held_tokens
                + st.pending_tokens
                + request.prompt_tokens
                - cached
                + request.output_tokens
                - capacity
            )
            if excess > 0:
                queue_s += excess / capacity * service
        return Prediction(
            cached_tokens=cached,
            queue_s=queue_s,
            prefill_s=(request.prompt_tokens - cached) / rate,
            decode_s=request.output_tokens * tpot,
            adapter_s=self.adapter_load_s(replica, request),
            delay_to_others_s=(request.prompt_tokens - cached) / rate * st.ahead,
        )
