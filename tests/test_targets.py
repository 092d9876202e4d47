"""Kernel targets: the standard speculative-sampling kernel handed ``kernel_target`` emits each
rule's exact law, and the one-hot divergence meter equals the general audit."""

from __future__ import annotations

import pytest
import torch
from lawcheck import random_dist

from cactus_spec.core.audit import (
    kl,
    lump_outside_q,
    one_hot_divergences,
    step_divergences,
    step_law,
)
from cactus_spec.core.rules import TAS, Cactus, Interp, SpS, TopK
from cactus_spec.core.sampling import one_hot
from cactus_spec.core.targets import kernel_target

RULES = [
    SpS(),
    Cactus(0.5),
    Cactus(2.0),
    Cactus(0.5, exact=True),
    Interp(0.3),
    TopK(3),
    TAS(),
    TAS(epsilon=0.5, alpha=1.0),
]


def standard_kernel_law(targets: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Exact law of the standard kernel: row n of ``targets`` [S, S] is the target handed to the
    kernel when n is drafted; accept min(1, t_n/p_n), else draw normalize(max(0, t - p))."""
    targets, p = targets.double(), p.double()
    law = torch.zeros_like(p)
    for n in range(p.shape[0]):
        if p[n] == 0:
            continue
        t = targets[n]
        accept = min(1.0, float(t[n] / p[n]))
        excess = (t - p).clamp(min=0.0)
        law[n] += p[n] * accept
        if accept < 1:
            law += p[n] * (1 - accept) * excess / excess.sum()
    return law


def targets_for_every_draft(rule, q: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    size = q.shape[-1]
    ids = torch.arange(size)
    p_rows = None if p is None else p.expand(size, size)
    return kernel_target(rule, q.expand(size, size), ids, p_rows)  # [S(n), S]


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_standard_kernel_with_the_target_emits_the_rules_law(rule) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        size = int(torch.randint(2, 12, (1,), generator=gen))
        p, q = random_dist(size, gen), random_dist(size, gen, sharpness=3.0)
        law = standard_kernel_law(targets_for_every_draft(rule, q, p), p)
        torch.testing.assert_close(law, step_law(p, q, rule), atol=1e-6, rtol=0)


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_one_hot_drafts_emit_the_rules_law(rule) -> None:
    gen = torch.Generator().manual_seed(8)
    size = 9
    q = random_dist(size, gen, sharpness=3.0)
    for n in range(size):
        p = one_hot(torch.tensor(n), size).float()
        target = kernel_target(rule, q, torch.tensor(n), None)
        law = standard_kernel_law(target.expand(size, size), p)
        torch.testing.assert_close(law, step_law(p, q, rule), atol=1e-6, rtol=0)


def test_generalised_rules_hand_the_kernel_their_own_h() -> None:
    gen = torch.Generator().manual_seed(9)
    q = torch.softmax(3 * torch.randn(6, 50, generator=gen), -1)
    p = torch.softmax(torch.randn(6, 50, generator=gen), -1)
    ids = torch.multinomial(p, 1, generator=gen).squeeze(-1)
    for rule in (SpS(), Cactus(1.0), Interp(0.5), TopK(4)):
        assert torch.equal(kernel_target(rule, q, ids, p), rule.h(q, ids, p))


def test_q_as_target_is_not_cactus() -> None:
    """Negative control: handing the kernel q (vLLM's own target) gives SpS's law, not Cactus's."""
    gen = torch.Generator().manual_seed(10)
    p, q = random_dist(8, gen), random_dist(8, gen, sharpness=3.0)
    law = standard_kernel_law(q.expand(8, 8), p)
    assert float((law - step_law(p, q, Cactus(1.0))).abs().max()) > 1e-2
    torch.testing.assert_close(law, step_law(p, q, SpS()), atol=1e-6, rtol=0)


@pytest.mark.parametrize("sparse", [False, True], ids=["full q", "top-5 q"])
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_one_hot_meter_equals_the_exact_law_over_the_whole_vocabulary(rule, sparse) -> None:
    gen = torch.Generator().manual_seed(11)
    logits = 3 * torch.randn(5, 30, generator=gen)
    if sparse:  # the meter cuts the rows to supp(q) and the drafts
        logits = logits.masked_fill(logits < logits.topk(5).values[:, -1:], float("-inf"))
    q = torch.softmax(logits, -1)
    ids = torch.randint(0, 30, (5,), generator=gen)
    p = one_hot(ids, 30).float()
    whole = kl(step_law(p, q, rule), q)  # [5], no restriction anywhere
    torch.testing.assert_close(one_hot_divergences(q, ids, rule), whole, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_lumping_the_drafts_mass_outside_q_keeps_the_divergence_exact(rule) -> None:
    """A full-support draft against a top-k verifier: the lumped audit equals the full one."""
    gen = torch.Generator().manual_seed(12)
    p = torch.softmax(torch.randn(3, 40, generator=gen), -1)  # full support
    logits = 3 * torch.randn(3, 40, generator=gen)
    q = torch.softmax(logits.masked_fill(logits < logits.topk(5).values[:, -1:], -1e9), -1)
    q = torch.where(q < 1e-30, torch.zeros_like(q), q)  # top-5 support per row
    full = kl(step_law(p, q, rule), q)
    p_l, q_l = lump_outside_q(p, q)
    assert p_l.shape[-1] < 16
    torch.testing.assert_close(kl(step_law(p_l, q_l, rule), q_l), full, atol=1e-7, rtol=1e-6)


def test_a_wide_draft_is_measured_through_the_lump(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(13)
    p = torch.softmax(torch.randn(2, 64, generator=gen) + 4 * (torch.arange(64) < 6), -1)
    q = torch.zeros(2, 64)
    q[:, :4] = torch.softmax(torch.randn(2, 4, generator=gen), -1)
    expected = kl(step_law(p, q, Cactus(0.5)), q)
    monkeypatch.setattr("cactus_spec.core.audit.MAX_AUDIT_SUPPORT", 16)  # p alone is too wide
    assert float(expected.max()) > 1e-3
    torch.testing.assert_close(step_divergences(p, q, Cactus(0.5)), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_each_position_is_audited_on_its_own_support(rule, monkeypatch) -> None:
    """A batch of top-4 rows whose supports together pass the audit's limit is measured
    exactly (each row on its own support); a row whose own support passes it is "not
    measured" (NaN) while the others still are. Control: the whole-vocabulary audit."""
    gen = torch.Generator().manual_seed(15)
    p = torch.softmax(2 * torch.randn(6, 48, generator=gen), -1)  # full support
    logits = torch.randn(6, 48, generator=gen)
    q = torch.softmax(logits.masked_fill(logits < logits.topk(4).values[:, -1:], -1e9), -1)
    q = torch.where(q < 1e-30, torch.zeros_like(q), q)
    q[5] = torch.softmax(torch.randn(48, generator=gen), -1)  # a row without top-k
    whole = kl(step_law(p, q, rule), q)  # [6]
    monkeypatch.setattr("cactus_spec.core.audit.MAX_AUDIT_SUPPORT", 12)  # 5 rows x 4 > 12
    measured = step_divergences(p, q, rule)
    torch.testing.assert_close(measured[:5], whole[:5], atol=1e-6, rtol=1e-5)
    assert float(whole[:5].max()) > 1e-3 or rule.lossless
    assert bool(measured[5].isnan())


def test_a_lossless_rows_divergence_is_never_negative() -> None:
    """Rounding made KL(q || q) -1e-9 here once, which a Prometheus counter refuses."""
    gen = torch.Generator().manual_seed(14)
    logits = 4 * torch.randn(256, 500, generator=gen)
    q = torch.softmax(logits.masked_fill(logits < logits.topk(20).values[:, -1:], -1e9), -1)
    ids = q.argmax(-1)
    assert bool((one_hot_divergences(q, ids, Cactus(0.0)) >= 0).all())
    assert bool((kl(q, q) == 0).all())
