"""Prompt-lookup (n-gram) proposals: no extra model, just the request's own history.

If the last n tokens occurred earlier in the context, guess that what followed them then follows them now.
Repetitive workloads (code edits, extraction, summaries quoting their source) accept many such guesses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chunkwise.engine.worker.step import DraftRequest


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4, window: int = 2048) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # Search only the recent context: proposals must cost far less than the forward they save.
        self.window = window

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        return {r.req_id: self.lookup(r.token_ids, r.k) for r in requests}

    def forget(self, req_ids: set[str]) -> None:
        """Stateless: nothing to drop."""

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        ctx = token_ids[-self.window :] if len(token_ids) > self.window else token_ids
        length = len(ctx)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = ctx[length - n :]
            first = suffix[0]
            # Most recent earlier occurrence wins: it is the likeliest to continue the same way.
            for start in range(length - n - 1, -1, -1):
                if ctx[start] == first and ctx[start : start + n] == suffix:
                    follow = ctx[start + n : start + n + k]
                    if follow:
                        return follow
        return []
