"""Exact one-step laws, acceptance probabilities and divergences.

For a draft n ~ p at one position, a rule accepts n with probability a(n) and
otherwise emits a token from its residual r_n. The emitted token follows

    law(x) = p(x) a(x) + sum_n p(n) (1 - a(n)) r_n(x)

which is q for SpS, and differs from the rule's h when h depends on n (Cactus).

Cost: the sum builds every residual r_n, an [S, S] matrix over the S tokens
passed in, so O(S^2) time and memory. Tokens outside supp(p) U supp(q) carry no
mass in p, q or any rule's law, so a real decode passes only that support
(``restrict_to_support``): with top-k = 20 on both models S <= 40 per position,
and a whole verified block is audited in one batched call (``step_divergences``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from cactus_spec.core.rules import Rule


def _check_pair(names: tuple[str, str], a: Tensor, b: Tensor) -> None:
    """TypeError unless a and b are tensors; ValueError unless one shape and no NaN."""
    for name, x in zip(names, (a, b), strict=True):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if a.shape != b.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, got {tuple(a.shape)} "
            f"and {tuple(b.shape)}"
        )
    for name, x in zip(names, (a, b), strict=True):
        if x.is_floating_point() and bool(torch.isnan(x).any()):
            raise ValueError(f"{name} contains NaN")


def _per_draft(p: Tensor, q: Tensor, rule: Rule) -> tuple[Tensor, Tensor]:
    """a(n) [..., S] and r_n [..., S(n), S(x)] for every possible draft n."""
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a Rule (SpS(), Cactus(delta), ...), got {rule!r}")
    size = q.shape[-1]
    ids = torch.arange(size, device=q.device).expand(q.shape)  # [..., S]
    q_rows = q.unsqueeze(-2).expand(*q.shape[:-1], size, size)  # [..., S, S]
    p_rows = p.unsqueeze(-2).expand(*p.shape[:-1], size, size)  # [..., S, S]
    return rule.accept_prob(q_rows, ids, p_rows), rule.residual(q_rows, ids, p_rows)


def step_law(p: Tensor, q: Tensor, rule: Rule) -> Tensor:
    """Exact distribution of the emitted token: p, q [..., S] -> [..., S] (float64)."""
    _check_pair(("p", "q"), p, q)
    p, q = p.double(), q.double()
    accept, resid = _per_draft(p.float(), q.float(), rule)
    kept = p * accept.double()  # [..., S]
    rejected_mass = (p * (1 - accept.double())).unsqueeze(-2)  # [..., 1, S]
    return kept + (rejected_mass @ resid.double()).squeeze(-2)


def acceptance_prob(p: Tensor, q: Tensor, rule: Rule) -> Tensor:
    """Probability that a draft n ~ p is accepted: sum_n p(n) a(n). [..., S] -> [...]."""
    _check_pair(("p", "q"), p, q)
    accept, _ = _per_draft(p.float(), q.float(), rule)
    return (p.double() * accept.double()).sum(-1)


def kl(a: Tensor, b: Tensor) -> Tensor:
    """KL(a || b) in nats over the last axis, 0 log 0 = 0; inf where a > 0 = b. Never below 0
    (rounding of two equal rows can give -1e-9)."""
    _check_pair(("a", "b"), a, b)
    a, b = a.double(), b.double()
    return (torch.special.xlogy(a, a) - torch.special.xlogy(a, b)).sum(-1).clamp(min=0.0)


def tv(a: Tensor, b: Tensor) -> Tensor:
    """Total variation distance: half the L1 distance over the last axis."""
    _check_pair(("a", "b"), a, b)
    return 0.5 * (a.double() - b.double()).abs().sum(-1)


#: Largest support the exact audit takes on: [S, S] float64 matrices are built.
MAX_AUDIT_SUPPORT = 4096


def support(*dists: Tensor | None, ids: Sequence[int] = ()) -> Tensor:
    """The tokens [S], sorted, where any row of any of ``dists`` [..., V] (None: none) is
    positive, and ``ids``: each distribution's largest entry per token, in its own dtype (so
    its smallest positives count), compared with 0; a maximum over the rows is one pass over
    V, five times faster than comparing every entry and reducing the comparisons."""
    given = [d for d in dists if d is not None]
    shown = given[0].new_zeros(given[0].shape[-1], dtype=torch.bool)  # [V]
    for d in given:
        if d.numel():
            shown |= d.reshape(-1, d.shape[-1]).amax(0) > 0
    shown[list(ids)] = True
    return shown.nonzero().squeeze(-1)


def restrict_to_support(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """p and q [..., V] restricted to the tokens where any row of either is positive -> [..., S]."""
    columns = support(p, q)  # [S]
    return p[..., columns], q[..., columns]


def lump_outside_q(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """p and q [..., V] on the tokens where any row of q is positive, plus one last token that
    holds each row's draft mass outside them (q = 0 there) -> [..., S+1].

    Exact for every rule of ``rules``: a drafted token n outside supp(q) has the same
    acceptance probability and the same residual whichever n it is (q_n = 0 gives SpS and
    Cactus h = q and a(n) = 0; TopK and TAS reject it; Interp accepts it with probability
    alpha and keeps the same residual), so all of them act as one token of their total mass,
    and the law outside supp(q) is the lumped token's. A draft with full support (vLLM's draft
    probabilities have no top-k) is then audited on the verifier's support alone.
    """
    return _lump(p, q, support(q))


def _lump(p: Tensor, q: Tensor, support: Tensor) -> tuple[Tensor, Tensor]:
    p_in, q_in = p[..., support], q[..., support]  # [..., S]
    rest = (1 - p_in.sum(-1, keepdim=True, dtype=torch.float64)).clamp(min=0.0)  # [..., 1]
    return torch.cat([p_in, rest.to(p.dtype)], -1), torch.cat(
        [q_in, torch.zeros_like(rest).to(q.dtype)], -1
    )


def step_divergences(p: Tensor, q: Tensor, rule: Rule) -> Tensor:
    """KL(law_i || q_i) in nats for each position i: p, q [P, V] -> [P] (float64).

    Each position is audited on its own verifier support (padded to the widest row's with
    tokens where p = q = 0, which no rule can emit), plus one token that holds the draft's
    mass outside it (``lump_outside_q``'s argument, row by row: exact), so a batch costs
    P S^2 for S the widest row's support, whatever its rows' supports together. A position
    whose verifier support exceeds MAX_AUDIT_SUPPORT tokens (an unrestricted vocabulary: no
    top-k or top-p) gives NaN, "not measured", rather than V x V matrices; the others are
    measured.
    """
    sizes = (q > 0).sum(-1)  # [P]
    narrow = sizes + 1 <= MAX_AUDIT_SUPPORT  # [P]
    out = torch.full(q.shape[:-1], float("nan"), dtype=torch.float64, device=q.device)
    if not bool(narrow.any()):
        return out
    if not bool(narrow.all()):
        p, q = p[narrow], q[narrow]  # [N, V]
    # each row's positive tokens, padded with zeros of q, in vocabulary order
    columns = q.topk(int(sizes[narrow].max()), -1).indices.sort(-1).values  # [N, S]
    q_in = q.gather(-1, columns)
    p_in = torch.where(q_in > 0, p.gather(-1, columns), torch.zeros_like(q_in))  # [N, S]
    rest = (1 - p_in.sum(-1, keepdim=True, dtype=torch.float64)).clamp(min=0.0)  # [N, 1]
    p_s = torch.cat([p_in, rest.to(p_in.dtype)], -1)  # [N, S+1]
    q_s = torch.cat([q_in, torch.zeros_like(rest).to(q_in.dtype)], -1)
    out[narrow] = kl(step_law(p_s, q_s, rule), q_s)
    return out


def one_hot_divergences(q: Tensor, draft_ids: Tensor, rule: Rule) -> Tensor:
    """KL(law_i || q_i) in nats for deterministic drafts: q [P, V], draft_ids [P] -> [P].

    With a one-hot draft at n the emitted law is a(n) e_n + (1 - a(n)) r_n, one row per
    position. Every rule's law lies on supp(q) and n (its h and residual do), so the rows
    are cut to the union of those tokens first: exact, and O(P S) for a top-k or top-p q.
    """
    q = q.float()
    keep = (q > 0).any(0)  # [V]
    keep[draft_ids] = True
    columns = keep.nonzero().squeeze(-1)  # [S], sorted
    q = q[:, columns]  # [P, S]
    ids = torch.searchsorted(columns, draft_ids)  # [P], positions within the S columns
    accept = rule.accept_prob(q, ids, None).double().unsqueeze(-1)  # [P, 1]
    law = (1 - accept) * rule.residual(q, ids, None).double()  # [P, S]
    law = law.scatter_add(-1, ids.unsqueeze(-1), accept)
    return kl(law, q)


def reported_kl(kl_nats: float | None) -> dict[str, float | bool | None]:
    """A meter reading as JSON can carry it: ``kl_nats`` finite, or None with
    ``kl_unbounded`` true. A rule whose law puts mass where q has none (interp, TAS, top-k
    at a temperature above 0) has KL(law || q) = inf: true, and not a JSON number."""
    if kl_nats is None or not math.isfinite(kl_nats):
        return {"kl_nats": None, "kl_unbounded": True}
    return {"kl_nats": kl_nats + 0.0, "kl_unbounded": False}  # + 0.0: -0.0 reads 0
