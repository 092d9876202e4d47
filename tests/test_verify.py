"""Chain verification: emitted tokens follow the exact laws, chains stop at the first
rejection, seeded draws reproduce, batches equal rows, and bad input is refused."""

from __future__ import annotations

import pytest
import torch
from lawcheck import binomial_violations, histogram, random_dist, wrong_law

from cactus_spec.core.audit import acceptance_prob, step_law
from cactus_spec.core.rules import TAS, Cactus, Interp, SpS, TopK
from cactus_spec.core.verification import verify

N = 100_000
V = 8
RULES = [SpS(), Cactus(0.5), Cactus(0.5, exact=True), TAS(), Interp(0.4), TopK(3)]


def one_position_batch(seed: int, rows: int = N):
    """N independent rows, K = 1: drafts n ~ p, target rows q (drafted and bonus)."""
    g = torch.Generator().manual_seed(seed)
    p, q = random_dist(V, g), random_dist(V, g)
    drafts = torch.multinomial(p, rows, replacement=True, generator=g).unsqueeze(1)  # [N, 1]
    target = q.expand(rows, 2, V)  # [N, 2, V]
    draft_probs = p.expand(rows, 1, V)  # [N, 1, V]
    return p, q, drafts, target, draft_probs


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_emitted_token_follows_step_law(rule) -> None:
    p, q, drafts, target, draft_probs = one_position_batch(seed=10)
    g = torch.Generator().manual_seed(11)
    out = verify(drafts, target, rule, draft_probs, generator=g)
    counts = histogram(out.tokens[:, 0], V)
    law = step_law(p, q, rule)
    assert binomial_violations(counts, law) == []
    assert binomial_violations(counts, wrong_law(law)) != []  # negative control


def test_cactus_with_large_delta_is_detectably_not_q() -> None:
    """The same check that passes SpS rejects Cactus(delta = 2) against q itself."""
    p, q, drafts, target, draft_probs = one_position_batch(seed=12)
    out = verify(
        drafts, target, Cactus(2.0), draft_probs, generator=torch.Generator().manual_seed(0)
    )
    assert binomial_violations(histogram(out.tokens[:, 0], V), q) != []


def test_chain_law_of_num_accepted_and_padding() -> None:
    """K = 3 with fixed (p_j, q_j): P(num_accepted = m) = prod_{j<m} a_j (1 - a_m)."""
    g = torch.Generator().manual_seed(20)
    k, rows = 3, N
    p = torch.stack([random_dist(V, g) for _ in range(k)])  # [K, V]
    q = torch.stack([random_dist(V, g) for _ in range(k)])  # [K, V]
    bonus = torch.zeros(V)
    bonus[[5, 6]] = torch.tensor([0.25, 0.75])
    drafts = torch.stack(
        [torch.multinomial(p[j], rows, replacement=True, generator=g) for j in range(k)], 1
    )  # [N, K]
    target = torch.cat([q, bonus.unsqueeze(0)]).expand(rows, k + 1, V)
    rule = Cactus(0.3)
    out = verify(drafts, target, rule, p.expand(rows, k, V), generator=g)
    alpha = torch.stack([acceptance_prob(p[j], q[j], rule) for j in range(k)])  # [K]
    survive = torch.cat([torch.ones(1, dtype=torch.float64), alpha.cumprod(0)])  # [K+1]
    law = survive * torch.cat([1 - alpha, torch.ones(1, dtype=torch.float64)])  # [K+1]
    assert binomial_violations(histogram(out.num_accepted, k + 1), law) == []
    assert binomial_violations(histogram(out.num_accepted, k + 1), wrong_law(law)) != []
    positions = torch.arange(k + 1)
    na = out.num_accepted.unsqueeze(1)
    assert bool((out.tokens[positions.expand(rows, -1) > na] == -1).all())
    assert torch.equal(out.tokens[:, :k][positions[:k] < na], drafts[positions[:k] < na])
    full = out.num_accepted == k
    bonus_tokens = out.tokens[full, k]
    assert binomial_violations(histogram(bonus_tokens, V), bonus) == []


def random_chains(seed: int, batch: int = 6, k: int = 4, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(2 * torch.randn(batch, k + 1, vocab, generator=g), -1)
    draft = torch.softmax(2 * torch.randn(batch, k, vocab, generator=g), -1)
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    return ids, target, draft


def test_cactus_delta_zero_equals_sps_with_same_generator() -> None:
    ids, target, draft = random_chains(30, batch=200)
    for exact in (False, True):
        a = verify(ids, target, SpS(), draft, generator=torch.Generator().manual_seed(5))
        b = verify(
            ids, target, Cactus(0.0, exact), draft, generator=torch.Generator().manual_seed(5)
        )
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.num_accepted, b.num_accepted)


@pytest.mark.parametrize("rule", RULES, ids=repr)
@pytest.mark.parametrize("with_probs", [True, False])
def test_same_generator_state_same_output(rule, with_probs: bool) -> None:
    ids, target, draft = random_chains(31)
    draft = draft if with_probs else None
    a = verify(ids, target, rule, draft, generator=torch.Generator().manual_seed(9))
    b = verify(ids, target, rule, draft, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_batch_equals_rows_run_alone(rule) -> None:
    ids, target, draft = random_chains(32, batch=8)
    batch = verify(
        ids, target, rule, draft, generator=[torch.Generator().manual_seed(i) for i in range(8)]
    )
    for i in range(8):
        alone = verify(
            ids[i : i + 1],
            target[i : i + 1],
            rule,
            draft[i : i + 1],
            generator=[torch.Generator().manual_seed(i)],
        )
        assert torch.equal(batch.tokens[i], alone.tokens[0])


def test_greedy_accepts_iff_argmax_and_emits_argmax() -> None:
    ids, target, _ = random_chains(33, batch=50)
    argmax = target.argmax(-1)  # [B, K+1]
    ids[:25] = argmax[:25, :-1]  # half the rows follow the verifier exactly
    out = verify(ids, target, Cactus(5.0), greedy=True)
    matches = (ids == argmax[:, :-1]).long().cumprod(-1).sum(-1)
    assert torch.equal(out.num_accepted, matches)
    rows = torch.arange(50)
    assert torch.equal(out.tokens[rows, out.num_accepted], argmax[rows, out.num_accepted])
    assert bool((out.num_accepted[:25] == 4).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_match_float32_math(dtype: torch.dtype) -> None:
    ids, target, draft = random_chains(34, batch=20)
    low_t, low_d = target.to(dtype), draft.to(dtype)
    a = verify(ids, low_t, Cactus(1.0), low_d, generator=torch.Generator().manual_seed(1))
    b = verify(
        ids,
        low_t.float(),
        Cactus(1.0),
        low_d.float(),
        generator=torch.Generator().manual_seed(1),
        validate=False,
    )
    assert a.tokens.dtype == torch.int64
    assert torch.equal(a.tokens, b.tokens)


def test_nan_target_is_refused_not_sampled() -> None:
    ids, target, draft = random_chains(35)
    target[2, 1, 7] = float("nan")
    with pytest.raises(ValueError, match="verifier_probs contains NaN"):
        verify(ids, target, SpS(), draft)


def bad_inputs():
    ids, target, draft = random_chains(36)
    neg = target.clone()
    neg[0, 0, 0] = -0.1
    unnormalised = target * 1.1
    zero_draft = draft.clone()
    zero_draft[0, 0, (ids[0, 0] + 1) % 50] += zero_draft[0, 0, ids[0, 0]]
    zero_draft[0, 0, ids[0, 0]] = 0
    out_of_vocab = ids.clone()
    out_of_vocab[1, 1] = 50
    return [
        ("int32_ids", (ids.int(), target, draft), "draft_ids must be an int64"),
        ("1d_ids", (ids[0], target, draft), "draft_ids must be an int64 tensor of shape"),
        ("no_drafts", (ids[:, :0], target[:, :1], None), "K >= 1"),
        ("q_rows", (ids, target[:, :-1], draft), r"verifier_probs must have shape \[6, 5, V\]"),
        ("draft_rows", (ids, target, draft[:, :-1]), r"draft_probs must have shape \[6, 4, V\]"),
        ("vocab", (ids, target, draft[..., :40]), "draft_probs has vocabulary 40"),
        ("int_probs", (ids, target.long(), draft), "verifier_probs dtype"),
        ("negative", (ids, neg, draft), "negative probability"),
        ("sum", (ids, unnormalised, draft), "sum to 1"),
        ("vocab_range", (out_of_vocab, target, draft), r"draft_ids must lie in \[0, 50\)"),
        ("zero_draft_prob", (ids, target, zero_draft), "probability 0 to a drafted token"),
        ("device", (ids, target.to("meta"), draft), "verifier_probs is on meta"),
    ]


@pytest.mark.parametrize(
    ("name", "args", "message"), bad_inputs(), ids=[b[0] for b in bad_inputs()]
)
def test_bad_input_raises(name: str, args, message: str) -> None:
    ids, target, draft = args
    with pytest.raises(ValueError, match=message):
        verify(ids, target, SpS(), draft, generator=torch.Generator().manual_seed(0))


def test_wrong_number_of_row_generators() -> None:
    ids, target, draft = random_chains(37)
    with pytest.raises(ValueError, match="generator"):
        verify(ids, target, SpS(), draft, generator=[torch.Generator()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_cuda_matches_law(rule) -> None:
    p, q, drafts, target, draft_probs = one_position_batch(seed=40)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = verify(drafts.cuda(), target.cuda(), rule, draft_probs.cuda(), generator=g)
    assert out.tokens.device.type == "cuda"
    counts = histogram(out.tokens[:, 0].cpu(), V)
    assert binomial_violations(counts, step_law(p, q, rule)) == []
