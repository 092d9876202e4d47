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
- ``marginal``: a row is funded (all that is left, as greedy) only when its worth, the
  acceptance Cactus at the cap adds to SpS's per nat its law costs, passes a water level: the
  worth above which the rows seen so far in the answer, repeated over the L - m - d tokens
  still to come at the rate they came, would spend what is left. The worthiest rows are
  funded first wherever they fall; the others are judged as SpS.

Each allocation sets a row's delta from the state before its draw (what is left, the rows
seen), never from the draw, so the bound above holds for all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cactus_spec.core.audit import (
    acceptance_prob,
    kl,
    one_hot_divergences,
    step_divergences,
    support,
)
from cactus_spec.core.rules import Cactus, SpS
from cactus_spec.core.sampling import one_hot
from cactus_spec.core.tree_verification import ROOT, TokenTree

#: How a row's allowance is set from what is left (the module docstring).
ALLOCATIONS = ("greedy", "paced", "marginal")
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
    most ``length`` tokens (None: unknown; ``paced`` and ``marginal`` then allow what is
    left)."""

    total: float
    cap: float | None = None
    exact: bool = False
    allocation: str = ALLOCATIONS[0]
    length: int | None = None
    spent: float = field(default=0.0)
    emitted: int = field(default=0)  # the answer's tokens so far (``paced``, ``marginal``)
    seen: list[tuple[float, float]] = field(default_factory=list)  # (worth, cost): marginal

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
            p_row = None if p is None else p[first]
            n = torch.tensor(tree.tokens[first], device=q.device)
            cut = Support.of(q[row], n, p_row)
            allowed = self._allowance(left, len(tree.path(node)), cut, block)
            fit = self._fit(cut, self._first_delta(allowed), allowed, block)
            deltas[row], targets[row], costs[row] = fit
            for kid in kids:
                before[kid] = before[node] + costs[row]
        return Plan(deltas, targets, costs)

    def charge(self, plan: Plan, rows: list[int], tokens: int) -> None:
        """Take off the costs of the ``rows`` that emitted; ``tokens`` were emitted."""
        self.spent += sum(plan.costs[r] for r in rows)
        self.emitted += tokens

    def _first_delta(self, allowed: float) -> float:
        return _SNUG * allowed if self.cap is None else min(self.cap, _SNUG * allowed)

    def _allowance(self, left: float, depth: int, row: Support, block: bool) -> float:
        """What a row at ``depth`` in its draft may cost, ``left`` being left on its path."""
        if self.allocation == "greedy" or self.length is None:
            return left
        remaining = max(1, self.length - self.emitted - depth)
        if self.allocation == "paced":
            return left / remaining
        delta = self._first_delta(left)
        if left < NEGLIGIBLE or delta <= 0:
            return left
        _, cost = self._law(row, delta, block)
        if math.isnan(cost):
            return left  # not measurable: _fit judges it SpS-wise
        worth = self._gain(row, delta, block) / cost if cost > 0 else math.inf
        level = _water_level(self.seen, left, remaining)
        self.seen.append((worth, cost))
        return left if worth > level else 0.0

    def _gain(self, row: Support, delta: float, block: bool) -> float:
        """The acceptance Cactus(delta) adds to SpS's at a row: for a chain, the chance that a
        draft n ~ p is kept (one-hot drafts: h_n - q_n); for blocks and trees, the overlap of
        p with the target over that with q."""
        rule = Cactus(delta, self.exact)
        if block:
            p = row.p if row.p is not None else one_hot(row.n.reshape(1), row.q.shape[-1])[0]
            target = rule.block_target(row.q[None], row.n.reshape(1), p[None])[0]
            return float(torch.minimum(p, target).sum() - torch.minimum(p, row.q).sum())
        if row.p is None:
            return float(rule.h_at_draft(row.q, row.n, None) - row.q[row.n])
        return float(acceptance_prob(row.p, row.q, rule) - acceptance_prob(row.p, row.q, SpS()))

    def _law(self, row: Support, delta: float, block: bool) -> tuple[Tensor, float]:
        """Cactus(delta)'s target row [S] at a drafted position and its law's KL to q."""
        rule = Cactus(delta, self.exact)
        if block:
            target = rule.block_target(row.q[None], row.n.reshape(1), _batch(row.p))[0]
            return target, float(kl(target, row.q))
        return rule.h(row.q, row.n, row.p), position_cost(row.q, row.n, row.p, rule)

    def _fit(
        self, row: Support, delta: float, allowed: float, block: bool
    ) -> tuple[float, Tensor, float]:
        """A delta whose law costs at most ``allowed``, its target row [V] and cost: ``delta``
        if it fits, else scaled down (at least halved) by (allowed / cost)^(1 / s), s the
        cost's log-log slope in delta over the last two tries, until one does; delta 0 (q
        itself, SpS) when none does or less than ``NEGLIGIBLE`` is allowed."""
        if allowed < NEGLIGIBLE:
            return 0.0, row.full, 0.0
        last = None  # the previous (delta, cost): the cost's slope in delta, log-log
        for _ in range(_TRIES):
            if delta <= 0:
                break
            target, cost = self._law(row, delta, block)
            if math.isnan(cost):
                break  # not measurable: SpS
            if cost <= allowed:
                return delta, row.widen(target), cost
            slope = _slope(last, delta, cost)
            last = delta, cost
            delta *= min(0.5, (_AIM * allowed / cost) ** (1 / slope))
        return 0.0, row.full, 0.0


@dataclass(frozen=True)
class Support:
    """One judged row cut to the tokens q, p or the draft n hold (no law reaches the others):
    q, p [S] (p None: a deterministic draft), n [] its index there, ``columns`` [S] the
    tokens, ``full`` q's whole row [V] as float."""

    q: Tensor
    p: Tensor | None
    n: Tensor
    columns: Tensor
    full: Tensor

    @classmethod
    def of(cls, q: Tensor, n: Tensor, p: Tensor | None) -> Support:
        """The row of q [V] with draft n [] drawn from p [V] (None: deterministic)."""
        columns = support(q, p, ids=[int(n)])  # [S]
        p_s = None if p is None else p[columns].float()
        return cls(q[columns].float(), p_s, torch.searchsorted(columns, n), columns, q.float())

    def widen(self, target: Tensor) -> Tensor:
        """A target [S] as a row over the whole vocabulary [V]."""
        return torch.zeros_like(self.full).index_copy(0, self.columns, target.float())


def _water_level(seen: list[tuple[float, float]], left: float, remaining: int) -> float:
    """The worth (acceptance per nat) above which the rows seen so far, repeated over the
    ``remaining`` tokens at the rate they came, would spend what is ``left``: rows above it
    are funded, the worthiest first; -inf when all of them fit."""
    if not seen:
        return -math.inf
    rate, spend = remaining / len(seen), 0.0
    for worth, cost in sorted(seen, reverse=True):
        spend += rate * cost
        if spend > left:
            return worth
    return -math.inf


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
    return float(value) + 0.0  # -0.0 is 0


def check_allocation(value: object, name: str = "allocation") -> str:
    """``value`` as one of ``ALLOCATIONS``; ValueError naming ``name``."""
    if value not in ALLOCATIONS:
        raise ValueError(f"{name} must be one of {', '.join(ALLOCATIONS)}, got {value!r}")
    return value


def pinsker_bound(budget: float) -> float:
    """The largest |P(A) - Q(A)| over events A that KL(P || Q) <= budget allows:
    min(1, sqrt(B / 2)) (a probability moves by 1 at most, so past B = 2 Pinsker says nothing)."""
    return min(1.0, math.sqrt(budget / 2))
