"""When the batch may take new requests: continuous (every step) or static (the seed's baseline)."""

from __future__ import annotations


class ContinuousBatching:
    """Iteration-level scheduling: finished requests leave at once and waiting ones join at every step."""

    # Admission stops when the step's token budget is spent: the next step admits the rest.
    admits_without_budget = False

    def admission_open(self, num_running: int) -> bool:
        return True


class StaticBatching:
    """Collect up to max_num_seqs requests, run them to the longest, then take the next batch.

    Finished requests still stream their results at once; only admission waits for the whole batch. We do not
    burn compute on padding rows for finished requests, which flatters this baseline on a CPU (where a smaller
    batch is cheaper) relative to a GPU (where a padded batch costs about the same as a full one).
    """

    # A batch is formed whole, not limited to the prefill chunks that fit in the first step.
    admits_without_budget = True

    def admission_open(self, num_running: int) -> bool:
        return num_running == 0
