"""The runner's verify stage: a speculating row's drafts judged against the target's logits (greedy: its
argmax; sampled: rejection sampling), queued on the device and read back with the step's sampled tokens."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.kernels import argmax
from chunkwise.engine.model.llama import LlamaForCausalLM
from chunkwise.engine.sampling.sampler import RequestGenerators, apply_grammar_mask, apply_top_k_top_p
from chunkwise.engine.sampling.structured.state import GrammarState
from chunkwise.engine.sched.output import ScheduledRequest
from chunkwise.engine.worker.rejection import finish_sampled, sampled_decisions, verify_greedy
from chunkwise.engine.worker.step import ModelRunnerOutput, PreparedStep

# A speculating row, its drafts, and how many values of the step's read are its.
Verifying = tuple[ScheduledRequest, list[int], int]


def require_grammar(grammar: GrammarState | None) -> GrammarState:
    if grammar is None:
        raise RuntimeError("a request has structured outputs, but this runner has no grammar compiler")
    return grammar


class DraftVerifier:
    def __init__(
        self,
        model: LlamaForCausalLM,
        grammar: GrammarState | None,
        generators: RequestGenerators,
    ) -> None:
        self.model = model
        self.grammar = grammar
        self.generators = generators  # the seeded requests' generators, shared with the runner's sampling

    def verify(self, step: PreparedStep, hidden: torch.Tensor, reads: list[torch.Tensor]) -> list[Verifying]:
        """Speculating rows: each one's verify queued on the device (a greedy row's argmax, a sampled row's
        rejection-sampling decisions) and read back with the sampled tokens: a read per row, or per draft,
        would be a sync each. Returns (row, its drafts, how many values it reads) per speculating row."""
        verifying: list[Verifying] = []
        for sr, row_drafts, start in self.rows(step):
            logits = self._logits(sr, row_drafts, hidden, start)
            params = sr.sampling_params
            if params.greedy:
                reads.append(argmax(logits))
            else:
                probs = _target_probs(logits, params)
                reads.append(
                    sampled_decisions(probs, row_drafts, None, self.generators.get(sr.req_id, params))
                )
            verifying.append((sr, row_drafts, len(reads[-1])))
        return verifying

    @staticmethod
    def rows(step: PreparedStep) -> Iterator[tuple[ScheduledRequest, list[int], int]]:
        """Each speculating row, its drafts, and its first hidden row (the last known token's)."""
        drafts = step.drafts
        for i in step.sample_rows:
            sr = step.scheduled[i]
            if sr.req_id in drafts:
                start = step.verify_at[sr.req_id] if step.keep is not None else step.row_starts[i]
                yield sr, drafts[sr.req_id], start

    def emit(
        self,
        verifying: list[Verifying],
        host: list[int],
        offset: int,
        out: ModelRunnerOutput,
    ) -> None:
        """Each speculating row's read values, from `offset` of the step's read, into its accepted tokens."""
        for sr, row_drafts, n in verifying:
            values = host[offset : offset + n]
            offset += n
            greedy = sr.sampling_params.greedy
            accepted = verify_greedy(values, row_drafts) if greedy else finish_sampled(values, row_drafts)
            self._accept(sr, row_drafts, accepted, out)

    def check_drafts(self, scheduled: list[ScheduledRequest], drafts: dict[str, list[int]]) -> None:
        """Cut each constrained request's draft at the first token its grammar rejects (none left: no draft)."""
        for sr in scheduled:
            spec = sr.sampling_params.structured
            if spec is None or sr.req_id not in drafts:
                continue
            kept = require_grammar(self.grammar).valid_prefix(sr.req_id, spec, drafts[sr.req_id])
            if kept:
                drafts[sr.req_id] = kept
            else:
                del drafts[sr.req_id]

    def _logits(
        self, sr: ScheduledRequest, drafts: list[int], hidden: torch.Tensor, start: int
    ) -> torch.Tensor:
        """One forward scored the last known token and every draft: their logits, grammar-masked."""
        # Row j predicts the token after position start_pos + j: rows 0..k-1 judge the drafts, row k is the bonus.
        logits = self.model.compute_logits(hidden[start : start + 1 + len(drafts)])
        spec = sr.sampling_params.structured
        if spec is not None:
            # Position j is masked with the grammar's state after drafts[:j] (all of which it accepts).
            logits = apply_grammar_mask(
                logits.float(), require_grammar(self.grammar).draft_masks(sr.req_id, spec, drafts)
            )
        return logits

    def _accept(
        self, sr: ScheduledRequest, drafts: list[int], tokens: list[int], out: ModelRunnerOutput
    ) -> None:
        """The drafts the target agreed with and its own next token: the request's tokens this step."""
        spec = sr.sampling_params.structured
        if spec is not None:
            require_grammar(self.grammar).accept(sr.req_id, spec, tokens)
        out.sampled[sr.req_id] = tokens
        out.drafted[sr.req_id] = len(drafts)


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, then top-k and top-p, as the sampler does."""
    scaled = (logits.float() - logits.float().amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        n = scaled.shape[0]
        top_k = torch.full((n,), params.top_k, dtype=torch.long, device=scaled.device)
        top_p = torch.full((n,), params.top_p, dtype=torch.float32, device=scaled.device)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)
