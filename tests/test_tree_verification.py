"""Draft trees: the verifier's exact law over two positions for SpS, the rule's target for
Cactus (with the negative control), sampling without replacement, and greedy walks."""

from __future__ import annotations

import pytest
import torch
from lawcheck import binomial_violations, random_dist
from torch import Tensor

from cactus_spec.core.kl_target import kl_target
from cactus_spec.core.rules import Cactus, Rule, SpS
from cactus_spec.core.sampling import sample_inverse_cdf
from cactus_spec.core.tree_verification import (
    ROOT,
    TokenTree,
    judged_rows,
    sample_distinct,
    verify_tree,
)

V, N = 4, 10_000


def _tables(seed: int) -> tuple[list[Tensor], list[Tensor]]:
    """Context-dependent p[j] [V]*j + [V] (j = 0, 1) and q[j] (j = 0, 1, 2)."""
    g = torch.Generator().manual_seed(seed)

    def table(j: int) -> Tensor:
        return torch.stack([random_dist(V, g) for _ in range(V**j)]).reshape(*([V] * j), V)

    return [table(0), table(1)], [table(0), table(1), table(2)]


def _tree(p: list[Tensor], widths: tuple[int, int], g: torch.Generator):
    """A depth-2 tree: ``widths[0]`` distinct children of the root, ``widths[1]`` of each;
    returns the tree and each node's prefix of tokens."""
    tokens, parents, prefixes = [], [], []
    for x in sample_distinct(p[0], widths[0], g, greedy=False):
        tokens.append(x), parents.append(ROOT), prefixes.append((x,))
        at = len(tokens) - 1
        for y in sample_distinct(p[1][x], widths[1], g, greedy=False):
            tokens.append(y), parents.append(at), prefixes.append((x, y))
    return TokenTree(tuple(tokens), tuple(parents)), prefixes


def _rows(tables: list[Tensor], prefixes: list[tuple[int, ...]], parents: bool) -> Tensor:
    """Each node's row of ``tables`` after its prefix (its parent's row when ``parents``)."""
    if parents:
        return torch.stack([tables[len(pre) - 1][pre[:-1]] for pre in prefixes])
    return torch.stack([tables[len(pre)][pre] for pre in prefixes])


def _two_tokens(
    rule: Rule, widths: tuple[int, int], seed: int, device: str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Counts [V, V] of the first two emitted tokens over N trees, and the rule's law: the
    second token comes from the tree, or, after one token, from the law a fresh iteration
    emits (the rule's target after the first token). The inner nodes' rows are the rule's
    targets, computed once per prefix (``judged_rows`` computes the same per tree). On
    ``device`` the trees are judged with a generator of that device's own."""
    p, q = _tables(seed)
    target = [kl_target(q[j], p[j], rule.delta) if not rule.lossless else q[j] for j in (0, 1)]
    judged = [*target, q[2]]
    counts = torch.zeros(V, V, dtype=torch.long)
    g = torch.Generator().manual_seed(seed + 1)
    judge = g if device == "cpu" else torch.Generator(device).manual_seed(seed + 2)
    for _ in range(N):
        tree, prefixes = _tree(p, widths, g)
        qs = torch.cat([target[0][None], _rows(judged, prefixes, parents=False)])  # [N+1, V]
        rows = _rows(p, prefixes, parents=True)  # [N, V]
        result = verify_tree(tree, qs.to(device), rows.to(device), judge)
        x = result.tokens[0]
        y = result.tokens[1] if len(result.tokens) > 1 else _draw(target[1][x], g)
        counts[x, y] += 1
    return counts, target[0][:, None] * target[1]


def _draw(row: Tensor, g: torch.Generator) -> int:
    return int(sample_inverse_cdf(row[None], torch.rand(1, generator=g)))


@pytest.mark.parametrize("widths", [(2, 2), (3, 1)])
def test_sps_tree_emits_the_verifiers_law(widths):
    counts, law = _two_tokens(SpS(), widths, seed=3)
    assert binomial_violations(counts.flatten(), law.flatten()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sps_tree_emits_the_verifiers_law_on_cuda():
    counts, law = _two_tokens(SpS(), (2, 2), seed=3, device="cuda")
    assert binomial_violations(counts.flatten(), law.flatten()) == []


def test_cactus_tree_emits_its_target_and_not_q():
    counts, law = _two_tokens(Cactus(0.5), (2, 2), seed=5)
    assert binomial_violations(counts.flatten(), law.flatten()) == []
    p, q = _tables(5)
    verifier_law = (q[0][:, None] * q[1]).flatten()
    assert binomial_violations(counts.flatten(), verifier_law) != []  # the check can fail


def test_judged_rows_replace_only_inner_nodes():
    p, q = _tables(7)
    tree = TokenTree((0, 1, 2), (ROOT, ROOT, 0))  # node 0 has a child; 1 and 2 are leaves
    qs = torch.stack([q[0], q[1][0], q[1][1], q[2][0, 2]])
    ps = torch.stack([p[0], p[0], p[1][0]])
    rows = judged_rows(tree, qs, ps, Cactus(0.3))
    torch.testing.assert_close(rows[0], kl_target(q[0], p[0], 0.3))
    torch.testing.assert_close(rows[1], kl_target(q[1][0], p[1][0], 0.3))
    torch.testing.assert_close(rows[2:], qs[2:])


def test_sampling_without_replacement_follows_its_law():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    g = torch.Generator().manual_seed(0)
    pairs = torch.zeros(5, 5, dtype=torch.long)
    for _ in range(N):
        first, second = sample_distinct(p, 2, g, greedy=False)
        pairs[first, second] += 1
    law = p[:, None] * p[None] / (1 - p[:, None])  # P(first = x, second = y), y != x
    law.fill_diagonal_(0.0)
    assert binomial_violations(pairs.flatten(), law.flatten()) == []
    assert sample_distinct(p, 9, g, greedy=False).__len__() == 4  # never a token of p = 0
    assert sample_distinct(p, 2, g, greedy=True) == [0, 1]


def test_greedy_walk_keeps_the_argmax_children():
    q = torch.eye(V)[[1, 2, 3, 0, 0]]  # argmax: root 1, node 0 -> 2 ...
    tree = TokenTree((3, 1, 2, 0), (ROOT, ROOT, 1, 1))  # root's child 1 holds token 1
    rows = torch.stack([q[0], q[3], q[1], q[2], q[3]])  # after node 1 the argmax is 2
    result = verify_tree(tree, rows, torch.full((4, V), 1 / V), greedy=True)
    assert result.path == [1, 2]
    assert result.tokens == [1, 2, int(rows[3].argmax())]


def test_a_chain_is_a_tree_and_bad_parents_are_refused():
    chain = TokenTree.chain([5, 6, 7])
    assert chain.parents == (ROOT, 0, 1) and chain.depth() == 3 and chain.inner() == [ROOT, 0, 1]
    with pytest.raises(ValueError, match=r"parents\[1\] must be in \[-1, 1\)"):
        TokenTree((1, 2), (ROOT, 1))
