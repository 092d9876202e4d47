"""Block verification (Sun et al., ICLR 2025): one drafted chain judged as a whole.

Token verification (``verification.verify``) accepts draft i with min(1, q_n / p_n) on its
own and stops at the first rejection. Block verification carries a weight along the chain,

    w_0 = 1,    w_i = min(1, w_{i-1} q_{i-1}(n_i) / p_{i-1}(n_i))      (i = 1..K)

(q_j, p_j: the rows after the first j drafts; n_i the i-th draft), and stops after draft i
with probability

    h_i = m_i / (m_i + 1 - w_i),   m_i = sum_x max(0, w_i q_i(x) - p_i(x))   (i < K; 1 if w_i = 1)
    h_K = w_K.

The kept prefix is the longest i whose independent uniform falls below h_i (none: 0), and
the token after it is drawn from norm(max(0, w_i q_i - p_i)), or from q_K when every draft
is kept. The output follows the verifier's law exactly (lossless, like SpS), and the
expected number of kept drafts is the largest any verifier of one chain can reach given
only the chain's rows, never below token verification's. With K = 1 the two coincide
draw for draw. The residual's weight lets a rejection at position i "give back" the mass
an earlier accepted draft took from the rows after it, which is where the extra drafts
come from.

Block verification is exact for any target that is a function of each position's prefix,
so a lossy rule joins it through a per-position target t (``Rule.block_target``; Cactus's is
``kl_target``): the output then follows t at every drafted position, and KL(t || q) is what
the position costs. At temperature 0 there is nothing to gain (every weight is 0 or 1):
``verify`` serves it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cactus_spec.core.rules import Rule, draft_prob_at, draft_row, gather_last, normalize
from cactus_spec.core.sampling import Generators, check_generators, sample_inverse_cdf, uniforms
from cactus_spec.core.verification import VerifyResult, assemble, check_inputs


def chain_weights(draft_ids: Tensor, q: Tensor, p: Tensor | None) -> Tensor:
    """w_1..w_K [B, K] for drafts [B, K], q [B, K+1, V] and p [B, K, V] (None: one-hot)."""
    q_n = gather_last(q[:, :-1], draft_ids)  # [B, K]
    p_n = draft_prob_at(p, draft_ids)  # [B, K]
    ratio = q_n / p_n  # [B, K]; p_n > 0 for a drafted token
    weights = []
    w = torch.ones_like(ratio[:, 0])  # [B]
    for i in range(ratio.shape[1]):
        w = torch.clamp(w * ratio[:, i], max=1.0)
        weights.append(w)
    return torch.stack(weights, dim=1)  # [B, K]


def stop_probs(draft_ids: Tensor, q: Tensor, p: Tensor | None) -> tuple[Tensor, Tensor]:
    """(h [B, K], w [B, K]): the probability of stopping after draft i = 1..K and the weights."""
    w = chain_weights(draft_ids, q, p)  # [B, K]
    k = draft_ids.shape[1]
    inner = w[:, :-1]  # [B, K-1] weights of the positions followed by another draft
    p_next = draft_row(p, draft_ids, q.shape[-1])[:, 1:]  # [B, K-1, V] rows 1..K-1
    mass = torch.clamp(inner.unsqueeze(-1) * q[:, 1:k] - p_next, min=0).sum(-1)  # [B, K-1]
    denominator = mass + 1 - inner
    h_inner = torch.where(inner >= 1, 1.0, mass / denominator.clamp_min(1e-30))
    return torch.cat([h_inner, w[:, -1:]], dim=1), w


def verify_block(
    draft_ids: Tensor,  # [B, K] int64
    verifier_probs: Tensor,  # [B, K+1, V]
    draft_probs: Tensor | None = None,  # [B, K, V], None = one-hot drafts
    generator: Generators = None,
    validate: bool = True,
    rule: Rule | None = None,
) -> VerifyResult:
    """Block-verify a batch of drafted chains; the same result type as ``verify``.

    ``rule`` (default SpS) names the target of the drafted positions, its ``block_target``
    (q for SpS; the output then follows it exactly); the bonus row stays q. Random numbers:
    K+1 uniforms per row (K stopping tests, one inverse-CDF draw), the same stream as
    ``verify`` (with K = 1 and SpS both emit the same tokens).
    """
    if validate:
        check_inputs(draft_ids, verifier_probs, draft_probs)
        check_generators(generator, draft_ids.shape[0])
    batch, k = draft_ids.shape
    p = None if draft_probs is None else draft_probs.float()
    q = verifier_probs.float()  # [B, K+1, V]
    if rule is not None and not rule.lossless:
        drafted = rule.block_target(q[:, :k], draft_ids, p)  # [B, K, V]
        q = torch.cat([drafted, q[:, k:]], dim=1)  # [B, K+1, V]: the targets, then q
    h, w = stop_probs(draft_ids, q, p)  # [B, K] each
    u = uniforms(batch, k + 1, generator, draft_ids.device)  # [B, K+1]
    positions = torch.arange(1, k + 1, device=draft_ids.device)  # [K]
    kept = torch.where(u[:, :k] < h, positions, 0).amax(-1)  # [B]
    rows = torch.arange(batch, device=draft_ids.device)
    q_stop = q[rows, kept]  # [B, V]; row K is the bonus row
    w_stop = torch.cat([w.new_ones(batch, 1), w], dim=1)[rows, kept]  # [B]
    p_full = draft_row(p, draft_ids, q.shape[-1])  # [B, K, V]
    p_stop = p_full[rows, kept.clamp(max=k - 1)]  # [B, V]
    rejected = (kept < k).unsqueeze(-1)  # [B, 1]
    excess = torch.clamp(w_stop.unsqueeze(-1) * q_stop - p_stop, min=0)  # [B, V]
    target = torch.where(rejected, excess, q_stop)
    final = sample_inverse_cdf(normalize(target, lambda: q_stop), u[:, k])  # [B]
    return VerifyResult(assemble(draft_ids, kept, final), kept)
