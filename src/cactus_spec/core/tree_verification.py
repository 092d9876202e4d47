"""Draft trees: several candidates per position, verified in one pass (SpecInfer's multi-draft
speculative sampling, with the candidates drawn without replacement).

A tree drafts ``w`` distinct children n_1..n_w at a node, drawn one after another from the
draft's row p without replacement: n_i from p_i = p with n_1..n_{i-1} removed, renormalised.
The verifier scores every node in one forward (a tree attention mask), giving the target row
t at each node (q for SpS). The node's children are then judged in turn, recursive rejection
sampling:

    t_1 = t
    accept n_i with probability  min(1, t_i(n_i) / p_i(n_i))   (then descend into n_i)
    else                         t_{i+1} = norm(max(0, t_i - p_i))

and when every child is rejected the node emits one token from t_{w+1}. Each test is an
ordinary speculative-sampling step from p_i towards t_i (n_i ~ p_i given the earlier ones), so
by induction the node emits t exactly, whatever w; a child rejected leaves t_{i+1}(n_i) = 0,
so no later test can pick it again. A leaf emits its bonus token from q.

So the tree is lossless for SpS (t = q at every node), and for a lossy rule whose target is a
function of the node's q and p (``Rule.block_target``; Cactus's ``kl_target``) every node
emits that target exactly: the meter reads KL(t || q) <= delta per emitted position, as on
blocks. At temperature 0 a node keeps the child equal to argmax q, if any (equal to AR).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from cactus_spec.core.rules import Rule, normalize
from cactus_spec.core.sampling import sample_inverse_cdf, uniforms

#: The parent of a node drafted right after the context (the tree's root is the context's last
#: token, the one the verifier reads first).
ROOT = -1


@dataclass(frozen=True)
class TokenTree:
    """Drafted nodes in feeding order: node j is ``tokens[j]`` with parent ``parents[j]`` (an
    earlier node, or ``ROOT``)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(
                f"tokens and parents must have one entry per node, got {len(self.tokens)} "
                f"and {len(self.parents)}"
            )
        for j, parent in enumerate(self.parents):
            if not ROOT <= parent < j:
                raise ValueError(f"parents[{j}] must be in [-1, {j}), got {parent}")

    @classmethod
    def chain(cls, tokens: list[int]) -> TokenTree:
        """A chain: node j's parent is node j - 1."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @cached_property
    def children(self) -> dict[int, list[int]]:
        """Each node's children (``ROOT`` included) in drafting order."""
        kids: dict[int, list[int]] = {ROOT: []}
        for j, parent in enumerate(self.parents):
            kids.setdefault(parent, []).append(j)
            kids.setdefault(j, [])
        return kids

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (empty for ``ROOT``)."""
        return path_to(self.parents, node)

    def depth(self) -> int:
        """The longest path's number of nodes."""
        return max((len(self.path(j)) for j in range(len(self.tokens))), default=0)

    def inner(self) -> list[int]:
        """The nodes with children, ``ROOT`` first (where a token is judged and emitted)."""
        return [node for node, kids in self.children.items() if kids]


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node``, given each node's parent."""
    nodes = []
    while node != ROOT:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]


@dataclass(frozen=True)
class TreeResult:
    """``path``: the accepted nodes, root first; ``tokens``: their tokens, then the emitted one."""

    path: list[int]
    tokens: list[int]


def sample_distinct(p: Tensor, count: int, generator: torch.Generator, greedy: bool) -> list[int]:
    """Up to ``count`` distinct tokens from p [V] without replacement (one uniform each), or
    its ``count`` most likely when ``greedy``; never a token of probability 0."""
    count = min(count, int((p > 0).sum()))
    if greedy:
        return p.topk(count).indices.tolist()
    left, chosen = p.float().clone(), []
    for u in uniforms(1, count, generator, p.device)[0]:
        token = int(sample_inverse_cdf(left[None], u[None]))
        chosen.append(token)
        left[token] = 0.0
    return chosen


def verify_tree(
    tree: TokenTree,
    verifier_probs: Tensor,  # [N+1, V]: row 0 after the root, row j+1 after node j
    draft_probs: Tensor,  # [N, V]: row j the draft's row node j was drawn from
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> TreeResult:
    """Walk the tree from the root, keeping one child per node by recursive rejection sampling
    (module docstring) and emitting one token where it stops. ``verifier_probs`` are the
    targets: q for SpS, ``judged_rows`` for a lossy rule. Random numbers: one uniform per
    child judged, one for the emitted token (none when ``greedy``)."""
    rows = verifier_probs.float()
    node, path = ROOT, []
    while True:
        kids, target = tree.children[node], rows[node + 1]  # [V]
        chosen = _descend(tree, kids, target, draft_probs, generator, greedy)
        if isinstance(chosen, int):
            node = chosen
            path.append(node)
            continue
        return TreeResult(path, [tree.tokens[j] for j in path] + [_emit(chosen, greedy, generator)])


def judged_rows(tree: TokenTree, q: Tensor, draft_probs: Tensor, rule: Rule) -> Tensor:
    """q [N+1, V] with each inner node's row replaced by the rule's target for the draft's row
    its children were drawn from (what the tree emits there)."""
    inner = tree.inner()
    first_child = torch.tensor([tree.children[node][0] for node in inner], device=q.device)
    at = torch.tensor(inner, device=q.device) + 1  # [I] rows of q
    ids = torch.tensor([tree.tokens[j] for j in first_child.tolist()], device=q.device)  # [I]
    targets = rule.block_target(q[at], ids, draft_probs[first_child].float())  # [I, V]
    return q.index_copy(0, at, targets)


def _descend(
    tree: TokenTree,
    kids: list[int],
    target: Tensor,  # [V]
    draft_probs: Tensor,
    generator: torch.Generator | None,
    greedy: bool,
) -> int | Tensor:
    """The child accepted at a node, or the row [V] its token is drawn from when none is."""
    if greedy:
        best = int(target.argmax())
        kept = [j for j in kids if tree.tokens[j] == best]
        return kept[0] if kept else target
    if not kids:
        return target
    p = draft_probs[kids[0]].float()  # [V]: siblings share the row they were drawn from
    tests = uniforms(1, len(kids), generator, target.device)[0]  # [w]
    for j, u in zip(kids, tests, strict=True):
        token = tree.tokens[j]
        if float(u) * float(p[token]) < float(target[token]):
            return j
        # a lambda's default binds the row of this iteration (mypy cannot type such lambdas)
        target = normalize((target - p).clamp_(min=0.0), lambda t=target: t)  # type: ignore[misc]
        p = p.clone()
        p[token] = 0.0
        p = normalize(p, lambda q=p: q)  # type: ignore[misc]
    return target


def _emit(row: Tensor, greedy: bool, generator: torch.Generator | None) -> int:
    """One token from ``row`` [V]: its argmax when greedy, else one inverse-CDF draw."""
    if greedy:
        return int(row.argmax())
    u = uniforms(1, 1, generator, row.device)[:, 0]  # [1]
    return int(sample_inverse_cdf(row[None], u))
