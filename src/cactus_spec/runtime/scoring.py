"""Log-likelihoods under the verifier alone: speculation changes how tokens are produced,
never the verifier's likelihoods, so these are every method's.

An item is (prefix, continuation): the verifier reads the prefix, then the continuation but
its last token, and log P(continuation | prefix) is the sum of log_softmax at the
continuation's tokens. Items with the same prefix share one prefill: a row reads the prefix
once, then each continuation after rolling back to it. Rows of the backend score several
prefixes in one forward; continuations go in pieces of at most ``SCORE_CHUNK`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from cactus_spec.backends.base import Backend

#: Tokens scored per forward: bounds the float32 logits held at once ([SCORE_CHUNK, V]).
SCORE_CHUNK = 256

Item = tuple[Sequence[int], Sequence[int]]
Score = tuple[float, bool]


def score(
    backend: Backend,
    vocab_size: int,
    items: Sequence[Item],
    on_scored: Callable[[int, Score], None] | None = None,
) -> list[Score]:
    """(log P(continuation | prefix), whether every continuation token is the verifier's
    argmax) per item, in order; ``on_scored(index, score)`` as each is done. An empty
    continuation has probability 1. Leaves the backend's rows holding the last prefixes."""
    out: list[Score | None] = [None] * len(items)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (prefix, continuation) in enumerate(items):
        if continuation:
            groups.setdefault(tuple(prefix), []).append(i)
        else:
            out[i] = (0.0, True)
            if on_scored is not None:
                on_scored(i, (0.0, True))
    batches = list(groups.items())
    for start in range(0, len(batches), backend.slots):
        chunk = batches[start : start + backend.slots]
        for i, scored in _score_rows(backend, vocab_size, chunk, items):
            out[i] = scored
            if on_scored is not None:
                on_scored(i, scored)
    return out  # type: ignore[return-value]  # every slot is filled


def _score_rows(
    backend: Backend,
    vocab_size: int,
    batch: list[tuple[tuple[int, ...], list[int]]],
    items: Sequence[Item],
) -> Iterator[tuple[int, Score]]:
    """Prefixes in rows 0..len(batch)-1, one pass; then the j-th continuation of every row,
    after rolling back to its prefix, in passes of at most ``SCORE_CHUNK`` tokens."""
    rows = list(range(len(batch)))
    for row in rows:
        backend.reset(row)
    prefixes = [list(prefix) for prefix, _ in batch]
    last = backend.append_ragged(prefixes, rows, last_only=True)  # b x [1, V]
    for j in range(max(len(members) for _, members in batch)):
        active = [r for r in rows if j < len(batch[r][1])]
        conts = {r: list(items[batch[r][1][j]][1]) for r in active}
        scores = {r: _logprob(last[r], conts[r][:1], vocab_size) for r in active}
        for r in active:
            backend.rollback(len(prefixes[r]), r)
        for at in range(0, max(len(c) for c in conts.values()) - 1, SCORE_CHUNK):
            fed = [r for r in active if at < len(conts[r]) - 1]
            pieces = [conts[r][at : min(at + SCORE_CHUNK, len(conts[r]) - 1)] for r in fed]
            logits = backend.append_ragged(pieces, fed)  # each [len(piece), V]
            for r, piece, piece_logits in zip(fed, pieces, logits, strict=True):
                more = _logprob(piece_logits, conts[r][at + 1 : at + 1 + len(piece)], vocab_size)
                scores[r] = (scores[r][0] + more[0], scores[r][1] and more[1])
        for r in active:
            yield batch[r][1][j], scores[r]


def _logprob(logits: torch.Tensor, continuation: list[int], vocab_size: int) -> Score:
    """logits [n, V'] at the n positions that predict ``continuation`` -> (sum of log_softmax
    at its tokens, all of them argmax), over the first ``vocab_size`` logits."""
    logits = logits[:, :vocab_size].float()  # [n, V]
    tokens = torch.tensor(continuation, device=logits.device)  # [n]
    logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None])  # [n, 1]
    return float(logprobs.sum()), bool((logits.argmax(-1) == tokens).all())
