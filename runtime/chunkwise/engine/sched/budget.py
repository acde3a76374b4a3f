"""The step token budget: B = decode rows + prefill chunk (chunked prefill, docs/scheduling.md)."""

from __future__ import annotations

from chunkwise.engine.datatypes.request import Request


class TokenBudget:
    def __init__(
        self,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        long_prompt_threshold: int,
        max_long_chunk: int | None = None,
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prompt_threshold = long_prompt_threshold
        self.max_long_chunk = max_long_chunk or max(1, max_num_batched_tokens // 2)
        # A cap the operator set is for every step; the default one only leaves room for other prompts.
        self.hard_cap = max_long_chunk is not None

    def chunk(self, req: Request, wanted: int, remaining: int, contended: bool = True) -> int:
        """Tokens of req to compute this step, given `remaining` budget. 0 means not this step.

        `contended`: another prompt (running, waiting or swapped) could use what this one leaves.
        """
        if (
            (contended or self.hard_cap)
            and self.enable_chunked_prefill
            and req.num_prompt_tokens >= self.long_prompt_threshold
        ):
            # A long prompt never takes the whole step while others wait for it: short requests keep a share
            # of every step. Alone (decode rows aside), it takes what the budget has: work-conserving.
            wanted = min(wanted, self.max_long_chunk)
        if wanted <= remaining:
            return wanted
        # Without chunking a prefill runs whole or waits: that is the convoy of docs/scheduling.md.
        return remaining if self.enable_chunked_prefill else 0
