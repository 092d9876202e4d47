"""Batched chain verification: which drafted tokens to keep, and the next token.

For each row the drafter proposed K tokens ``n_1..n_K``; the verifier scored them
in one pass, giving K+1 rows of q (row K is the *bonus* distribution). Walking
the chain, position j is accepted with the rule's probability a_j; the first
rejection ends the chain and emits one token from the rule's residual at that
position; if every draft is accepted, a bonus token is drawn from q at row K.

Everything is vectorised over B, K and V: the acceptance test needs only
``h_n`` per position, and the residual is built for one gathered row per chain.
Random numbers: K+1 uniforms per row (K acceptance tests, one inverse-CDF draw).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cactus_spec.core.rules import Rule
from cactus_spec.core.sampling import Generators, check_generators, sample_inverse_cdf, uniforms

#: Allowed |row sum - 1| of probability rows, by input dtype.
SUM_TOLERANCE = {
    torch.float64: 1e-4,
    torch.float32: 1e-3,
    torch.bfloat16: 2e-2,
    torch.float16: 2e-2,
}


@dataclass(frozen=True)
class VerifyResult:
    """``tokens`` [B, K+1]: accepted drafts, then one recovered or bonus token, then -1.
    ``num_accepted`` [B]: how many drafts each row kept."""

    tokens: Tensor
    num_accepted: Tensor


def verify(
    draft_ids: Tensor,  # [B, K] int64
    verifier_probs: Tensor,  # [B, K+1, V]
    rule: Rule,
    draft_probs: Tensor | None = None,  # [B, K, V], None = one-hot drafts
    generator: Generators = None,
    greedy: bool = False,
    validate: bool = True,
) -> VerifyResult:
    """Verify a batch of drafted chains with ``rule``.

    ``generator`` is one ``torch.Generator`` or a sequence of B of them (row i
    draws from generator i, so a batch gives the same rows as each row alone).
    ``greedy=True`` is temperature 0: a draft is kept iff it equals argmax q, and
    the correction or bonus is argmax q. ``validate=False`` skips the input checks
    (for callers that build the probabilities themselves, like the engine).
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a Rule (SpS(), Cactus(delta), ...), got {_describe(rule)}")
    if validate:
        check_inputs(draft_ids, verifier_probs, draft_probs)
        check_generators(generator, draft_ids.shape[0])
    batch, k = draft_ids.shape
    q_drafted = verifier_probs[:, :k].float()  # [B, K, V]
    if greedy:
        accepted = draft_ids == q_drafted.argmax(-1)  # [B, K]
    else:
        u = uniforms(batch, k + 1, generator, draft_ids.device)  # [B, K+1]
        p = None if draft_probs is None else draft_probs.float()
        accepted = u[:, :k] < rule.accept_prob(q_drafted, draft_ids, p)  # [B, K]
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(batch, device=draft_ids.device)
    stop = num_accepted.clamp(max=k - 1)  # [B] position of the first rejection
    q_stop = q_drafted[rows, stop]  # [B, V]
    bonus = verifier_probs[:, k].float()  # [B, V]
    rejected = (num_accepted < k).unsqueeze(-1)  # [B, 1]
    if greedy:
        final = torch.where(rejected, q_stop, bonus).argmax(-1)  # [B]
    else:
        p_stop = None if draft_probs is None else draft_probs[rows, stop].float()
        resid = rule.residual(q_stop, draft_ids[rows, stop], p_stop)  # [B, V]
        final = sample_inverse_cdf(torch.where(rejected, resid, bonus), u[:, k])
    return VerifyResult(assemble(draft_ids, num_accepted, final), num_accepted)


def assemble(draft_ids: Tensor, num_accepted: Tensor, final: Tensor) -> Tensor:
    """[B, K+1] rows: kept drafts, the final token at column num_accepted, then -1."""
    batch, k = draft_ids.shape
    positions = torch.arange(k + 1, device=draft_ids.device)  # [K+1]
    padded = torch.cat([draft_ids, draft_ids.new_full((batch, 1), -1)], dim=1)  # [B, K+1]
    na = num_accepted.unsqueeze(-1)  # [B, 1]
    tokens = torch.where(positions < na, padded, -1)
    return torch.where(positions == na, final.unsqueeze(-1), tokens)


def check_inputs(draft_ids: Tensor, verifier_probs: Tensor, draft_probs: Tensor | None) -> None:
    """Raise ValueError naming the offending argument, shape or value."""
    if not isinstance(draft_ids, Tensor) or draft_ids.dim() != 2 or draft_ids.dtype != torch.int64:
        raise ValueError(
            f"draft_ids must be an int64 tensor of shape [B, K], got {_describe(draft_ids)}"
        )
    batch, k = draft_ids.shape
    if batch < 1:
        raise ValueError(f"draft_ids must hold B >= 1 rows, got shape {tuple(draft_ids.shape)}")
    if k < 1:
        raise ValueError(
            f"draft_ids must hold K >= 1 drafted tokens per row, got shape {tuple(draft_ids.shape)}"
        )
    _check_probs("verifier_probs", verifier_probs, (batch, k + 1), draft_ids.device)
    vocab = verifier_probs.shape[-1]
    if draft_probs is not None:
        draft_vocab = draft_probs.shape[-1] if isinstance(draft_probs, Tensor) else vocab
        if draft_vocab != vocab:
            raise ValueError(f"draft_probs has vocabulary {draft_vocab}, verifier_probs {vocab}")
        _check_probs("draft_probs", draft_probs, (batch, k), draft_ids.device)
    low, high = int(draft_ids.min()), int(draft_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"draft_ids must lie in [0, {vocab}), got values in [{low}, {high}]")
    if draft_probs is not None:
        p_n = draft_probs.gather(-1, draft_ids.unsqueeze(-1))
        if bool((p_n <= 0).any()):
            raise ValueError("draft_probs gives probability 0 to a drafted token in draft_ids")


def _check_probs(name: str, probs: Tensor, lead: tuple[int, int], device: torch.device) -> None:
    if not isinstance(probs, Tensor) or probs.dim() != 3 or tuple(probs.shape[:2]) != lead:
        raise ValueError(
            f"{name} must have shape [{lead[0]}, {lead[1]}, V], got {_describe(probs)}"
        )
    if probs.dtype not in SUM_TOLERANCE:
        allowed = ", ".join(str(d) for d in SUM_TOLERANCE)
        raise ValueError(f"{name} dtype must be one of {allowed}, got {probs.dtype}")
    if probs.device != device:
        raise ValueError(f"{name} is on {probs.device} but draft_ids is on {device}")
    sums = probs.sum(-1, dtype=torch.float32)  # [B, rows]; NaN propagates here
    if bool(torch.isnan(sums).any()):
        raise ValueError(f"{name} contains NaN")
    smallest = float(probs.amin())
    if smallest < 0:
        raise ValueError(f"{name} contains a negative probability ({smallest:g})")
    worst = float((sums - 1).abs().max())
    if worst > SUM_TOLERANCE[probs.dtype]:
        raise ValueError(
            f"{name} rows must sum to 1 within {SUM_TOLERANCE[probs.dtype]:g} for {probs.dtype}; "
            f"worst row is off by {worst:.3g}"
        )


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
