"""What the rule-aware samplers of both vLLM runners (``sampler``, ``sampler_v2``) share about
one verification call.

The plugin sets ``Current.requests`` around each call (``calling``): each request's id and
the spec it asks for, by the index its runner's sampler reads it at. A sampled row that asks
for a rule is a ``RuleRow``, whose drafts lie at a span of the call's flattened token axis
(``spans``; the indices of several spans: ``ranges``). Its chain rows get their rule's kernel
target in place of q (``rule_targets``); the meter records each rule row once the call has
emitted its tokens (``meter_call``). When vLLM's own acceptance is on, requests' rules do not
apply (``vllm_decides``).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from cactus_spec.core.rules import SpS
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.core.targets import kernel_target
from cactus_spec.integrations.vllm.meter import Chain, Meter, logger
from cactus_spec.runtime.verifications import Verification

#: A call's requests: request id and spec (None: nothing asked) by the index the runner's
#: sampler reads them at (the V1 runner: the batch row; Model Runner V2: the request state).
Requests = dict[int, tuple[str, DecodeSpec | None]]

_warned: list[bool] = []  # vllm_decides' warning, once per process


class Current:
    """The requests of the verification call in progress (one per worker process)."""

    requests: Requests | None = None


@contextmanager
def calling(requests: Requests) -> Iterator[None]:
    """``Current.requests`` is ``requests`` for the duration of the block."""
    Current.requests = requests
    try:
        yield
    finally:
        Current.requests = None


@dataclass(frozen=True)
class RuleRow:
    """A sampled row that asks for a rule: its index in the batch, request, spec, the span of
    its drafts on the flattened token axis and its kind (``runtime.verifications.kind_of``: a
    block, which emits its rule's targets, or a chain; the plugin refuses trees)."""

    index: int
    request_id: str
    spec: DecodeSpec
    span: tuple[int, int]
    kind: Verification

    @property
    def drafted(self) -> int:
        """The drafts the row verifies."""
        return self.span[1] - self.span[0]


def spans(num_draft_tokens: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each request's drafts in the flattened token axis."""
    ends = itertools.accumulate(num_draft_tokens)
    return [(end - n, end) for n, end in zip(num_draft_tokens, ends, strict=True)]


def ranges(spans: list[tuple[int, int]]) -> Tensor:
    """The integers of [start, end) for each span, concatenated, on the CPU -> [sum of sizes]."""
    bounds = torch.tensor(spans, dtype=torch.long).view(-1, 2)  # [S, 2]
    sizes = bounds[:, 1] - bounds[:, 0]  # [S]
    first = torch.cumsum(sizes, 0) - sizes  # [S] where each span starts in the output
    steps = torch.arange(int(sizes.sum())) - first.repeat_interleave(sizes)
    return bounds[:, 0].repeat_interleave(sizes) + steps


def rule_targets(
    q: Tensor,  # [T, V] processed verifier rows, T drafted tokens of the call
    draft_ids: Tensor,  # [T]
    draft_probs: Tensor | None,  # [T, V]
    rows: list[RuleRow],
) -> Tensor:
    """q with each chain row's span replaced by its rule's kernel target -> [T, V] float32.

    Blocks and SpS rows keep q (an SpS chain's target is q). One rule over every token, the
    common case, is computed in one call without copying q first; otherwise per rule, written
    span by span."""
    lossy = [
        (row.spec.rule, row.span)
        for row in rows
        if not row.kind.emits_targets and not isinstance(row.spec.rule, SpS)
    ]
    if not lossy:
        return q
    ids = draft_ids.long()
    rules = {rule for rule, _ in lossy}
    covered = sum(end - start for _, (start, end) in lossy)
    if len(rules) == 1 and covered == q.shape[0]:
        return kernel_target(lossy[0][0], q, ids, draft_probs).contiguous()
    by_rule: dict[object, list[tuple[int, int]]] = defaultdict(list)
    for rule, span in lossy:
        by_rule[rule].append(span)
    targets = q.clone()
    for rule, group in by_rule.items():
        index = ranges(group).to(q.device)  # [P]
        p = None if draft_probs is None else draft_probs[index]
        rows_target = kernel_target(rule, q[index], ids[index], p)  # [P, V]
        offset = 0
        for start, end in group:
            targets[start:end] = rows_target[offset : offset + end - start]
            offset += end - start
    return targets


def vllm_decides(synthetic: bool, options: dict) -> bool:
    """Whether vLLM's own acceptance is on (synthetic rates, or FLy from 0.33: a window of
    0 or None is off): it decides acceptance itself, so requests' rules cannot apply. Asked
    only when some row asks for a rule; the first yes in a process is logged as a warning."""
    decides = synthetic or bool(options.get("fly_window_size"))
    if decides and not _warned:
        logger.warning(
            "cactus-spec: vLLM's own acceptance (synthetic or FLy) is on; it decides "
            "acceptance itself, so requests' rules do not apply"
        )
        _warned.append(True)
    return decides


def meter_call(
    meter: Meter,
    rows: list[RuleRow],
    emitted: Tensor,  # [B] the tokens each batch row emitted
    q: Tensor,  # [T, V]
    draft_ids: Tensor,  # [T]
    draft_probs: Tensor | None,  # [T, V]
    block_kl: Tensor | None,  # [T] KL(t || q) at the blocks' drafted positions
) -> None:
    """The call's rule rows recorded in ``meter``, one ``Chain`` each; a failure is logged,
    never raised (the meter must never take the engine down)."""
    try:
        counts = emitted.tolist()
        chains = [
            Chain(row.request_id, row.spec, row.span[0], row.drafted, counts[row.index], row.kind)
            for row in rows
        ]
        meter.record(chains, q, draft_ids, draft_probs, block_kl)
    except Exception:
        logger.exception("cactus-spec: the divergence meter failed; tokens are unaffected")
