"""How many tokens to draft this step: the rule of docs/scheduling.md that speculation must fall as load rises, from what a
step really costs.

Drafting k tokens for each of n decode rows costs, per row asked to draft, c(k) seconds: host work (the
proposer's lookup, the draft rows' inputs, verification and rejection sampling, the update of several tokens)
and the forward's extra tokens. It yields g(k) accepted tokens per such row. A plain decode step of n rows
costs T0(n), tau = T0(n) / n a row, so with drafts the step makes n (1 + g(k)) tokens in T0(n) + n c(k)
seconds, and k beats 0 when g(k) tau > c(k). At batch 1 tau is a whole step's fixed cost and a draft is
nearly free; under saturation tau falls to a row's marginal cost, which c(k) exceeds, and k falls to zero.
The token budget caps k too: decode rows times (1 + k) must fit the step.

Both sides are measured on whole steps (schedule, drafts, inputs, forward, verification, update): on a GPU
most of a small model's step is host work, and forward time alone never shows what drafting costs.
- T0 is a plane in rows and prompt tokens, fitted on the steps that draft nothing (StepCostModel.base);
- c(k) = alpha + beta * drafted tokens per asked row, fitted on drafting steps' excess over T0;
- g(k) from the acceptance rate (geometric: accepted / (accepted + cut drafts)) and how much of a draft the
  proposer fills.
A model fitted only on the k in use cannot compare it with k it never runs, so the policy measures what it
compares: at a load it has not run plainly of late it runs a plain step first (T0 there); it raises k one
step at a time and drops it at once; while drafting pays it still runs a plain step, soon after drafting
begins and then ever more seldom (after first_refresh steps, doubling up to refresh_steps); while it does
not, it tries k = 1 after a wait long enough that such tries cost at most explore_share of throughput by
its own prediction, the wait doubling with each try that confirms 0. So under saturation k is 0 within a
step or two of measuring what a draft costs, and drafting comes back when load falls (the model, at the
new load) or when drafts get cheaper or better accepted (the tries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class LeastSquares:
    """Weighted least squares with exponential forgetting, over prior pseudo-observations that never fade: a
    direction the recent observations leave unmeasured (every step the same size) falls back to the prior."""

    def __init__(self, prior: list[tuple[tuple[float, ...], float, float]], decay: float) -> None:
        self.dim = len(prior[0][0])
        self.decay = decay
        self._xx = [[0.0] * self.dim for _ in range(self.dim)]
        self._xy = [0.0] * self.dim
        self._pxx = [[0.0] * self.dim for _ in range(self.dim)]
        self._pxy = [0.0] * self.dim
        for x, y, w in prior:
            _accumulate(self._pxx, self._pxy, x, y, w, 1.0)
        self._theta: list[float] | None = None

    def observe(self, x: tuple[float, ...], y: float, weight: float = 1.0) -> None:
        _accumulate(self._xx, self._xy, x, y, weight, self.decay)
        self._theta = None

    @property
    def theta(self) -> list[float]:
        if self._theta is None:
            a = [
                [p + q for p, q in zip(r, s)] + [u + v]
                for r, s, u, v in zip(self._xx, self._pxx, self._xy, self._pxy)
            ]
            self._theta = _solve(a)
        return self._theta

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))


def _accumulate(
    xx: list[list[float]], xy: list[float], x: tuple[float, ...], y: float, w: float, decay: float
) -> None:
    for i, xi in enumerate(x):
        wx = w * xi
        xy[i] = decay * xy[i] + wx * y
        row = xx[i]
        for j, xj in enumerate(x):
            row[j] = decay * row[j] + wx * xj


def _solve(a: list[list[float]]) -> list[float]:
    """Cramer's rule on an augmented matrix of two or three unknowns: once a step, a few microseconds, where
    elimination in Python takes several times that."""
    if len(a) == 2:
        (p, q, u), (r, t, v) = a
        det = p * t - q * r
        return [(u * t - q * v) / det, (p * v - u * r) / det] if det else [0.0, 0.0]
    (a0, a1, a2, y0), (b0, b1, b2, y1), (c0, c1, c2, y2) = a
    det = _det3(a0, a1, a2, b0, b1, b2, c0, c1, c2)
    if not det:
        return [0.0, 0.0, 0.0]
    return [
        _det3(y0, a1, a2, y1, b1, b2, y2, c1, c2) / det,
        _det3(a0, y0, a2, b0, y1, b2, c0, y2, c2) / det,
        _det3(a0, a1, y0, b0, b1, y1, c0, c1, y2) / det,
    ]


def _det3(
    a0: float, a1: float, a2: float, b0: float, b1: float, b2: float, c0: float, c1: float, c2: float
) -> float:
    return a0 * (b1 * c2 - b2 * c1) - a1 * (b0 * c2 - b2 * c0) + a2 * (b0 * c1 - b1 * c0)


class StepCostModel:
    """A step's whole seconds: a plain step's T0 = a + b * rows + p * prompt tokens past one a row, plus, per
    row asked to draft, alpha + beta * its drafted tokens.

    Seeded from the start-up probe (fixed_s, per_token_s), which times forwards only: the plain plane starts
    as that forward's line and the per-drafted-token cost as its per-token cost; the host work per asked row
    is unknown at start-up (0). Measured steps replace the prior where they reach; it stays where they do
    not (how T0 grows with the rows when every step has the same size; beta, below)."""

    def __init__(
        self, fixed_s: float, per_token_s: float, decay: float = 0.95, draft_decay: float = 0.9
    ) -> None:
        a, b = fixed_s, per_token_s
        # Three points of the probe's line, each a fiftieth of a step: the measured steps outweigh them at
        # once, and they still fix what steps of one size leave open (how T0 changes with the rows).
        self.base = LeastSquares(
            [
                ((1.0, 1.0, 0.0), a + b, 0.02),
                ((1.0, 64.0, 0.0), a + 64 * b, 0.02),
                ((1.0, 1.0, 63.0), a + 64 * b, 0.02),
            ],
            decay,
        )
        # Per asked row, features (1, drafted tokens); a step weighs as many asked rows as it had. Steps at
        # one k say only what that k costs, so the per-token slope, which carries it to other k, leans on
        # the probe's per-token cost (a ridge worth four asked rows) while alpha follows the measured steps
        # at once. Draft steps are few: each counts for longer.
        self.draft = LeastSquares([((1.0, 0.0), 0.0, 0.25), ((0.0, 1.0), b, 4.0)], draft_decay)

    def plain_seconds(self, rows: int, prompt_tokens: int = 0) -> float:
        """T0: a step of `rows` rows that drafts nothing."""
        return max(self.base.predict((1.0, rows, prompt_tokens)), 1e-9)

    def draft_seconds(self, drafted_per_row: float) -> float:
        """c: what drafting adds to a step, per row asked to draft, at this many drafted tokens a row."""
        alpha, beta = self.draft.theta
        return max(alpha, 0.0) + max(beta, 0.0) * drafted_per_row

    def observe(
        self, seconds: float, rows: int, prompt_tokens: int = 0, asked: int = 0, drafted: int = 0
    ) -> None:
        share = rows / (rows + prompt_tokens)
        if asked == 0:
            # A stall (another process, the collector) is not what a step costs: at most 3x the model's
            # own prediction counts. A step mostly prompt weighs little: it is a different regime (attention
            # over long prompts), and a plane fitted to it would misjudge what decode rows cost.
            x = (1.0, rows, prompt_tokens)
            self.base.observe(x, min(seconds, 3 * self.base.predict(x)), weight=share)
            return
        # Drafting never makes a step cheaper: a negative excess is noise (clipped, erring towards k = 0).
        excess = max(seconds - self.plain_seconds(rows, prompt_tokens), 0.0) / asked
        # Weighed by its asked rows: T0's error spreads over them, so a step of many says more per row (a
        # batch-1 step's excess is the difference of two noisy step times). A step mostly prompt says
        # little about its drafts: T0's error on the chunk would swamp them.
        self.draft.observe((1.0, drafted / asked), excess, weight=asked * share)


@dataclass
class _Load:
    """What the policy last measured at one load (decode rows, bucketed by powers of two), in its steps."""

    plain_at: float  # last step that drafted nothing here
    # When to try k = 1 here, should the model still say 0 then, counted in this load's own steps: each load
    # spends at most explore_share of its steps on tries, however the steps are spread over loads.
    try_at: float
    steps: int = 0  # steps at this load
    tries: int = 0  # tries of k = 1 since drafting last paid here: each doubles the wait for the next
    refreshes: int = 0  # plain steps amid drafting since it began here: each doubles the wait for the next


class AdaptiveDraftLength:
    """The draft length policy the scheduler calls: choose(rows that may draft, budget) each step, and
    observe_step(...) with the step's whole seconds and shape once it has run (sched/apply.py's _learn)."""

    def __init__(
        self,
        max_k: int,
        cost: StepCostModel,
        adaptive: bool = True,
        prior_acceptance: float = 0.5,
        margin: float = 0.05,
        refresh_steps: int = 64,
        first_refresh: int = 8,
        explore_share: float = 0.01,
        min_hold: int = 16,
        max_hold: int = 1024,
        decay: float = 0.9,
    ) -> None:
        self.max_k = max_k
        self.cost = cost
        self.adaptive = adaptive
        # Leaving k = 0 must promise this much more throughput: a wrong draft under saturation is what loses.
        self.margin = margin
        self.refresh_steps = refresh_steps
        self.first_refresh = first_refresh
        # What trying k = 1 where the model says 0 may cost, as a share of throughput (by the model's own
        # prediction of that step's loss): a try that would lose a whole step's worth waits 1 / share steps.
        self.explore_share = explore_share
        self.min_hold = min_hold
        self.max_hold = max_hold
        self.decay = decay
        # Decayed counts, with a prior worth two drafted rows: accepted tokens and cut drafts (the geometric
        # acceptance rate), rows asked and rows that got a draft (the fill), drafted tokens and slots offered.
        self._accepted = 2.0 * prior_acceptance
        self._cut = 2.0 * (1.0 - prior_acceptance)
        self._asked = self._drafted_rows = 2.0
        self._drafted = self._slots = 2.0
        self.last_k = 0
        self._ramp = 0  # the k of the last step that had decode rows
        self._step = 0
        self._n = 0  # this step's decode rows
        self._bucket = 0  # and their bucket
        self._load: _Load | None = None  # this step's
        self._loads: dict[int, _Load] = {}

    @property
    def acceptance(self) -> float:
        """Per-token acceptance rate r: each draft token is accepted with r given the ones before it were.
        Capped below 1 so E(k) stays finite and a long lucky streak cannot pin k at its maximum."""
        return min(self._accepted / max(self._accepted + self._cut, 1e-9), 0.95)

    def expected_tokens(self, k: int) -> tuple[float, float]:
        """(accepted tokens, drafted tokens) per row asked to draft k."""
        r = self.acceptance
        fill = self._drafted_rows / self._asked
        length = k * min(self._drafted / self._slots, 1.0)  # the proposer may offer fewer than k
        return fill * r * (1 - r**length) / (1 - r), fill * length

    def preferred(self, num_decode_rows: int, cap: int) -> int:
        """The model's k in 0..cap for this many rows, from what it has measured (no exploration)."""
        tau = self.cost.plain_seconds(num_decode_rows) / num_decode_rows
        alpha, beta = self.cost.draft.theta
        alpha, beta = max(alpha, 0.0), max(beta, 0.0)
        # expected_tokens and draft_seconds, inlined: this runs every step.
        r = self.acceptance
        fill = self._drafted_rows / self._asked
        frac = min(self._drafted / self._slots, 1.0)
        best_k, best_rate = 0, 1.0 / tau
        for k in range(1, cap + 1):
            length = k * frac
            gain = fill * r * (1 - r**length) / (1 - r)
            rate = (1.0 + gain) / (tau + alpha + beta * fill * length)
            # The shorter draft unless the longer one is clearly better: noise-robust, and a step away
            # from 0 needs the full margin.
            if rate > best_rate * (1.0 + (self.margin if best_k == 0 else 0.02)):
                best_k, best_rate = k, rate
        return best_k

    def _hold(self, n: int, tries: int) -> float:
        """Steps to wait at load n before trying k = 1 again: the model's predicted loss of that step (in
        plain steps: its cost over a plain step's, less its tokens over a plain step's) over explore_share,
        doubled for each try that confirmed 0, within [min_hold, max_hold]."""
        tau = self.cost.plain_seconds(n) / n
        gain, drafted = self.expected_tokens(1)
        loss = self.cost.draft_seconds(drafted) / tau - gain
        return min(max(self.min_hold, loss / self.explore_share) * 2 ** min(tries, 30), self.max_hold)

    def choose(self, num_decode_rows: int, budget: int) -> int:
        """Draft length for this step given the decode rows that could draft and the step's token budget."""
        n = num_decode_rows
        self._load = None
        cap = min(self.max_k, budget // n - 1) if n else 0
        if cap <= 0:
            self.last_k = 0
            return 0
        if not self.adaptive:
            self.last_k = cap
            return cap
        self._step += 1
        bucket = n.bit_length()
        load = self._loads.get(bucket)
        if load is None:
            # The first try waits as long as the model's prediction of its loss says (what a draft costs
            # per row is known from other loads, if any).
            load = self._loads[bucket] = _Load(-math.inf, self._hold(n, 0))
        self._load = load
        load.steps += 1
        moved, self._bucket = bucket != self._bucket, bucket
        if self._step - load.plain_at > min(
            self.first_refresh << min(load.refreshes, 30), self.refresh_steps
        ):
            # Measure a plain step at this load first (or again): drafting is judged against it. The first
            # refreshes amid drafting come soon, the next ones later: a plain cost misjudged (a stall, a
            # fit from other steps) then costs a few drafting steps, not refresh_steps of them. A refresh
            # keeps the ramp (one step lost, not a climb back); a new load climbs from 0.
            if moved:
                self._ramp = 0
            else:
                load.refreshes += 1
            self.last_k = 0
            return 0
        best = self.preferred(n, cap)
        if best > 0:
            k = min(best, self._ramp + 1)
            load.tries = 0
        elif load.steps >= load.try_at:
            k = 1  # the cheapest look at whether drafting pays here now
            load.tries += 1
            load.refreshes = 0
            # Until this step's measurement sets the wait from what it cost (observe_step).
            load.try_at = load.steps + self.min_hold * 2 ** min(load.tries, 30)
        else:
            k = 0
            load.refreshes = 0
        self._n = n
        self._ramp = self.last_k = k
        return k

    def observe_step(
        self,
        seconds: float,
        rows: int,
        prompt_tokens: int = 0,
        asked: int = 0,
        drafted: int = 0,
        drafted_rows: int = 0,
        accepted: int = 0,
        cut: int = 0,
    ) -> None:
        """One step's whole seconds and its shape: rows, prompt tokens past one a row, rows asked to draft,
        tokens drafted and rows that got them, drafts accepted, and drafts cut short by a rejection."""
        self.cost.observe(seconds, rows, prompt_tokens, asked, drafted)
        load = self._load
        if asked == 0:
            if load is not None:
                load.plain_at = self._step
            return
        d = self.decay
        self._accepted = d * self._accepted + accepted
        self._cut = d * self._cut + cut
        self._asked = d * self._asked + asked
        self._drafted_rows = d * self._drafted_rows + drafted_rows
        self._drafted = d * self._drafted + drafted
        self._slots = d * self._slots + drafted_rows * max(self.last_k, 1)
        if load is not None:
            load.try_at = load.steps + self._hold(self._n, load.tries)
