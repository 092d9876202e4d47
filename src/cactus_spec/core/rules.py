"""Acceptance rules for speculative sampling.

Notation (see docs/DESIGN.md): ``p`` is the draft distribution at a position, ``q`` the
verifier's, ``n`` the drafted token. Every rule answers two questions for a drafted
token: how likely it is to be accepted (``accept_prob``) and, on rejection, which
distribution the replacement token is drawn from (``residual``).

All rules but TAS are *generalised speculative sampling* towards a target ``h``:

    accept n with probability  min(1, h_n / p_n)
    on rejection draw from     normalize(max(0, h - p))

which emits exactly ``h`` when ``h`` does not depend on ``n``. Each such rule
exposes ``h(q, draft_ids, p)`` (the whole row) and ``h_at_draft`` (just ``h_n``,
cheap, so verification never materialises ``h`` for accepted positions).

``p=None`` means a deterministic drafter: ``p`` is one-hot at the drafted token.
Tensors are float32 here; ``verify`` casts inputs before calling a rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cactus_spec.core.kl_target import kl_target
from cactus_spec.core.sampling import one_hot

#: Bisection steps for the exact Cactus bound: float64 halves [q_n, 1] to below 1e-12,
#: well under a float32 ulp of the result.
_BISECTION_STEPS = 40


def gather_last(x: Tensor, ids: Tensor) -> Tensor:
    """``x[..., ids]`` per position: x [..., V], ids [...] -> [...]."""
    return x.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def draft_row(p: Tensor | None, draft_ids: Tensor, vocab_size: int) -> Tensor:
    """The full draft distribution [..., V]; one-hot at ``draft_ids`` when ``p`` is None."""
    return p if p is not None else one_hot(draft_ids, vocab_size)


def draft_prob_at(p: Tensor | None, draft_ids: Tensor) -> Tensor:
    """``p_n`` [...]; 1 for a deterministic drafter."""
    if p is None:
        return torch.ones(draft_ids.shape, dtype=torch.float32, device=draft_ids.device)
    return gather_last(p, draft_ids)


def normalize(x: Tensor, fallback: Callable[[], Tensor]) -> Tensor:
    """Rows of ``x`` [..., V] scaled to sum 1; rows summing to 0 take ``fallback()`` instead
    (built only when such a row exists: one pass over x in the common case)."""
    total = x.sum(-1, keepdim=True)  # [..., 1]
    empty = total <= 0
    if not bool(empty.any()):
        return x / total
    return torch.where(empty, fallback(), x / torch.where(empty, 1.0, total))


def _is_number(value: object) -> bool:
    """A real int or float (a bool is not a number here: ``delta=True`` is a mistake)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_unit_interval(name: str, value: float) -> None:
    if not (_is_number(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


class Rule:
    """Base of every rule: acceptance probability and residual of a drafted token."""

    #: True when the emitted tokens follow q exactly.
    lossless: bool = False
    #: True when the rule has a per-position target for block verification.
    verifies_blocks: bool = False
    #: True when the rule's bound is a KL per position that an answer's budget can set
    #: position by position (``core.budget``).
    spends_budget: bool = False

    def accept_prob(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        """Probability of accepting ``draft_ids``: q [..., V], ids [...], p [..., V] -> [...]."""
        raise NotImplementedError

    def residual(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        """Distribution of the replacement token on rejection: -> [..., V]."""
        raise NotImplementedError

    def block_target(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        """The target t [..., V] block verification emits at each drafted position: a
        function of q and p only, so the position's law is t itself (``verifies_blocks``)."""
        raise ValueError(f"{type(self).__name__} has no block target; it verifies chains")


class GeneralizedRule(Rule):
    """Generalised speculative sampling towards a target ``h`` (see module docstring)."""

    def h(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        """The target row ``h`` for the drafted token: q [..., V] -> [..., V]."""
        raise NotImplementedError

    def h_at_draft(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        """``h_n`` [...] without building the whole row."""
        return gather_last(self.h(q, draft_ids, p), draft_ids)

    def accept_prob(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        """min(1, h_n / p_n)."""
        p_n = draft_prob_at(p, draft_ids)  # [...]
        h_n = self.h_at_draft(q, draft_ids, p)  # [...]
        ratio = h_n / torch.where(p_n > 0, p_n, torch.ones_like(p_n))
        return torch.where(p_n > 0, ratio.clamp(max=1.0), torch.ones_like(ratio))

    def residual(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        """normalize(max(0, h - p)); when that is all zero (rejection impossible), h itself."""
        h = self.h(q, draft_ids, p)  # [..., V]
        excess = (h - draft_row(p, draft_ids, q.shape[-1])).clamp_(min=0.0)  # [..., V]
        return normalize(excess, lambda: normalize(h.clamp(min=0.0), lambda: q))


@dataclass(frozen=True)
class SpS(GeneralizedRule):
    """Exact speculative sampling: h = q, so the output follows q exactly."""

    lossless = True
    verifies_blocks = True

    def h(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        return q

    def block_target(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        return q

    def h_at_draft(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        return gather_last(q, draft_ids)


def binary_kl(a: Tensor, b: Tensor) -> Tensor:
    """KL(Bernoulli(a) || Bernoulli(b)) in nats, elementwise, with 0 log 0 = 0."""
    a, b = torch.broadcast_tensors(a, b)
    first = torch.where(a > 0, a * (torch.log(a) - torch.log(b)), torch.zeros_like(a))
    second = torch.where(a < 1, (1 - a) * (torch.log1p(-a) - torch.log1p(-b)), torch.zeros_like(a))
    return first + second


def exact_cactus_bound(q_n: Tensor, delta: float) -> Tensor:
    """Largest gamma in [q_n, 1] with binary KL(gamma || q_n) <= delta, elementwise.

    The binary KL is increasing in gamma on [q_n, 1] and equals -log q_n at gamma = 1,
    so gamma = 1 when -log q_n <= delta, else a bisection in float64. The result is
    rounded *down* to the input dtype so the bound still holds after rounding.
    """
    q64 = q_n.double()
    lo, hi = q64.clone(), torch.ones_like(q64)
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        within = binary_kl(mid, q64) <= delta
        lo = torch.where(within, mid, lo)
        hi = torch.where(within, hi, mid)
    whole = (q64 > 0) & (-torch.log(q64.clamp(min=1e-300)) <= delta)
    gamma = torch.where(whole, torch.ones_like(q64), lo)
    rounded = gamma.to(q_n.dtype)
    too_high = rounded.double() > gamma
    return torch.where(too_high, torch.nextafter(rounded, q_n), rounded)


@dataclass(frozen=True)
class Cactus(GeneralizedRule):
    """Constrained acceptance speculative sampling (Hao & Mou, ICLR 2026).

    Raise the drafted token's target mass and scale the rest proportionally:

        h_n = min(1, q_n + sqrt(2 delta q_n (1 - q_n)))        (closed form)
        h_x = q_x (1 - h_n) / (1 - q_n)   for x != n

    so KL(h || q) = binary KL(h_n || q_n) ~= delta to second order. With
    ``exact=True``, h_n is the largest gamma in [q_n, 1] with binary KL <= delta,
    so KL(h || q) <= delta for every drafted token. delta = 0 gives h = q (SpS).

    On blocks the budget is spent per position instead (``block_target``): the target t
    within KL delta of q that overlaps p most (``kl_target``), which block verification
    emits exactly, so KL(law || q) <= delta at every position whatever ``exact``.
    """

    delta: float
    exact: bool = False
    verifies_blocks = True
    spends_budget = True

    def __post_init__(self) -> None:
        valid = _is_number(self.delta) and math.isfinite(self.delta)
        if not valid or self.delta < 0:
            raise ValueError(f"delta must be a finite number >= 0, got {self.delta!r}")
        if not isinstance(self.exact, bool):
            raise ValueError(f"exact must be a bool, got {self.exact!r}")

    def h_at_draft(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        q_n = gather_last(q, draft_ids)  # [...]
        if self.exact:
            return exact_cactus_bound(q_n, self.delta)
        step = torch.sqrt(2 * self.delta * q_n * (1 - q_n).clamp(min=0.0))
        return (q_n + step).clamp(max=1.0)

    def h(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        q_n = gather_last(q, draft_ids)  # [...]
        h_n = self.h_at_draft(q, draft_ids, p)  # [...]
        room = 1 - q_n
        scale = torch.where(room > 0, (1 - h_n) / torch.where(room > 0, room, 1.0), 0.0)
        h = q * scale.unsqueeze(-1)  # [..., V]
        return h.scatter_(-1, draft_ids.unsqueeze(-1), h_n.unsqueeze(-1))  # h is ours

    def block_target(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        return kl_target(q, draft_row(p, draft_ids, q.shape[-1]), self.delta)


@dataclass(frozen=True)
class Interp(GeneralizedRule):
    """Interpolation towards the draft: h = alpha p + (1 - alpha) q. Unbounded divergence."""

    alpha: float

    def __post_init__(self) -> None:
        _check_unit_interval("alpha", self.alpha)

    def h(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        return self.alpha * draft_row(p, draft_ids, q.shape[-1]) + (1 - self.alpha) * q

    def h_at_draft(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        p_n = draft_prob_at(p, draft_ids)
        return self.alpha * p_n + (1 - self.alpha) * gather_last(q, draft_ids)


@dataclass(frozen=True)
class TopK(GeneralizedRule):
    """Accept iff q_n is among the k largest of q.

    As generalised speculative sampling, h = 1[top-k(q)] (an indicator, not a
    distribution): min(1, h_n / p_n) is 1 inside the top k and 0 outside, and the
    residual is normalize(max(0, 1[top-k(q)] - p)). Ties with the k-th value count
    as inside; tokens with q = 0 never do (when q has fewer than k tokens).
    """

    k: int

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")

    def _kth_largest(self, q: Tensor) -> Tensor:
        k = min(self.k, q.shape[-1])
        return q.topk(k, dim=-1).values[..., -1:]  # [..., 1]

    def h(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        return ((q >= self._kth_largest(q)) & (q > 0)).to(torch.float32)

    def h_at_draft(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        q_n = gather_last(q, draft_ids)
        return ((q_n >= self._kth_largest(q).squeeze(-1)) & (q_n > 0)).to(torch.float32)


def entropy(q: Tensor) -> Tensor:
    """Shannon entropy in nats of rows q [..., V] -> [...], with 0 log 0 = 0."""
    return torch.special.entr(q).sum(-1)


@dataclass(frozen=True)
class TAS(Rule):
    """Typical acceptance (Medusa; vLLM's typical acceptance sampler).

    Accept n deterministically iff q_n > min(epsilon, alpha * exp(-H(q))); on the
    first rejection emit argmax q. The drafter's probabilities are not used and
    the divergence from q is unbounded.
    """

    epsilon: float = 0.09
    alpha: float = 0.3

    def __post_init__(self) -> None:
        _check_unit_interval("epsilon", self.epsilon)
        _check_unit_interval("alpha", self.alpha)

    def threshold(self, q: Tensor) -> Tensor:
        """min(epsilon, alpha * exp(-H(q))): q [..., V] -> [...]."""
        return torch.clamp(self.alpha * torch.exp(-entropy(q)), max=self.epsilon)

    def accept_prob(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        return (gather_last(q, draft_ids) > self.threshold(q)).to(torch.float32)

    def residual(self, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
        return one_hot(q.argmax(-1), q.shape[-1])
