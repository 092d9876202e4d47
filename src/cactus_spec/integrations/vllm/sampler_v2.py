"""Rule-aware rejection sampling in vLLM's Model Runner V2 (MRV2), in MRV2's own kernels.

MRV2 verifies in ``rejection_sampler_utils.rejection_sample(target_logits, draft_logits,
draft_sampled, cu_num_logits, ...)``: ``target_logits`` [L, V] are the processed logits
(after penalties, temperature, top-k, top-p: q = softmax) of each request's drafted
positions and its bonus position, request j owning rows [cu_j, cu_{j+1}); the draft verified
at row r is ``draft_sampled[r + 1]``. Its Triton kernels accept a draft x when
log t(x) > log u + log p(x) and redraw a rejected position from max(0, t - p) (one-hot
drafts: t without x), with t = softmax(target row); with ``use_block_verification`` they judge
each request's drafts as one block (Sun et al.) towards those rows.

The replacement here hands the kernels, at each drafted row of a request that asks for a
rule, log t where t is the rule's target: ``core.targets.kernel_target`` on chains (the law
that accept/redraw step emits is then the rule's, as in the V1 runner, ``sampler``) and the
rule's ``block_target`` on blocks (a block emits t at every drafted position). Rows that ask
for nothing, greedy rows, bonus rows and rows after an invalid draft (-1) keep q, so their
tokens are vLLM's, draw for draw. MRV2 returns the processed logits it computed, not these,
so logprobs stay q's.

MRV2 judges a whole call as chains or as blocks (``rejection_sample_method``). A request
names its own (``cactus_verification``; unnamed: the server's), and when a batch holds both
kinds each kind is judged in its own call on its own rows. MRV2 keys every random draw by
the request's seed and the token's position (Philox), never by the batch row, so a row's
tokens do not depend on its neighbours or on the call that judged it.

Which rule each row asks for comes from ``calls.Current.requests`` (request-state index ->
request id and spec), which the plugin sets around each ``RejectionSampler`` call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cactus_spec.core.rules import draft_row
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.integrations.vllm.calls import (
    Current,
    Requests,
    RuleRow,
    meter_call,
    ranges,
    rule_targets,
    spans,
    vllm_decides,
)
from cactus_spec.integrations.vllm.meter import Meter
from cactus_spec.runtime.verifications import Block, Verification, kind_of


@dataclass(frozen=True)
class Row:
    """One request of the call: its position j, logits rows [start, end) (the last is the
    bonus row), valid drafts ``drafted``, request id, spec and the kind it is judged as
    (``runtime.verifications``: a block, which emits its rule's targets, or a chain)."""

    j: int
    start: int
    end: int
    drafted: int
    request_id: str
    spec: DecodeSpec | None
    kind: Verification

    @property
    def ruled(self) -> bool:
        return self.spec is not None and self.drafted > 0


def make_rejection_sample(original: Callable, meter: Meter) -> Callable:
    """The replacement of MRV2's ``rejection_sample`` (same signature)."""

    def rejection_sample(
        target_logits: Tensor,  # [L, V]
        draft_logits: Tensor | None,  # [max_num_reqs, K, V], before temperature
        draft_sampled: Tensor,  # [L]
        cu_num_logits: Tensor,  # [B + 1]
        pos: Tensor,  # [L]
        idx_mapping: Tensor,  # [B]
        expanded_idx_mapping: Tensor,  # [L]
        expanded_local_pos: Tensor,  # [L]
        temperature: Tensor,  # [max_num_reqs]
        seed: Tensor,  # [max_num_reqs]
        num_speculative_steps: int,
        synthetic_conditional_rates: Tensor | None = None,
        use_fp64: bool = False,
        use_block_verification: bool = False,
        **options,  # watermarking's; 0.33's FLy window
    ) -> tuple[Tensor, Tensor]:
        call = Call(
            draft_logits,
            draft_sampled,
            cu_num_logits,
            pos,
            idx_mapping,
            expanded_idx_mapping,
            expanded_local_pos,
            temperature,
            seed,
            num_speculative_steps,
            use_fp64,
            options,
        )
        requests = Current.requests
        if (
            not requests
            or not any(spec is not None for _, spec in requests.values())
            or vllm_decides(synthetic_conditional_rates is not None, options)
        ):
            return call.run(original, target_logits, use_block_verification)
        rows = _rows(
            requests, cu_num_logits, idx_mapping, temperature, draft_sampled, use_block_verification
        )
        ruled = [row for row in rows if row.ruled]
        if not ruled:
            return call.run(original, target_logits, use_block_verification)
        drafted = _drafted_index(ruled, target_logits.device)  # [T]
        q = target_logits[drafted].softmax(-1, dtype=torch.float32)  # [T, V]
        ids = draft_sampled[drafted + 1].long()  # [T]
        p = _draft_probs(ruled, draft_logits, idx_mapping, temperature, q.shape[-1])  # [T, V]
        rule_rows = _rule_rows(ruled)
        targets, block_kl = _targets(rule_rows, q, ids, p)  # [T, V], [T]
        logits = _with_targets(target_logits, drafted, rule_rows, targets)  # [L, V]
        sampled, num_sampled = call.judge(original, logits, rows)
        meter_call(meter, rule_rows, num_sampled, q, ids, p, block_kl)
        return sampled, num_sampled

    return rejection_sample


@dataclass
class Call:
    """MRV2's ``rejection_sample`` arguments other than the target logits and the kind."""

    draft_logits: Tensor | None
    draft_sampled: Tensor
    cu_num_logits: Tensor
    pos: Tensor
    idx_mapping: Tensor
    expanded_idx_mapping: Tensor
    expanded_local_pos: Tensor
    temperature: Tensor
    seed: Tensor
    num_speculative_steps: int
    use_fp64: bool
    options: dict  # keyword options passed on (watermarking's are per logits row)

    def run(self, original: Callable, logits: Tensor, block: bool) -> tuple[Tensor, Tensor]:
        return original(
            logits,
            self.draft_logits,
            self.draft_sampled,
            self.cu_num_logits,
            self.pos,
            self.idx_mapping,
            self.expanded_idx_mapping,
            self.expanded_local_pos,
            self.temperature,
            self.seed,
            self.num_speculative_steps,
            None,
            use_fp64=self.use_fp64,
            use_block_verification=block,
            **self.options,
        )

    def judge(self, original: Callable, logits: Tensor, rows: list[Row]) -> tuple[Tensor, Tensor]:
        """Every row judged as its kind: one call when the batch holds one kind, else one
        call per kind on that kind's rows, merged in row order."""
        kinds = {row.kind.emits_targets for row in rows}  # blocks, and chains
        if len(kinds) == 1:
            return self.run(original, logits, kinds.pop())
        parts = []
        for block in (False, True):
            part = [row for row in rows if row.kind.emits_targets == block]
            subset, lines = self.subset(part)
            parts.append((part, *subset.run(original, logits[lines], block)))
        s0, n0 = parts[0][1], parts[0][2]
        sampled = s0.new_empty(len(rows), s0.shape[1])  # [B, K+1]
        num_sampled = n0.new_empty(len(rows))  # [B]
        for part, s, n in parts:
            index = torch.tensor([row.j for row in part], device=s.device)
            sampled[index], num_sampled[index] = s, n
        return sampled, num_sampled

    def subset(self, rows: list[Row]) -> tuple[Call, Tensor]:
        """The call restricted to ``rows``, and their logits rows [L'] (per-request-state
        tensors stay whole: they are indexed by request state, not by batch row)."""
        device = self.draft_sampled.device
        lines = ranges([(row.start, row.end) for row in rows]).to(device)
        sizes = torch.tensor([row.end - row.start for row in rows], device=device)
        cu = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).to(self.cu_num_logits.dtype)
        requests = torch.tensor([row.j for row in rows], device=device)
        options = dict(self.options)
        for key in ("contexts", "watermarking_skip_mask"):
            if options.get(key) is not None:
                options[key] = options[key][lines]
        return Call(
            self.draft_logits,
            self.draft_sampled[lines],
            cu,
            self.pos[lines],
            self.idx_mapping[requests],
            self.expanded_idx_mapping[lines],
            self.expanded_local_pos[lines],
            self.temperature,
            self.seed,
            self.num_speculative_steps,
            self.use_fp64,
            options,
        ), lines


def _rows(
    requests: Requests,
    cu_num_logits: Tensor,  # [B + 1]
    idx_mapping: Tensor,  # [B]
    temperature: Tensor,  # [max_num_reqs]
    draft_sampled: Tensor,  # [L]
    server_block: bool,
) -> list[Row]:
    """The call's requests in order; greedy rows and unknown requests ask for no rule."""
    batch = idx_mapping.shape[0]
    flat = torch.cat(  # one copy to the host
        [
            cu_num_logits.long(),
            idx_mapping.long(),
            (temperature[idx_mapping] == 0).long(),
            (draft_sampled >= 0).long(),
        ]
    ).tolist()
    cu, states = flat[: batch + 1], flat[batch + 1 : 2 * batch + 1]
    greedy, valid = flat[2 * batch + 1 : 3 * batch + 1], flat[3 * batch + 1 :]
    rows = []
    for j, state in enumerate(states):
        request_id, spec = requests.get(state, ("", None))
        start, end = cu[j], cu[j + 1]
        drafted = 0
        while drafted < end - start - 1 and valid[start + 1 + drafted]:
            drafted += 1
        if greedy[j]:
            spec = None
        if spec is not None and spec.verification is not None:
            kind = kind_of(spec, greedy=False)
        else:  # the server's kind
            kind = Block() if server_block else Verification()
        rows.append(Row(j, start, end, drafted, request_id, spec, kind))
    return rows


def as_distribution(t: Tensor, p: Tensor) -> Tensor:
    """A kernel target t [T, V] (any non-negative row, ``kernel_target``'s: TopK's is an
    indicator) as the distribution the MRV2 kernels need, which normalise what they are given:
    t' = min(p, t) + (1 - sum min(p, t)) normalize(max(0, t - p)), p [T, V] the draft's law.

    At every token x, min(1, t'_x / p_x) = min(1, t_x / p_x) (where t_x < p_x, t'_x = t_x,
    since the residual is 0 there; elsewhere t'_x >= p_x), and max(0, t' - p) is a multiple
    of max(0, t - p): each draft is accepted, and a rejection redrawn, exactly as V1's
    kernels do with t. When max(0, t - p) is 0 everywhere (rejection impossible) t' = min(p, t)
    already sums to 1. A t that sums to 1 is its own t'."""
    kept = torch.minimum(p, t)  # [T, V]
    excess = (t - p).clamp(min=0)  # [T, V]
    mass = excess.sum(-1, keepdim=True)  # [T, 1]
    residual = excess / torch.where(mass > 0, mass, torch.ones_like(mass))
    return kept + (1 - kept.sum(-1, keepdim=True)).clamp(min=0) * residual


def _drafted_index(rows: list[Row], device: torch.device) -> Tensor:
    """The logits rows of the rows' valid drafts, concatenated -> [T]."""
    return ranges([(r.start, r.start + r.drafted) for r in rows]).to(device)


def _rule_rows(rows: list[Row]) -> list[RuleRow]:
    """Rows that ask for a rule (``Row.ruled``) as ``RuleRow``: their spans lie on the axis of
    their valid drafts, concatenated in row order."""
    at = spans([row.drafted for row in rows])
    return [
        RuleRow(row.j, row.request_id, row.spec, span, row.kind)
        for row, span in zip(rows, at, strict=True)
    ]


def _draft_probs(
    rows: list[Row],
    draft_logits: Tensor | None,  # [max_num_reqs, K, V'] before temperature
    idx_mapping: Tensor,  # [B]
    temperature: Tensor,  # [max_num_reqs]
    vocab: int,
) -> Tensor | None:
    """p at every valid draft -> [T, V], None for one-hot drafts (n-gram, greedy drafting).
    Tokens beyond the draft's vocabulary (vLLM pads the larger one) get p = 0."""
    if draft_logits is None:
        return None
    counts = torch.tensor([r.drafted for r in rows])  # [R]
    at = torch.tensor([r.j for r in rows]).repeat_interleave(counts)  # [T]
    states = idx_mapping[at.to(idx_mapping.device)].long()  # [T]
    steps = ranges([(0, r.drafted) for r in rows]).to(states.device)  # [T]
    logits = draft_logits[states, steps, :vocab].float() / temperature[states, None]
    if logits.shape[-1] < vocab:
        logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=-torch.inf)
    return logits.softmax(-1)


def _targets(
    rows: list[RuleRow], q: Tensor, ids: Tensor, p: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Each row's targets at its drafts -> t [T, V], and KL(t || q) at each drafted position
    of a lossy block -> [T] float64 (0 elsewhere; the meter's, solved once here)."""
    targets = rule_targets(q, ids, p, rows)
    if targets is not q:
        targets = as_distribution(targets, draft_row(p, ids, q.shape[-1]))
    block_kl = torch.zeros(q.shape[0], dtype=torch.float64, device=q.device)  # [T]
    by_rule: dict[object, list[tuple[int, int]]] = defaultdict(list)
    kinds: dict[object, Verification] = {}  # a block's, to meter each rule's positions
    for row in rows:
        if row.kind.emits_targets and not row.spec.lossless:
            by_rule[row.spec.rule].append(row.span)
            kinds.setdefault(row.spec.rule, row.kind)
    for rule, group in by_rule.items():
        index = ranges(group).to(q.device)  # [P]
        t = rule.block_target(q[index], ids[index], None if p is None else p[index])
        if targets is q:
            targets = q.clone()
        targets[index] = t
        block_kl[index] = kinds[rule].divergences(rule, q[index], t)
    return targets, block_kl


def _with_targets(
    target_logits: Tensor,  # [L, V]
    drafted: Tensor,  # [T] the logits rows of the rule rows' drafts
    rows: list[RuleRow],
    targets: Tensor,  # [T, V] from ``_targets``
) -> Tensor:
    """The logits the kernels judge -> [L, V] float32: log t at the drafted rows of each lossy
    rule's row, ``target_logits`` elsewhere (q's rows bit for bit)."""
    counts = torch.tensor([row.drafted for row in rows])  # [R]
    lossy = torch.tensor([not row.spec.lossless for row in rows]).repeat_interleave(counts)
    lossy = lossy.to(drafted.device)  # [T]
    logits = target_logits.float()  # [L, V]
    logits = logits.clone() if logits is target_logits else logits
    logits[drafted[lossy]] = targets[lossy].log()
    return logits
