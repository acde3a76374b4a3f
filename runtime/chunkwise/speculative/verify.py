"""Verification of draft tokens against the target model's distributions from one forward pass.

Greedy accepts the longest run of drafts equal to the target's argmax, then takes the target's own token.
Sampling uses rejection sampling (Leviathan et al., Chen et al.): accept draft d with probability
min(1, p(d) / q(d)); on rejection draw from normalise(max(0, p - q)); after k acceptances draw a bonus token
from p. The output then has exactly the target distribution p. A deterministic proposer (n-gram) is a draft
distribution q that puts all its mass on d.
"""

from __future__ import annotations

import torch


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """target_argmax has len(drafts) + 1 entries. Returns accepted drafts plus one target token."""
    out = []
    for i, d in enumerate(drafts):
        t = target_argmax[i]
        out.append(t)
        if t != d:
            return out
    out.append(target_argmax[len(drafts)])
    return out


def verify_sampled(
    target_probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """target_probs [len(drafts) + 1, V] (after temperature/top-k/top-p); draft_probs [len(drafts), V] or None
    for a deterministic proposer. Returns accepted drafts plus one token drawn from the target."""
    out: list[int] = []
    uniforms = torch.rand(len(drafts), generator=generator, device=target_probs.device).tolist()
    for i, d in enumerate(drafts):
        p = float(target_probs[i, d])
        q = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q > 0 and uniforms[i] < min(1.0, p / q):
            out.append(d)
            continue
        if draft_probs is None:
            residual = target_probs[i].clone()
            residual[d] = 0.0
        else:
            residual = (target_probs[i] - draft_probs[i]).clamp_(min=0.0)
        total = float(residual.sum())
        # p == q exactly (nothing left over) can only be reached with probability 0; fall back to p.
        dist = residual / total if total > 0 else target_probs[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return out
