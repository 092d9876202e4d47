"""The decode loop on tiny random-weight models: SpS reproduces the verifier exactly
(greedy token for token, sampled in law), Cactus(0) is SpS, and bad input is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import AR, make_tiny_lm, spec_of

from cactus_spec.core.kl_target import kl_target
from cactus_spec.core.rules import Cactus, SpS
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.models import VocabularyMismatchError
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.policy import SpeculationPolicy

PROMPT = [5, 17, 3, 99, 42, 7, 17, 3]


def noisy_copy(model, scale: float, seed: int):
    """A draft that mostly agrees with the target: its weights plus seeded noise."""
    draft = make_tiny_lm(model.config.vocab_size, seed=0)
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        draft.lm_head.weight += scale * torch.randn(draft.lm_head.weight.shape, generator=g)
    return draft


def reference_greedy(model, prompt: list[int], count: int, eos: int | None = None) -> list[int]:
    """Greedy decoding by full forward passes without any cache."""
    ids, out = list(prompt), []
    for _ in range(count):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_sps_equals_verifier_greedy(k: int) -> None:
    target = make_tiny_lm()
    draft = noisy_copy(target, 0.3, seed=1)
    result = SpeculativeDecoder(target, draft, spec_of(SpS(), k)).generate(
        PROMPT, max_new_tokens=40, temperature=0
    )
    assert result.token_ids == reference_greedy(target, PROMPT, 40)
    assert 0 < result.stats.accepted < result.stats.drafted  # both paths exercised
    assert result.stats.kl_nats == 0


def test_greedy_ngram_drafter_equals_verifier_greedy() -> None:
    target = make_tiny_lm()
    result = SpeculativeDecoder(target, None, spec_of(SpS(), 4, drafter="ngram")).generate(
        PROMPT * 3, max_new_tokens=40, temperature=0
    )
    assert result.token_ids == reference_greedy(target, PROMPT * 3, 40)
    assert result.stats.drafted > 0


def test_eos_inside_an_accepted_block_ends_generation() -> None:
    target = make_tiny_lm()
    reference = reference_greedy(target, PROMPT, 30)
    eos = reference[5]
    first = reference.index(eos)
    target.generation_config.eos_token_id = eos
    draft = noisy_copy(target, 0.0, seed=0)  # identical: every draft is accepted
    result = SpeculativeDecoder(target, draft, spec_of(SpS(), 8)).generate(
        PROMPT, max_new_tokens=30, temperature=0
    )
    assert result.token_ids == reference[: first + 1]
    s = result.stats
    # One iteration: drafts 0..first accepted and emitted (EOS last), the rest dropped.
    assert (s.iterations, s.drafted, s.accepted, s.new_tokens) == (1, 8, first + 1, first + 1)
    assert s.reached_by_position == [1] * (first + 1) + [0] * (7 - first)
    assert s.accepted_by_position == s.reached_by_position
    assert_stats_invariants(s, ended_in_draft=True)


def assert_stats_invariants(s, ended_in_draft: bool) -> None:
    """What the statistics must satisfy whatever the run: only emitted drafts count."""
    own_tokens = s.iterations - (1 if ended_in_draft else 0)  # corrections and bonuses
    assert s.new_tokens == s.accepted + own_tokens
    assert s.accepted <= s.drafted
    assert sum(s.accepted_by_position) == s.accepted
    assert all(
        a <= r <= s.iterations
        for a, r in zip(s.accepted_by_position, s.reached_by_position, strict=True)
    )
    assert s.mean_accepted == s.accepted / s.iterations


@pytest.mark.parametrize("k", [2, 5, 8])
def test_statistics_count_only_emitted_drafts_at_eos_for_every_k(k: int) -> None:
    """Sampled runs with a draft equal to the verifier accept every draft, so iteration i
    emits tokens i(K+1) .. i(K+1)+K, the last one its bonus. A run ending at EOS then has
    exactly the drafts before and at the EOS accepted, whatever position it falls on."""
    target = make_tiny_lm(seed=3)
    eos = reference_greedy(target, PROMPT, 4)[3]
    target.generation_config.eos_token_id = eos
    decoder = SpeculativeDecoder(target, noisy_copy(target, 0.0, seed=0), spec_of(Cactus(1.0), k))
    ended_in_draft = 0
    for seed in range(8):
        result = decoder.generate(PROMPT, 200, temperature=1.0, top_k=0, top_p=1.0, seed=seed)
        ids, s = result.token_ids, result.stats
        if ids[-1] != eos:
            continue  # ended at the budget: not the case under test
        last = len(ids) - 1
        assert s.iterations == last // (k + 1) + 1
        assert s.accepted == sum(1 for i in range(len(ids)) if i % (k + 1) != k)
        in_draft = last % (k + 1) != k
        ended_in_draft += in_draft
        assert_stats_invariants(s, ended_in_draft=in_draft)
        with pytest.raises(AssertionError):  # negative control: one draft too many fails
            assert_stats_invariants(replace(s, accepted=s.accepted + 1), in_draft)
    assert ended_in_draft > 0  # the case under test did occur


def test_budget_is_exact() -> None:
    target = make_tiny_lm()
    target.config.eos_token_id = target.generation_config.eos_token_id = None
    decoder = SpeculativeDecoder(target, noisy_copy(target, 0.0, 0), spec_of(SpS(), 8))
    for budget in (1, 2, 9, 17):
        result = decoder.generate(PROMPT, max_new_tokens=budget, temperature=0.8, seed=1)
        assert len(result.token_ids) == budget


def test_cactus_delta_zero_equals_sps_for_the_same_seed() -> None:
    target = make_tiny_lm()
    draft = noisy_copy(target, 0.5, seed=2)
    for exact in (False, True):
        sps = SpeculativeDecoder(target, draft, spec_of(SpS(), 4)).generate(PROMPT, 30, 0.9, seed=3)
        cactus = SpeculativeDecoder(target, draft, spec_of(Cactus(0.0, exact), 4)).generate(
            PROMPT, 30, 0.9, seed=3
        )
        assert cactus.token_ids == sps.token_ids


def test_divergence_meter_reads_zero_for_sps_and_positive_for_cactus() -> None:
    target = make_tiny_lm()
    draft = noisy_copy(target, 1.0, seed=4)
    sps = SpeculativeDecoder(target, draft, spec_of(SpS(), 4)).generate(
        PROMPT, 40, 1.0, 0, 1.0, seed=5
    )
    cactus = SpeculativeDecoder(target, draft, spec_of(Cactus(1.0), 4)).generate(
        PROMPT, 40, 1.0, 0, 1.0, seed=5
    )
    assert sps.stats.kl_nats == 0
    assert cactus.stats.kl_nats > 0
    assert cactus.stats.kl_nats_per_token == cactus.stats.kl_nats / 40


def exact_pair_law(model, prompt: list[int], sampling: SamplingConfig) -> dict:
    """P(t1, t2) = q(t1 | prompt) q(t2 | prompt, t1), enumerating t1 over q's support."""
    with torch.no_grad():
        q1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], sampling)
        law = {}
        for t1 in q1.nonzero().flatten().tolist():
            q2 = logits_to_probs(model(torch.tensor([prompt + [t1]])).logits[0, -1], sampling)
            for t2 in q2.nonzero().flatten().tolist():
                law[(t1, t2)] = float(q1[t1] * q2[t2])
    return law


def chi_square_p_value(counts: dict, law: dict, runs: int) -> float:
    """Pearson goodness of fit of observed pair counts to an exact law (survival of chi^2)."""
    assert set(counts) <= set(law), "a pair outside the verifier's support was emitted"
    stat = sum((counts.get(c, 0) - runs * pr) ** 2 / (runs * pr) for c, pr in law.items())
    dof = torch.tensor((len(law) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


def sampled_pairs(decoder: SpeculativeDecoder, prompt: list[int], runs: int, sampling) -> dict:
    """Counts of the first two new tokens over ``runs`` seeds."""
    counts: dict = {}
    for seed in range(runs):
        ids = decoder.generate(
            prompt, 2, sampling.temperature, sampling.top_k, sampling.top_p, seed=seed
        ).token_ids
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    return counts


@pytest.mark.parametrize(
    ("verification", "k", "branches"),
    [
        ("chain", 2, None),
        ("block", 2, None),
        ("tree", 2, None),
        ("tree", 3, None),
        ("traversal", 3, None),
        ("traversal", 2, 1),  # a chain, judged as a block
        ("chain", "auto", None),
        ("tree", "auto", None),
    ],
)
def test_joint_law_of_first_two_tokens_matches_verifier_and_rejects_cactus(
    verification, k, branches
) -> None:
    target = make_tiny_lm(vocab_size=32, seed=6)
    draft = noisy_copy(target, 1.0, seed=7)  # overlaps the target, but differs
    sampling = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
    prompt, runs = [5, 17, 3, 19, 11], 1200
    law = exact_pair_law(target, prompt, sampling)
    sps_spec = DecodeSpec.of(
        "sps", num_draft_tokens=k, verification=verification, branches=branches
    )
    policy = None
    if k == "auto":  # drafting pays and stops where the draft is unsure (no timing here)
        policy = SpeculationPolicy(2)
        policy.draft.observe(1, 0.01)
        policy.verify.observe(1, 0.05)
        policy.verify.observe(16, 0.05)
    cap = 2 if k == "auto" else k
    sps = SpeculativeDecoder(target, draft, sps_spec, max_draft_tokens=cap, policy=policy)
    cactus = SpeculativeDecoder(target, draft, spec_of(Cactus(5.0), 2))
    assert chi_square_p_value(sampled_pairs(sps, prompt, runs, sampling), law, runs) > 1e-3
    negative = chi_square_p_value(sampled_pairs(cactus, prompt, runs, sampling), law, runs)
    assert negative < 1e-6  # negative control: the same test can fail


@pytest.mark.parametrize("verification", ["block", "tree", "traversal"])
def test_cactus_on_blocks_and_trees_emits_its_target_and_meters_at_most_delta_per_position(
    verification: str,
) -> None:
    target = make_tiny_lm(vocab_size=32, seed=6)
    draft = noisy_copy(target, 1.0, seed=7)
    sampling = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
    prompt, runs, delta = [5, 17, 3, 19, 11], 1200, 0.5
    with torch.no_grad():
        q0 = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1], sampling)
        p0 = logits_to_probs(draft(torch.tensor([prompt])).logits[0, -1], sampling)
    t0 = kl_target(q0, p0, delta)
    spec = DecodeSpec.of("cactus", delta=delta, num_draft_tokens=2, verification=verification)
    decoder = SpeculativeDecoder(target, draft, spec)
    firsts: dict = {}
    for pair, count in sampled_pairs(decoder, prompt, runs, sampling).items():
        firsts[(pair[0],)] = firsts.get((pair[0],), 0) + count
    target_law = {(x,): float(t0[x]) for x in t0.nonzero().flatten().tolist()}
    verifier_law = {(x,): float(q0[x]) for x in q0.nonzero().flatten().tolist()}
    assert chi_square_p_value(firsts, target_law, runs) > 1e-3
    assert chi_square_p_value(firsts, verifier_law, runs) < 1e-6  # negative control
    result = decoder.generate(prompt, 40, 1.0, 3, 1.0, seed=1)
    drafted_positions = result.stats.accepted + result.stats.iterations  # upper bound
    assert 0 < result.stats.kl_nats <= delta * drafted_positions + 1e-6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": []}, "prompt must not be empty"),
        ({"prompt": [1, 500]}, r"prompt token ids must lie in \[0, 128\)"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be an integer >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
        ({"prompt": list(range(100)) * 2 + [1] * 50, "max_new_tokens": 10}, "context overflow"),
    ],
)
def test_bad_generate_arguments(kwargs: dict, message: str) -> None:
    decoder = SpeculativeDecoder(make_tiny_lm(), spec=AR)
    args = {"prompt": PROMPT, "max_new_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        decoder.generate(**args)


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1"):
        SpeculativeDecoder(make_tiny_lm(), None, spec_of(SpS(), 0))
    with pytest.raises(ValueError, match="drafter must be"):
        SpeculativeDecoder(make_tiny_lm(), None, DecodeSpec.of("sps", drafter="layerskip"))
    with pytest.raises(VocabularyMismatchError, match="128.*64|64.*128"):
        SpeculativeDecoder(make_tiny_lm(128), make_tiny_lm(64))
    with pytest.raises(ValueError, match="cactus-spec models fetch"):
        SpeculativeDecoder("/nonexistent/model.gguf", spec=AR)
    with pytest.raises(ValueError, match="method sps with the model drafter needs a draft model"):
        SpeculativeDecoder(make_tiny_lm(), None, spec_of(SpS(), 2))
    with pytest.raises(ValueError, match="draft does not apply: nothing is drafted by a model"):
        SpeculativeDecoder(make_tiny_lm(), make_tiny_lm(), AR)
    with pytest.raises(TypeError, match="spec must be a DecodeSpec"):
        SpeculativeDecoder(make_tiny_lm(), None, SpS())
