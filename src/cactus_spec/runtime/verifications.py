"""How a row's drafts are judged, declared once per row: a chain, a block, a tree or a
traversal.

``verification_of(spec, sampling)`` reads a row's spec and sampling when the row starts
(``Generation``) and gives the one object that owns its kind: how its drafts are shaped
(``branches``, the drafter's argument), which rows they are judged against
(``judged_rows``: q, or a lossy rule's per-position targets on blocks and trees), how they
are judged (``judge``), which of the verifier's rows its tokens were emitted at
(``emitted_rows``) and what each emitted draft cost in divergence (``divergence``). The
stepper asks the row's kind; nothing guesses it from a draft's shape.

- ``Verification`` (a chain): token by token, each draft against the rule's ``h``
  (``core.verification``). Also a tree of one branch (its draft is a chain) and a block at
  temperature 0 (every block weight is then 0 or 1, so token verification runs the same test).
- ``Block``: the chain as a whole (``core.block_verification``), towards q's rows, or the
  rule's block targets for a lossy rule. Also a traversal of one branch.
- ``Tree``: a draft tree judged top down (``core.tree_verification``).
- ``Traversal``: the tree judged leaf to root, each path as a whole
  (``core.traversal_verification``).
- ``Budgeted``: any of these for a Cactus row under its answer budget (``core.budget``):
  each judged row gets the target of Cactus at the delta the budget gives it, and the rows
  that emitted are charged their laws' exact KL.

Every kind is judged on its row alone: a row's law depends on its own spec, sampling and
seed, never on its neighbours' kinds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cactus_spec.core.audit import kl, one_hot_divergences, step_divergences
from cactus_spec.core.block_verification import verify_block
from cactus_spec.core.budget import Budget, Plan
from cactus_spec.core.rules import Cactus, Rule, SpS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.core.traversal_verification import verify_traversal
from cactus_spec.core.tree_verification import TokenTree, judged_rows, verify_tree
from cactus_spec.core.verification import verify
from cactus_spec.runtime.drafters import Draft


class Verification:
    """A chain's kind: drafts judged token by token against q. The other kinds override
    what differs. Asked only of a row that drafted; ``judged_rows`` and ``divergence`` only
    of a lossy rule's row away from temperature 0."""

    name = "chain"
    trees = False  # whether its drafts are token trees
    emits_targets = False  # whether each judged row emits its target exactly (else h's step law)

    def __init__(self, branches: int = 1) -> None:
        self.branches = branches

    def judged_rows(self, rule: Rule, draft: Draft, q: Tensor) -> Tensor:
        """The rows [K+1, V] the drafts are judged against: q's, for a chain."""
        return q

    def judge(
        self, rule: Rule, draft: Draft, judged: Tensor, generator, greedy: bool
    ) -> tuple[list[int], list[int]]:
        """The emitted tokens (the kept drafts, then the row's own) and the kept drafts."""
        ids, p = _one_row(draft, judged.device)
        result = verify(ids, judged[None], rule, p, generator, greedy=greedy, validate=False)
        return _kept(result)

    def emitted_rows(self, q: Tensor, path: list[int]) -> Tensor:
        """q's rows [>= len(path) + 1, V] the row's tokens were emitted at: a chain's first."""
        return q

    def divergence(
        self, rule: Rule, draft: Draft, q: Tensor, judged: Tensor, path: list[int], count: int
    ) -> Tensor:
        """KL(law || q) [P] of the drafted positions that emitted the first ``count`` tokens
        of a row (``divergences`` at its first P positions)."""
        positions = min(count, len(draft.tokens))
        ids = torch.tensor(draft.tokens, dtype=torch.long, device=q.device)[:positions]  # [P]
        p = None if draft.probs is None else draft.probs[:positions]  # [P, V]
        return self.divergences(rule, q[:positions], judged[:positions], ids, p)

    def divergences(
        self,
        rule: Rule,
        q: Tensor,
        judged: Tensor,
        ids: Tensor | None = None,
        p: Tensor | None = None,
    ) -> Tensor:
        """The meter, for the engine's rows and the vLLM plugin's alike: KL(law || q) [P]
        (float64) at P drafted positions that emitted, stacked from any rows of one rule. q,
        judged [P, V]; ids [P] the drafts; p [P, V] their draft rows, None for one-hot drafts.
        A kind that emits each judged row t exactly has law t, so KL(t || q). A chain's law
        is the rule's one step from p and q: for one-hot drafts exact at any vocabulary
        (``one_hot_divergences``), else on q's support (``step_divergences``, NaN where that
        exceeds ``audit.MAX_AUDIT_SUPPORT`` tokens)."""
        if self.emits_targets:
            return kl(judged, q)
        assert ids is not None  # a chain's law depends on its drafts
        if p is None:
            return one_hot_divergences(q, ids, rule)
        return step_divergences(p, q, rule)


class Block(Verification):
    """The chain as a whole, towards q's rows or a lossy rule's block targets, which the block
    emits exactly (so each position's law is its target)."""

    name = "block"
    emits_targets = True

    def judged_rows(self, rule: Rule, draft: Draft, q: Tensor) -> Tensor:
        k = len(draft.tokens)
        ids = torch.tensor(draft.tokens, dtype=torch.long, device=q.device)  # [K]
        targets = rule.block_target(q[:k], ids, draft.probs)  # [K, V]; probs [K, V] or None
        return torch.cat([targets, q[k:]])  # [K+1, V]

    def judge(self, rule: Rule, draft: Draft, judged: Tensor, generator, greedy: bool):
        ids, p = _one_row(draft, judged.device)
        return _kept(verify_block(ids, judged[None], p, generator, False))  # SpS to judged


class Tree(Verification):
    """A draft tree of up to ``branches`` nodes per depth, judged top down; a lossy rule's
    targets replace q's rows node by node."""

    name = "tree"
    trees = True
    emits_targets = True

    def judged_rows(self, rule: Rule, draft: Draft, q: Tensor) -> Tensor:
        assert draft.probs is not None  # trees are drawn by a draft model
        return judged_rows(draft.tree, q, draft.probs, rule)

    walk = staticmethod(verify_tree)  # top down

    def judge(self, rule: Rule, draft: Draft, judged: Tensor, generator, greedy: bool):
        assert draft.probs is not None  # trees are drawn by a draft model
        walked = self.walk(draft.tree, judged, draft.probs, generator, greedy)
        return walked.tokens, walked.path

    def emitted_rows(self, q: Tensor, path: list[int]) -> Tensor:
        return q[torch.tensor(path_rows(path), device=q.device)]

    def divergence(self, rule, draft, q, judged, path, count) -> Tensor:
        at = torch.tensor(path_rows(path)[:count], device=q.device)  # [P]
        return self.divergences(rule, q[at], judged[at])


class Traversal(Tree):
    """The draft tree judged leaf to root, each path as a whole."""

    name = "traversal"
    walk = staticmethod(verify_traversal)


class Budgeted(Verification):
    """A chain, block, tree or traversal (``inner``) whose Cactus deltas come from the row's
    answer budget: each judged row's target is planned from what is left on its path
    (``Budget.plan``), the drafts are judged by ``inner`` against those targets (a chain
    SpS-wise: generalised speculative sampling towards each position's h), and the rows that
    emitted are charged."""

    def __init__(self, budget: Budget, inner: Verification) -> None:
        super().__init__(inner.branches)
        self.budget, self.inner = budget, inner
        self.name, self.trees = inner.name, inner.trees
        self.plan: Plan | None = None

    def judged_rows(self, rule: Rule, draft: Draft, q: Tensor) -> Tensor:
        tree = draft.tree if self.trees else TokenTree.chain(draft.tokens)
        self.plan = self.budget.plan(tree, q, draft.probs, self.inner.emits_targets)
        return self.plan.targets.to(q.dtype)  # [N+1, V]

    def judge(self, rule: Rule, draft: Draft, judged: Tensor, generator, greedy: bool):
        return self.inner.judge(SpS(), draft, judged, generator, greedy)

    def emitted_rows(self, q: Tensor, path: list[int]) -> Tensor:
        return self.inner.emitted_rows(q, path)

    def divergence(self, rule, draft, q, judged, path, count) -> Tensor:
        rows = path_rows(path)[:count] if self.trees else list(range(count))
        assert self.plan is not None  # judged_rows planned these drafts
        self.budget.charge(self.plan, rows, count)
        return torch.tensor([self.plan.costs[r] for r in rows], dtype=torch.float64)


def verification_of(
    spec: DecodeSpec, sampling: SamplingConfig, length: int | None = None
) -> Verification:
    """The kind a row of ``spec`` at ``sampling`` is verified by (the module docstring);
    ``length``: the most tokens the row may emit (a budget's pace)."""
    kind = kind_of(spec, sampling.greedy)
    if spec.kl_budget is None or sampling.greedy:
        return kind
    cactus = spec.rule
    assert isinstance(cactus, Cactus) and spec.allocation is not None  # a budget: Cactus only
    budget = Budget(spec.kl_budget, cactus.delta, cactus.exact, spec.allocation, length)
    return Budgeted(budget, kind)


def kind_of(spec: DecodeSpec, greedy: bool) -> Verification:
    """The kind of a row of ``spec`` without an answer budget; ``greedy``: at temperature 0,
    where a block is judged as a chain."""
    if spec.trees and spec.branches > 1:
        return (Tree if spec.verification == "tree" else Traversal)(spec.branches)
    if spec.verification in ("block", "traversal") and not greedy:
        return Block()
    return Verification()


def _one_row(draft: Draft, device) -> tuple[Tensor, Tensor | None]:
    """A chain draft as one row: its ids [1, K] and draft probabilities [1, K, V] (or None)."""
    ids = torch.tensor([draft.tokens], device=device)  # [1, K]
    return ids, None if draft.probs is None else draft.probs[None]


def _kept(result) -> tuple[list[int], list[int]]:
    """A one-row chain verification's emitted tokens and kept drafts."""
    accepted = int(result.num_accepted[0])
    return result.tokens[0, : accepted + 1].tolist(), list(range(accepted))


def path_rows(path: list[int]) -> list[int]:
    """The fed positions of a tree's accepted path: the root (the last emitted token, fed
    first) and node j at j + 1; the verifier's row after each is where a token was emitted."""
    return [0, *(j + 1 for j in path)]
