"""The step's records: its timings (StepStats) and what it did to its requests (StepUpdate)."""

from __future__ import annotations

from dataclasses import dataclass

from chunkwise.engine.datatypes.outputs import TokenLogprob
from chunkwise.engine.datatypes.request import Request


@dataclass
class StepStats:
    """One step's timings, for metrics, the cost model and the host-overhead benchmark.

    step = schedule + prepare + forward + sample + update + output (+ the little between them): the forward is
    the device's share (the model, logits and sampler up to the sampled ids on the host); the rest is host
    work, which on a GPU is time the device may sit idle."""

    step_seconds: float
    schedule_seconds: float
    forward_seconds: float
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_rows: int
    prepare_seconds: float = 0.0
    sample_seconds: float = 0.0
    update_seconds: float = 0.0
    output_seconds: float = 0.0
    # Static batching's padding rows in this step (held slots of finished requests), on top of the real rows.
    num_padding_rows: int = 0

    @property
    def host_seconds(self) -> float:
        """Everything in the step outside the forward."""
        return self.step_seconds - self.forward_seconds


Logprobs = list[tuple[float, list[tuple[int, float]]]]


@dataclass(slots=True)
class StepUpdate:
    """What one step did to its requests, as of the end of that step: the output side reads this snapshot
    (and a finished request's finish fields, which never change again), not the live requests, which the
    step loop may already be advancing on another thread. Parallel lists, not an object per request: at
    hundreds of rows a step, the snapshot is a few list passes."""

    reqs: list[Request]
    num_tokens: list[int]  # len(req.token_ids) when the step ended: the new tokens are the ones before it
    finished: list[bool]
    # Per request id, per new token: (chosen logprob, top alternatives); None when no row asked for them.
    logprobs: dict[str, Logprobs] | None = None
    # Per request whose prompt was scored whole this step: its prompt log-probs.
    prompt_logprobs: dict[str, list[TokenLogprob]] | None = None

    @classmethod
    def of(
        cls,
        reqs: list[Request],
        logprobs: dict[str, Logprobs] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprob]] | None = None,
    ) -> StepUpdate:
        # finish() sets finish_reason: whether it is set is whether the request is finished.
        return cls(
            reqs,
            [len(r.token_ids) for r in reqs],
            [r.finish_reason is not None for r in reqs],
            logprobs or None,
            prompt_logprobs or None,
        )
