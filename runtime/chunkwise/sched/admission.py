"""Admission by reservation (the seed's formula).

    blocks(r) = ceil(|p_r| / B_blk) + ceil(l_r / B_blk)

l_r is the client's max_tokens when it gave one, else a high quantile of the output lengths observed on the
request's route. The mean would guarantee periodic exhaustion, the maximum wastes most of the cache; a p90 with
preemption as the backstop is the default. Blocks already in the prefix cache are not charged.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Literal

from chunkwise.cache.kv_cache_manager import cdiv
from chunkwise.request import Request

EstimateKind = Literal["quantile", "mean"]


class OutputLengthEstimator:
    """A sliding window of observed output lengths per route; answers a quantile (or the mean)."""

    def __init__(
        self,
        quantile: float,
        cold_start: int,
        window: int = 1000,
        min_samples: int = 20,
        kind: EstimateKind = "quantile",
    ) -> None:
        self.quantile = quantile
        self.cold_start = cold_start
        self.window = window
        self.min_samples = min_samples
        self.kind = kind
        self._recent: dict[str, deque[int]] = {}
        self._sorted: dict[str, list[int]] = {}

    def observe(self, route: str, length: int) -> None:
        recent = self._recent.setdefault(route, deque())
        ordered = self._sorted.setdefault(route, [])
        recent.append(length)
        bisect.insort(ordered, length)
        if len(recent) > self.window:
            old = recent.popleft()
            del ordered[bisect.bisect_left(ordered, old)]

    def estimate(self, route: str) -> int:
        ordered = self._sorted.get(route)
        if not ordered or len(ordered) < self.min_samples:
            return self.cold_start
        if self.kind == "mean":
            return cdiv(sum(ordered), len(ordered))
        # Nearest-rank quantile: the smallest observation covering `quantile` of the window.
        rank = max(1, math.ceil(round(self.quantile * len(ordered), 6)))
        return ordered[rank - 1]


class ReservationAdmission:
    def __init__(self, block_size: int, estimator: OutputLengthEstimator, spec_tokens: int = 0) -> None:
        self.block_size = block_size
        self.estimator = estimator
        # Speculative decoding writes up to this many draft tokens' KV past a sequence's end in a step.
        self.spec_tokens = spec_tokens

    def output_estimate(self, req: Request) -> int:
        if req.sampling_params.max_tokens is not None:
            return req.max_tokens
        return min(req.max_tokens, self.estimator.estimate(req.route))

    def blocks_needed(self, req: Request, num_cached_blocks: int) -> int:
        """Blocks to reserve for req: its tokens so far plus its estimated remaining output, less cache hits.

        For a request resumed after recompute-preemption, its tokens so far include what it generated.
        """
        remaining_output = max(0, req.output_length_estimate - req.num_output_tokens)
        if req.fork_hold:
            return self._family_blocks(req, remaining_output) - num_cached_blocks
        return (
            cdiv(req.num_tokens, self.block_size)
            + cdiv(remaining_output + self.spec_tokens, self.block_size)
            - num_cached_blocks
        )

    def _family_blocks(self, req: Request, output: int) -> int:
        """A parent not yet forked (n > 1, sched/fork.py): the prompt's full blocks once (its n children share
        them), and per child its own blocks from the prompt's partial last block (the parent's, or a copy)
        through its estimated output."""
        bs = self.block_size
        shared = (req.num_prompt_tokens - 1) // bs
        per_child = cdiv(req.num_prompt_tokens + output + self.spec_tokens, bs) - shared
        return shared + req.sampling_params.n * per_child
