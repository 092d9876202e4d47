"""Draft trees, judged top down (``verify_tree``) and leaf to root (``verify_traversal``): the
verifier's exact law over the first tokens for SpS, the rule's target for Cactus (with the
negative controls), traversal on a chain against block verification's exact law, sampling
without replacement, and greedy walks."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from lawcheck import binomial_violations, random_dist
from torch import Tensor

from cactus_spec.core import traversal_verification
from cactus_spec.core.block_verification import stop_probs
from cactus_spec.core.kl_target import kl_target
from cactus_spec.core.rules import Cactus, Rule, SpS
from cactus_spec.core.sampling import sample_inverse_cdf
from cactus_spec.core.traversal_verification import verify_traversal
from cactus_spec.core.tree_verification import (
    ROOT,
    TokenTree,
    TreeResult,
    judged_rows,
    sample_distinct,
    verify_tree,
)

V, N = 4, 10_000


def _tables(seed: int, depth: int = 2) -> tuple[list[Tensor], list[Tensor]]:
    """Context-dependent p[j] [V]*j + [V] (j < depth) and q[j] (j <= depth)."""
    g = torch.Generator().manual_seed(seed)

    def table(j: int) -> Tensor:
        return torch.stack([random_dist(V, g) for _ in range(V**j)]).reshape(*([V] * j), V)

    return [table(j) for j in range(depth)], [table(j) for j in range(depth + 1)]


def _tree(p: list[Tensor], widths: tuple[int, ...], g: torch.Generator):
    """A tree of depth ``len(widths)``: ``widths[d]`` distinct children for each node at depth
    d, drawn from p after the node's prefix; returns the tree and each node's prefix."""
    tokens, parents, prefixes = [], [], []

    def grow(parent: int, prefix: tuple[int, ...]) -> None:
        depth = len(prefix)
        if depth == len(widths):
            return
        for x in sample_distinct(p[depth][prefix], widths[depth], g, greedy=False):
            tokens.append(x), parents.append(parent), prefixes.append((*prefix, x))
            grow(len(tokens) - 1, (*prefix, x))

    grow(ROOT, ())
    return TokenTree(tuple(tokens), tuple(parents)), prefixes


def _rows(tables: list[Tensor], prefixes: list[tuple[int, ...]], parents: bool) -> Tensor:
    """Each node's row of ``tables`` after its prefix (its parent's row when ``parents``)."""
    if parents:
        return torch.stack([tables[len(pre) - 1][pre[:-1]] for pre in prefixes])
    return torch.stack([tables[len(pre)][pre] for pre in prefixes])


def _first_tokens(
    rule: Rule,
    widths: tuple[int, ...],
    seed: int,
    count: int = 2,
    device: str = "cpu",
    verifier: Callable[..., TreeResult] = verify_tree,
) -> tuple[Tensor, Tensor]:
    """Counts [V] * count of the first ``count`` emitted tokens over N trees judged by
    ``verifier``, and the rule's law. Tokens after the tree's come from the law a fresh
    iteration emits: the rule's target after the prefix (q for SpS; for a lossy rule ``count``
    must stay within the tree's depth, where a fresh tree emits targets too). The inner
    nodes' rows are the rule's targets, computed once per prefix (``judged_rows`` computes the
    same per tree). On ``device`` the trees are judged with a generator of that device's own."""
    depth = len(widths)
    p, q = _tables(seed, depth)
    target = [q[j] if rule.lossless else kl_target(q[j], p[j], rule.delta) for j in range(depth)]
    judged = [*target, q[depth]]
    counts = torch.zeros([V] * count, dtype=torch.long)
    g = torch.Generator().manual_seed(seed + 1)
    judge = g if device == "cpu" else torch.Generator(device).manual_seed(seed + 2)
    for _ in range(N):
        tree, prefixes = _tree(p, widths, g)
        qs = torch.cat([target[0][None], _rows(judged, prefixes, parents=False)])  # [N+1, V]
        rows = _rows(p, prefixes, parents=True)  # [N, V]
        tokens = verifier(tree, qs.to(device), rows.to(device), judge).tokens[:count]
        while len(tokens) < count:
            tokens.append(_draw(judged[len(tokens)][tuple(tokens)], g))
        counts[tuple(tokens)] += 1
    law = target[0]
    for j in range(1, count):
        law = law[..., None] * judged[j]
    return counts, law


def _draw(row: Tensor, g: torch.Generator) -> int:
    return int(sample_inverse_cdf(row[None], torch.rand(1, generator=g)))


VERIFIERS = [verify_tree, verify_traversal]


@pytest.mark.parametrize("verifier", VERIFIERS)
@pytest.mark.parametrize("widths", [(2, 2), (3, 1), (1, 3)])
def test_sps_tree_emits_the_verifiers_law(widths, verifier):
    counts, law = _first_tokens(SpS(), widths, seed=3, verifier=verifier)
    assert binomial_violations(counts.flatten(), law.flatten()) == []


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_sps_tree_emits_the_verifiers_law_over_three_tokens(verifier):
    """Depth 2: the tree's whole output (a path of up to two nodes and its token)."""
    counts, law = _first_tokens(SpS(), (2, 2), seed=11, count=3, verifier=verifier)
    assert binomial_violations(counts.flatten(), law.flatten()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("verifier", VERIFIERS)
def test_sps_tree_emits_the_verifiers_law_on_cuda(verifier):
    counts, law = _first_tokens(SpS(), (2, 2), seed=3, device="cuda", verifier=verifier)
    assert binomial_violations(counts.flatten(), law.flatten()) == []


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_cactus_tree_emits_its_target_and_not_q(verifier):
    counts, law = _first_tokens(Cactus(0.5), (2, 2), seed=5, verifier=verifier)
    assert binomial_violations(counts.flatten(), law.flatten()) == []
    p, q = _tables(5)
    verifier_law = (q[0][:, None] * q[1]).flatten()
    assert binomial_violations(counts.flatten(), verifier_law) != []  # the check can fail


def test_traversal_law_check_catches_a_parent_kept_without_its_weight(monkeypatch):
    """A parent kept whenever its children's subtrees are rejected (weight 1 instead of
    m / sum max(0, p - w t)) emits too many short paths: the same check fails."""
    exact = traversal_verification.after_rejection

    def kept(target, weight, p, token):
        residual, _, left = exact(target, weight, p, token)
        return residual, 1.0, left

    monkeypatch.setattr(traversal_verification, "after_rejection", kept)
    counts, law = _first_tokens(SpS(), (2, 2), seed=11, count=3, verifier=verify_traversal)
    assert binomial_violations(counts.flatten(), law.flatten()) != []


def _block_kept_law(p: Tensor, q: Tensor, k: int) -> Tensor:
    """Block verification's law [k+1] of the number of kept drafts of a chain of k drafts
    from context-free p [V] against q [V], by enumerating every chain."""
    law = torch.zeros(k + 1, dtype=torch.float64)
    for chain in itertools.product(range(len(p)), repeat=k):
        ids = torch.tensor([chain])  # [1, k]
        h, _ = stop_probs(ids, q.expand(1, k + 1, -1), p.expand(1, k, -1))  # [1, k]
        chance = float(torch.prod(p[list(chain)]))
        going = 1.0
        for i in range(k, 0, -1):  # the longest prefix whose test passes
            law[i] += chance * going * float(h[0, i - 1])
            going *= 1 - float(h[0, i - 1])
        law[0] += chance * going
    return law


def test_traversal_on_a_chain_keeps_what_block_verification_keeps():
    """Sun et al.'s example (q = (1/3, 2/3), p = (2/3, 1/3), K = 2): blocks keep 11/9 drafts
    on average, tokens 10/9. Traversal of the chain keeps block verification's law of the
    kept length (and so 11/9), which the top-down walk (token verification) does not."""
    p = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    q = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    law = _block_kept_law(p, q, 2)
    assert float((law * torch.arange(3)).sum()) == pytest.approx(11 / 9, abs=1e-12)
    g = torch.Generator().manual_seed(0)
    kept = {verify_traversal: torch.zeros(3, dtype=torch.long), verify_tree: torch.zeros(3)}
    for _ in range(N):
        chain = TokenTree.chain([_draw(p, g), _draw(p, g)])
        for verifier, counts in kept.items():
            result = verifier(chain, q.expand(3, 2), p.expand(2, 2), g)
            counts[len(result.path)] += 1
    assert binomial_violations(kept[verify_traversal], law) == []
    assert binomial_violations(kept[verify_tree].long(), law) != []  # the check can fail


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


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_greedy_walk_keeps_the_argmax_children(verifier):
    q = torch.eye(V)[[1, 2, 3, 0, 0]]  # argmax: root 1, node 0 -> 2 ...
    tree = TokenTree((3, 1, 2, 0), (ROOT, ROOT, 1, 1))  # root's child 1 holds token 1
    rows = torch.stack([q[0], q[3], q[1], q[2], q[3]])  # after node 1 the argmax is 2
    result = verifier(tree, rows, torch.full((4, V), 1 / V), greedy=True)
    assert result.path == [1, 2]
    assert result.tokens == [1, 2, int(rows[3].argmax())]


def test_a_chain_is_a_tree_and_bad_parents_are_refused():
    chain = TokenTree.chain([5, 6, 7])
    assert chain.parents == (ROOT, 0, 1) and chain.depth() == 3 and chain.inner() == [ROOT, 0, 1]
    with pytest.raises(ValueError, match=r"parents\[1\] must be in \[-1, 1\)"):
        TokenTree((1, 2), (ROOT, 1))
