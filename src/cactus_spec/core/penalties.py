"""Repetition, frequency and presence penalties and logit biases, on the logits of a position.

At a position whose generated tokens so far (the output, then the drafts before it) hold
token x c_x times, and whose prompt holds it when s_x:

    l_x <- l_x / r   if l_x > 0 and (s_x or c_x > 0), l_x * r if l_x <= 0 and (s_x or c_x > 0)
    l_x <- l_x - frequency * c_x - presence * [c_x > 0] + bias_x

(the repetition penalty r as in vLLM and transformers, frequency and presence as OpenAI's,
counting generated tokens only). Then ``sampling.logits_to_probs`` makes the distribution.

The draft's p and the verifier's q at one position are penalised with the same counts, the
drafts before that position included, so each verified position's q is the penalised
verifier's distribution there and SpS emits it exactly; Cactus keeps its δ of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Penalties:
    """OpenAI's ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]), the
    ``repetition_penalty`` extension (> 0; 1 = off) and ``logit_bias`` ((token, bias in
    [-100, 100]) pairs)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name}_penalty must be a number in [-2, 2], got {value!r}")
        if not _number(self.repetition) or not 0 < self.repetition <= 10:
            raise ValueError(
                f"repetition_penalty must be a number in (0, 10], got {self.repetition!r}"
            )
        for token, bias in self.logit_bias:
            if not _number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias!r}")

    @property
    def active(self) -> bool:
        """Whether the penalties change any logit."""
        return bool(self.presence or self.frequency or self.repetition != 1 or self.logit_bias)

    def check_tokens(self, vocab_size: int) -> None:
        """ValueError naming a biased token outside [0, vocab_size)."""
        for token, _ in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias: token {token} is not in [0, {vocab_size})")

    def apply(
        self, logits: Tensor, counts: Tensor, prompt: Tensor, drafts: Sequence[int]
    ) -> Tensor:
        """Penalised logits [T, V]: row t counts the generated tokens ``counts`` [V] and the
        first len(drafts) - T + 1 + t of ``drafts`` (so with T = K + 1 rows after K drafts,
        row t counts drafts[:t]); ``prompt`` [V] marks the prompt's tokens."""
        rows, width = logits.shape
        counts = _row_counts(counts, drafts, rows)  # [T, V]
        out = logits.float()
        if self.repetition != 1:
            seen = prompt[None] | (counts > 0)  # [T, V]
            scaled = torch.where(out > 0, out / self.repetition, out * self.repetition)
            out = torch.where(seen, scaled, out)
        if self.frequency:
            out = out - self.frequency * counts
        if self.presence:
            out = out - self.presence * (counts > 0).float()
        if self.logit_bias:
            ids = torch.tensor([t for t, _ in self.logit_bias], device=out.device)
            bias = torch.tensor([b for _, b in self.logit_bias], device=out.device)
            out = out.index_add(1, ids, bias[None].expand(rows, -1))
        return out


def _row_counts(counts: Tensor, drafts: Sequence[int], rows: int) -> Tensor:
    """[T, V] counts: row t is ``counts`` plus the first len(drafts) - T + 1 + t drafts."""
    before = len(drafts) - rows + 1
    base = counts.float().clone()  # [V]
    for token in drafts[:before]:
        base[token] += 1
    out = base.expand(rows, -1).clone()  # [T, V]
    for t, token in enumerate(drafts[before:], start=1):
        out[t:, token] += 1
    return out


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
