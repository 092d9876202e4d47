"""vLLM's own rejection-sampling kernels, driven through the plugin on synthetic tensors: each
request's emitted tokens follow its rule's exact law (audit.step_law), for one-hot and for
probabilistic drafts, and a row that asks for nothing follows q (the negative control)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lawcheck import binomial_violations, histogram, random_dist

from cactus_spec.core.audit import step_law
from cactus_spec.core.kl_target import kl_target
from cactus_spec.core.sampling import one_hot
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.integrations.vllm.calls import calling

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
    with calling({i: (str(i), spec) for i, spec in enumerate(specs)}):
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


# Blocks: requests asking for verification = block, K = 2 drafts each, through vLLM's own
# rejection_sample. Tables per prefix: p1, q1 [V]; p2, q2 [V, V] (row n1); q3 [V, V, V].
BLOCK = DecodeSpec.of("sps", verification="block")
CACTUS_BLOCK = DecodeSpec.of("cactus", delta=0.5, verification="block")


def _block_tables(seed: int, size: int = 3):
    gen = torch.Generator().manual_seed(seed)

    def table(*shape: int, sharpness: float) -> torch.Tensor:
        return torch.softmax(sharpness * torch.randn(*shape, size, generator=gen), -1)

    p = (table(sharpness=1.5), table(size, sharpness=1.5))
    q = (table(sharpness=3.0), table(size, sharpness=3.0), table(size, size, sharpness=3.0))
    return p, q


def sample_blocks(specs, p, q, rows: int, generators=None) -> torch.Tensor:
    """One vLLM verification of ``rows`` two-draft chains drawn from the tables; [rows, 3]."""
    from vllm.v1.sample import rejection_sampler

    n1 = torch.multinomial(p[0], rows, replacement=True)  # [R]
    n2 = torch.multinomial(p[1][n1], 1).squeeze(-1)  # [R]
    bonus = torch.multinomial(q[2][n1, n2], 1)  # [R, 1]
    drafts = torch.stack([n1, n2], 1).flatten()  # [2R]
    draft_probs = torch.stack([p[0].expand(rows, -1), p[1][n1]], 1).flatten(0, 1)  # [2R, V]
    logits = torch.stack([q[0].expand(rows, -1), q[1][n1]], 1).flatten(0, 1).log()  # [2R, V]
    metadata = SimpleNamespace(
        all_greedy=False,
        all_random=True,
        temperature=torch.ones(rows),
        generators=generators or {},
    )
    with calling({i: (str(i), spec) for i, spec in enumerate(specs)}):
        return rejection_sampler.rejection_sample(
            drafts.to(torch.int32),
            [2] * rows,
            2,
            torch.arange(2, 2 * rows + 1, 2, dtype=torch.int32),
            draft_probs.contiguous(),
            logits.contiguous(),
            bonus,
            metadata,
        ).long()


def _continue(out: torch.Tensor, laws) -> torch.Tensor:
    """The first len(laws) tokens of each row: the block's, then fresh draws from the law
    the next iteration's first token follows (``laws[i]`` indexed by the prefix)."""
    tokens = out[:, : len(laws)].clone()
    for i, law in enumerate(laws):
        missing = tokens[:, i] < 0
        if i and bool(missing.any()):
            rows = law[tuple(tokens[missing, :i].T)]  # [M, V]
            tokens[missing, i] = torch.multinomial(rows, 1).squeeze(-1)
    return tokens


def _joint(tokens: torch.Tensor, size: int) -> torch.Tensor:
    index = torch.zeros(tokens.shape[0], dtype=torch.long)
    for i in range(tokens.shape[1]):
        index = index * size + tokens[:, i]
    return histogram(index, size ** tokens.shape[1])


def test_sps_blocks_emit_the_verifiers_law_over_three_tokens(plugin) -> None:
    torch.manual_seed(4)
    p, q = _block_tables(6)
    tokens = _continue(sample_blocks([BLOCK] * ROWS, p, q, ROWS), q)
    law = q[0][:, None, None] * q[1][:, :, None] * q[2]  # [V, V, V]
    assert binomial_violations(_joint(tokens, 3), law.flatten().double()) == []


def test_cactus_blocks_emit_their_per_position_targets(plugin) -> None:
    """Negative control: vLLM's own rows (q's law) fail the targets' check."""
    torch.manual_seed(5)
    p, q = _block_tables(7)
    delta = CACTUS_BLOCK.rule.delta
    t = (kl_target(q[0], p[0], delta), kl_target(q[1], p[1], delta))  # [V], [V, V]
    law = (t[0][:, None] * t[1]).flatten().double()
    tokens = _continue(sample_blocks([CACTUS_BLOCK] * ROWS, p, q, ROWS), t)
    assert binomial_violations(_joint(tokens, 3), law) == []
    plain = _continue(sample_blocks([None] * ROWS, p, q, ROWS), q[:2])
    assert binomial_violations(_joint(plain, 3), law) != []


def test_a_block_keeps_eleven_ninths_where_vllms_chain_keeps_ten(plugin) -> None:
    """Sun et al.'s example (q = (1/3, 2/3), p = (2/3, 1/3), K = 2): the block keeps 11/9
    drafts on average, token verification (vLLM's own rows, the control) 10/9."""
    torch.manual_seed(6)
    p1, q1 = torch.tensor([2 / 3, 1 / 3]), torch.tensor([1 / 3, 2 / 3])
    p, q = (p1, p1.expand(2, 2)), (q1, q1.expand(2, 2), q1.expand(2, 2, 2))
    specs = [BLOCK, None] * (ROWS // 2)
    out = sample_blocks(specs, p, q, ROWS)
    kept = (out >= 0).sum(-1) - 1  # [R]
    se = 0.9 / (ROWS // 2) ** 0.5  # kept is in {0, 1, 2}: its standard deviation is < 0.9
    assert abs(kept[0::2].double().mean() - 11 / 9) < 5 * se
    assert abs(kept[1::2].double().mean() - 10 / 9) < 5 * se


def test_a_seeded_block_request_draws_the_same_tokens_again(plugin) -> None:
    p, q = _block_tables(8)
    runs = []
    for _ in range(2):
        torch.manual_seed(9)  # the same drafts; vLLM's per-request generators do the rest
        generators = {i: torch.Generator().manual_seed(100 + i) for i in range(64)}
        runs.append(sample_blocks([CACTUS_BLOCK] * 64, p, q, 64, generators))
    assert torch.equal(runs[0], runs[1])
