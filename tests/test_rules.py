"""Rules and their exact laws: SpS is lossless, Cactus is bounded, the worked example."""

from __future__ import annotations

import math

import pytest
import torch
from lawcheck import random_dist

from cactus_spec.core.audit import (
    MAX_AUDIT_SUPPORT,
    acceptance_prob,
    kl,
    restrict_to_support,
    step_divergences,
    step_law,
)
from cactus_spec.core.rules import TAS, Cactus, Interp, SpS, TopK, binary_kl

ALL_RULES = [SpS(), Cactus(0.5), Cactus(0.5, exact=True), TAS(), Interp(0.3), TopK(2)]


def sps_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    cases = [(f"random{i}", random_dist(7, g), random_dist(7, g)) for i in range(5)]
    q = random_dist(7, g)
    cases.append(("p_equals_q", q.clone(), q))
    cases.append(
        ("disjoint", torch.tensor([0.5, 0.5, 0, 0, 0]), torch.tensor([0, 0, 0.2, 0.3, 0.5]))
    )
    cases.append(
        ("one_hot_p", torch.tensor([0, 0, 1.0, 0, 0]), torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2]))
    )
    return cases


@pytest.mark.parametrize(("name", "p", "q"), sps_cases())
def test_sps_step_law_is_q(name: str, p: torch.Tensor, q: torch.Tensor) -> None:
    assert torch.allclose(step_law(p, q, SpS()), q.double(), atol=1e-6), name


@pytest.mark.parametrize("rule", ALL_RULES, ids=repr)
def test_every_step_law_is_a_distribution(rule) -> None:
    g = torch.Generator().manual_seed(1)
    p, q = random_dist(9, g), random_dist(9, g)
    law = step_law(p, q, rule)
    assert float(law.min()) >= 0
    assert math.isclose(float(law.sum()), 1.0, abs_tol=1e-6)


def test_worked_example() -> None:
    """q = (.30, .35, .35), p = (.05, .80, .15), the middle token drafted."""
    q, p, n = torch.tensor([0.30, 0.35, 0.35]), torch.tensor([0.05, 0.80, 0.15]), torch.tensor(1)
    assert SpS().accept_prob(q, n, p).item() == pytest.approx(0.4375, abs=1e-6)
    delta = 0.31**2 / (2 * 0.35 * 0.65)  # makes h_n = .35 + .31 = .66
    rule = Cactus(delta)
    h = rule.h(q, n, p)
    assert h.tolist() == pytest.approx([0.30 * 0.34 / 0.65, 0.66, 0.35 * 0.34 / 0.65], abs=1e-6)
    assert h.tolist() == pytest.approx([0.157, 0.66, 0.183], abs=1e-3)
    assert rule.accept_prob(q, n, p).item() == pytest.approx(0.825, abs=1e-6)
    assert kl(h, q).item() == pytest.approx(0.198, abs=5e-4)


def test_cactus_acceptance_monotone_in_delta_and_above_sps() -> None:
    g = torch.Generator().manual_seed(2)
    deltas = [0.0, 0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 8.0]
    for _ in range(50):
        p, q = random_dist(12, g, 2.5), random_dist(12, g, 2.5)
        sps = acceptance_prob(p, q, SpS()).item()
        for exact in (False, True):
            rates = [acceptance_prob(p, q, Cactus(d, exact)).item() for d in deltas]
            assert rates[0] == pytest.approx(sps, abs=1e-7)
            assert all(b >= a - 1e-7 for a, b in zip(rates, rates[1:], strict=False)), rates
            assert min(rates) >= sps - 1e-7


def test_cactus_exact_keeps_kl_within_delta_for_every_draft() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(3 * torch.randn(200, 16, generator=g), -1)  # [R, V], many q_n > 0.5
    ids = torch.arange(16).expand(200, 16)  # every token drafted
    rows = q.unsqueeze(1).expand(200, 16, 16)  # [R, n, V]
    for delta in (0.001, 0.05, 0.3, 1.0, 3.0):
        rule = Cactus(delta, exact=True)
        h_n = rule.h_at_draft(rows, ids, None).double()  # [R, n], rounded down: exact bound
        assert float(binary_kl(h_n, q.double()).max()) <= delta, delta
        # The whole row: KL(h || q) equals the binary KL up to float32 rounding of h.
        divergence = kl(rule.h(rows, ids, None), rows)  # [R, n]
        assert float(divergence.max()) <= delta + 1e-6, delta


def test_cactus_taylor_form_can_exceed_delta_when_h_n_above_half() -> None:
    """The closed form is a second-order expansion: for large q_n it overshoots delta."""
    q_n = torch.linspace(0.01, 0.99, 99)
    delta = 0.01
    rule = Cactus(delta)
    q = torch.stack([q_n, 1 - q_n], -1)  # [99, 2]
    h_n = rule.h_at_draft(q, torch.zeros(99, dtype=torch.long), None)
    divergence = binary_kl(h_n.double(), q_n.double())
    over = divergence > delta
    assert bool(over.any())
    assert bool((h_n[over] > 0.5).all())
    exact = Cactus(delta, exact=True).h_at_draft(q, torch.zeros(99, dtype=torch.long), None)
    assert float(binary_kl(exact.double(), q_n.double()).max()) <= delta * (1 + 1e-6)


def test_cactus_delta_zero_h_is_q_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(30, 50, generator=g), -1)
    ids = torch.randint(0, 50, (30,), generator=g)
    for exact in (False, True):
        assert torch.equal(Cactus(0.0, exact).h(q, ids, None), q)


def test_tas_high_entropy_accepts_everything() -> None:
    q = torch.full((1000,), 1e-3)  # alpha exp(-H) = 0.3 / 1000 < q_n
    ids = torch.arange(1000)
    accept = TAS().accept_prob(q.expand(1000, 1000), ids, None)
    assert bool((accept == 1).all())


def test_tas_one_hot_target_rejects_other_drafts_and_emits_argmax() -> None:
    q = torch.zeros(10)
    q[7] = 1.0
    ids = torch.tensor([0, 3, 7])
    accept = TAS().accept_prob(q.expand(3, 10), ids, None)
    assert accept.tolist() == [0.0, 0.0, 1.0]
    residual = TAS().residual(q.expand(3, 10), ids, None)
    assert residual.argmax(-1).tolist() == [7, 7, 7]
    assert bool((residual.max(-1).values == 1).all())


def test_topk_accepts_exactly_the_top_k() -> None:
    q = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    ids = torch.arange(5)
    accept = TopK(2).accept_prob(q.expand(5, 5), ids, None)
    assert accept.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: Cactus(-0.1), "delta"),
        (lambda: Cactus(float("nan")), "delta"),
        (lambda: Cactus(float("inf")), "delta"),
        (lambda: TAS(epsilon=1.5), "epsilon"),
        (lambda: TAS(alpha=-0.1), "alpha"),
        (lambda: Interp(1.1), "alpha"),
        (lambda: Interp(float("nan")), "alpha"),
        (lambda: TopK(0), "k"),
        (lambda: TopK(2.5), "k"),
    ],
)
def test_bad_parameters_raise_naming_the_parameter(factory, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^{message} must"):
        factory()


def test_residual_when_nothing_is_left_over_falls_back_to_h() -> None:
    """With p = q there is no excess mass (rejection has probability 0): the residual is q."""
    g = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(4, 9, generator=g), -1)
    ids = torch.tensor([0, 3, 5, 8])
    assert torch.allclose(SpS().residual(q, ids, q), q)
    one_hot_top = torch.nn.functional.one_hot(q.argmax(-1), 9).float()
    expected = one_hot_top  # TopK(1): h = 1[argmax q], nothing left over once p covers it
    assert torch.equal(TopK(1).residual(q, q.argmax(-1), one_hot_top), expected)


def test_block_audit_equals_position_by_position() -> None:
    """A shared (union) support changes nothing: tokens outside a position's own support
    carry no mass in p, q or the law (up to float32 rounding of the rules)."""
    g = torch.Generator().manual_seed(6)
    vocab, rows = 60, 5
    p = torch.zeros(rows, vocab)
    q = torch.zeros(rows, vocab)
    for i in range(rows):  # each position has its own sparse support
        p[i, torch.randperm(vocab, generator=g)[:6]] = random_dist(6, g)
        q[i, torch.randperm(vocab, generator=g)[:6]] = random_dist(6, g)
    for rule in (Cactus(0.7), Cactus(0.7, exact=True), TAS(), Interp(0.2), TopK(2)):
        together = step_divergences(p, q, rule)
        for i in range(rows):
            p_i, q_i = restrict_to_support(p[i], q[i])
            alone = kl(step_law(p_i, q_i, rule), q_i)
            assert together[i].item() == pytest.approx(alone.item(), rel=1e-4, abs=1e-6)


def test_block_audit_refuses_a_whole_vocabulary() -> None:
    q = torch.full((2, MAX_AUDIT_SUPPORT + 1), 1.0 / (MAX_AUDIT_SUPPORT + 1))
    assert torch.isnan(step_divergences(q, q, Cactus(1.0))).all()
