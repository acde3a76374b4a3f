"""Prompt log-probs (SamplingParams.prompt_logprobs): the runner's prompt-scoring stage and its state."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from chunkwise.engine.datatypes.outputs import TokenLogprob
from chunkwise.engine.model.llama import LlamaForCausalLM
from chunkwise.engine.sched.output import ScheduledRequest
from chunkwise.engine.worker.inputs import RowLike


class PromptScorer:
    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        # Prompt log-probs scored so far per request, and the requests already handed theirs over.
        self._scores: dict[str, list[TokenLogprob]] = {}
        self._scored: set[str] = set()

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self._scores.pop(rid, None)
            self._scored.discard(rid)

    def score(
        self,
        scheduled: list[ScheduledRequest],
        rows: Sequence[RowLike],
        hidden: torch.Tensor,
        done: dict[str, list[TokenLogprob]],
    ) -> None:
        """Prompt log-probs: each position of a prompt chunk scored against the prompt's next token, kept
        per request until the whole prompt is scored, then handed over once (into `done`). A rare, costly
        request (logits for every prompt position, a host sync per chunk), kept out of every other row's way."""
        offset = 0
        for sr, row in zip(scheduled, rows):
            start, n = offset, len(row.token_ids)
            offset += n
            prompt = sr.prompt_token_ids
            if prompt is None or sr.req_id in self._scored:
                continue
            if sr.start_pos == 0:
                self._scores[sr.req_id] = []  # (re)started from the first token: a recompute restarts
            scores = self._scores.get(sr.req_id)
            if scores is None or len(scores) != sr.start_pos:
                continue  # resumed past positions it never scored (a forked sequence): not its to report
            # Positions start_pos .. start_pos + m - 1 predict prompt tokens start_pos + 1 .. start_pos + m.
            m = min(n, len(prompt) - 1 - sr.start_pos)
            if m > 0:
                logprobs = self.model.compute_logits(hidden[start : start + m]).float().log_softmax(dim=-1)
                targets = prompt[sr.start_pos + 1 : sr.start_pos + 1 + m]
                target_t = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
                chosen = logprobs.gather(1, target_t)
                ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
                k = sr.sampling_params.prompt_logprobs or 0
                top_ids: list[list[int]] = [[] for _ in range(m)]
                top_vals: list[list[float]] = [[] for _ in range(m)]
                if k:
                    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
                    top_ids, top_vals = ids.tolist(), values.tolist()
                for t, v, r, ti, tv in zip(targets, chosen.squeeze(1).tolist(), ranks, top_ids, top_vals):
                    scores.append(TokenLogprob(t, v, list(zip(ti, tv)), rank=r))
            if sr.start_pos + n >= len(prompt) - 1:
                done[sr.req_id] = self._scores.pop(sr.req_id)
                self._scored.add(sr.req_id)
