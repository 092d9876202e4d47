"""The per-answer KL budget (core.budget, ``kl_budget``): the exact law of whole two-token
answers stays within B of the verifier's on chains, blocks and trees and with either
allocation, budget 0 is SpS (in the engine token for token), and no answer spends more
than B."""

from __future__ import annotations

import math

import pytest
import torch

from cactus_spec.core.audit import kl, step_law
from cactus_spec.core.budget import ALLOCATIONS, Budget, Support, check_budget, pinsker_bound
from cactus_spec.core.rules import Cactus
from cactus_spec.core.sampling import SamplingConfig, one_hot
from cactus_spec.core.spec import DecodeSpec, parse_spec
from cactus_spec.core.tree_verification import TokenTree
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request

V = 5


def tables(seed: int):
    """p1, q1 [V]; p2, q2 [V, V] (row x1): a draft and a verifier over two tokens."""
    gen = torch.Generator().manual_seed(seed)

    def dist(*shape: int, sharpness: float) -> torch.Tensor:
        return torch.softmax(sharpness * torch.randn(*shape, V, generator=gen), -1)

    return dist(sharpness=1.0), dist(sharpness=2.0), dist(V, sharpness=1.0), dist(V, sharpness=2.0)


def answer_law(p1, q1, p2, q2, delta_of) -> torch.Tensor:
    """The exact law of the two-token answer [V, V] when position 1 uses delta_of(None) and
    position 2, after x1, delta_of(x1) (probabilistic drafts: the step laws)."""
    first = step_law(p1, q1, Cactus(delta_of(None)))  # [V]
    second = torch.stack([step_law(p2[x], q2[x], Cactus(delta_of(x))) for x in range(V)])
    return first[:, None] * second  # [V, V]


def chain_plan(budget: Budget, q, ids, p, block: bool = False):
    """``budget``'s plan for a chain drafting ``ids`` [K] at q's rows [K, V] (p [K, V] or
    None), with a bonus row (q's last) after them."""
    rows = torch.cat([q, q[-1:]])  # [K+1, V]
    return budget.plan(TokenTree.chain(ids.tolist()), rows, p, block)


def budgeted(p1, q1, p2, q2, total: float):
    """delta_of for a Budget of ``total``: position 1 planned with all of it, position 2 with
    what position 1's law cost (the same whether the chain went on or started again)."""
    budget = Budget(total)
    any_draft = torch.tensor([0])
    first = chain_plan(budget, q1[None], any_draft, p1[None])
    budget.charge(first, [0], 1)

    def delta_of(x):
        if x is None:
            return first.deltas[0]
        after = Budget(total, spent=budget.spent)
        return chain_plan(after, q2[x][None], any_draft, p2[x][None]).deltas[0]

    return delta_of


@pytest.mark.parametrize("total", [0.02, 0.1, 0.5])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_whole_answers_kl_stays_within_the_budget(total, seed) -> None:
    """Negative control: the same budget as a per-position delta passes it."""
    p1, q1, p2, q2 = tables(seed)
    verifier = (q1[:, None] * q2).double()  # [V, V]
    law = answer_law(p1, q1, p2, q2, budgeted(p1, q1, p2, q2, total))
    assert float(kl(law.flatten(), verifier.flatten())) <= total * (1 + 1e-6)
    per_position = answer_law(p1, q1, p2, q2, lambda x: total)
    assert float(kl(per_position.flatten(), verifier.flatten())) > total


def test_the_budget_is_spent_where_it_is_left() -> None:
    """Position 1 spends, position 2 gets what is left: a budget above one position's need
    leaves some for the next, and one at 0 leaves nothing."""
    p1, q1, p2, q2 = tables(4)
    budget = Budget(0.05)
    q, p = torch.stack([q1, q2[0]]), torch.stack([p1, p2[0]])
    plan = chain_plan(budget, q, torch.tensor([0, 1]), p)
    assert plan.costs[0] > 0 and sum(plan.costs) <= 0.05 * (1 + 1e-9)
    assert plan.deltas[1] <= 0.05 - plan.costs[0] + 1e-12


def test_budget_zero_is_sps_row_for_row() -> None:
    p1, q1, p2, q2 = tables(5)
    q = torch.stack([q1, q2[2]])  # [2, V]
    plan = chain_plan(Budget(0.0), q, torch.tensor([3, 1]), torch.stack([p1, p2[2]]))
    assert plan.deltas == [0.0] * 3 and plan.costs == [0.0] * 3
    assert torch.equal(plan.targets[:2], q)
    lossy = chain_plan(Budget(0.5), q, torch.tensor([3, 1]), torch.stack([p1, p2[2]]))
    assert not torch.equal(lossy.targets[:2], q)  # the check can fail


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("exact", [False, True])
def test_no_path_spends_more_than_the_budget(exact: bool, allocation: str) -> None:
    """Long random answers of one-hot and probabilistic chains (top-8 verifiers), each
    chain keeping a random number of its drafts: what is charged never passes B."""
    gen = torch.Generator().manual_seed(6)
    for total in (0.01, 0.3, 2.0):
        budget = Budget(total, cap=0.5, exact=exact, allocation=allocation, length=200)
        for step in range(40):
            k = 4
            logits = 2 * torch.randn(k, 30, generator=gen)
            q = torch.softmax(logits.masked_fill(logits < logits.topk(8).values[:, -1:], -1e9), -1)
            q = torch.where(q < 1e-30, torch.zeros_like(q), q)
            ids = torch.multinomial(q, 1, generator=gen).squeeze(-1)
            p = None if step % 2 else torch.softmax(torch.randn(k, 30, generator=gen), -1)
            plan = chain_plan(budget, q, ids, p)
            assert all(d <= 0.5 for d in plan.deltas)
            kept = int(torch.randint(0, k + 1, (1,), generator=gen))
            budget.charge(plan, list(range(kept + 1)), kept + 1)
            assert budget.spent <= total * (1 + 1e-9)
        assert budget.spent > 0.25 * total  # it does spend (paced: about its share so far)


def test_one_hot_drafts_are_charged_their_own_law() -> None:
    """A deterministic draft n: the position's law is a(n) e_n + (1 - a(n)) r_n, whose KL is
    the charge (not the step law over a probabilistic p)."""
    _, q1, _, _ = tables(7)
    n = torch.tensor([int(q1.argsort()[1])])
    plan = chain_plan(Budget(0.2), q1[None], n, None)
    law = step_law(one_hot(n, V).double(), q1[None], Cactus(plan.deltas[0]))[0]
    assert plan.costs[0] == pytest.approx(float(kl(law, q1)), rel=1e-6)
    assert 0 < plan.costs[0] <= 0.2


def tree_law(p1, q1, p2, q2, total: float, allocation: str, per_position: float | None = None):
    """The exact law [V, V] of a two-token answer of a budgeted tree (blocks and trees emit
    each row's target): the root row emits t_root; after x1 the row is x1's node's when x1 was
    drafted with children, else the next iteration's root, planned with what x1 left. Both
    plans are built and must agree (so the law does not depend on the draws). ``per_position``:
    Cactus's block target at that delta everywhere instead (the negative control)."""
    if per_position is not None:
        rule = Cactus(per_position)
        first = rule.block_target(q1[None], torch.tensor([0]), p1[None])[0]
        second = torch.stack(
            [rule.block_target(q2[x][None], torch.tensor([0]), p2[x][None])[0] for x in range(V)]
        )
        return first.double()[:, None] * second.double()
    rows = []
    for x1 in range(V):
        tree = TokenTree((x1, (x1 + 1) % V, 0), (-1, -1, 0))  # x1 (with a child) and a sibling
        q = torch.stack([q1, q2[x1], q2[(x1 + 1) % V], q2[0]])  # [N+1, V]
        p = torch.stack([p1, p1, p2[x1]])  # [N, V]: each node's draft row
        budget = Budget(total, cap=1.0, allocation=allocation, length=8)
        plan = budget.plan(tree, q, p, block=True)
        budget.charge(plan, [0], 1)  # x1 emitted at the root row
        again = budget.plan(TokenTree.chain([0]), q2[x1][None].expand(2, V), p2[x1][None], True)
        assert torch.allclose(plan.targets[1], again.targets[0])  # in the tree = after it
        rows.append((plan.targets[0], plan.targets[1]))
    first = rows[0][0].double()  # the root's row is planned alike in every tree
    return first[:, None] * torch.stack([second.double() for _, second in rows])


@pytest.mark.parametrize("allocation", ["greedy", "paced"])  # a row's delta from what is left
@pytest.mark.parametrize("total", [0.02, 0.3])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_trees_answer_stays_within_the_budget(allocation, total, seed) -> None:
    p1, q1, p2, q2 = tables(seed)
    verifier = (q1[:, None] * q2).double()  # [V, V]
    law = tree_law(p1, q1, p2, q2, total, allocation)
    assert float(kl(law.flatten(), verifier.flatten())) <= total * (1 + 1e-6)
    assert float(kl(law.flatten(), verifier.flatten())) > 0  # it spends
    control = tree_law(p1, q1, p2, q2, total, allocation, per_position=total)
    assert float(kl(control.flatten(), verifier.flatten())) > total


def test_marginal_funds_the_worthiest_rows() -> None:
    """Marginal: a row worth less than the rows that would spend what is left at the rate they
    come is judged as SpS; with room for every row seen, it is funded."""
    p1, q1, _, _ = tables(9)
    budget = Budget(0.05, allocation="marginal", length=100)
    row = Support.of(q1, torch.tensor(int(p1.argmax())), p1)
    delta = budget._first_delta(0.05)  # what the row is weighed at
    worth = budget._gain(row, delta, False) / budget._law(row, delta, False)[1]
    assert worth > 0
    # 100 tokens at the rate seen: the worthier half alone would spend 0.5 nats, above 0.05
    budget.seen = [(worth / 2, 0.01)] * 5 + [(worth * 2, 0.01)] * 5
    assert budget._allowance(0.05, 0, row, False) == 0.0
    budget.seen = [(worth / 2, 0.0001)] * 10  # every row fits: funded
    assert budget._allowance(0.05, 0, row, False) == 0.05


def test_paced_rows_get_a_share_of_what_is_left() -> None:
    """Paced: a row may cost what is left over the tokens still to come; greedy: all of it."""
    p1, q1, _, _ = tables(8)
    n = torch.tensor([0])
    greedy = chain_plan(Budget(0.05), q1[None], n, p1[None])
    paced = chain_plan(Budget(0.05, allocation="paced", length=100), q1[None], n, p1[None])
    assert paced.costs[0] <= 0.05 / 100 < greedy.costs[0]
    unknown = chain_plan(Budget(0.05, allocation="paced"), q1[None], n, p1[None])  # no length
    assert unknown.costs == greedy.costs


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "0.5", True, None])
def test_a_bad_budget_names_the_field(bad) -> None:
    with pytest.raises(ValueError, match="kl_budget must be a finite number >= 0"):
        check_budget(bad)
    with pytest.raises(ValueError, match="kl_budget must be"):
        Budget(bad)


def test_the_pinsker_bound() -> None:
    assert pinsker_bound(0.02) == pytest.approx(0.1)
    assert pinsker_bound(0.08) == pytest.approx(0.2)
    assert math.isclose(pinsker_bound(0.0), 0.0)


# The engine: SmolLM2-135M as verifier, n-gram drafts (one-hot, and unlike the model itself as
# a draft, p != q), seeded, temperature 1 with top-k 20.
SAMPLING = SamplingConfig(temperature=1.0, top_k=20)
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


@pytest.fixture(scope="module")
def engine():
    from cactus_spec.loading.fetch import fetch
    from cactus_spec.loading.models import load_model

    smollm = load_model(fetch("smollm2-135m"), dtype="float32")
    spec = DecodeSpec.of("sps", drafter="ngram", num_draft_tokens=4)
    return SpeculativeDecoder(smollm, None, spec, backend="lean")


def decode(engine, spec: DecodeSpec, seed: int, tokens: int = 48):
    ids = engine.encode(PROMPT)
    spec = parse_spec({"drafter": "ngram", "num_draft_tokens": 4}, base=spec)
    prompt = Request(prompt_ids=ids, max_new_tokens=tokens, seed=seed, spec=spec)
    return engine.decode_many([prompt], SAMPLING)[0]


@pytest.mark.slow
@pytest.mark.parametrize("verification", ["chain", "block"])
def test_budget_zero_is_sps_token_for_token(engine, verification) -> None:
    for seed in (1, 2):
        sps = decode(engine, DecodeSpec.of("sps", verification=verification), seed)
        zero = DecodeSpec.of("cactus", kl_budget=0, verification=verification)
        result = decode(engine, zero, seed)
        assert result.token_ids == sps.token_ids and result.stats.kl_nats == 0
    spent = DecodeSpec.of("cactus", kl_budget=2.0, verification=verification)
    assert decode(engine, spent, 2).token_ids != sps.token_ids  # the check can fail


@pytest.mark.slow
@pytest.mark.parametrize("verification", ["chain", "block"])
def test_an_answer_never_spends_more_than_its_budget(engine, verification) -> None:
    """Negative control: per-position Cactus at the same delta spends more over the answers."""
    total = 0.05
    budgeted = DecodeSpec.of("cactus", kl_budget=total, verification=verification)
    stats = [decode(engine, budgeted, seed).stats for seed in range(3)]
    spent = [s.kl_nats for s in stats]
    assert all(0 < s <= total * (1 + 1e-9) for s in spent), spent
    reported = stats[0].as_dict()
    assert reported["kl_budget"] == total and reported["tv_bound"] == pytest.approx(0.158113883)
    plain = DecodeSpec.of("cactus", verification=verification)
    assert max(decode(engine, plain, seed).stats.kl_nats for seed in range(3)) > total


@pytest.mark.parametrize("verification", ["tree", "traversal"])
def test_a_budgeted_tree_is_sps_at_zero_and_never_spends_more(verification) -> None:
    """Tiny models (a noisy copy drafts trees of depth 3, two nodes a depth), temperature 1:
    budget 0 is SpS token for token, a budget is never overspent; negative control: per-position
    Cactus spends more."""
    from conftest import make_tiny_lm
    from test_engine import PROMPT as TINY_PROMPT
    from test_engine import noisy_copy

    target = make_tiny_lm()
    draft = noisy_copy(target, 0.6, seed=1)
    shape = {"num_draft_tokens": 3, "verification": verification, "branches": 2}

    def run(method: str, seed: int, **values):
        spec = DecodeSpec.of(method, **shape, **values)
        decoder = SpeculativeDecoder(target, draft, spec)  # fresh: no reused prefix's rounding
        return decoder.generate(TINY_PROMPT, 40, 1.0, top_k=0, top_p=1.0, seed=seed)

    for seed in (1, 2):
        sps = run("sps", seed)
        assert run("cactus", seed, kl_budget=0).token_ids == sps.token_ids
    total = 0.05
    for allocation in ALLOCATIONS:
        spent = [run("cactus", s, kl_budget=total, allocation=allocation).stats for s in range(3)]
        assert all(0 < s.kl_nats <= total * (1 + 1e-9) for s in spent), spent
    assert max(run("cactus", seed).stats.kl_nats for seed in range(3)) > total
