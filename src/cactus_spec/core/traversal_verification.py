"""Traversal verification: a draft tree judged leaf to root, each path as a whole (the idea of
Weng et al., NeurIPS 2025; on a chain it is block verification, ``core.block_verification``).

Top-down verification (``verify_tree``) rejects a node on its own ratio and discards every
node below it. Traversal carries a weight down each path, as blocks do,

    w_root = 1,    w_c = min(1, w_f t_f(n_c) / p_f(n_c))    (c a child of f, token n_c)

(t_f the target row after node f, q for SpS; p_f the draft row f's children were drawn from),
and visits the tree depth first, children in drafting order, judging a node only after its
subtree. A leaf is accepted with probability w. When a child's subtree is rejected, its
parent f takes the mass the child did not use:

    m = sum_x max(0, w_f t_f(x) - p_f(x))          (what t_f still needs)
    t_f <- norm(max(0, w_f t_f - p_f))
    w_f <- m / sum_x max(0, p_f(x) - w_f t_f(x))   (what t_f needs / the chance of the rejection)
    p_f <- p_f without n_c, renormalised           (the next child was drawn from it)

and the next child is judged against the new (t_f, w_f, p_f). Once every child is rejected, f
is accepted with probability w_f and emits a token from t_f; otherwise f's own parent goes on.
The root's weight stays 1, so the root is always accepted in the end.

Why it is exact. Claim: for a node f with target t, weight w and children drawn from p without
replacement, the walk below f accepts a path through f continued by the tokens s with
probability w t(s_1) T(s_2.. | s_1), where T is the law the subtrees emit (by induction, t at
every drafted position and q after a leaf), and rejects f with probability 1 - w. A leaf is
the case without children. The first child n ~ p is kept (through its subtree) with
probability min(p(n), w t(n)) T(..), and its subtree is rejected with probability
sum_x max(0, p(x) - w t(x)) = 1 - w + m. What f still owes is max(0, w t - p) T(..), of mass
m, which is exactly the claim for the state (norm(max(0, w t - p)), m / (1 - w + m), p without
n) whatever n was: the rest of the walk pays it. Summed, f emits w t(s_1) T(..): at the root
(w = 1) the output follows t at every drafted position, q itself for SpS (lossless). A child
whose subtree was rejected had w t(n) < p(n), so t keeps no mass on it afterwards. On a chain
the weight after a rejection is block verification's stopping probability
h = m / (m + 1 - w), and the token drawn is its residual's.

A lossy rule joins as on blocks and trees: its target per node (``judged_rows``) replaces q,
and the meter reads KL(t || q) per emitted position. At temperature 0 every weight is 0 or 1,
and traversal keeps what the top-down walk keeps (``verify_tree``, greedy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cactus_spec.core.rules import normalize
from cactus_spec.core.sampling import sample_inverse_cdf, uniforms
from cactus_spec.core.tree_verification import ROOT, TokenTree, TreeResult, verify_tree


def verify_traversal(
    tree: TokenTree,
    verifier_probs: Tensor,  # [N+1, V]: row 0 after the root, row j+1 after node j
    draft_probs: Tensor,  # [N, V]: row j the draft's row node j was drawn from
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> TreeResult:
    """Judge the tree leaf to root (module docstring) and emit one token where the accepted
    path ends. ``verifier_probs`` are the targets: q for SpS, ``judged_rows`` for a lossy rule.
    Random numbers: N + 1 uniforms, node j's test at j and the emitted token's at N (none when
    ``greedy``)."""
    if greedy:
        return verify_tree(tree, verifier_probs, draft_probs, greedy=True)
    rows = verifier_probs.float()
    tests = uniforms(1, len(tree.tokens) + 1, generator, rows.device)[0]  # [N+1]
    walk = _Walk(tree, rows, draft_probs, tests[:-1].tolist())
    found = walk.visit(ROOT, rows[0], 1.0)
    assert found is not None  # the root is never rejected
    path, row = found
    token = int(sample_inverse_cdf(row[None], tests[-1:]))
    return TreeResult(path, [tree.tokens[j] for j in path] + [token])


class _Walk:
    """One traversal of ``tree``: the targets [N+1, V], the draft rows [N, V] and each node's
    uniform."""

    def __init__(self, tree: TokenTree, rows: Tensor, draft_probs: Tensor, tests: list[float]):
        self.tree, self.rows, self.draft_probs, self.tests = tree, rows, draft_probs, tests

    def visit(self, node: int, target: Tensor, weight: float) -> tuple[list[int], Tensor] | None:
        """The accepted path below ``node`` and the row [V] its token is drawn from, or None
        when ``node`` is rejected; ``target`` [V] and ``weight`` are the node's t and w."""
        if weight <= 0.0 and node != ROOT:
            return None  # every test below and at the node fails: nothing to draw
        kids = self.tree.children[node]
        if not kids:
            return ([], target) if node == ROOT or self.tests[node] < weight else None
        ids, t, p = _support(target, self.draft_probs[kids[0]].float())  # [S] each
        at = {token: i for i, token in enumerate(ids.tolist())}
        for child in kids:
            i = at[self.tree.tokens[child]]  # a drafted token has p > 0
            child_weight = min(1.0, weight * float(t[i]) / float(p[i]))
            found = self.visit(child, self.rows[child + 1], child_weight)
            if found is not None:
                return [child, *found[0]], found[1]
            t, weight, p = after_rejection(t, weight, p, i)
        if node == ROOT or self.tests[node] < weight:
            return [], torch.zeros_like(target).index_copy_(0, ids, t)
        return None


def _support(target: Tensor, p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The tokens where t [V] or p [V] has mass [S], and both rows there [S]: a node's
    rejections touch only them (a few dozen tokens under top-k or top-p, not the vocabulary)."""
    ids = ((target > 0) | (p > 0)).nonzero().flatten()  # [S]
    return ids, target[ids], p[ids]


def after_rejection(
    target: Tensor,  # [S]
    weight: float,
    p: Tensor,  # [S]
    token: int,
) -> tuple[Tensor, float, Tensor]:
    """A node's (t, w, p) after the subtree of its child at index ``token`` was rejected: the
    residual norm(max(0, w t - p)), the weight m / sum max(0, p - w t) and p without
    ``token``."""
    excess = (weight * target - p).clamp_(min=0.0)  # [V]
    needed = float(excess.sum())
    rejected = float((p - weight * target).clamp_(min=0.0).sum())  # 1 - w + m
    new_weight = min(1.0, needed / rejected) if rejected > 0.0 else 1.0
    new_target = excess / needed if needed > 0.0 else target
    left = p.clone()
    left[token] = 0.0
    return new_target, new_weight, normalize(left, lambda: p)
