"""The target row that realises a rule in a standard speculative-sampling kernel.

Engines such as vLLM verify drafts with the standard kernel: at a position with draft
distribution p and drafted token n, given a *target* row t [V] (not necessarily summing to 1),

    accept n with probability  min(1, t_n / p_n)
    on rejection draw from     normalize(max(0, t - p))

With t = q this is exact speculative sampling. ``kernel_target`` gives, for any rule of
``rules``, the t under which that kernel emits exactly the rule's tokens:

- a generalised rule (SpS, Cactus, Interp, TopK): t = h, the rule's own target row (TopK's
  h is an indicator, which is why t need not be normalised);
- any other rule (TAS), from its acceptance probability a_n and residual r:

      t = a_n p_n e_n + (p + r) (1 - e_n)

  so t_n / p_n = a_n, and max(0, t - p) = r off n (r_n = 0 wherever rejection can happen).

``p=None`` is a one-hot draft at n (n-gram or greedy drafting), as in ``rules``.
"""

from __future__ import annotations

from torch import Tensor

from cactus_spec.core.rules import GeneralizedRule, Rule, draft_prob_at, draft_row


def kernel_target(rule: Rule, q: Tensor, draft_ids: Tensor, p: Tensor | None) -> Tensor:
    """The target row t for ``rule``: q [..., V], draft_ids [...], p [..., V] -> [..., V]."""
    q = q.float()
    p = None if p is None else p.float()
    if isinstance(rule, GeneralizedRule):
        return rule.h(q, draft_ids, p)
    accept = rule.accept_prob(q, draft_ids, p)  # [...]
    p_row = draft_row(p, draft_ids, q.shape[-1])  # [..., V]
    target = p_row + rule.residual(q, draft_ids, p)  # [..., V]
    at_draft = (accept * draft_prob_at(p, draft_ids)).unsqueeze(-1)  # [..., 1]
    return target.scatter(-1, draft_ids.unsqueeze(-1), at_draft)
