"""Drafting with a model whose tokenizer is not the verifier's (cross-vocabulary drafting).

The verifier's context is decoded to text and encoded with the draft's tokenizer; the draft
model drafts its own tokens on its own cache (``ModelDrafter``, which keeps what the new
encoding shares with the last one); the text of those drafts is encoded with the verifier's
tokenizer, and its first K tokens are the proposal (where the drafts finish a word the context
cut, the verifier's tokens of its start stay as emitted and the proposal spells the rest).
The verifier never sees the draft's
distribution: the proposal is one-hot (``Draft.probs`` None), as the n-gram drafter's is.

Why that is exact for SpS: given a proposed token n, accepting it with probability q_n and
drawing a rejection from norm(max(0, q - 1[n])) (q with n removed) emits
q_n 1[n] + (1 - q_n) q_{-n} / (1 - q_n) = q, whatever law chose n, as long as that law does
not read the verifier's draws. Cactus applies its rule to the one-hot p, so its target given
the proposal is h(n), and the meter reads KL(h(n) ‖ q), which bounds the divergence of the
emitted law E_n h(n) by convexity.

The draft proposes its most likely token at each step: a one-hot proposal n is kept with
probability q_n, so the best proposal is the verifier's likeliest token, and the draft's mode
is its guess of it (sampling n from p would keep sum_n p_n q_n on average). Its confidence
(for ``keep_drafting``) is p of that token under the request's temperature, top-k and top-p.
The verifier's penalties, logit biases and grammar act on verifier ids only, so they shape the
verification, and the engine cuts a proposal at the first token a grammar refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.runtime.drafters import Draft, DraftRequest, ModelDrafter

#: Draft tokens of the context decoded with the drafts, so that their text comes out as in
#: the whole sequence (a character split across tokens, a leading space).
_TAIL = 4


class CrossVocabDrafter:
    """Drafts for a verifier with ``verifier_tokenizer`` by drafting text with ``drafter``
    (a model with ``draft_tokenizer``) and re-encoding it for the verifier."""

    def __init__(
        self,
        drafter: ModelDrafter,
        draft_tokenizer: PreTrainedTokenizerBase,
        verifier_tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.drafter = drafter
        self.backend = drafter.backend
        self.draft_tokenizer = draft_tokenizer
        self.verifier_tokenizer = verifier_tokenizer
        self._encoded: dict[int, tuple[list[int], list[int]]] = {}  # row -> (context, its ids)

    def reset(self, row: int | None = None) -> None:
        self.drafter.reset(row)
        if row is None:
            self._encoded = {}
        else:
            self._encoded.pop(row, None)

    def start(self, row: int, prompt: Sequence[int], reuse: bool) -> int:
        """The draft's prompt tokens kept (counted in the draft's tokens)."""
        return self.drafter.start(row, self.draft_context(row, prompt), reuse)

    def behind(self, row: int, context: Sequence[int]) -> int:
        """Draft tokens the draft model would read before drafting for ``row`` again."""
        return self.drafter.behind(row, self.draft_context(row, context))

    def catch_up(
        self, rows: Sequence[int], contexts: Sequence[Sequence[int]], budget: int | None
    ) -> int:
        """Draft tokens the draft model read of what it lags (``ModelDrafter.catch_up``)."""
        ids = [
            self.draft_context(row, context) for row, context in zip(rows, contexts, strict=True)
        ]
        return self.drafter.catch_up(rows, ids, budget)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        contexts = [self.draft_context(r.row, r.context) for r in requests]
        room = self.backend.context_length
        asks = [
            DraftRequest(
                r.row,
                ids,
                max(0, min(r.num_draft_tokens, room - len(ids))) if ids else 0,
                _MODE,
                r.generator,
                partial(_probs, sampling=r.sampling),
                r.keep_drafting,
            )
            for r, ids in zip(requests, contexts, strict=True)
        ]
        drafted = self.drafter.propose(asks)
        return [
            Draft(self.verifier_tokens(ids, d.tokens)[: r.num_draft_tokens], None)
            for r, ids, d in zip(requests, contexts, drafted, strict=True)
        ]

    def draft_context(self, row: int, context: Sequence[int]) -> list[int]:
        """The verifier's ``context`` as the draft's ids (its text, encoded again)."""
        context = list(context)
        last = self._encoded.get(row)
        if last is not None and last[0] == context:
            return last[1]
        ids = self.draft_tokenizer(_text(self.verifier_tokenizer, context), **_RAW).input_ids
        self._encoded[row] = (context, ids)
        return ids

    def verifier_tokens(self, draft_context: Sequence[int], drafted: Sequence[int]) -> list[int]:
        """The verifier's ids of the text that ``drafted`` (draft ids) adds after
        ``draft_context``."""
        new = added_text(self.draft_tokenizer, draft_context[-_TAIL:], drafted)
        return self.verifier_tokenizer(new, **_RAW).input_ids if new else []


_RAW = {"add_special_tokens": False}
#: The draft's draws: its mode.
_MODE = SamplingConfig(temperature=0.0)


def _probs(logits: Tensor, drafted: Sequence[int], sampling: SamplingConfig) -> Tensor:
    """The draft's p [1, V] under the request's sampling (its confidence in its mode)."""
    return logits_to_probs(logits, sampling)


def _text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """The exact text of ``ids``, special tokens spelled out."""
    # transformers types a list and every result it can give; any sequence of ids gives one str
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # type: ignore[arg-type, return-value]


def added_text(
    tokenizer: PreTrainedTokenizerBase, before: Sequence[int], added: Sequence[int]
) -> str:
    """The text ``added`` appends to ``before`` (decoded together: a character split across
    tokens, or a leading space a tokenizer strips alone, comes out right), without a trailing
    character still incomplete."""
    head = _text(tokenizer, before)
    whole = _text(tokenizer, [*before, *added])
    new = whole[len(head) :] if whole.startswith(head) else _text(tokenizer, added)
    return new.rstrip("\ufffd")
