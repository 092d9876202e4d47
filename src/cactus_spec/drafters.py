"""Where draft tokens come from.

A drafter sees the whole token context (prompt and output so far) and proposes
up to K next tokens, with their draft distributions ``p`` [K, V] when it samples
them, or ``None`` when its drafts are deterministic (``p`` one-hot). The engine
knows drafters only through ``Drafter``; a new drafter (layer skipping, trained
heads) is a new class here, with no change to the decode loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from cactus_spec.backends.base import Backend
from cactus_spec.sampling import SamplingConfig, logits_to_probs, sample_inverse_cdf, uniforms


@dataclass(frozen=True)
class Draft:
    """``tokens``: up to K proposed ids; ``probs`` [len(tokens), V] or None (one-hot)."""

    tokens: list[int]
    probs: Tensor | None


class Drafter(Protocol):
    """Proposes continuations of a token context."""

    def reset(self) -> None:
        """Forget any state from an earlier sequence."""

    def propose(
        self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator
    ) -> Draft:
        """Up to ``k`` tokens that may follow ``context``."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    limit = min(len(a), len(b))
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit


class ModelDrafter:
    """Drafts by sampling K tokens from a small language model on its own KV cache.

    The cache keeps the longest prefix it shares with the new context (it is
    rolled back after a rejection, never recomputed), then catches up on the
    tokens it has not seen (the corrected token, or the last draft and the bonus
    token after a fully accepted block) in the first of its K forward passes.
    """

    def __init__(self, backend: Backend, vocab_size: int) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self._cached: list[int] = []

    def reset(self) -> None:
        self.backend.reset()
        self._cached = []

    def propose(
        self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator
    ) -> Draft:
        keep = common_prefix_length(self._cached, context)
        keep = min(keep, len(context) - 1)  # always feed at least one token
        self.backend.rollback(keep)
        pending = list(context[keep:])
        tokens: list[int] = []
        rows: list[Tensor] = []
        for step in range(k):
            logits = self.backend.append(pending, keep=1)[-1:, : self.vocab_size]  # [1, V]
            probs = logits_to_probs(logits, sampling)  # [1, V]
            token = _draw(probs, sampling, generator)
            rows.append(probs)
            tokens.append(token)
            if step < k - 1:
                pending = [token]
        self._cached = list(context) + tokens[:-1]
        return Draft(tokens, torch.cat(rows))


def _draw(probs: Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """One token from probs [1, V]: argmax when greedy, else one seeded inverse-CDF draw."""
    if sampling.greedy:
        return int(probs.argmax(-1))
    u = uniforms(1, 1, generator, probs.device)[:, 0]  # [1]
    return int(sample_inverse_cdf(probs, u))


class NGramDrafter:
    """Prompt lookup: continue the latest earlier occurrence of the context's last n-gram.

    Tries n = max_ngram down to min_ngram and proposes the up to K tokens that
    followed the most recent earlier match. No model and no randomness, so the
    drafts are deterministic (p one-hot). Proposes nothing when nothing matches.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                "ngram sizes must satisfy 1 <= min_ngram <= max_ngram, "
                f"got min_ngram={min_ngram}, max_ngram={max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self) -> None:
        """Stateless: nothing to forget."""

    def propose(
        self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator
    ) -> Draft:
        ids = torch.as_tensor(context, dtype=torch.long)  # [L]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            start = latest_match(ids, n)
            if start is not None:
                return Draft(ids[start + n : start + n + k].tolist(), None)
        return Draft([], None)


def latest_match(ids: Tensor, n: int) -> int | None:
    """Start of the latest earlier occurrence of the last ``n`` tokens of ids [L] that
    is followed by at least one token, or None."""
    if ids.numel() <= n:
        return None
    windows = ids[:-1].unfold(0, n, 1)  # [L-n, n], every window followed by a token
    hits = (windows == ids[-n:]).all(-1).nonzero()  # [M, 1]
    return int(hits[-1]) if hits.numel() else None
