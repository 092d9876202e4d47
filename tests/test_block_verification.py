"""Block verification: the verifier's exact law over whole sequences, the paper's optimal
expected length on its own example, and token verification's draws at K = 1."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
from lawcheck import binomial_violations, random_dist
from torch import Tensor

from cactus_spec.core.block_verification import stop_probs, verify_block
from cactus_spec.core.kl_target import kl_target
from cactus_spec.core.rules import Cactus, Rule, SpS, normalize
from cactus_spec.core.sampling import sample_inverse_cdf, uniforms
from cactus_spec.core.verification import VerifyResult, assemble, verify

V, K, N = 3, 2, 120_000
SPS = SpS()


def _tables(seed: int, sharpness: float) -> tuple[list[Tensor], list[Tensor]]:
    """Context-dependent p and q: p[j] [V]*j + [V] for j = 0..K-1, q[j] for j = 0..K."""
    g = torch.Generator().manual_seed(seed)

    def table(j: int) -> Tensor:
        rows = [random_dist(V, g, sharpness) for _ in range(V**j)]
        return torch.stack(rows).reshape(*([V] * j), V).double()

    return [table(j) for j in range(K)], [table(j) for j in range(K + 1)]


def _rows(table: Tensor, prefixes: Tensor) -> Tensor:
    """table[prefix] for each row of prefixes [N, j] -> [N, V]."""
    return table[tuple(prefixes.T)] if prefixes.shape[1] else table.expand(len(prefixes), V)


def _draw(probs: Tensor, g: torch.Generator) -> Tensor:
    return torch.multinomial(probs.float(), 1, generator=g).squeeze(-1)


def _context_free(p: tuple[float, ...], q: tuple[float, ...]) -> tuple[list[Tensor], list[Tensor]]:
    """Tables where every prefix has the same p and q."""

    def table(row: tuple[float, ...], j: int) -> Tensor:
        return torch.tensor(row, dtype=torch.float64).expand(*([V] * j), V).clone()

    return [table(p, j) for j in range(K)], [table(q, j) for j in range(K + 1)]


#: Where the residual's weight matters: after draft 0 (w_1 = 1/4) only token 2 has
#: w_1 q > p, while q > p on tokens 1 and 2 (an unweighted residual is off by 0.015 in TV).
WEIGHT_MATTERS = _context_free((0.8, 0.15, 0.05), (0.2, 0.3, 0.5))


def _targets(tables, rule: Rule) -> list[Tensor]:
    """The rule's target at every prefix: block_target(q, p) for j < K, q at K."""
    p, q = tables
    out = []
    for j in range(K):
        flat_q, flat_p = q[j].reshape(-1, V).float(), p[j].reshape(-1, V).float()
        ids = flat_p.argmax(-1)  # unused by sps and by cactus with a full p row
        out.append(rule.block_target(flat_q, ids, flat_p).double().reshape(q[j].shape))
    return [*out, q[K]]


def _sequence_counts(verifier, tables, one_hot: bool, rule: Rule = SPS) -> tuple[Tensor, Tensor]:
    """Counts of the first K+1 output tokens over N runs (one block-verified iteration,
    then draws from the targets), and their exact law: the product of the rule's targets
    (q for SpS)."""
    p, q = tables
    t = _targets(tables, rule) if not one_hot else q
    g = torch.Generator().manual_seed(1)
    drafts = torch.empty(N, 0, dtype=torch.long)
    p_rows, q_rows = [], []
    for j in range(K):
        p_j = _rows(p[j], drafts)  # [N, V]
        token = p_j.argmax(-1) if one_hot else _draw(p_j, g)  # one-hot: a deterministic drafter
        p_rows.append(p_j)
        q_rows.append(_rows(q[j], drafts))
        drafts = torch.cat([drafts, token[:, None]], dim=1)
    q_rows.append(_rows(q[K], drafts))
    probs = None if one_hot else torch.stack(p_rows, 1).float()  # [N, K, V]
    result = verifier(drafts, torch.stack(q_rows, 1).float(), probs, g)
    out = result.tokens  # [N, K+1], -1 after the emitted ones
    for j in range(K + 1):  # extend every row to K+1 tokens with the targets' law
        missing = out[:, j] < 0
        if bool(missing.any()):
            out[missing, j] = _draw(_rows(t[j], out[missing, :j]), g)
    codes = (out * torch.tensor([V**i for i in reversed(range(K + 1))])).sum(-1)
    counts = torch.bincount(codes, minlength=V ** (K + 1))
    law = torch.ones(V ** (K + 1), dtype=torch.float64)
    for code, seq in enumerate(itertools.product(range(V), repeat=K + 1)):
        for j in range(K + 1):
            law[code] *= t[j][seq[:j]][seq[j]]
    return counts, law


def _unweighted_residual(draft_ids, q, p, g) -> VerifyResult:
    """A plausible bug: block verification's stopping rule with SpS's residual (weight 1)."""
    h, _ = stop_probs(draft_ids, q, p)
    batch, k = draft_ids.shape
    u = uniforms(batch, k + 1, g, draft_ids.device)
    kept = torch.where(u[:, :k] < h, torch.arange(1, k + 1), 0).amax(-1)
    rows = torch.arange(batch)
    q_stop = q[rows, kept]
    p_stop = (p if p is not None else torch.nn.functional.one_hot(draft_ids, V).float())[
        rows, kept.clamp(max=k - 1)
    ]
    target = torch.where((kept < k)[:, None], (q_stop - p_stop).clamp(min=0), q_stop)
    final = sample_inverse_cdf(normalize(target, lambda: q_stop), u[:, k])
    return VerifyResult(assemble(draft_ids, kept, final), kept)


def _block(draft_ids, q, p, g) -> VerifyResult:
    return verify_block(draft_ids, q, p, g)


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("tables", ["random", "weight_matters"])
def test_block_output_follows_verifier_law_over_whole_sequences(tables, one_hot) -> None:
    chosen = _tables(0, 1.5) if tables == "random" else WEIGHT_MATTERS
    counts, law = _sequence_counts(_block, chosen, one_hot)
    assert binomial_violations(counts, law) == []


def test_law_check_catches_an_unweighted_residual() -> None:
    counts, law = _sequence_counts(_unweighted_residual, WEIGHT_MATTERS, one_hot=False)
    assert binomial_violations(counts, law) != []


def _expected_kept(p: Tensor, q: Tensor, k: int, block: bool) -> float:
    """Exact E[drafts kept] for context-free p and q [V] by enumerating every draft chain."""
    total = 0.0
    size = p.shape[0]
    for chain in itertools.product(range(size), repeat=k):
        ids = torch.tensor([chain])
        chance = float(torch.prod(p[ids[0]]))
        q_rows = q.expand(1, k + 1, size)
        p_rows = p.expand(1, k, size)
        if block:
            h = stop_probs(ids, q_rows.double(), p_rows.double())[0][0]  # [K]
            stop = [float(h[i] * torch.prod(1 - h[i + 1 :])) for i in range(k)]
            total += chance * sum((i + 1) * s for i, s in enumerate(stop))
        else:
            accept = torch.clamp(q[ids[0]] / p[ids[0]], max=1)
            total += chance * float(sum(torch.prod(accept[: i + 1]) for i in range(k)))
    return total


def test_paper_example_block_keeps_eleven_ninths_where_tokens_keep_ten() -> None:
    """Sun et al.'s example: q = (1/3, 2/3), p = (2/3, 1/3), K = 2."""
    p = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    q = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    token = _expected_kept(p, q, 2, block=False)
    block = _expected_kept(p, q, 2, block=True)
    assert token == pytest.approx(float(Fraction(10, 9)), abs=1e-12)
    assert block == pytest.approx(float(Fraction(11, 9)), abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_block_never_keeps_fewer_than_token_verification(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    p, q = random_dist(4, g).double(), random_dist(4, g).double()
    assert _expected_kept(p, q, 3, True) >= _expected_kept(p, q, 3, False) - 1e-12


def test_one_draft_equals_token_verification_draw_for_draw() -> None:
    g = torch.Generator().manual_seed(3)
    batch, vocab = 64, 11
    q = torch.softmax(torch.randn(batch, 2, vocab, generator=g), -1)
    p = torch.softmax(torch.randn(batch, 1, vocab, generator=g), -1)
    ids = torch.multinomial(p[:, 0], 1, generator=g)  # [B, 1]
    block = verify_block(ids, q, p, torch.Generator().manual_seed(9))
    chain = verify(ids, q, SpS(), p, torch.Generator().manual_seed(9))
    assert torch.equal(block.tokens, chain.tokens)


def test_same_rows_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(4)
    batch, k, vocab = 6, 4, 9
    q = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g), -1)
    p = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    ids = torch.multinomial(p.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(batch)]
    together = verify_block(ids, q, p, gens)
    for i in range(batch):
        alone = verify_block(
            ids[i : i + 1], q[i : i + 1], p[i : i + 1], torch.Generator().manual_seed(100 + i)
        )
        assert torch.equal(alone.tokens[0], together.tokens[i])


def test_bad_input_is_refused_like_verify() -> None:
    q = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_ids must lie in"):
        verify_block(torch.tensor([[0, 7]]), q)


def _kl(t: Tensor, q: Tensor) -> float:
    return float(torch.special.xlogy(t, t).sum() - torch.special.xlogy(t, q).sum())


@pytest.mark.parametrize("delta", [0.02, 0.3, 1.0])
def test_kl_target_is_the_best_overlap_within_the_budget(delta: float) -> None:
    """Against every target on a 0.004 grid of the 3-token simplex: none within the budget
    overlaps p more (to the grid's resolution), and the budget holds exactly."""
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    p = torch.tensor([0.1, 0.3, 0.6], dtype=torch.float64)
    t = kl_target(q.float(), p.float(), delta).double()
    assert abs(float(t.sum()) - 1) < 1e-6 and bool((t >= 0).all())
    assert _kl(t, q) <= delta + 1e-6
    steps = torch.arange(0, 1.0001, 0.004, dtype=torch.float64)
    a, b = torch.meshgrid(steps, steps, indexing="ij")
    grid = torch.stack([a, b, 1 - a - b], -1).reshape(-1, 3)
    grid = grid[(grid[:, 2] >= 0)]
    kls = (torch.special.xlogy(grid, grid) - torch.special.xlogy(grid, q)).sum(-1)
    best = torch.minimum(grid[kls <= delta], p).sum(-1).max()
    overlap = float(torch.minimum(t, p).sum())
    assert overlap >= float(best) - 1e-6  # t is float32
    assert overlap <= float(best) + 0.01  # the grid comes close: the check can fail


def test_kl_target_edges_zero_budget_saturation_and_support() -> None:
    g = torch.Generator().manual_seed(5)
    q, p = random_dist(40, g), random_dist(40, g)
    assert torch.equal(kl_target(q, p, 0.0), q)
    assert torch.allclose(kl_target(q, p, 50.0), p, atol=1e-6)  # the budget covers KL(p || q)
    q_cut = torch.where(q > q.median(), q, 0.0)
    q_cut /= q_cut.sum()
    t = kl_target(q_cut, p, 0.1)
    assert bool((t[q_cut == 0] == 0).all())  # nothing leaves q's support
    assert _kl(t.double(), q_cut.double()) == pytest.approx(0.1, abs=1e-5)
    wide = kl_target(q_cut, p, 5.0)  # saturated: all of p's mass on q's support is matched
    assert float(torch.minimum(wide, p).sum()) == pytest.approx(float(p[q_cut > 0].sum()))


def test_one_hot_target_is_exact_cactus_h() -> None:
    g = torch.Generator().manual_seed(6)
    q = torch.stack([random_dist(30, g) for _ in range(8)])  # [8, V]
    ids = torch.randint(0, 30, (8,), generator=g)
    one_hot = torch.nn.functional.one_hot(ids, 30).float()
    for delta in (0.05, 0.5):
        expected = Cactus(delta, exact=True).h(q, ids, None)
        assert torch.allclose(kl_target(q, one_hot, delta), expected, atol=1e-5)


def _cactus_block(delta: float):
    def run(draft_ids, q, p, g) -> VerifyResult:
        return verify_block(draft_ids, q, p, g, rule=Cactus(delta))

    return run


@pytest.mark.parametrize("tables", ["random", "weight_matters"])
def test_cactus_on_blocks_emits_its_per_position_targets(tables) -> None:
    chosen = _tables(0, 1.5) if tables == "random" else WEIGHT_MATTERS
    counts, law = _sequence_counts(_cactus_block(0.3), chosen, False, Cactus(0.3))
    assert binomial_violations(counts, law) == []
    # negative control: the same samples are not the verifier's law
    _, q_law = _sequence_counts(_cactus_block(0.3), chosen, False, SPS)
    assert binomial_violations(counts, q_law) != []


@pytest.mark.parametrize("seed", range(3))
def test_one_hot_drafts_keep_what_token_verification_keeps(seed: int) -> None:
    """With one-hot drafts token verification already keeps a prefix with probability
    prod q(n_j), the most the law allows, so the block's E[kept] is the same (vLLM's greedy
    drafting; DESIGN "Inside vLLM")."""
    g = torch.Generator().manual_seed(seed)
    k, size = 4, 6
    q = torch.softmax(2 * torch.randn(1, k + 1, size, generator=g, dtype=torch.float64), -1)
    ids = torch.randint(0, size, (1, k), generator=g)
    h = stop_probs(ids, q, None)[0][0]  # [K]
    block = sum((i + 1) * float(h[i] * torch.prod(1 - h[i + 1 :])) for i in range(k))
    q_n = q[0, torch.arange(k), ids[0]]  # [K]
    token = sum(float(torch.prod(q_n[: i + 1])) for i in range(k))
    assert block == pytest.approx(token, rel=1e-12)
    assert token > 1e-3  # the drafts are kept often enough for the equality to say something
