"""A divergence budget for the whole answer: each drafted position's delta from what is left.

Cactus bounds each position: KL(law_t || q_t) <= delta. Over an answer those add up. A
budget B bounds the answer instead. By the chain rule, KL(P || Q) over whole sequences is
E_P[sum_t KL(P_t || Q_t)], P_t the law of token t given the tokens before it; P_t mixes the
laws law_t the sampler applied in the states (where the iteration started, what was drafted
and kept) that lead to that prefix, so by convexity KL(P_t || Q_t) <= E[KL(law_t || q_t) |
prefix] and

    KL(P || Q) <= E_P[sum_t KL(law_t || q_t)].

``Budget.plan`` gives each row of a draft where a token is judged (a chain's drafted
positions; a tree's inner nodes) a delta from what is left after the rows on its path before
it, and the exact KL of the law that delta makes as its cost (``audit``, computed before the
draw: the step law over the draft p on chains, KL(t || q) of the target t blocks and trees
emit). ``Budget.charge`` then takes off the costs of the rows that emitted. Every path thus
sums at most B, so KL(P || Q) <= B, and by Pinsker |P(A) - Q(A)| <= sqrt(B / 2) for every
event A: "the answer passes its tests" included.

A row's delta does not depend on its own draft (only on what is left), so on chains its law
is the step law over n ~ p, the same whether the iteration goes on or starts again there.
When the law a delta makes costs more than the row is allowed, the delta is scaled down
until it fits (delta = 0, SpS, costs 0). A row whose KL cannot be measured (a verifier without top-k
or top-p, past ``audit.MAX_AUDIT_SUPPORT``) gets delta 0: the bound holds on every path.

How much a row is allowed (``ALLOCATIONS``):

- ``greedy``: all that is left (up to ``cap``). The first rows spend, the rest get what they
  leave.
- ``paced``: what is left spread evenly over the tokens the answer may still emit, L - m - d
  for L its length limit, m the tokens emitted and d the row's depth in the draft. A row whose
  law is cheap (p close to q) keeps the whole cap; a dear one is scaled down to the pace; what a
  row leaves unspent raises the pace of the rows after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cactus_spec.core.audit import kl, one_hot_divergences, step_divergences
from cactus_spec.core.rules import Cactus
from cactus_spec.core.tree_verification import ROOT, TokenTree

#: How a row's allowance is set from what is left (the module docstring).
ALLOCATIONS = ("greedy", "paced")
#: How many times a delta is scaled down before the row falls back to SpS.
_TRIES = 12
#: A scaled-down delta aims at this share of what the row is allowed (the slope is estimated).
_AIM = 0.9
#: A row's first delta is at most this share of what it is allowed: a block target solved to
#: KL = delta lands within rounding of delta, above it as often as below.
_SNUG = 0.999
#: A row allowed less than this many nats is judged SpS-wise: below it a law's KL is
#: float rounding, which no smaller delta lowers.
NEGLIGIBLE = 1e-7


@dataclass(frozen=True)
class Plan:
    """A draft's per-row deltas, target rows and exact costs, for its N + 1 verifier rows
    (a row that judges nothing: delta 0, q's row, cost 0)."""

    deltas: list[float]
    targets: Tensor  # [N+1, V] Cactus(delta_r)'s h at row r (blocks and trees: its target)
    costs: list[float]  # KL(law_r || q_r) in nats


@dataclass
class Budget:
    """What is left of ``total`` nats for one answer, each row at most ``cap`` (None: no cap),
    Cactus's closed form or its exact bound, allowed by ``allocation`` over an answer of at
    most ``length`` tokens (None: unknown; ``paced`` then allows what is left)."""

    total: float
    cap: float | None = None
    exact: bool = False
    allocation: str = ALLOCATIONS[0]
    length: int | None = None
    spent: float = field(default=0.0)
    emitted: int = field(default=0)  # the answer's tokens so far (``paced``)

    def __post_init__(self) -> None:
        check_budget(self.total)
        check_allocation(self.allocation)

    @property
    def left(self) -> float:
        return max(0.0, self.total - self.spent)

    def plan(self, tree: TokenTree, q: Tensor, p: Tensor | None, block: bool = False) -> Plan:
        """Deltas for a draft ``tree`` (a chain: ``TokenTree.chain``) whose node j was drawn
        from p[j] [V] (None: deterministic drafts) and is judged at q's row j + 1 (the root's
        children at row 0): q [N+1, V]. ``block``: the targets are the rule's block targets
        (what blocks and trees emit), else its h (chains)."""
        rows = q.shape[0]
        deltas, costs = [0.0] * rows, [0.0] * rows
        targets = q.float().clone()  # [N+1, V]
        before = {ROOT: 0.0}  # by node: the costs of the rows on its path down to it
        for node in tree.inner():
            kids, row = tree.children[node], node + 1
            first = kids[0]
            left = max(0.0, self.left - before[node])
            allowed = self._allowance(left, len(tree.path(node)))
            wanted = _SNUG * allowed if self.cap is None else min(self.cap, _SNUG * allowed)
            p_row = None if p is None else p[first]
            n = torch.tensor(tree.tokens[first], device=q.device)
            fit = self._fit(q[row], n, p_row, wanted, allowed, block)
            deltas[row], targets[row], costs[row] = fit
            for kid in kids:
                before[kid] = before[node] + costs[row]
        return Plan(deltas, targets, costs)

    def charge(self, plan: Plan, rows: list[int], tokens: int) -> None:
        """Take off the costs of the ``rows`` that emitted; ``tokens`` were emitted."""
        self.spent += sum(plan.costs[r] for r in rows)
        self.emitted += tokens

    def _allowance(self, left: float, depth: int) -> float:
        """What a row at ``depth`` in its draft may cost, ``left`` being left on its path."""
        if self.allocation == "greedy" or self.length is None:
            return left
        return left / max(1, self.length - self.emitted - depth)

    def _law(
        self, q: Tensor, n: Tensor, p: Tensor | None, delta: float, block: bool
    ) -> tuple[Tensor, float]:
        """Cactus(delta)'s target row at a drafted position and its law's KL to q: q, p [S]."""
        rule = Cactus(delta, self.exact)
        if block:
            row = rule.block_target(q[None], n.reshape(1), _batch(p))[0]
            return row, float(kl(row, q))
        return rule.h(q, n, p), position_cost(q, n, p, rule)

    def _fit(
        self, q: Tensor, n: Tensor, p: Tensor | None, delta: float, allowed: float, block: bool
    ) -> tuple[float, Tensor, float]:
        """A delta whose law costs at most ``allowed``, its target row [V] and cost: ``delta``
        if it fits, else scaled down (at least halved) by (allowed / cost)^(1 / s), s the
        cost's log-log slope in delta over the last two tries, until one does;
        delta 0 (q itself, SpS) when none does or less than ``NEGLIGIBLE`` is allowed.
        Computed on the tokens q, p or the draft n hold (no law reaches the others)."""
        if allowed < NEGLIGIBLE:
            return 0.0, q.float(), 0.0
        keep = q > 0 if p is None else (q > 0) | (p > 0)  # [V]
        keep[n] = True
        columns = keep.nonzero().squeeze(-1)  # [S]
        q_s, n_s = q[columns], torch.searchsorted(columns, n)  # [S], []
        p_s = None if p is None else p[columns]
        last = None  # the previous (delta, cost): the cost's slope in delta, log-log
        for _ in range(_TRIES):
            if delta <= 0:
                break
            row, cost = self._law(q_s, n_s, p_s, delta, block)
            if math.isnan(cost):
                break  # not measurable: SpS
            if cost <= allowed:
                target = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [V]
                return delta, target.index_copy(0, columns, row.float()), cost
            slope = _slope(last, delta, cost)
            last = delta, cost
            delta *= min(0.5, (_AIM * allowed / cost) ** (1 / slope))
        return 0.0, q.float(), 0.0


def _slope(last: tuple[float, float] | None, delta: float, cost: float) -> float:
    """d log cost / d log delta between the last try and this one, within [1/2, 2] (1 at
    the first try, and where the last cost was 0)."""
    if last is None or last[1] <= 0 or cost <= 0 or last[0] == delta:
        return 1.0
    slope = math.log(last[1] / cost) / math.log(last[0] / delta)
    return min(2.0, max(0.5, slope))


def _batch(p: Tensor | None) -> Tensor | None:
    return None if p is None else p[None]


def position_cost(q: Tensor, n: Tensor, p: Tensor | None, rule: Cactus) -> float:
    """KL(law || q) in nats of one drafted position's law under ``rule``: q, p [V], n []."""
    if p is None:
        return float(one_hot_divergences(q[None], n.reshape(1).long(), rule)[0])
    return float(step_divergences(p[None].float(), q[None], rule)[0])


def check_budget(value: object, name: str = "kl_budget") -> float:
    """``value`` as a budget in nats: a finite number >= 0; ValueError naming ``name``."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number >= 0 (nats), got {value!r}")
    return float(value)


def check_allocation(value: object, name: str = "allocation") -> str:
    """``value`` as one of ``ALLOCATIONS``; ValueError naming ``name``."""
    if value not in ALLOCATIONS:
        raise ValueError(f"{name} must be one of {', '.join(ALLOCATIONS)}, got {value!r}")
    return value


def pinsker_bound(budget: float) -> float:
    """The largest |P(A) - Q(A)| over events A that KL(P || Q) <= budget allows: sqrt(B/2)."""
    return math.sqrt(budget / 2)
