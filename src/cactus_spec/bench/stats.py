"""Confidence intervals for accuracy, and the spread of speed ratios.

Accuracy of one configuration: the Wilson score interval of a proportion. The difference
between a method and the verifier alone on the same items: Newcombe's square-and-add
interval for paired proportions (Newcombe 1998, method 10), which, unlike the normal
approximation mean(d) ± 1.96 sd(d)/sqrt(n), stays informative when few items disagree.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: Two-sided 95% normal quantile.
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Interval:
    """An estimate with its lower and upper confidence limits."""

    estimate: float
    low: float
    high: float

    def as_list(self) -> list[float]:
        return [self.estimate, self.low, self.high]


def wilson(successes: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval for a proportion p = s / n:

        centre = (p + z²/2n) / (1 + z²/n)
        half   = z / (1 + z²/n) · sqrt(p (1 - p) / n + z² / 4n²)

    e.g. 8 of 10 gives [0.490, 0.943].
    """
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes} of {n}")
    p = successes / n
    shrink = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / shrink
    half = z / shrink * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


def _correlation(both: int, only_a: int, only_b: int, neither: int) -> float:
    """Newcombe's phi between the two paired outcomes: (AD - BC) / sqrt(marginals), with
    AD - BC shrunk by n/2 towards 0 when positive (0 when it lies in [0, n/2])."""
    n = both + only_a + only_b + neither
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    if margins == 0:
        return 0.0
    cross = both * neither - only_a * only_b
    if cross > n / 2:
        return (cross - n / 2) / math.sqrt(margins)
    return cross / math.sqrt(margins) if cross < 0 else 0.0


def paired_difference(a: Sequence[bool], b: Sequence[bool], z: float = Z95) -> Interval:
    """Interval for p_a - p_b from paired outcomes (item i scored under both A and B).

    Newcombe's square-and-add: with Wilson limits [l_a, u_a], [l_b, u_b] and correlation phi,

        low  = d - sqrt((p_a - l_a)² - 2 phi (p_a - l_a)(u_b - p_b) + (u_b - p_b)²)
        high = d + sqrt((u_a - p_a)² - 2 phi (u_a - p_a)(p_b - l_b) + (p_b - l_b)²)
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need two non-empty outcome lists of one length, got {len(a)}, {len(b)}")
    pairs = list(zip(map(bool, a), map(bool, b), strict=True))
    both = sum(x and y for x, y in pairs)
    only_a = sum(x and not y for x, y in pairs)
    only_b = sum(y and not x for x, y in pairs)
    n = len(pairs)
    neither = n - both - only_a - only_b
    wa, wb = wilson(both + only_a, n, z), wilson(both + only_b, n, z)
    phi = _correlation(both, only_a, only_b, neither)
    down_a, up_a = wa.estimate - wa.low, wa.high - wa.estimate
    down_b, up_b = wb.estimate - wb.low, wb.high - wb.estimate
    d = wa.estimate - wb.estimate
    low = d - math.sqrt(max(0.0, down_a**2 - 2 * phi * down_a * up_b + up_b**2))
    high = d + math.sqrt(max(0.0, up_a**2 - 2 * phi * up_a * down_b + down_b**2))
    return Interval(d, low, high)


def median_spread(values: Sequence[float]) -> Interval:
    """The median of ``values`` with their minimum and maximum."""
    if not values:
        raise ValueError("need at least one value")
    return Interval(statistics.median(values), min(values), max(values))
