"""Rule-aware rejection sampling in vLLM's V1 runner, in vLLM's own kernels.

vLLM verifies a batch's drafts in ``rejection_sampler.rejection_sample``: it turns the
processed target logits into q, draws the recovered tokens from normalize(max(0, q - p)) and
accepts with min(1, q_n / p_n). The replacement here does the same steps with the same
kernels and the same random draws, but hands them, for each request that asks for a rule,
the rule's target row t (``core.targets.kernel_target``) in place of q, so the kernels emit
that rule's law. Rows that ask for nothing keep q: their tokens are vLLM's, draw for draw.
Greedy rows (temperature 0) go through vLLM's greedy kernel untouched.

Rows that ask for ``verification = block`` are judged as a whole instead
(``core.block_verification``, towards the rule's per-position target): their drafted rows
and, for the all-kept case, vLLM's bonus token (a draw from the last row's q, as a one-hot
row) go to ``verify_block``, with the request's own generator when it is seeded; the targets
solved to judge them give the meter its KL(t || q) too. When every sampled row of a batch is
a block, vLLM's random kernels are not run. With one-hot drafts (vLLM's default
``draft_sample_method = greedy``) a block keeps as many drafts as token verification on
average; it keeps more with ``probabilistic`` drafts.

Which rule each row asks for comes from ``Batch``, which the runner's ``_sample`` sets
for the duration of one sampling call (``plugin``).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from cactus_spec.core.block_verification import verify_block
from cactus_spec.core.rules import SpS
from cactus_spec.core.sampling import one_hot
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.core.targets import kernel_target
from cactus_spec.integrations.vllm.meter import Chain, Meter, logger
from cactus_spec.runtime.verifications import Verification, kind_of

_warned: list[bool] = []  # the synthetic-mode warning, once per process


@dataclass
class Batch:
    """The requests of the batch being sampled, in row order, and the spec each asks for."""

    request_ids: list[str]
    specs: list[DecodeSpec | None]


class Current:
    """The batch of the sampling call in progress (one per worker process)."""

    batch: Batch | None = None


@dataclass(frozen=True)
class RuleRow:
    """A sampled row that asks for a rule: its index in the batch, request, spec, span and
    kind (``runtime.verifications.kind_of``: a block, which emits its rule's targets, or a
    chain; the plugin refuses trees)."""

    index: int
    request_id: str
    spec: DecodeSpec
    span: tuple[int, int]
    kind: Verification


def spans(num_draft_tokens: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each request's drafts in the flattened token axis."""
    ends = itertools.accumulate(num_draft_tokens)
    return [(end - n, end) for n, end in zip(num_draft_tokens, ends, strict=True)]


def rule_targets(
    q: Tensor,  # [T, V] processed verifier rows, T drafted tokens of the batch
    draft_ids: Tensor,  # [T]
    draft_probs: Tensor | None,  # [T, V]
    rows: list[tuple[DecodeSpec, tuple[int, int]]],  # each rule row's spec and span
) -> Tensor:
    """q with each rule row's span replaced by its rule's target rows -> [T, V] float32.

    SpS rows keep q (their h). One rule over every token, the common case, is computed in
    one call without copying q first; otherwise per rule, written span by span."""
    lossy = [(spec.rule, span) for spec, span in rows if not isinstance(spec.rule, SpS)]
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
        index = torch.cat([torch.arange(start, end, device=q.device) for start, end in group])
        p = None if draft_probs is None else draft_probs[index]
        rows_target = kernel_target(rule, q[index], ids[index], p)  # [P, V]
        offset = 0
        for start, end in group:
            targets[start:end] = rows_target[offset : offset + end - start]
            offset += end - start
    return targets


def make_rejection_sample(vllm_sampler: ModuleType, meter: Meter) -> Callable:
    """The replacement of ``vllm_sampler.rejection_sample`` (same signature)."""
    original = vllm_sampler.rejection_sample
    m = vllm_sampler

    def rejection_sample(
        draft_token_ids: Tensor,  # [T]
        num_draft_tokens: list[int],  # [B]
        max_spec_len: int,
        cu_num_draft_tokens: Tensor,  # [B]
        draft_probs: Tensor | None,  # [T, V]
        target_logits: Tensor,  # [T, V]
        bonus_token_ids: Tensor,  # [B, 1]
        sampling_metadata,
        synthetic_mode: bool = False,
        synthetic_conditional_rates: Tensor | None = None,
        use_fp64_gumbel: bool = False,
        **options,  # later releases' (0.33: FLy's window), passed on
    ) -> Tensor:
        args = (
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
        )
        batch = Current.batch
        rows = _rule_rows(batch, num_draft_tokens, sampling_metadata)
        if rows and vllm_decides(synthetic_mode, options):
            warn_vllm_decides()
        if not rows or vllm_decides(synthetic_mode, options):
            return original(
                *args,
                synthetic_mode=synthetic_mode,
                synthetic_conditional_rates=synthetic_conditional_rates,
                use_fp64_gumbel=use_fp64_gumbel,
                **options,
            )
        device = target_logits.device
        out = torch.full(
            (len(num_draft_tokens), max_spec_len + 1),
            m.PLACEHOLDER_TOKEN_ID,
            dtype=torch.int32,
            device=device,
        )  # [B, K+1]
        is_greedy = sampling_metadata.temperature == m.GREEDY_TEMPERATURE  # [B]
        uniform = m.generate_uniform_probs(
            draft_token_ids.shape[0], num_draft_tokens, sampling_metadata.generators, device
        )  # [T]
        if not sampling_metadata.all_random:
            m._rejection_greedy_sample(
                out,
                cu_num_draft_tokens,
                draft_token_ids,
                target_logits.argmax(dim=-1),
                bonus_token_ids,
                is_greedy,
                max_spec_len,
                uniform,
                None,
            )
        q = target_logits.softmax(dim=-1, dtype=torch.float32)  # [T, V]
        blocks = [r for r in rows if r.kind.emits_targets]
        if int((~is_greedy).sum()) > len(blocks):  # sampled rows the kernels judge
            chains = [(r.spec, r.span) for r in rows if not r.kind.emits_targets]
            targets = rule_targets(q, draft_token_ids, draft_probs, chains)
            recovered = m.sample_recovered_tokens(
                max_spec_len,
                num_draft_tokens,
                cu_num_draft_tokens,
                draft_token_ids,
                draft_probs,
                targets,
                sampling_metadata,
                device,
                use_fp64_gumbel,
            )  # [T]
            m._rejection_random_sample(
                out,
                cu_num_draft_tokens,
                draft_token_ids,
                draft_probs,
                targets,
                bonus_token_ids,
                recovered,
                uniform,
                is_greedy,
                max_spec_len,
                None,
            )
        block_kl = None
        if blocks:
            block_kl = judge_blocks(
                out,
                blocks,
                q,
                draft_token_ids,
                draft_probs,
                bonus_token_ids,
                sampling_metadata.generators,
                m.PLACEHOLDER_TOKEN_ID,
            )
        try:
            _meter(meter, rows, out, q, draft_token_ids, draft_probs, block_kl)
        except Exception:  # the meter must never take the engine down
            logger.exception("cactus-spec: the divergence meter failed; tokens are unaffected")
        return out

    return rejection_sample


def vllm_decides(synthetic: bool, options: dict) -> bool:
    """Whether vLLM's own acceptance is on (synthetic rates, or FLy from 0.33: a window of
    0 or None is off): it decides acceptance itself, so requests' rules cannot apply."""
    return synthetic or bool(options.get("fly_window_size"))


def warn_vllm_decides() -> None:
    if not _warned:
        logger.warning(
            "cactus-spec: vLLM's own acceptance (synthetic or FLy) is on; it decides "
            "acceptance itself, so requests' rules do not apply"
        )
        _warned.append(True)


def judge_blocks(
    out: Tensor,  # [B, K+1] the kernels' tokens, block rows overwritten here
    blocks: list[RuleRow],
    q: Tensor,  # [T, V]
    draft_ids: Tensor,  # [T]
    draft_probs: Tensor | None,  # [T, V]
    bonus_ids: Tensor,  # [B, 1] vLLM's draws from each row's last q
    generators: dict[int, torch.Generator],
    placeholder: int,
) -> Tensor:
    """Each block row's tokens from ``verify_block`` towards its rule's targets t (the rule's
    ``block_target`` of the drafted rows of q), then the bonus token as a one-hot row (emitted
    when every draft is kept). Rows of one rule, draft length and seededness are judged in one
    call. Returns KL(t || q) at every drafted position of a lossy rule's block, 0 elsewhere
    -> [T] float64 (the meter's, so the targets are solved once)."""
    divergences = torch.zeros(q.shape[0], dtype=torch.float64, device=q.device)  # [T]
    groups: dict[tuple, list[RuleRow]] = defaultdict(list)
    for row in blocks:
        n = row.span[1] - row.span[0]
        groups[row.spec.rule, n, row.index in generators].append(row)
    for (rule, n, seeded), rows in groups.items():
        index = torch.cat([torch.arange(*row.span, device=q.device) for row in rows])  # [R n]
        batch = torch.tensor([row.index for row in rows], device=q.device)  # [R]
        ids, bonus = draft_ids[index].long(), bonus_ids[batch, 0].long()  # [R n], [R]
        q_rows = q[index]  # [R n, V]
        used = _support(q_rows, ids, bonus)  # [S]
        size = (len(rows), n, used.numel())
        rows_q = q_rows[:, used].view(size)  # [R, n, S]
        p = None if draft_probs is None else draft_probs[index][:, used].float().view(size)
        local = torch.searchsorted(used, ids).view(len(rows), n)  # [R, n]
        targets = rows_q  # [R, n, S]
        if not rule.lossless:
            targets = rule.block_target(rows_q, local, p)
            flat = (targets.flatten(0, 1), rows_q.flatten(0, 1))  # [R n, S]
            divergences[index] = rows[0].kind.divergences(rule, flat[1], flat[0])
        bonus_row = one_hot(torch.searchsorted(used, bonus), size[-1]).to(q.dtype)  # [R, S]
        targets = torch.cat([targets, bonus_row[:, None]], 1)  # [R, n+1, S]
        generator = [generators[row.index] for row in rows] if seeded else None
        tokens = verify_block(local, targets, p, generator, validate=False).tokens
        tokens = torch.where(tokens < 0, placeholder, used[tokens.clamp_min(0)])  # [R, n+1]
        out[batch] = placeholder
        out[batch, : n + 1] = tokens.to(out)
    return divergences


def _support(q: Tensor, ids: Tensor, bonus: Tensor) -> Tensor:
    """The sorted tokens a block can emit or weigh [S]: q's support, the drafts and the bonus
    tokens. Off them q is 0, so neither the weights, the residuals nor the targets (which stay
    in q's support) read p there: judging on them alone is judging on the whole vocabulary."""
    inside = (q > 0).any(0).nonzero().squeeze(-1)  # [S0]
    return torch.unique(torch.cat([inside, ids, bonus]))  # sorted


def _rule_rows(
    batch: Batch | None, num_draft_tokens: list[int], sampling_metadata
) -> list[RuleRow]:
    """The sampled (not greedy) rows that ask for a rule."""
    if batch is None or sampling_metadata.all_greedy:
        return []
    if len(batch.specs) != len(num_draft_tokens):
        raise RuntimeError(
            f"cactus-spec: the batch holds {len(batch.specs)} requests but vLLM verifies "
            f"{len(num_draft_tokens)}; this vLLM is not one the plugin supports"
        )
    greedy = (sampling_metadata.temperature == 0).tolist()
    rows = zip(batch.request_ids, batch.specs, spans(num_draft_tokens), greedy, strict=True)
    return [
        RuleRow(index, request_id, spec, span, kind_of(spec, greedy=False))
        for index, (request_id, spec, span, is_greedy) in enumerate(rows)
        if spec is not None and not is_greedy and span[1] > span[0]
    ]


def _meter(
    meter: Meter,
    rows: list[RuleRow],
    out: Tensor,  # [B, K+1]
    q: Tensor,  # [T, V]
    draft_ids: Tensor,  # [T]
    draft_probs: Tensor | None,  # [T, V]
    block_kl: Tensor | None,  # [T] from judge_blocks, None without blocks
) -> None:
    emitted = (out != -1).sum(-1).tolist()  # [B]
    chains = [
        Chain(r.request_id, r.spec, r.span[0], r.span[1] - r.span[0], emitted[r.index], r.kind)
        for r in rows
    ]
    meter.record(chains, q, draft_ids, draft_probs, block_kl)
