"""From logits to the distributions p and q, and seeded draws from them.

Draft and verifier logits go through the same processing, in this order: temperature, then
min-p (drop tokens less likely than min_p times the most likely one), then top-k, then top-p
(nucleus), then renormalisation. At temperature 0 the distribution is one-hot at the argmax
(greedy decoding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Generators = torch.Generator | Sequence[torch.Generator] | None
#: The largest seed a torch.Generator takes.
MAX_SEED = 2**64 - 1


#: Temperatures below this decode greedily, as vLLM's do: logits / T overflows to inf (and q
#: to NaN) near the smallest floats, and the distribution is argmax's to float precision.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    """Temperature (below GREEDY_BELOW, 0 included: greedy), top-k (0 = off), top-p
    (1 = off) and min-p (0 = off)."""

    temperature: float = 0.6
    top_k: int = 20
    top_p: float = 0.95
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not (
            isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1
        ):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def logits_to_probs(logits: Tensor, config: SamplingConfig) -> Tensor:
    """Processed distribution rows: logits [..., V] -> float32 probabilities [..., V].

    With top-k on, the softmax and the nucleus run over the k largest logits only
    (exactly k tokens; ties at the k-th broken by index), then scatter back: the
    same distribution as masking the rest to -inf, without sorting V entries.
    """
    logits = logits.float()
    if config.greedy:
        return one_hot(logits.argmax(-1), logits.shape[-1])
    if config.min_p > 0:  # p_x >= min_p p_max  <=>  (l_x - l_max) / T >= log(min_p)
        gap = (logits - logits.amax(-1, keepdim=True)) / config.temperature
        logits = logits.masked_fill(gap < math.log(config.min_p), float("-inf"))
    if 0 < config.top_k < logits.shape[-1]:
        values, ids = top_k(logits, config.top_k)  # [..., k], descending
        kept = _sorted_nucleus(torch.softmax(values / config.temperature, -1), config.top_p)
        return torch.zeros_like(logits).scatter_(-1, ids, kept)
    probs = torch.softmax(logits / config.temperature, dim=-1)  # [..., V]
    if config.top_p == 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [..., V]
    kept = _sorted_nucleus(sorted_probs, config.top_p)
    return torch.zeros_like(probs).scatter_(-1, order, kept)


#: Logits a row's chunk holds when ``top_k`` bounds the k-th largest by the chunks' maxima.
_CHUNK = 128
#: Up to this many logits (rows x V), ``top_k`` tries ``torch.topk`` first: one row of a
#: 32,768-token head in 102 us against 146 by chunks (AVX512-BF16, 2 threads; at 151,936 or
#: 4 rows of 32,768 the chunks are as fast or faster).
_FEW_LOGITS = 65536


def top_k(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest logits of each row [..., V] and their ids [..., k], in descending order,
    ties broken by the lower id (``torch.topk`` breaks them as its kernel happens to).

    The rows are cut into chunks of ``_CHUNK`` logits; the k-th largest chunk maximum b is
    no larger than the k-th largest logit (k chunks hold a logit >= b), so the top k lie in
    the chunks whose maximum reaches b, and only those few chunks are compared and sorted:
    one pass over V (the maxima), a quarter of ``torch.topk``'s time (40 rows of a
    151,936-token vocabulary: 2.0 ms against 8.2 on 2 cores of the AMX Xeon). A row's end
    short of a chunk is padded with -inf; rows of fewer than k chunks, or with a NaN, are
    sorted whole. Up to ``_FEW_LOGITS`` logits in all (a draft's row over a cut head),
    ``torch.topk``'s k are taken where they are distinct from the rest (``_distinct``): fewer
    operations, where a step's small operations each run on caches its products flushed.
    """
    width = logits.shape[-1]
    if logits.numel() <= _FEW_LOGITS and width > k:
        values, ids = logits.topk(k, dim=-1)  # [..., k], descending
        if _distinct(logits, values):
            return values, ids
    chunks = -(-width // _CHUNK)
    if chunks < k:
        return _sorted_top_k(logits, k)
    rows = logits.reshape(-1, width)  # [N, V]
    if width % _CHUNK:
        rows = torch.nn.functional.pad(rows, (0, chunks * _CHUNK - width), value=-math.inf)
    blocks = rows.view(rows.shape[0], chunks, _CHUNK)  # [N, C, chunk]
    maxima = blocks.amax(-1)  # [N, C]
    bound = maxima.topk(k, dim=-1).values[:, -1:]  # [N, 1]
    row, chunk = (maxima >= bound).nonzero(as_tuple=True)  # [M] each, by row, then chunk
    values = blocks[row, chunk]  # [M, chunk]
    ids = chunk[:, None] * _CHUNK + torch.arange(_CHUNK, device=logits.device)  # [M, chunk]
    held = values >= bound[row]  # [M, chunk]
    row = row[:, None].expand_as(held)[held]  # [F], by row, then id
    values, ids = values[held], ids[held]  # [F] each
    counts = torch.bincount(row, minlength=rows.shape[0])  # [N]
    if bool((counts < k).any()):  # a NaN among the maxima
        return _sorted_top_k(logits, k)
    order = values.sort(descending=True, stable=True).indices  # [F], ties by id
    order = order[row[order].sort(stable=True).indices]  # [F], by row, then as above
    starts = counts.cumsum(0) - counts  # [N]
    picked = order[starts[:, None] + torch.arange(k, device=logits.device)]  # [N, k]
    shape = (*logits.shape[:-1], k)
    return values[picked].reshape(shape), ids[picked].reshape(shape)


def _distinct(logits: Tensor, values: Tensor) -> bool:
    """Whether each row's k largest ``values`` (descending) are strictly decreasing and the
    row holds no other logit as large as the k-th: then they are the top k whatever the ties
    rule (no tie among them or at the k-th, and no NaN, which compares false)."""
    decreasing = bool((values[..., 1:] < values[..., :-1]).all())
    k = values.shape[-1]
    return decreasing and bool(((logits >= values[..., -1:]).sum(-1) == k).all())


def _sorted_top_k(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``top_k`` by a stable sort of whole rows."""
    values, ids = logits.sort(dim=-1, descending=True, stable=True)  # [..., V]
    return values[..., :k], ids[..., :k]


def one_hot(ids: Tensor, vocab_size: int) -> Tensor:
    """float32 one-hot rows: ids [...] -> [..., V]."""
    return torch.nn.functional.one_hot(ids, vocab_size).to(torch.float32)


def _sorted_nucleus(sorted_probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest prefix of descending probabilities [..., n] whose mass reaches
    top_p (the first token always), renormalised."""
    if top_p == 1:
        return sorted_probs
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., n]
    keep = mass_before < top_p  # a top_p below float32's smallest (1e-300) compares as 0
    keep[..., 0] = True
    kept = sorted_probs * keep
    return kept / kept.sum(-1, keepdim=True)


def check_seed(seed: object, name: str = "seed") -> int:
    """``seed`` if it is an integer in [0, MAX_SEED], else ValueError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be an integer in [0, 2**64 - 1], got {seed!r}")
    return seed


def check_generators(generator: object, rows: int) -> None:
    """Raise TypeError unless ``generator`` is None, one ``torch.Generator`` or a sequence of
    them; ValueError when a sequence does not hold one per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return
    if (
        not isinstance(generator, Sequence)
        or isinstance(generator, (str, bytes))
        or not all(isinstance(g, torch.Generator) for g in generator)
    ):
        raise TypeError(
            "generator must be a torch.Generator or a sequence of them (one per row), "
            f"got {type(generator).__name__}"
        )
    if len(generator) != rows:
        raise ValueError(
            f"generator: expected one generator per row ({rows}), got {len(generator)}"
        )


def uniforms(rows: int, count: int, generator: Generators, device: torch.device) -> Tensor:
    """U[0, 1) draws [rows, count] in float32.

    One generator draws the whole block; a sequence of ``rows`` generators draws
    row i from generator i, so a batch reproduces each row run alone.
    """
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        draws = torch.rand(rows, count, generator=generator, device=gen_device)
        return draws.to(device)
    check_generators(generator, rows)
    per_row = [torch.rand(count, generator=g, device=g.device).to(device) for g in generator]
    return torch.stack(per_row)


def sample_inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """One token per row by inverse CDF: probs [B, V] (need not sum to 1), u [B] -> [B] int64.

    Picks the first index whose cumulative mass exceeds u * total, so a token of
    zero probability is never chosen; if rounding puts u * total at the very top,
    the last token of positive mass is taken.
    """
    cdf = probs.float().cumsum(-1)  # [B, V]
    total = cdf[:, -1:].contiguous()  # [B, 1]
    ids = torch.searchsorted(cdf, u.unsqueeze(-1) * total, right=True)  # [B, 1]
    last_positive = torch.searchsorted(cdf, total, right=False)  # [B, 1]
    return torch.minimum(ids, last_positive).squeeze(-1)


def draw(probs: Tensor, greedy: bool, generator: torch.Generator) -> int:
    """One token from probs [1, V]: the argmax when greedy, else one inverse-CDF draw of one
    uniform from ``generator``."""
    if greedy:
        return int(probs.argmax(-1))
    u = uniforms(1, 1, generator, probs.device)[:, 0]  # [1]
    return int(sample_inverse_cdf(probs, u))
