"""Statistical checks shared by the tests: counts against an exact law."""

from __future__ import annotations

import torch
from torch import Tensor


def binomial_violations(counts: Tensor, law: Tensor) -> list[int]:
    """Categories where |count - N law| > 6 sqrt(N law (1 - law)) + 5 (docs/DESIGN.md's bound)."""
    counts, law = counts.double(), law.double()
    n = counts.sum()
    expected = n * law
    bound = 6 * torch.sqrt(n * law * (1 - law)) + 5
    return ((counts - expected).abs() > bound).nonzero().flatten().tolist()


def histogram(tokens: Tensor, size: int) -> Tensor:
    """Counts of each value 0..size-1 in a 1-D integer tensor -> [size]."""
    return torch.bincount(tokens.flatten(), minlength=size)


def wrong_law(law: Tensor) -> Tensor:
    """A deliberately wrong law: 10% of the mass moved onto the least likely token."""
    shifted = 0.9 * law.double()
    shifted[law.argmin()] += 0.1
    return shifted


def random_dist(size: int, generator: torch.Generator, sharpness: float = 1.5) -> Tensor:
    """A random full-support distribution [size] with some peakedness."""
    return torch.softmax(sharpness * torch.randn(size, generator=generator), -1)
