"""The records a runner step passes: what it returns (ModelRunnerOutput), what a proposer is asked
(DraftRequest, Proposer), and what its prepare stage hands the stages after it (PreparedStep)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from chunkwise.engine.attention.backend import AttentionMetadata, AttentionPlan
from chunkwise.engine.datatypes.outputs import TokenLogprob
from chunkwise.engine.lora.rows import LoRAStep
from chunkwise.engine.sampling.sampler import SamplerOutput, SamplingBatch
from chunkwise.engine.sampling.structured.state import GrammarRow
from chunkwise.engine.sched.output import ScheduledRequest, SchedulerOutput
from chunkwise.engine.worker.inputs import RowLike, StepInputs


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # A decode-only step's tokens in row order, one a row, instead of `sampled` (no per-row dict to build
    # and look up at hundreds of rows).
    row_tokens: list[int] | None = None
    # Per sampled request, per token: (chosen logprob, [(id, logprob) of the top alternatives]).
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)
    # Per request whose prompt is now all scored: its prompt tokens' log-probs (SamplingParams.prompt_logprobs).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Draft tokens proposed per speculating request (the accepted ones are in `sampled`, before its last).
    drafted: dict[str, int] = field(default_factory=dict)
    # Host work before the forward: drafts, inputs, the attention plan, the sampling parameters.
    prepare_seconds: float = 0.0
    # The model, the logits and the sampler's tensor work, up to the sampled ids back on the host.
    forward_seconds: float = 0.0
    # Turning sampled ids (and log-probs) into per-request lists.
    sample_seconds: float = 0.0


@dataclass(frozen=True)
class DraftRequest:
    req_id: str
    token_ids: list[int]  # the request's known tokens (live reference: do not modify)
    block_table: list[int]  # slots are allocated up to len(token_ids) + k
    k: int


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Up to k draft tokens per request (fewer, or none, when it has no good guess)."""
        ...

    def forget(self, req_ids: set[str]) -> None: ...


@dataclass
class PreparedStep:
    """What the prepare stage worked out for one step, for the stages after it."""

    scheduled: list[ScheduledRequest]
    rows: list[RowLike]  # the scheduled rows, a speculating one with its drafts appended
    drafts: dict[str, list[int]]
    inputs: StepInputs
    num_pad: int  # static batching's padding rows, after the real ones
    score_prompts: bool
    # Every row one token that samples (a one-token chunk mid-prompt does not), none speculating.
    decode_only: bool
    sample_rows: list[int]  # the rows that produce tokens
    plain: list[int]  # those of them sampled (not verified)
    batch: SamplingBatch | None = None
    grammar_rows: list[GrammarRow] = field(default_factory=list)
    keep: torch.Tensor | None = None  # the token rows kept past the last attention
    kept_rows: list[int] | None = None  # the same, on the host
    last: torch.Tensor | None = None  # the plain rows' last tokens, when every row is kept (prompt scoring)
    verify_at: dict[str, int] = field(default_factory=dict)  # a speculating row's first kept row
    row_starts: list[int] = field(default_factory=list)  # each row's first token row
    graphed: bool = False
    plan: AttentionPlan | None = None
    lora: LoRAStep | None = None  # which rows run which adapter (None: every row the base model)

    @property
    def meta(self) -> AttentionMetadata:
        return self.inputs.meta


def emit_plain(
    so: SchedulerOutput,
    rows: list[int],
    tokens: list[int],
    result: SamplerOutput,
    out: ModelRunnerOutput,
) -> None:
    """The plain rows' sampled tokens (and log-probs) into the step's output."""
    if so.decode_only:
        out.row_tokens = tokens
    else:
        sampled = out.sampled
        for i, tok in zip(rows, tokens):
            sampled[so.scheduled[i].req_id] = [tok]
    if result.logprobs is None:
        return
    chosen = result.logprobs.tolist()
    top_ids = top_vals = None
    if result.top_logprobs is not None:
        top_ids, top_vals = (t.tolist() for t in result.top_logprobs)
    for row, i in enumerate(rows):
        sr = so.scheduled[i]
        k = sr.sampling_params.logprobs
        if k is not None:
            top = list(zip(top_ids[row][:k], top_vals[row][:k])) if k and top_ids and top_vals else []
            out.logprobs[sr.req_id] = [(chosen[row], top)]
