"""The i.i.d. speedup bound of speculative decoding (Leviathan et al. 2023, Theorem 3.8).

If every draft position is accepted independently with probability alpha, one iteration
with K drafts emits (1 - alpha^(K+1)) / (1 - alpha) tokens on average and costs K draft
forwards plus one verifier pass over K+1 tokens. In units of one verifier AR step:

    speedup <= (1 - alpha^(K+1)) / ((1 - alpha) (K c + v))

with c = draft time per drafted token / AR step and v = verifier time per iteration /
AR step. All four are measured: alpha = accepted / reached (per position, pooled over
items), K = drafted / iterations (an n-gram drafter may propose fewer than the nominal
K), c and v from the engine's forward-pass timers (prefill included, on both sides).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """The measured inputs of the bound and the bound itself (a speedup factor)."""

    alpha: float
    k: float
    c: float
    v: float
    speedup: float


def iid_speedup_bound(alpha: float, k: float, c: float, v: float) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha)(K c + v)); the gain is K + 1 at alpha = 1."""
    gain = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    cost = k * c + v
    return gain / cost if cost > 0 else float("inf")


def measured_bound(totals: dict, ar_step_s: float) -> Bound:
    """The bound from pooled engine statistics of one configuration.

    ``totals`` sums over items: accepted, reached (sum of reached_by_position), drafted,
    iterations, time_draft_s and time_verify_s; ``ar_step_s`` is the verifier's time per
    AR iteration on the same items.
    """
    iterations = max(1, totals["iterations"])
    alpha = totals["accepted"] / max(1, totals["reached"])
    k = totals["drafted"] / iterations
    c = totals["time_draft_s"] / max(1, totals["drafted"]) / ar_step_s
    v = totals["time_verify_s"] / iterations / ar_step_s
    return Bound(alpha, k, c, v, iid_speedup_bound(alpha, k, c, v))
