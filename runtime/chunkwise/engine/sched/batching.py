"""When the batch may take new requests: continuous (every step) or static (the baseline).

Both answer the same three questions, so the scheduler never asks which one it holds: may this step admit
(admission_open), what becomes of a running request's slot when it finishes (release), and which padding rows
this step computes for the slots still held (padding_positions).
"""

from __future__ import annotations

from chunkwise.engine.datatypes.request import Request


class ContinuousBatching:
    """Iteration-level scheduling: finished requests leave at once and waiting ones join at every step."""

    # Admission stops when the step's token budget is spent: the next step admits the rest.
    admits_without_budget = False

    def admission_open(self, num_running: int) -> bool:
        return True

    def release(self, req: Request, num_running: int) -> None:
        """A finished request's slot is free for the next step: nothing is held."""

    def padding_positions(self) -> tuple[int, ...]:
        return ()


class StaticBatching:
    """Collect up to max_num_seqs requests, run them to the longest, then take the next batch.

    As docs/scheduling.md describes it, a request that finishes before its batch's longest holds its slot, computing
    padding, until the longest one completes: every later step of the batch carries one padding row per
    finished request. The scheduler sends a padding row's position; the model runner computes it as a decode
    row of a fixed token that writes its key and value into the runner's sink block (a cache block the block
    pool never hands out, so no request's KV is touched and no block is held past the batch) and discards
    its logits. A padding row continues where its request stopped, one position further each step (never past
    max_model_len - 1), so it attends over a context as long as the finished sequence's would have been.

    The finished request's outputs still stream at once and its own KV blocks are freed at once (the block
    pool's free count is back where it was when the batch ends); only its slot, and the compute it stands
    for, is held. Admission waits for the whole batch.
    """

    # A batch is formed whole, not limited to the prefill chunks that fit in the first step.
    admits_without_budget = True

    def __init__(self, max_model_len: int) -> None:
        self._max_pos = max_model_len - 1
        # Per held slot: the position its next padding row computes.
        self._held: list[int] = []

    @property
    def num_held(self) -> int:
        return len(self._held)

    def admission_open(self, num_running: int) -> bool:
        if num_running == 0:
            # The batch is over (even if preemption emptied it): its held slots go with it.
            self._held.clear()
            return True
        return False

    def release(self, req: Request, num_running: int) -> None:
        """A running request finished, leaving `num_running` others in the batch: its slot is held until
        the batch ends, which is now when it was the last."""
        if num_running == 0:
            self._held.clear()
        else:
            # Where its next decode would have been: the last token, whose KV it never computed.
            self._held.append(min(max(req.num_tokens - 1, 0), self._max_pos))

    def padding_positions(self) -> tuple[int, ...]:
        """This step's padding rows (one per held slot, at its position); advances each slot by one."""
        held = self._held
        if not held:
            return ()
        out = tuple(held)
        top = self._max_pos
        self._held = [p + 1 if p < top else top for p in held]
        return out
