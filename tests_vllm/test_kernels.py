"""vLLM's own rejection-sampling kernels, driven through the plugin on synthetic tensors: each
request's emitted tokens follow its rule's exact law (audit.step_law), for one-hot and for
probabilistic drafts, and a row that asks for nothing follows q (the negative control)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lawcheck import binomial_violations, histogram, random_dist

from cactus_spec.core.audit import step_law
from cactus_spec.core.sampling import one_hot
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.integrations.vllm.sampler import Batch, Current

ROWS = 20_000
VOCAB = 8
SPECS = [
    DecodeSpec.of("sps"),
    DecodeSpec.of("cactus", delta=0.5),
    DecodeSpec.of("cactus", delta=0.5, exact=True),
    DecodeSpec.of("tas", epsilon=0.3, alpha=0.6),
    DecodeSpec.of("interp", alpha=0.4),
    DecodeSpec.of("topk", k=2),
]


def sample_once(specs, p, q, drafts, probabilistic: bool) -> torch.Tensor:
    """One vLLM verification of ROWS one-token chains; the emitted first tokens [ROWS]."""
    from vllm.v1.sample import rejection_sampler

    rows = len(drafts)
    metadata = SimpleNamespace(
        all_greedy=False, all_random=True, temperature=torch.ones(rows), generators={}
    )
    Current.batch = Batch([str(i) for i in range(rows)], specs)
    try:
        out = rejection_sampler.rejection_sample(
            drafts.to(torch.int32),  # [T]
            [1] * rows,
            1,
            torch.arange(1, rows + 1, dtype=torch.int32),  # cu_num_draft_tokens
            p.expand(rows, VOCAB).contiguous() if probabilistic else None,
            q.log().expand(rows, VOCAB).contiguous(),  # target logits
            torch.full((rows, 1), VOCAB - 1, dtype=torch.int64),  # bonus, unused here
            metadata,
        )
    finally:
        Current.batch = None
    return out[:, 0].long()


def laws(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return random_dist(VOCAB, gen), random_dist(VOCAB, gen, sharpness=3.0)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}{dict(s.params)}")
def test_probabilistic_drafts_follow_the_rules_law(plugin, spec) -> None:
    torch.manual_seed(0)
    p, q = laws(1)
    drafts = torch.multinomial(p, ROWS, replacement=True)
    tokens = sample_once([spec] * ROWS, p, q, drafts, probabilistic=True)
    assert binomial_violations(histogram(tokens, VOCAB), step_law(p, q, spec.rule)) == []


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}{dict(s.params)}")
def test_one_hot_drafts_follow_the_rules_law(plugin, spec) -> None:
    torch.manual_seed(1)
    p_unused, q = laws(2)
    n = int(q.argsort()[VOCAB // 2])  # a middling token: rejections happen
    drafts = torch.full((ROWS,), n)
    tokens = sample_once([spec] * ROWS, p_unused, q, drafts, probabilistic=False)
    law = step_law(one_hot(torch.tensor(n), VOCAB).double(), q, spec.rule)
    assert binomial_violations(histogram(tokens, VOCAB), law) == []


def test_rows_that_ask_for_nothing_follow_q_not_cactus(plugin) -> None:
    """Negative control: the same check fails when the rows are vLLM's standard SpS."""
    torch.manual_seed(2)
    p, q = laws(3)
    drafts = torch.multinomial(p, ROWS, replacement=True)
    tokens = sample_once([None] * ROWS, p, q, drafts, probabilistic=True)
    counts = histogram(tokens, VOCAB)
    cactus = DecodeSpec.of("cactus", delta=0.5).rule
    assert binomial_violations(counts, step_law(p, q, cactus)) != []
    assert binomial_violations(counts, q.double()) == []


def test_a_mixed_batch_gives_each_row_its_own_law(plugin) -> None:
    torch.manual_seed(3)
    p, q = laws(4)
    drafts = torch.multinomial(p, ROWS, replacement=True)
    specs = [SPECS[i % 2] for i in range(ROWS)]  # sps, cactus, sps, ...
    tokens = sample_once(specs, p, q, drafts, probabilistic=True)
    for i, spec in enumerate(SPECS[:2]):
        counts = histogram(tokens[i::2], VOCAB)
        assert binomial_violations(counts, step_law(p, q, spec.rule)) == []


def test_a_failing_meter_leaves_the_tokens_and_the_engine_alone(
    plugin, monkeypatch, caplog
) -> None:
    def broken(*args, **kwargs):
        raise ValueError("meter bug")

    monkeypatch.setattr(plugin.METER, "record", broken)
    p, q = laws(5)
    drafts = torch.multinomial(p, 100, replacement=True)
    tokens = sample_once([SPECS[1]] * 100, p, q, drafts, probabilistic=True)
    assert tokens.shape == (100,) and bool((tokens >= 0).all())
    assert "the divergence meter failed" in caplog.text
