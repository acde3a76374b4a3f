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
    return finish_sampled(sampled_decisions(target_probs, drafts, draft_probs, generator).tolist(), drafts)


def sampled_decisions(
    target_probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Every decision rejection sampling can need, on the device, without reading anything back: [2k + 1]
    int64, k = len(drafts): whether each draft is accepted, then for each position the token it takes if its
    draft is the first rejected, then the bonus token. `finish_sampled` reads them (one transfer, which the
    runner makes together with its other reads).

    Drawing every position's replacement up front, not only the first rejected one's, changes nothing in
    distribution: each is drawn independently of the acceptance tests, and only the first rejected position's
    is used."""
    k = len(drafts)
    device = target_probs.device
    pin = device.type == "cuda"
    d = torch.tensor(drafts, dtype=torch.long, pin_memory=pin).to(device, non_blocking=pin)[:, None]
    uniforms = torch.rand(k, generator=generator, device=device)
    heads = target_probs[:k]
    p = heads.gather(1, d).squeeze(1)
    if draft_probs is None:
        # A deterministic proposer: q(d) = 1, accept with probability p(d); on rejection, p without d.
        accept = uniforms < p
        residual = heads.scatter(1, d, 0.0)
    else:
        q = draft_probs[:k].gather(1, d).squeeze(1)
        accept = (q > 0) & (uniforms * q < p)  # u < min(1, p / q), without dividing by q
        residual = (heads - draft_probs[:k]).clamp_(min=0.0)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q exactly (nothing left over) can only be reached with probability 0; fall back to p.
    replacement = torch.where(total > 0, residual / total.clamp(min=1e-30), heads)
    rows = torch.cat((replacement, target_probs[k : k + 1]))
    draws = torch.multinomial(rows, 1, generator=generator).squeeze(1)
    return torch.cat((accept.long(), draws))


def finish_sampled(decisions: list[int], drafts: list[int]) -> list[int]:
    """The tokens from sampled_decisions' values: the accepted run of drafts, then the first rejected
    position's replacement, or the bonus token when every draft is accepted."""
    k = len(drafts)
    out: list[int] = []
    for i, d in enumerate(drafts):
        if not decisions[i]:
            out.append(decisions[k + i])
            return out
        out.append(d)
    out.append(decisions[2 * k])
    return out
