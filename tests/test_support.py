"""A row is judged on the tokens its q, p and drafts hold (``stepper._on_support``): every
kind and rule emits the tokens it emits over the whole vocabulary, with the same divergence."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from cactus_spec.core.audit import support
from cactus_spec.core.budget import Budget
from cactus_spec.core.rules import Cactus, Rule, SpS
from cactus_spec.runtime.drafters import Draft
from cactus_spec.runtime.stepper import _on_support
from cactus_spec.runtime.verifications import (
    Block,
    Budgeted,
    Traversal,
    Tree,
    Verification,
)

V, TOP_K, K = 3000, 20, 3
#: (a kind's name, a new kind): each judge gets a fresh one (a budget keeps state).
KINDS = {
    "chain": Verification,
    "block": Block,
    "tree": lambda: Tree(2),
    "traversal": lambda: Traversal(2),
    "budgeted chain": lambda: Budgeted(Budget(0.05), Verification()),
}
#: A tree's nodes: two children of the root, then a child of the first (parents by node).
TREE_PARENTS = (-1, -1, 0)


def _sparse(g: torch.Generator, rows: int, pool: Tensor) -> Tensor:
    """[rows, V] distributions on TOP_K tokens each, drawn from ``pool``, sharply peaked."""
    out = torch.zeros(rows, V)
    for row in out:
        ids = pool[torch.randperm(len(pool), generator=g)[:TOP_K]]
        row[ids] = torch.softmax(3 * torch.randn(TOP_K, generator=g), -1)
    return out


def _row(seed: int, tree: bool) -> tuple[Tensor, Draft]:
    """q [K+1, V] and a draft of K tokens drawn from its rows p [K, V] (a chain, or the tree
    of ``TREE_PARENTS``, its siblings distinct), their supports overlapping."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(V, generator=g)[: 2 * TOP_K]  # scattered over the vocabulary
    q, p = _sparse(g, K + 1, pool), _sparse(g, K, pool)
    if tree:
        p[1] = p[0]
        first, second = torch.multinomial(p[0], 2, generator=g).tolist()
        tokens = [first, second, int(torch.multinomial(p[2], 1, generator=g))]
        return q, Draft(tokens, p, TREE_PARENTS)
    return q, Draft([int(torch.multinomial(row, 1, generator=g)) for row in p], p)


def _judge(kind_name: str, rule: Rule, q: Tensor, draft: Draft, seed: int):
    """The tokens a fresh kind emits for the row (ids as given) and their divergences."""
    kind = KINDS[kind_name]()
    judged = kind.judged_rows(rule, draft, q)
    generator = torch.Generator().manual_seed(seed)
    tokens, path = kind.judge(rule, draft, judged, generator, False)
    divergence = kind.divergence(rule, draft, q, judged, path, len(tokens))
    return tokens, divergence


def _on(columns: Tensor, q: Tensor, draft: Draft) -> tuple[Tensor, Draft]:
    numbered = [int((columns == t).nonzero()) for t in draft.tokens]
    assert draft.probs is not None
    return q[:, columns], Draft(numbered, draft.probs[:, columns], draft.parents)


@pytest.mark.parametrize("kind_name", KINDS)
@pytest.mark.parametrize("rule", [SpS(), Cactus(1.0)], ids=["sps", "cactus"])
def test_a_row_judged_on_its_support_emits_the_whole_vocabularys_tokens(kind_name, rule) -> None:
    tree = kind_name in ("tree", "traversal")
    emitted = set()
    for seed in range(40):
        q, draft = _row(seed, tree)
        columns, q_s, draft_s = _on_support(q, draft)
        assert torch.equal(columns, support(q, draft.probs))  # drafts lie where p is
        assert len(columns) <= 2 * TOP_K < V
        tokens, divergence = _judge(kind_name, rule, q, draft, seed)
        numbered, divergence_s = _judge(kind_name, rule, q_s, draft_s, seed)
        assert columns[numbered].tolist() == tokens
        torch.testing.assert_close(divergence_s, divergence, rtol=1e-6, atol=1e-9)
        emitted.add(len(tokens))
    assert len(emitted) > 1  # some rows kept more drafts than others


def test_the_columns_order_is_what_keeps_the_draws() -> None:
    """Negative control: the same columns in reverse order (the same tokens, masses summed
    in another order) move some inverse-CDF draws, so the equality above can fail."""
    moved = 0
    for seed in range(40):
        q, draft = _row(seed, tree=False)
        columns = support(q, draft.probs).flip(0)
        tokens, _ = _judge("chain", SpS(), q, draft, seed)
        numbered, _ = _judge("chain", SpS(), *_on(columns, q, draft), seed)
        moved += columns[numbered].tolist() != tokens
    assert moved > 0


def test_the_support_holds_every_positive_token_and_the_ids() -> None:
    q = torch.zeros(2, 10, dtype=torch.float64)
    q[0, 3], q[1, 7] = 1.0, 1e-300  # float64's small positives are kept
    p = torch.zeros(1, 10)
    p[0, 5] = 1.0
    assert support(q, p, ids=[9]).tolist() == [3, 5, 7, 9]
    assert support(q, None).tolist() == [3, 7]
