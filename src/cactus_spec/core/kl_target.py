"""The target within a KL budget of q that a draft p matches best: Cactus at one position.

Verified towards a target t (accept n with min(1, t_n / p_n), else draw from
norm(max(0, t - p))), a position accepts with probability sum_x min(p_x, t_x). Among the
targets with KL(t || q) <= delta, the one accepting most solves

    maximise  sum_x min(p_x, t_x)   subject to   KL(t || q) <= delta,  sum_x t_x = 1,

and its optimality conditions give t = clip(p, a q, b q) with a <= 1 <= b: a draft token
the verifier likes less than the draft is raised towards p up to b q, one it likes more is
lowered towards p down to a q, the rest keep p, and nothing leaves q's support. The two
numbers are fixed by the sum and the budget. With tokens sorted by r = p / q, writing
Q(a) = sum_{r < a} q, P(a) = sum_{r < a} p and L = sum p log r over the middle,

    sum t  = a Q(a) - P(a) + P(b+) + b (1 - Q(b+))       (b+: r <= b)
    KL     = a log a Q(a) + L(a, b) + b log b (1 - Q(b+)),

so for each b, a follows from one search along the sorted ratios (a Q(a) - P(a) increases
with a), and b is the largest value whose KL stays within delta (an interval search, 15
points a round; the KL grows with b along this path, from 0 at b = 1). The KL bound holds
exactly, not to second order.

Unlike Cactus's per-token h (``rules.Cactus``), this t depends on p and q only, not on the
drafted token, so any lossless verifier (a chain, a block, a tree) emits t itself at the
position: the step law is t and the meter reads KL(t || q) <= delta. For a one-hot draft
it is Cactus(exact)'s h: the drafted token raised to the largest q_n-ratio the budget
allows, the rest scaled down alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The search for log b splits [0, log r_max] into _SPLIT + 1 parts per round, _ROUNDS
#: times: 16^12 = 2^48, float64 well below float32 rounding, in a quarter of the rounds a
#: bisection takes (each round is a few small tensor operations: their dispatch is the cost).
_SPLIT = 15
_ROUNDS = 12


def kl_target(q: Tensor, p: Tensor, delta: float) -> Tensor:
    """t [..., V] for q, p [..., V] (float32 out): the argmax of sum min(p, t) over
    KL(t || q) <= delta (see the module docstring)."""
    if delta <= 0:
        return q.float()
    shape = q.shape
    q_rows, p_rows = q.reshape(-1, shape[-1]), p.reshape(-1, shape[-1])  # [R, V]
    # t is 0 off q's support and p there counts nowhere: solve on the union of q's supports
    used = (q_rows > 0).any(0).nonzero().squeeze(-1)  # [S] (top-k: small)
    t = _solve(q_rows[:, used].double(), p_rows[:, used].double(), delta)  # [R, S]
    out = torch.zeros(q_rows.shape, dtype=torch.float32, device=q.device)
    out[:, used] = t.float()
    return out.reshape(shape)


def _solve(q64: Tensor, p64: Tensor, delta: float) -> Tensor:
    """t [R, S] for float64 q, p [R, S]."""
    inside = q64 > 0
    ratio = torch.where(inside, p64 / q64.clamp_min(1e-300), -1.0)  # [R, V]; -1 off q
    r, order = ratio.sort(-1)  # [R, V] ascending
    q_s, p_s = q64.gather(-1, order), torch.where(r >= 0, p64.gather(-1, order), 0.0)
    plogr = torch.where(p_s > 0, p_s * torch.log(r.clamp_min(1e-300)), 0.0)
    sums = _Prefix(r, q_s, p_s, plogr)
    hi = torch.log(r[:, -1:].clamp_min(1.0))  # [R, 1]
    lo = torch.zeros_like(hi)
    parts = torch.arange(1, _SPLIT + 1, dtype=hi.dtype, device=hi.device) / (_SPLIT + 1)  # [M]
    for _ in range(_ROUNDS):
        mids = lo + (hi - lo) * parts  # [R, M] ascending
        within = (sums.kl(torch.exp(mids)) <= delta).long()  # [R, M]
        # the KL grows with b; counting the leading points that fit keeps lo a point that
        # fits (the bound stays exact) even where rounding breaks the order
        fits = within.cumprod(-1).sum(-1, keepdim=True)  # [R, 1]
        lo = torch.where(fits > 0, mids.gather(-1, (fits - 1).clamp_min(0)), lo)
        hi = torch.where(fits < _SPLIT, mids.gather(-1, fits.clamp_max(_SPLIT - 1)), hi)
    b = torch.exp(lo)  # [R, 1]
    a = sums.a_for(b)  # [R, 1]
    t = torch.clamp(p64, min=a * q64)
    t = torch.minimum(t, b * q64)  # [R, V]; 0 wherever q is
    return t / t.sum(-1, keepdim=True)


class _Prefix:
    """Prefix sums along tokens sorted by r = p / q (r = -1 off q's support, first)."""

    def __init__(self, r: Tensor, q_s: Tensor, p_s: Tensor, plogr: Tensor) -> None:
        zero = r.new_zeros(r.shape[0], 1)
        self.r = r.contiguous()  # [R, V]
        self.q = torch.cat([zero, q_s.cumsum(-1)], -1)  # [R, V+1]: sum over the first i
        self.p = torch.cat([zero, p_s.cumsum(-1)], -1)
        self.plogr = torch.cat([zero, plogr.cumsum(-1)], -1)
        self.off = (r < 0).sum(-1, keepdim=True)  # [R, 1] tokens off q's support
        self.q_total = self.q[:, -1:]  # [R, 1]
        # F at each breakpoint a = r_i: a Q(a) - P(a) over q's support (increasing in a;
        # -inf before the support, so a search lands on it)
        f = r * (self.q[:, :-1] - self.q.gather(-1, self.off)) - (
            self.p[:, :-1] - self.p.gather(-1, self.off)
        )  # [R, V]
        before = torch.arange(r.shape[-1], device=r.device) < self.off
        self.f = torch.where(before, -torch.inf, f).contiguous()

    def _below(self, values: Tensor, right: bool) -> Tensor:
        """[R, M] count of tokens with r < value (r <= value when ``right``), values [R, M]."""
        return torch.searchsorted(self.r, values.contiguous(), right=right)

    def _sum(self, table: Tensor, count: Tensor) -> Tensor:
        return table.gather(-1, count) - table.gather(-1, self.off)

    def a_for(self, b: Tensor) -> Tensor:
        """[R, M] the a in [0, 1] making sum clip(p, a q, b q) = 1 for each b [R, M]."""
        upto_b = self._below(b, right=True)  # [R, M]
        above_q = self.q_total - self.q.gather(-1, upto_b)
        need = 1 - self._sum(self.p, upto_b) - b * above_q  # F(a) = need
        at = torch.searchsorted(self.f, need.contiguous(), right=True)  # [R, M]
        at = torch.maximum(at, self.off + 1) - 1  # the last breakpoint with F <= need
        q_below = self._sum(self.q, at + 1)  # tokens with r <= r_at: they sit at a q
        p_below = self._sum(self.p, at + 1)
        a = (need + p_below) / q_below.clamp_min(1e-300)
        return a.clamp(0.0, 1.0)

    def kl(self, b: Tensor) -> Tensor:
        """[R, M] KL(clip(p, a q, b q) || q) with a = ``a_for(b)``, b [R, M]; +inf where even
        a = 0 leaves more than unit mass (b too large)."""
        a = self.a_for(b)
        low = self._below(a, right=False)  # r < a: at a q
        upto_b = self._below(b, right=True)  # r <= b: at p; above: at b q
        q_low = self._sum(self.q, low)
        q_high = self.q_total - self.q.gather(-1, upto_b)
        middle = self.plogr.gather(-1, upto_b) - self.plogr.gather(-1, torch.maximum(low, self.off))
        mass = a * q_low + self._sum(self.p, upto_b) - self._sum(self.p, low) + b * q_high
        kl = torch.xlogy(a, a) * q_low + middle + torch.xlogy(b, b) * q_high
        return torch.where(mass <= 1 + 1e-9, kl, torch.inf)
