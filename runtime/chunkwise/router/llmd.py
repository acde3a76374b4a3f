"""An llm-d-style baseline policy: the default scoring of llm-d's inference scheduler (its endpoint picker).

Reproduced from the source, not from descriptions of it:

- kubernetes-sigs/gateway-api-inference-extension (GIE) v1.5.0, commit df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849,
  which llm-d/llm-d-inference-scheduler v0.8.0 (commit 05c91f0d655fbd7ea71fc50949c899c360d06f07) builds on
  (its go.mod requires GIE v1.5.0). llm-d-inference-scheduler's main branch (commit 520af478, 2026-05-17), which
  has since taken the endpoint picker in-tree, has the same weights and formulas.
- The weights: `loadDefaultConfig` in pkg/epp/config/loader/defaults.go, the config the endpoint picker runs
  when given none, and the same as the Helm chart's `default-plugins.yaml`
  (config/charts/epplib/templates/_config.yaml): queue-scorer 2, kv-cache-utilization-scorer 2,
  prefix-cache-scorer 3, no filter, and the max-score-picker that `ensureSchedulingLayer` adds.
- Combination (pkg/epp/scheduling/scheduler_profile.go, runScorerPlugins): each score is clamped to [0, 1]
  (enforceScoreRange) and the endpoint's total is sum(weight * score).
- Picker (pkg/epp/framework/plugins/scheduling/picker/max_score_picker.go): the highest total; the candidates
  are shuffled first, so ties are broken at random.
- queue-scorer (scorer/queuedepth/queue.go): min-max normalised waiting queue over the candidates,
  (max - w) / (max - min), so the shortest queue scores 1 and the longest 0; 1 for every candidate when all
  queues are equal. w is `vllm:num_requests_waiting` (an int in the endpoint's metrics).
- kv-cache-utilization-scorer (scorer/kvcacheutilization/kvcache_utilization.go): 1 - `vllm:kv_cache_usage_perc`.
- prefix-cache-scorer (scorer/prefix/plugin.go): matched blocks / the prompt's blocks, 0 when the prompt has
  no full block. Its data comes from the approximate prefix producer (requestcontrol/dataproducer/
  approximateprefix/), which the config loader adds whenever prefix-cache-scorer is configured
  (pkg/epp/config/loader/configloader.go). That index is fed by the picker's own decisions, not by engine KV
  events (the KV-event-fed `precise-prefix-cache-scorer` is a separate plugin, in none of the defaults):
  - after each pick (PreRequest) the prompt's block hashes are added to the chosen server's LRU, in prompt
    order, so a prompt's last block is its most recent entry; a hash already there moves to the front;
  - each server's LRU holds `NumOfGPUBlocks` entries, read once from the server's metrics when its LRU is
    made (autoTune; `vllm:cache_config_info{num_gpu_blocks}`), else 31250 (defaultLRUCapacityPerServer);
    an entry evicted from a server's LRU leaves the hash -> servers map;
  - matchLongestPrefix walks the prompt's hashes from the first while *any* server holds the hash, and
    counts, per server, the hashes it holds on that walk;
  - at most 256 blocks of a prompt count (defaultMaxPrefixBlocks).

Blocks. llm-d hashes the prompt's text in blocks of `block size in tokens x 4` characters (its
averageCharactersPerToken; the block size is the engine's, 16 by default, read from its metrics), chained
with xxhash. The router sees token ids, not text, and already hashes the prompt's full KV blocks with the
engine's own chained hashes, so a block here is `blocks_per_chunk` KV blocks, identified by the chained hash
of its last one (a chained hash covers the whole prefix before it, as llm-d's does). With the default
`blocks_per_chunk=1` one llm-d block is one KV block of 16 tokens: what 4 characters per token means for
the tokenizers llm-d is tuned for. chunkwise's built-in models use a byte tokenizer (one token per
character), where llm-d's literal 64-character block would be 4 KV blocks and its LRU of num_gpu_blocks
entries would cover 4 times the engine's cache; `blocks_per_chunk=4` reproduces that literal behaviour.

Signals. The router's scrape of each replica (`Replica.scrape`) gives the waiting queue and KV usage, as the
endpoint picker's metrics data source does (it scrapes every 50 ms by default; the router at its
--poll-interval-seconds). llm-d's default scorers do not count the picker's own requests in flight, and
neither does this policy. A replica not scraped yet has waiting 0 and KV usage 0, as a new endpoint has.
Not reproduced: the model name in the first hash (one model per fleet here), P/D disaggregation, flow control
and the saturation detector (which only shed requests of negative priority), and the periodic removal of
servers that left (this index keeps them).
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from chunkwise.engine.cache.hashing import BlockHash
from chunkwise.router.cost import CostModel
from chunkwise.router.prompt import RoutedRequest
from chunkwise.router.replica import Replica

QUEUE_SCORER = "queue-scorer"
KV_CACHE_UTILIZATION_SCORER = "kv-cache-utilization-scorer"
PREFIX_CACHE_SCORER = "prefix-cache-scorer"
# loadDefaultConfig, pkg/epp/config/loader/defaults.go (GIE v1.5.0).
DEFAULT_WEIGHTS: dict[str, float] = {
    QUEUE_SCORER: 2.0,
    KV_CACHE_UTILIZATION_SCORER: 2.0,
    PREFIX_CACHE_SCORER: 3.0,
}
# approximateprefix/types.go (GIE v1.5.0).
DEFAULT_MAX_PREFIX_BLOCKS = 256
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250


def clamp(score: float) -> float:
    """enforceScoreRange: a scorer's output counts within [0, 1]."""
    return min(1.0, max(0.0, score))


def queue_scores(waiting: Sequence[int]) -> list[float]:
    """queue-scorer: (max - w) / (max - min) over the candidates; 1 for all when every queue is equal."""
    lo, hi = min(waiting), max(waiting)
    if hi == lo:
        return [1.0] * len(waiting)
    return [(hi - w) / (hi - lo) for w in waiting]


def kv_cache_utilization_scores(usage: Sequence[float]) -> list[float]:
    """kv-cache-utilization-scorer: 1 - KV cache usage (a fraction, 1 = full)."""
    return [1.0 - u for u in usage]


def prefix_scores(matched: Sequence[int], total: int) -> list[float]:
    """prefix-cache-scorer: matched blocks over the prompt's blocks; 0 when it has none."""
    return [m / total if total else 0.0 for m in matched]


def prompt_blocks(
    hashes: Sequence[BlockHash], blocks_per_chunk: int = 1, max_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS
) -> list[BlockHash]:
    """llm-d's blocks of a prompt, from its chained KV block hashes: the last hash of each run of
    `blocks_per_chunk` (a chained hash stands for the whole prefix up to it), at most `max_blocks`."""
    return list(hashes[blocks_per_chunk - 1 :: blocks_per_chunk][:max_blocks])


class ApproxPrefixIndex:
    """The approximate prefix producer's indexer (approximateprefix/indexer.go): a per-server LRU of block
    hashes and the reverse map from a hash to the servers holding it."""

    def __init__(self, default_capacity: int = DEFAULT_LRU_CAPACITY_PER_SERVER) -> None:
        self.default_capacity = default_capacity
        self._servers: dict[BlockHash, set[str]] = {}
        self._lru: dict[str, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[str, int] = {}

    def capacity(self, server: str) -> int | None:
        return self._capacity.get(server)

    def held(self, server: str) -> list[BlockHash]:
        """The server's LRU, least recent first."""
        return list(self._lru.get(server, ()))

    def get(self, block: BlockHash) -> set[str]:
        return set(self._servers.get(block, ()))

    def add(self, hashes: Sequence[BlockHash], server: str, capacity: int = 0) -> None:
        """Indexer.Add: `capacity` (the server's GPU blocks; <= 0: the default) sizes its LRU when first made."""
        lru = self._lru.get(server)
        if lru is None:
            size = capacity if capacity > 0 else self.default_capacity
            lru = self._lru[server] = OrderedDict()
            self._capacity[server] = size
        size = self._capacity[server]
        # As in Go: first the LRU (whose evictions leave the reverse map), then the reverse map for every
        # hash, even one the LRU has just evicted again (a prompt longer than the LRU).
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > size:
                    evicted, _ = lru.popitem(last=False)
                    self._evicted(evicted, server)
        for h in hashes:
            self._servers.setdefault(h, set()).add(server)

    def _evicted(self, block: BlockHash, server: str) -> None:
        servers = self._servers.get(block)
        if servers is not None:
            servers.discard(server)
            if not servers:
                del self._servers[block]

    def match_longest_prefix(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """matchLongestPrefix: walk the hashes while any server holds one; count each holder's hits."""
        matched: Counter[str] = Counter()
        for h in hashes:
            servers = self._servers.get(h)
            if not servers:
                break
            matched.update(servers)  # counted in C: a popular prefix is held by hundreds of servers
        return dict(matched)


@dataclass(frozen=True)
class Scores:
    """One candidate's scores, each as its scorer gave it, and the weighted total."""

    queue: float
    kv_cache_utilization: float
    prefix: float
    total: float


class LlmD:
    """llm-d's default endpoint picker: queue 2, KV utilization 2, approximate prefix 3; max score wins."""

    name = "llm-d"

    def __init__(
        self,
        cost: CostModel,
        *,
        weights: dict[str, float] | None = None,
        blocks_per_chunk: int = 1,
        max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
        seed: int = 0,
    ) -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self.blocks_per_chunk = blocks_per_chunk
        self.max_prefix_blocks = max_prefix_blocks
        self.index = ApproxPrefixIndex()
        self._rng = random.Random(seed)

    def blocks(self, request: RoutedRequest) -> list[BlockHash]:
        return prompt_blocks(request.block_hashes, self.blocks_per_chunk, self.max_prefix_blocks)

    def _scored(
        self, request: RoutedRequest, candidates: Sequence[Replica]
    ) -> tuple[list[float], list[float], list[float], list[float]]:
        """Each scorer's scores of the candidates, and their weighted totals (in lists: a pick at a fleet of
        hundreds scores every candidate)."""
        waiting = [int(r.scrape.waiting) if r.scrape is not None else 0 for r in candidates]
        usage = [r.scrape.kv_usage if r.scrape is not None else 0.0 for r in candidates]
        blocks = self.blocks(request)
        matched = self.index.match_longest_prefix(blocks)
        w = self.weights
        wq = w.get(QUEUE_SCORER, 0.0)
        wk = w.get(KV_CACHE_UTILIZATION_SCORER, 0.0)
        wp = w.get(PREFIX_CACHE_SCORER, 0.0)
        q = queue_scores(waiting)
        kv = kv_cache_utilization_scores(usage)
        p = prefix_scores([matched.get(r.url, 0) for r in candidates], len(blocks))
        # clamp(x) inlined: enforceScoreRange.
        totals = [
            min(1.0, max(0.0, a)) * wq + min(1.0, max(0.0, b)) * wk + min(1.0, max(0.0, c)) * wp
            for a, b, c in zip(q, kv, p)
        ]
        return q, kv, p, totals

    def score(self, request: RoutedRequest, candidates: Sequence[Replica]) -> list[Scores]:
        return [Scores(*row) for row in zip(*self._scored(request, candidates))]

    def choose(self, request: RoutedRequest, candidates: Sequence[Replica], now: float) -> Replica:
        totals = self._scored(request, candidates)[3]
        # The max-score picker shuffles the candidates before its stable sort: the best total wins, ties
        # at random (uniformly among the tied).
        top = max(totals)
        tied = [i for i, t in enumerate(totals) if t == top]
        best = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        chosen = candidates[best]
        # PreRequest: the chosen server now holds the prompt's blocks, as far as the index knows.
        capacity = chosen.scrape.cache_blocks if chosen.scrape is not None else None
        self.index.add(self.blocks(request), chosen.url, capacity or 0)
        return chosen
