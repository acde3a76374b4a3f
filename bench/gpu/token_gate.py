"""The like-with-like token check: do two engine configurations compute the same model?

Exact greedy tokens are the wrong test between configurations that round differently: the torch reference
(fp32 attention) against Triton (bf16 probabilities), or a CUDA graph's bucket of 8 rows against 6 eager
rows (another GEMM tiling). Over a 128k vocabulary two candidates are sometimes within rounding of each
other, and once one greedy choice flips, the sequences part and every later token differs with nothing
wrong. A bug (stale inputs, a wrong slot, a missed position) moves log-probs by whole nats instead.

So each sequence is walked from its first token while both configurations chose the same token, and at
every such position the log-probs of the tokens both report (the chosen one and the shared part of each
top-k) must agree within `logprob_tol`. Where the choices first differ, the split must be a near tie in
both configurations' eyes (each one's log-prob of the other's choice within `tie_tol` of its own choice);
the rest of that sequence is not comparable and is not compared. A split that is not a tie fails, and so
does a run in which too few positions could be compared to mean anything (`min_compared`).

Pure and stdlib-only: the GPU machine runs it, and tests/bench/gpu/test_gpu_first_run.py checks it on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# One generated token: (chosen id, its log-prob, [(id, log-prob) of the top alternatives, best first]).
Step = tuple[int, float, Sequence[tuple[int, float]]]


@dataclass
class GateResult:
    ok: bool
    positions: int  # generated positions in the reference
    compared: int  # positions where both chose the same token and log-probs were compared
    max_abs_logprob_diff: float
    ties: list[str] = field(default_factory=list)  # splits explained by a near tie
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "positions": self.positions,
            "compared": self.compared,
            "max_abs_logprob_diff": self.max_abs_logprob_diff,
            "ties": self.ties,
            "failures": self.failures,
        }


def _lookup(step: Step, token: int) -> float | None:
    chosen, lp, top = step
    if token == chosen:
        return lp
    return next((v for t, v in top if t == token), None)


def compare(
    reference: Sequence[Sequence[Step]],
    other: Sequence[Sequence[Step]],
    *,
    logprob_tol: float,
    tie_tol: float,
    min_compared: float = 0.5,
) -> GateResult:
    """Compare `other` with `reference`, sequence by sequence (same prompts, same order)."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference sequences against {len(other)}")
    positions = compared = 0
    worst = 0.0
    ties: list[str] = []
    failures: list[str] = []
    for s, (ref, oth) in enumerate(zip(reference, other)):
        positions += len(ref)
        if len(ref) != len(oth):
            failures.append(f"sequence {s}: {len(ref)} tokens against {len(oth)}")
        for i, (a, b) in enumerate(zip(ref, oth)):
            if a[0] == b[0]:
                compared += 1
                for token, lp_a in [(a[0], a[1]), *a[2]]:
                    lp_b = _lookup(b, token)
                    if lp_b is None:
                        continue
                    diff = abs(lp_a - lp_b)
                    worst = max(worst, diff)
                    if diff > logprob_tol:
                        failures.append(
                            f"sequence {s} position {i}: token {token} log-prob {lp_a:.4f} against "
                            f"{lp_b:.4f} (|diff| {diff:.4f} > {logprob_tol})"
                        )
                        break
                continue
            # The first split: a near tie in both configurations, or a failure.
            a_of_b, b_of_a = _lookup(a, b[0]), _lookup(b, a[0])
            gaps = [
                None if a_of_b is None else a[1] - a_of_b,
                None if b_of_a is None else b[1] - b_of_a,
            ]
            if all(g is not None and g <= tie_tol for g in gaps):
                ties.append(f"sequence {s} position {i}: {a[0]} vs {b[0]}, gaps {gaps[0]:.4f}/{gaps[1]:.4f}")
            else:
                shown = ["not in top-k" if g is None else f"{g:.4f}" for g in gaps]
                failures.append(
                    f"sequence {s} position {i}: chose {a[0]} against {b[0]}, not a near tie "
                    f"(gaps {shown[0]} / {shown[1]}, tie tolerance {tie_tol})"
                )
            break
    if positions and compared < min_compared * positions:
        failures.append(
            f"only {compared} of {positions} positions comparable (at least {min_compared:.0%} needed)"
        )
    return GateResult(not failures, positions, compared, worst, ties, failures)
