"""Admission by reservation (docs/scheduling.md).

    blocks(r) = ceil(|p_r| / B_blk) + ceil(l_r / B_blk)

l_r is the client's max_tokens when it gave one, else a high quantile of the output lengths observed on the
request's route. The mean would guarantee periodic exhaustion, the maximum wastes most of the cache; a p90 with
preemption as the backstop is the default. Blocks already in the prefix cache are not charged.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from typing import Literal

from chunkwise.engine.cache.kv_cache_manager import cdiv
from chunkwise.engine.datatypes.request import Request

EstimateKind = Literal["quantile", "mean"]


class OutputLengthEstimator:
    """A sliding window of observed output lengths per route; answers a quantile (or the mean).

    The step loop observes; request validation, on callers' threads, reads: each route's answer is kept
    ready as one int, recomputed on observe, so a read never walks a list another thread is changing."""

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
        self._sum: dict[str, int] = {}
        self._current: dict[str, int] = {}

    def observe(self, route: str, length: int) -> None:
        recent = self._recent.setdefault(route, deque())
        ordered = self._sorted.setdefault(route, [])
        recent.append(length)
        bisect.insort(ordered, length)
        total = self._sum.get(route, 0) + length
        if len(recent) > self.window:
            old = recent.popleft()
            del ordered[bisect.bisect_left(ordered, old)]
            total -= old
        self._sum[route] = total
        if len(ordered) >= self.min_samples:
            self._current[route] = self._answer(ordered, total)

    def _answer(self, ordered: list[int], total: int) -> int:
        if self.kind == "mean":
            return cdiv(total, len(ordered))
        # Nearest-rank quantile: the smallest observation covering `quantile` of the window.
        rank = max(1, math.ceil(round(self.quantile * len(ordered), 6)))
        return ordered[rank - 1]

    def estimate(self, route: str) -> int:
        return self._current.get(route, self.cold_start)


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
        return self.reservation(req, remaining_output) - num_cached_blocks

    def reservation(self, req: Request, remaining_output: int, n: int | None = None) -> int:
        """Blocks for req's tokens so far and `remaining_output` more, with no cache hit: the formula of docs/scheduling.md
        (prompt and output rounded up apart, the output widened by the draft tokens a step may write).

        Never more than the request can ever hold: its tokens stop at `length_limit`, and a draft never runs
        past it (the scheduler cuts drafts at max_tokens and max_model_len), so a request whose limit fits
        the cache is never refused for the formula's rounding or its drafts. `n` overrides a parent's n (the
        largest n that fits, for an error message).
        """
        bs = self.block_size
        ceiling = cdiv(req.length_limit, bs)
        if req.fork_hold:
            return self._family_blocks(
                req, remaining_output, ceiling, req.sampling_params.n if n is None else n
            )
        return min(cdiv(req.num_tokens, bs) + cdiv(remaining_output + self.spec_tokens, bs), ceiling)

    def child_blocks(self, req: Request) -> int:
        """What a forked child's table reaches: the prompt (its shared blocks included) and its estimated
        output, as its parent's reservation counted it."""
        return min(
            cdiv(req.num_prompt_tokens + req.output_length_estimate + self.spec_tokens, self.block_size),
            cdiv(req.length_limit, self.block_size),
        )

    def _family_blocks(self, req: Request, output: int, ceiling: int, n: int) -> int:
        """A parent not yet forked (n > 1, sched/fork.py): the prompt's full blocks once (its n children share
        them), and per child its own blocks from the prompt's partial last block (the parent's, or a copy)
        through its estimated output."""
        bs = self.block_size
        shared = (req.num_prompt_tokens - 1) // bs
        per_child = min(cdiv(req.num_prompt_tokens + output + self.spec_tokens, bs), ceiling) - shared
        return shared + n * per_child

    def check_fits(self, req: Request, num_blocks: int) -> None:
        """Raise Unadmittable when req, as it arrives, could never be admitted into a cache of num_blocks:
        its reservation (blocks_needed with no cache hit, n children for n > 1) exceeds the whole cache. The
        message names what to lower and by how much."""
        n = req.sampling_params.n
        output = req.output_length_estimate
        need = self.reservation(req, output)
        if need <= num_blocks:
            return
        largest_output = self._largest_fitting(lambda o: self.reservation(req, o), output, num_blocks)
        largest_n = self._largest_fitting(lambda k: self.reservation(req, output, n=k), n, num_blocks)
        given = req.sampling_params.max_tokens is not None
        out_name = (
            f"max_tokens ({output})" if given else f"the estimated output ({output} tokens; max_tokens unset)"
        )
        subject = f"n ({n}) and {out_name} need" if n > 1 else f"{out_name} needs"
        fixes = []
        if largest_output > 0:
            fixes.append(f"max_tokens at most {largest_output}")
        if n > 1 and largest_n > 0:
            fixes.append(f"n at most {largest_n}")
        fix = f"; it would fit with {' or '.join(fixes)}" if fixes else ""
        # Starts with the parameter's name: the server's 400 names it (server/errors.py).
        raise Unadmittable(
            f"{subject} {need} KV blocks of {self.block_size} tokens with a {req.num_prompt_tokens}-token "
            f"prompt, but the KV cache holds {num_blocks} blocks{fix}"
        )

    @staticmethod
    def _largest_fitting(blocks: Callable[[int], int], upper: int, num_blocks: int) -> int:
        """The largest x in [0, upper] with blocks(x) <= num_blocks (blocks grows with x), or 0 if none."""
        lo, hi = 0, upper
        if blocks(0) > num_blocks:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks(mid) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


class Unadmittable(ValueError):
    """A request whose reservation exceeds the whole KV cache: no amount of waiting admits it."""
