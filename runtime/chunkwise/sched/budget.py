"""The step token budget: B = decode rows + prefill chunk (the seed's chunked prefill)."""

from __future__ import annotations

from chunkwise.request import Request


class TokenBudget:
    def __init__(self, max_num_batched_tokens: int, enable_chunked_prefill: bool) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill

    def chunk(self, req: Request, wanted: int, remaining: int) -> int:
        """Tokens of req to compute this step, given `remaining` budget. 0 means not this step."""
        if wanted <= remaining:
            return wanted
        # Without chunking a prefill runs whole or waits: that is the convoy the seed warns about.
        return remaining if self.enable_chunked_prefill else 0
