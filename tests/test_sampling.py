"""Logit processing and seeded draws."""

from __future__ import annotations

import pytest
import torch
from lawcheck import binomial_violations, histogram, wrong_law

from cactus_spec.core.sampling import (
    SamplingConfig,
    logits_to_probs,
    one_hot,
    sample_inverse_cdf,
    top_k,
    uniforms,
)


def masked_reference(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k by masking to -inf, then nucleus over the full sorted row."""
    scaled = logits / config.temperature
    if config.top_k:
        kth = scaled.topk(config.top_k, -1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -float("inf"))
    probs = torch.softmax(scaled, -1)
    ordered, order = probs.sort(-1, descending=True)
    keep_sorted = (ordered.cumsum(-1) - ordered) < config.top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(0.7, 20, 0.9),
        SamplingConfig(1.0, 0, 0.8),
        SamplingConfig(0.6, 5, 1.0),
        SamplingConfig(1.3, 0, 1.0),
    ],
    ids=repr,
)
def test_processing_matches_masking_reference(config: SamplingConfig) -> None:
    logits = 2 * torch.randn(6, 500, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, config)
    assert torch.allclose(probs, masked_reference(logits, config), atol=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(6))
    if config.top_k:
        assert int((probs > 0).sum(-1).max()) <= config.top_k


def stable_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: a stable descending sort of whole rows, its first k."""
    values, ids = logits.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


@pytest.mark.parametrize(
    "shape", [(40, 151936), (3, 5, 8000), (7, 32768), (1, 32768), (4, 300)], ids=str
)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_top_k_is_the_stable_sorts_first_k(shape: tuple[int, ...], ties: bool) -> None:
    """Every path of ``top_k`` (chunks of a vocabulary that is a multiple of the chunk, one
    padded, one too small to chunk; torch.topk's for few logits, distinct or tied) keeps the
    values and ids a stable sort ranks first, ties (integer logits, -inf included) broken by
    the lower id."""
    logits = 3 * torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
    if ties:
        logits = (2 * logits).round()
    logits[..., ::7] = -float("inf")
    values, ids = top_k(logits, 20)
    reference = stable_top_k(logits, 20)
    assert torch.equal(values, reference[0]) and torch.equal(ids, reference[1])
    assert torch.equal(values, logits.gather(-1, ids))


def test_top_k_breaks_ties_where_torch_topk_may_not() -> None:
    """Negative control: on integer logits torch.topk keeps other ids among ties at the
    k-th value than the lowest, so the equality above can fail."""
    logits = (4 * torch.randn(8, 8192, generator=torch.Generator().manual_seed(3))).round()
    kept = logits.topk(20, -1).indices.sort(dim=-1).values
    assert not torch.equal(kept, stable_top_k(logits, 20)[1].sort(dim=-1).values)
    assert torch.equal(top_k(logits, 20)[1], stable_top_k(logits, 20)[1])


def test_a_row_of_fewer_finite_logits_than_k_keeps_them_first() -> None:
    logits = torch.full((2, 4096), -float("inf"))
    logits[0, 5], logits[1, 4000] = 1.0, 2.0
    values, ids = top_k(logits, 20)
    assert ids[:, 0].tolist() == [5, 4000] and ids[0, 1:4].tolist() == [0, 1, 2]
    assert torch.equal(ids, stable_top_k(logits, 20)[1])


def test_greedy_is_one_hot_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, SamplingConfig(0.0, 20, 0.95))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3))


def test_inverse_cdf_follows_the_law_and_skips_zero_mass() -> None:
    law = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    rows = 100_000
    u = uniforms(rows, 1, torch.Generator().manual_seed(2), torch.device("cpu"))[:, 0]
    draws = sample_inverse_cdf(law.expand(rows, -1), u)
    counts = histogram(draws, 6)
    assert counts[law == 0].sum() == 0
    assert binomial_violations(counts, law) == []
    assert binomial_violations(counts, wrong_law(law)) != []


def test_inverse_cdf_at_the_very_top_takes_the_last_positive_token() -> None:
    law = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    assert int(sample_inverse_cdf(law, torch.tensor([1.0]))) == 1


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_vanishing_top_p_keeps_the_top_token(top_p: float) -> None:
    """Found by schemathesis: top_p = 1e-300 kept nothing (NaN rows, then an index error)."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 5
    for k in (0, 20):
        probs = logits_to_probs(logits, SamplingConfig(0.6, k, top_p))
        assert torch.equal(probs, one_hot(logits.argmax(-1), 500))


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 9e-6])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    """Found by schemathesis: temperature 5e-324 made logits / T infinite and q NaN."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)) * 5
    probs = logits_to_probs(logits, SamplingConfig(temperature, 20, 0.95))
    assert torch.equal(probs, one_hot(logits.argmax(-1), 500))
