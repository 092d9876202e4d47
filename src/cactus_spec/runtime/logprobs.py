"""Log-probabilities of emitted tokens under the verifier: log q of each token and of q's most
likely alternatives at its position.

q is the verifier's distribution after the request's sampling processing (temperature,
top-k, top-p), the law SpS emits exactly. A lossy rule (Cactus, TAS, ...) samples from
another law, so for it these are q's figures, not those of the law the token was drawn
from; a token outside q's support (possible with Interp or TAS) has log q = -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cactus_spec.core.checks import is_int

#: Most alternatives a request may ask for per position (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


def check_logprobs(logprobs: int | None, name: str = "logprobs") -> None:
    """ValueError naming ``name`` unless ``logprobs`` is None or an integer in
    [0, MAX_TOP_LOGPROBS]."""
    if logprobs is None:
        return
    if not is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {logprobs!r}"
        )


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted ``token``, its log q, and the ``top`` alternatives (token, log q), most
    likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(q: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The entries of ``tokens``, the i-th emitted at the position of q [>= len(tokens), V],
    with ``top`` alternatives each."""
    count = len(tokens)
    logq = q[:count].log()  # [n, V]; log 0 = -inf
    ids = torch.tensor(tokens, device=q.device)  # [n]
    chosen = logq.gather(1, ids[:, None])[:, 0].tolist()  # [n]
    if top:
        values, indices = logq.topk(min(top, logq.shape[-1]), dim=-1)  # [n, top] x2
        alternatives = [
            list(zip(i, v, strict=True))
            for i, v in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    else:
        alternatives = [[] for _ in range(count)]
    return [
        TokenLogprob(token, logprob, alts)
        for token, logprob, alts in zip(tokens, chosen, alternatives, strict=True)
    ]
