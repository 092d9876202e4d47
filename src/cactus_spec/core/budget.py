"""A divergence budget for the whole answer: each drafted position's delta from what is left.

Cactus bounds each position: KL(law_t || q_t) <= delta. Over an answer those add up. A
budget B bounds the answer instead. By the chain rule, KL(P || Q) over whole sequences is
E_P[sum_t KL(P_t || Q_t)], P_t the law of token t given the tokens before it; P_t mixes the
laws law_t the sampler applied in the states (where the iteration started, what was kept)
that lead to that prefix, so by convexity KL(P_t || Q_t) <= E[KL(law_t || q_t) | prefix] and

    KL(P || Q) <= E_P[sum_t KL(law_t || q_t)].

``Budget.plan`` gives each drafted position of a chain a delta from what is left and charges
the exact KL of the law that delta makes (``audit``: the step law over the draft p, computed
before the draw); a position reached only if every earlier one of its chain emitted is
planned with what those left. ``Budget.charge`` then takes off the charges of the positions
that emitted. Every path thus sums at most B, so KL(P || Q) <= B, and by Pinsker
|P(A) - Q(A)| <= sqrt(B / 2) for every event A: "the answer passes its tests" included.

A position's delta does not depend on its own draft (only on what is left), so its law is
the step law over n ~ p, the same whether the iteration goes on or starts again there (the
draft's law given the prefix is the same): what is left after it is the same in both. When
the law the delta makes costs more than what is left (the closed form can pass delta), the
delta is halved until it fits (delta = 0, SpS, costs 0). A position whose KL cannot be
measured (a verifier without top-k or top-p, past ``audit.MAX_AUDIT_SUPPORT``) gets delta 0:
the budget's bound holds on every path, measured or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cactus_spec.core.audit import kl, one_hot_divergences, step_divergences
from cactus_spec.core.rules import Cactus

#: How many times a delta is halved before the position falls back to SpS.
_HALVINGS = 30


@dataclass(frozen=True)
class Plan:
    """One chain's per-position deltas, their Cactus target rows and exact costs."""

    deltas: list[float]
    targets: Tensor  # [K, V] Cactus(delta_j)'s h at draft j (blocks: its block target)
    costs: list[float]  # KL(law_j || q_j) in nats


@dataclass
class Budget:
    """What is left of ``total`` nats for one answer, each position at most ``cap`` (None:
    no cap), with Cactus's closed form or its exact bound."""

    total: float
    cap: float | None = None
    exact: bool = False
    spent: float = field(default=0.0)

    def __post_init__(self) -> None:
        check_budget(self.total)

    @property
    def left(self) -> float:
        return max(0.0, self.total - self.spent)

    def plan(self, q: Tensor, ids: Tensor, p: Tensor | None, block: bool = False) -> Plan:
        """Deltas for a chain's K drafts: q [K, V] the verifier's rows at them, ids [K] the
        drafts, p [K, V] the draft's law (None: deterministic drafts). ``greedy``: each
        position may take all that is left (up to the cap). ``block``: the targets are the
        rule's block targets (a block emits them: the cost is KL(t || q))."""
        left = self.left
        deltas, rows, costs = [], [], []
        for j in range(ids.shape[0]):
            wanted = left if self.cap is None else min(self.cap, left)
            p_j = None if p is None else p[j]
            delta, row, cost = self._fit(q[j], ids[j], p_j, wanted, left, block)
            deltas.append(delta)
            rows.append(row)
            costs.append(cost)
            left = max(0.0, left - cost)
        targets = torch.stack(rows) if rows else q[:0].float()
        return Plan(deltas, targets, costs)

    def charge(self, plan: Plan, emitted: int) -> None:
        """Take off the costs of the chain's first ``emitted`` drafted positions."""
        self.spent += sum(plan.costs[:emitted])

    def _fit(
        self, q: Tensor, n: Tensor, p: Tensor | None, delta: float, left: float, block: bool
    ) -> tuple[float, Tensor, float]:
        """The largest delta of delta, delta/2, ... whose law costs at most ``left``, its
        target row [V] and cost; delta 0 (q itself, SpS) when none does."""
        for _ in range(_HALVINGS):
            if delta <= 0:
                break
            rule = Cactus(delta, self.exact)
            if block:
                row = rule.block_target(q[None], n.reshape(1), None if p is None else p[None])[0]
                cost = float(kl(row, q))
            else:
                row, cost = rule.h(q, n, p), position_cost(q, n, p, rule)
            if math.isnan(cost):
                break  # not measurable: SpS
            if cost <= left:
                return delta, row, cost
            delta /= 2
        return 0.0, q.float(), 0.0


def position_cost(q: Tensor, n: Tensor, p: Tensor | None, rule: Cactus) -> float:
    """KL(law || q) in nats of one drafted position's law under ``rule``: q, p [V], n []."""
    if p is None:
        return float(one_hot_divergences(q[None], n.reshape(1).long(), rule)[0])
    return float(step_divergences(p[None].float(), q[None], rule)[0])


def check_budget(value: object, name: str = "kl_budget") -> float:
    """``value`` as a budget in nats: a finite number >= 0; ValueError naming ``name``."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (nats), got {value!r}")
    return float(value)


def pinsker_bound(budget: float) -> float:
    """The largest |P(A) - Q(A)| over events A that KL(P || Q) <= budget allows: sqrt(B/2)."""
    return math.sqrt(budget / 2)
