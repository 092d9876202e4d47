"""Log-probabilities of emitted tokens: log q of each token at its position, and q's most
likely alternatives, equal to q recomputed offline from the verifier alone."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_lm, spec_of
from test_engine import noisy_copy

from cactus_spec.core.rules import Cactus, SpS
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import as_loaded
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.logprobs import token_logprobs
from cactus_spec.server.logprobs import LOGPROB_FLOOR, chat_logprobs, completion_logprobs

PROMPT = [5, 17, 3, 99, 42, 7]
SAMPLING = SamplingConfig(0.8, 20, 0.95)


def test_entries_hold_log_q_of_the_token_and_the_top_alternatives() -> None:
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.1, 0.0, 0.9]])
    first, second = token_logprobs(q, [1, 0], top=2)
    assert first.token == 1 and first.logprob == pytest.approx(math.log(0.3))
    assert first.top == [(0, pytest.approx(math.log(0.5))), (1, pytest.approx(math.log(0.3)))]
    assert second.logprob == -math.inf  # a token outside q's support
    assert token_logprobs(q, [1], top=0)[0].top == []


def test_the_openai_shapes_floor_log_zero_and_offset_the_text() -> None:
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    entries = token_logprobs(q, [0, 2], top=1)
    names = {0: "ab", 1: "c", 2: "é"}.__getitem__
    chat = chat_logprobs(entries, names)["content"]
    assert [e["token"] for e in chat] == ["ab", "é"] and chat[1]["bytes"] == [0xC3, 0xA9]
    assert chat[0]["top_logprobs"][0]["token"] in ("ab", "c")
    done = completion_logprobs(token_logprobs(q, [2, 1], top=0), names, offset=4)
    assert done["text_offset"] == [4, 5] and done["token_logprobs"][1] == LOGPROB_FLOOR


def offline_logq(target, context: list[int], token: int) -> float:
    """log q(token | context) from a fresh verifier backend, processed by SAMPLING."""
    backend = make_backend(as_loaded("verifier", target), "lean", 1)
    logits = backend.append(context, keep=1)  # [1, V]
    return float(logits_to_probs(logits, SAMPLING)[0, token].log())


@pytest.mark.parametrize("rule", [SpS(), Cactus(1.0), None])
def test_each_tokens_logprob_is_log_q_at_its_position(rule) -> None:
    target = make_tiny_lm(seed=0)
    draft = noisy_copy(target, 0.4, seed=1) if rule is not None else None
    d = SpeculativeDecoder(target, draft, spec_of(rule, 4 if rule else 0))
    result = d.generate(PROMPT, 12, 0.8, 20, 0.95, seed=3, logprobs=3)
    assert [e.token for e in result.logprobs] == result.token_ids
    for i, entry in enumerate(result.logprobs):
        expected = offline_logq(target, PROMPT + result.token_ids[:i], entry.token)
        assert entry.logprob == pytest.approx(expected, abs=1e-4), i
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        assert entry.top[0][1] >= entry.logprob
    # negative control: a position off by one gives other figures
    shifted = offline_logq(target, PROMPT + result.token_ids[:2], result.token_ids[1])
    assert shifted != pytest.approx(result.logprobs[1].logprob, abs=1e-4)


def test_no_logprobs_unless_asked_and_a_bad_count_is_refused() -> None:
    d = SpeculativeDecoder(make_tiny_lm(seed=0), spec=spec_of(None, 0))
    assert d.generate(PROMPT, 4, seed=1).logprobs is None
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        d.generate(PROMPT, 4, seed=1, logprobs=21)
