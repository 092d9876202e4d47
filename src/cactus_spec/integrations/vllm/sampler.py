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

Which rule each row asks for comes from ``calls.Current.requests`` (batch row -> request id
and spec), which the plugin sets around the runner's ``_sample``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from cactus_spec.core.block_verification import verify_block
from cactus_spec.core.sampling import one_hot
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
from cactus_spec.runtime.verifications import kind_of


def make_rejection_sample(vllm_sampler: ModuleType, meter: Meter) -> Callable:
    """The replacement of ``vllm_sampler.rejection_sample`` (same signature)."""
    original = vllm_sampler.rejection_sample

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
        call = Call(
            vllm_sampler,
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            use_fp64_gumbel,
        )
        rows = call.rule_rows(Current.requests)
        if not rows or vllm_decides(synthetic_mode, options):
            return call.run(original, synthetic_mode, synthetic_conditional_rates, options)
        out, uniform = call.greedy()  # [B, K+1], [T]
        q = target_logits.softmax(dim=-1, dtype=torch.float32)  # [T, V]
        blocks = [row for row in rows if row.kind.emits_targets]
        if call.sampled_rows() > len(blocks):  # sampled rows the kernels judge
            call.random(out, uniform, rule_targets(q, draft_token_ids, draft_probs, rows))
        block_kl = call.blocks(out, blocks, q) if blocks else None  # [T]
        emitted = (out != vllm_sampler.PLACEHOLDER_TOKEN_ID).sum(-1)  # [B]
        meter_call(meter, rows, emitted, q, draft_token_ids, draft_probs, block_kl)
        return out

    return rejection_sample


@dataclass
class Call:
    """One call of V1's ``rejection_sample``: vLLM's module of kernels and the arguments its
    kernels read."""

    kernels: ModuleType  # vllm.v1.sample.rejection_sampler
    draft_ids: Tensor  # [T]
    num_draft_tokens: list[int]  # [B]
    max_spec_len: int  # K
    cu_num_draft_tokens: Tensor  # [B]
    draft_probs: Tensor | None  # [T, V]
    target_logits: Tensor  # [T, V]
    bonus_ids: Tensor  # [B, 1]
    metadata: Any  # vLLM's SamplingMetadata
    use_fp64_gumbel: bool

    @cached_property
    def is_greedy(self) -> Tensor:
        """Which batch rows are greedy (temperature 0) -> [B] bool."""
        return self.metadata.temperature == self.kernels.GREEDY_TEMPERATURE

    def run(
        self, original: Callable, synthetic_mode: bool, rates: Tensor | None, options: dict
    ) -> Tensor:
        """vLLM's own ``original`` on the call: its tokens [B, K+1]."""
        return original(
            self.draft_ids,
            self.num_draft_tokens,
            self.max_spec_len,
            self.cu_num_draft_tokens,
            self.draft_probs,
            self.target_logits,
            self.bonus_ids,
            self.metadata,
            synthetic_mode=synthetic_mode,
            synthetic_conditional_rates=rates,
            use_fp64_gumbel=self.use_fp64_gumbel,
            **options,
        )

    def greedy(self) -> tuple[Tensor, Tensor]:
        """The call's tokens with the greedy rows judged by vLLM's greedy kernel and the others
        placeholders -> [B, K+1] int32, and the uniforms of the random kernel -> [T]."""
        m = self.kernels
        device = self.target_logits.device
        out = torch.full(
            (len(self.num_draft_tokens), self.max_spec_len + 1),
            m.PLACEHOLDER_TOKEN_ID,
            dtype=torch.int32,
            device=device,
        )  # [B, K+1]
        uniform = m.generate_uniform_probs(
            self.draft_ids.shape[0], self.num_draft_tokens, self.metadata.generators, device
        )  # [T]
        if not self.metadata.all_random:
            m._rejection_greedy_sample(
                out,
                self.cu_num_draft_tokens,
                self.draft_ids,
                self.target_logits.argmax(dim=-1),
                self.bonus_ids,
                self.is_greedy,
                self.max_spec_len,
                uniform,
                None,
            )
        return out, uniform

    def rule_rows(self, requests: Requests | None) -> list[RuleRow]:
        """The sampled (not greedy) rows that ask for a rule; ``requests`` by batch row."""
        if requests is None or self.metadata.all_greedy:
            return []
        if len(requests) != len(self.num_draft_tokens):
            raise RuntimeError(
                f"cactus-spec: the batch holds {len(requests)} requests but vLLM verifies "
                f"{len(self.num_draft_tokens)}; this vLLM is not one the plugin supports"
            )
        greedy = self.is_greedy.tolist()
        asked = [requests[index] for index in range(len(self.num_draft_tokens))]
        rows = zip(asked, spans(self.num_draft_tokens), greedy, strict=True)
        return [
            RuleRow(index, request_id, spec, span, kind_of(spec, greedy=False))
            for index, ((request_id, spec), span, is_greedy) in enumerate(rows)
            if spec is not None and not is_greedy and span[1] > span[0]
        ]

    def sampled_rows(self) -> int:
        """How many batch rows are sampled (not greedy)."""
        return int((~self.is_greedy).sum())

    def random(
        self,
        out: Tensor,  # [B, K+1] sampled rows written here
        uniform: Tensor,  # [T] from ``greedy``
        targets: Tensor,  # [T, V] t in place of q (``rule_targets``)
    ) -> None:
        """The sampled rows judged by vLLM's random kernels towards ``targets``: accepted with
        min(1, t_n / p_n), a rejection's token recovered from normalize(max(0, t - p))."""
        m = self.kernels
        recovered = m.sample_recovered_tokens(
            self.max_spec_len,
            self.num_draft_tokens,
            self.cu_num_draft_tokens,
            self.draft_ids,
            self.draft_probs,
            targets,
            self.metadata,
            self.target_logits.device,
            self.use_fp64_gumbel,
        )  # [T]
        m._rejection_random_sample(
            out,
            self.cu_num_draft_tokens,
            self.draft_ids,
            self.draft_probs,
            targets,
            self.bonus_ids,
            recovered,
            uniform,
            self.is_greedy,
            self.max_spec_len,
            None,
        )

    def blocks(self, out: Tensor, blocks: list[RuleRow], q: Tensor) -> Tensor:
        """``judge_blocks`` on the call's block rows (``out`` [B, K+1], q [T, V]) -> [T]."""
        return judge_blocks(
            out,
            blocks,
            q,
            self.draft_ids,
            self.draft_probs,
            self.bonus_ids,
            self.metadata.generators,
            self.kernels.PLACEHOLDER_TOKEN_ID,
        )


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
        groups[row.spec.rule, row.drafted, row.index in generators].append(row)
    for (rule, n, seeded), rows in groups.items():
        index = ranges([row.span for row in rows]).to(q.device)  # [R n]
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
