"""Penalties, logit biases and min-p, applied to p and q alike (the drafts before a position
counted): the formula, and SpS emitting exactly the penalised verifier's law."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_lm, spec_of
from lawcheck import binomial_violations, histogram
from test_engine import noisy_copy

from cactus_spec.core.penalties import Penalties
from cactus_spec.core.rules import SpS
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import as_loaded
from cactus_spec.runtime.engine import SpeculativeDecoder

VOCAB = 32
#: Negative frequency and presence penalties favour repeating: counting a draft shows plainly.
PENALTIES = Penalties(presence=-1.0, frequency=-2.0, repetition=1.5, logit_bias=((3, 6.0),))
SAMPLING = SamplingConfig(1.0, 0, 1.0)
PROMPT = [5, 7, 9, 7, 11]


def test_the_formula_row_by_row() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]]).expand(3, -1)  # [T=3, V=4]
    counts = torch.tensor([0, 1, 0, 0])  # token 1 generated once
    prompt = torch.tensor([False, False, True, False])  # token 2 in the prompt
    out = Penalties(0.5, 1.0, 2.0, ((3, 1.5),)).apply(logits, counts, prompt, drafts=[0, 0])
    # row 0: token 1 (count 1): -1 * 2 - 1 - 0.5; token 2 (prompt): 0.5 / 2; token 3: + 1.5
    assert out[0].tolist() == [2.0, -3.5, 0.25, 1.5]
    assert out[1, 0] == 2.0 / 2 - 1.0 - 0.5  # the first draft counted from row 1 on
    assert out[2, 0] == 2.0 / 2 - 2.0 - 0.5  # both drafts in row 2
    unchanged = Penalties().apply(logits, counts, prompt, drafts=[0, 0])
    assert torch.equal(unchanged, logits) and not Penalties().active


def test_min_p_drops_tokens_below_its_share_of_the_most_likely() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, SamplingConfig(1.0, 0, 1.0, min_p=0.2))
    assert probs[0, 3] == 0 and probs[0, 2] > 0  # 0.05 < 0.2 * 0.5 <= 0.15
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"presence": 3.0}, "presence_penalty must be a number in [-2, 2]"),
        ({"repetition": 0.0}, "repetition_penalty must be a number in (0, 10]"),
        ({"logit_bias": ((1, 200.0),)}, "logit_bias[1] must be in [-100, 100]"),
    ],
)
def test_bad_penalties_are_refused_naming_them(kwargs, words) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
        Penalties(**kwargs)


def penalised_q(target, context: list[int], generated: list[int]) -> torch.Tensor:
    """The penalised verifier's distribution after ``context`` (``generated`` its output)."""
    backend = make_backend(as_loaded("verifier", target), "lean", 1)
    logits = backend.append(context, keep=1)[:, :VOCAB]  # [1, V]
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=VOCAB)
    prompt = torch.zeros(VOCAB, dtype=torch.bool)
    prompt[PROMPT] = True
    return logits_to_probs(PENALTIES.apply(logits, counts, prompt, []), SAMPLING)[0]


def emitted_pairs(penalties: Penalties, runs: int) -> torch.Tensor:
    """The first two tokens of ``runs`` seeded SpS generations (K = 3): [runs, 2]."""
    target = make_tiny_lm(vocab_size=VOCAB, seed=0)
    d = SpeculativeDecoder(target, noisy_copy(target, 0.5, seed=1), spec_of(SpS(), 3))
    pairs = [
        d.generate(PROMPT, 2, 1.0, 0, 1.0, seed=seed, penalties=penalties).token_ids
        for seed in range(runs)
    ]
    return torch.tensor(pairs)


def test_sps_emits_the_penalised_verifiers_law_at_drafted_positions() -> None:
    """The first token's law is the penalised q after the prompt; the second's, given the
    first, counts it (as a draft, or as output when the first iteration ended there)."""
    target = make_tiny_lm(vocab_size=VOCAB, seed=0)
    pairs = emitted_pairs(PENALTIES, 3000)
    first = penalised_q(target, PROMPT, [])
    assert binomial_violations(histogram(pairs[:, 0], VOCAB), first) == []
    firsts = histogram(pairs[:, 0], VOCAB)

    def laws(a: int) -> tuple[torch.Tensor, torch.Tensor]:  # counted, uncounted
        return penalised_q(target, PROMPT + [a], [a]), penalised_q(target, PROMPT + [a], [])

    def power(a: int) -> float:  # how far apart the two laws put the samples
        counted, uncounted = laws(a)
        return float(firsts[a] * (counted[a] - uncounted[a]).abs())

    a = max((t for t in range(VOCAB) if firsts[t] >= 300), key=power)
    second, uncounted = laws(a)
    given = pairs[pairs[:, 0] == a, 1]
    assert binomial_violations(histogram(given, VOCAB), second) == []
    # negative control: the law without the first token counted is another law
    assert binomial_violations(histogram(given, VOCAB), uncounted) != []


def test_negative_control_penalties_change_the_law() -> None:
    pairs = emitted_pairs(Penalties(), 1000)
    target = make_tiny_lm(vocab_size=VOCAB, seed=0)
    assert binomial_violations(histogram(pairs[:, 0], VOCAB), penalised_q(target, PROMPT, [])) != []
