"""How many tokens to draft this step: the seed's rule that speculation must fall as load rises.

A step's cost is close to linear in its tokens: t(T) = a + b*T, where a is the fixed cost of a step (weight
reads on a GPU, launch and Python overhead everywhere) and b the cost per token. With n decode rows drafting k
tokens each at per-token acceptance rate r, a step yields n * E(k) tokens, E(k) = (1 - r^(k+1)) / (1 - r), for
t(n * (1 + k)). We pick the k in 0..k_max that maximises tokens per second. At batch 1 the fixed cost
dominates and drafting is nearly free; as n grows b*n*(1+k) dominates and E(k)/(1+k) < 1 wins nothing, so k
falls to zero. The token budget caps it too: decode rows times (1 + k) must fit the step.
"""

from __future__ import annotations


class StepCostModel:
    """Online least squares of step seconds on step tokens, with exponential forgetting."""

    def __init__(self, fixed_s: float, per_token_s: float, decay: float = 0.98) -> None:
        self.decay = decay
        # Sufficient statistics, seeded with a prior worth a few steps of (1, fixed) and (T0, fixed + T0*b).
        self._n = 0.0
        self._sx = self._sy = self._sxx = self._sxy = 0.0
        for tokens in (1.0, 64.0):
            self.observe(int(tokens), fixed_s + per_token_s * tokens, weight=2.0)

    def observe(self, tokens: int, seconds: float, weight: float = 1.0) -> None:
        d = self.decay
        self._n = d * self._n + weight
        self._sx = d * self._sx + weight * tokens
        self._sy = d * self._sy + weight * seconds
        self._sxx = d * self._sxx + weight * tokens * tokens
        self._sxy = d * self._sxy + weight * tokens * seconds

    @property
    def coefficients(self) -> tuple[float, float]:
        var = self._n * self._sxx - self._sx * self._sx
        if var <= 1e-12:
            return max(self._sy / self._n, 1e-6), 1e-6
        b = (self._n * self._sxy - self._sx * self._sy) / var
        a = (self._sy - b * self._sx) / self._n
        return max(a, 0.0), max(b, 1e-9)


class AdaptiveDraftLength:
    def __init__(
        self, max_k: int, cost: StepCostModel, adaptive: bool = True, prior_acceptance: float = 0.5
    ) -> None:
        self.max_k = max_k
        self.cost = cost
        self.adaptive = adaptive
        self.acceptance = prior_acceptance
        self.last_k = 0

    def observe_step(self, num_tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        """One step's result: its forward time at its size (the step-cost line) and its drafts' fate."""
        self.cost.observe(num_tokens, seconds)
        self.observe_acceptance(drafted, accepted)

    def observe_acceptance(self, drafted: int, accepted: int, per_token_weight: float = 0.02) -> None:
        """Exponential moving average of the per-token acceptance rate, weighted by tokens drafted."""
        if drafted > 0:
            w = 1.0 - (1.0 - per_token_weight) ** drafted
            self.acceptance += w * (accepted / drafted - self.acceptance)
            # Capped below 1 so E(k) stays finite and a long lucky streak cannot pin k at its maximum.
            self.acceptance = min(max(self.acceptance, 0.0), 0.95)

    def choose(self, num_decode_rows: int, budget: int) -> int:
        """Draft length for this step given the decode rows that could draft and the step's token budget."""
        if num_decode_rows == 0:
            self.last_k = 0
            return 0
        cap = min(self.max_k, budget // num_decode_rows - 1)
        if cap <= 0:
            self.last_k = 0
            return 0
        if not self.adaptive:
            self.last_k = cap
            return cap
        a, b = self.cost.coefficients
        r = self.acceptance
        best_k, best_rate = 0, 0.0
        for k in range(cap + 1):
            expected = (1 - r ** (k + 1)) / (1 - r)
            rate = num_decode_rows * expected / (a + b * num_decode_rows * (1 + k))
            # Prefer the shorter draft unless the longer one is clearly better (2%): noise-robust.
            if rate > best_rate * 1.02:
                best_k, best_rate = k, rate
        self.last_k = best_k
        return best_k
