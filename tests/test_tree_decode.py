"""Draft trees through the engine: greedy equals the verifier's greedy token for token (tiny
models and SmolLM2, trees judged top down and leaf to root), a wider tree keeps more,
penalties read each node's own path, the context check counts every node, and what cannot
draft trees is refused. (The laws of SpS
and Cactus trees are checked beside chains and blocks in ``test_engine``.)"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_lm
from test_batch import policy_with
from test_engine import (
    PROMPT,
    noisy_copy,
    reference_greedy,
)
from test_smollm import assert_same_greedy_tokens, smollm  # noqa: F401 (a fixture)

from cactus_spec.backends.lean import LeanBackend, LeanModel
from cactus_spec.core.penalties import Penalties
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.fetch import fetch
from cactus_spec.loading.models import load_model
from cactus_spec.runtime.drafters import DraftRequest, ModelDrafter, tree_widths
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request


def tree(
    method: str = "sps", k: int = 3, branches: int = 3, verification: str = "tree", **params
) -> DecodeSpec:
    """A spec verifying draft trees of depth k with up to ``branches`` nodes per depth."""
    spec = {"num_draft_tokens": k, "verification": verification, "branches": branches}
    return DecodeSpec.of(method, **spec, **params)


@pytest.mark.parametrize(
    ("k", "branches", "verification"),
    [(1, 3, "tree"), (4, 2, "tree"), (3, 1, "tree"), (4, 2, "traversal"), (3, 1, "traversal")],
)
def test_greedy_tree_equals_verifier_greedy(k: int, branches: int, verification: str) -> None:
    target = make_tiny_lm()
    draft = noisy_copy(target, 0.3, seed=1)
    decoder = SpeculativeDecoder(
        target, draft, tree(k=k, branches=branches, verification=verification)
    )
    result = decoder.generate(PROMPT, max_new_tokens=40, temperature=0)
    assert result.token_ids == reference_greedy(target, PROMPT, 40)
    assert 0 < result.stats.accepted < result.stats.drafted  # both paths exercised


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_tree_equals_verifier_greedy_on_cuda() -> None:
    target = make_tiny_lm()
    draft = noisy_copy(target, 0.3, seed=1)
    expected = reference_greedy(target, PROMPT, 40)  # on the CPU, before the engine moves it
    decoder = SpeculativeDecoder(target, draft, tree(k=4, branches=2), device="cuda")
    result = decoder.generate(PROMPT, max_new_tokens=40, temperature=0)
    assert result.token_ids == expected
    assert 0 < result.stats.accepted < result.stats.drafted


def test_greedy_tree_of_a_depth_left_open_equals_verifier_greedy() -> None:
    target = make_tiny_lm(seed=3)
    draft = noisy_copy(target, 0.5, seed=1)
    spec = DecodeSpec.of("sps", num_draft_tokens="auto", verification="traversal", branches=2)
    pays = policy_with(0.0001, {1: 0.050, 16: 0.050})  # drafting pays (no timing)
    decoder = SpeculativeDecoder(target, draft, spec, max_draft_tokens=4, policy=pays)
    result = decoder.generate(PROMPT, max_new_tokens=40, temperature=0)
    ar = SpeculativeDecoder(target, spec=DecodeSpec.of("ar")).generate(PROMPT, 40, 0.0)
    assert result.token_ids == ar.token_ids
    assert 0 < result.stats.accepted < result.stats.drafted


def test_a_wider_tree_keeps_more_of_a_greedy_draft() -> None:
    target = make_tiny_lm()
    draft = noisy_copy(target, 0.15, seed=1)  # often right in its second choice only
    kept = []
    for branches in (1, 4):
        decoder = SpeculativeDecoder(target, draft, tree(k=2, branches=branches))
        stats = decoder.generate(PROMPT, max_new_tokens=60, temperature=0).stats
        kept.append(stats.accepted / stats.iterations)
    assert kept[1] > kept[0]


def test_tree_widths_are_the_largest_gains() -> None:
    """Against every (node, rank) gain sorted by brute force, zero scores included."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        nodes, budget = (
            int(torch.randint(1, 5, (1,), generator=g)),
            int(torch.randint(1, 6, (1,), generator=g)),
        )
        scores = torch.rand(nodes, 6, generator=g) * (torch.rand(nodes, 6, generator=g) > 0.3)
        scores = scores / scores.sum(-1, keepdim=True).clamp_min(1e-9)  # [F, V]
        values = torch.rand(nodes, generator=g).tolist()
        gains = [(v * s, f) for f, v in enumerate(values) for s in scores[f].tolist() if s > 0]
        best = sorted(gains, reverse=True)[:budget]
        expected = [sum(f == node for _, f in best) for node in range(nodes)]
        assert tree_widths(values, scores, budget) == expected


def test_a_drafted_tree_gives_its_width_to_likely_paths() -> None:
    """At most ``branches`` nodes per depth; below the first depth some node gets several
    children while some branch gets none (not a fixed shape)."""
    drafter = ModelDrafter(LeanBackend(LeanModel(make_tiny_lm(seed=1))), 128)
    wide = pruned = False
    for seed in range(8):
        request = DraftRequest(0, PROMPT + [seed], 4, SamplingConfig(temperature=1.5),
                               torch.Generator().manual_seed(seed), branches=3)  # fmt: skip
        draft = drafter.propose([request])[0]
        tree = draft.tree
        depths = [len(tree.path(j)) for j in range(len(tree.tokens))]
        assert max(depths) <= 4 and all(depths.count(d) <= 3 for d in depths)
        inner = [j for j in range(len(tree.tokens)) if 1 <= depths[j] < max(depths)]
        wide |= any(len(tree.children.get(j, [])) > 1 for j in inner)
        pruned |= any(not tree.children.get(j) for j in inner)
    assert wide and pruned


def test_penalties_read_each_nodes_own_path() -> None:
    target = make_tiny_lm()
    draft = noisy_copy(target, 0.3, seed=1)
    penalties = Penalties(presence=1.5, repetition=1.3)
    outputs = []
    for spec in (DecodeSpec.of("sps", num_draft_tokens=3), tree(k=3, branches=3)):
        decoder = SpeculativeDecoder(target, draft, spec)
        outputs.append(decoder.generate(PROMPT, 40, temperature=0, penalties=penalties).token_ids)
    assert outputs[0] == outputs[1]
    plain = SpeculativeDecoder(target, draft, tree(k=3)).generate(PROMPT, 40, temperature=0)
    assert plain.token_ids != outputs[1]  # the penalties do change this output


def test_what_cannot_draft_trees_is_refused() -> None:
    target, draft = make_tiny_lm(), make_tiny_lm(seed=1)
    ngram = DecodeSpec.of("sps", drafter="ngram", verification="tree")
    with pytest.raises(ValueError, match="verification tree needs a draft model"):
        SpeculativeDecoder(target, None, ngram).generate(PROMPT, 4)
    hf = SpeculativeDecoder(target, draft, tree(), backend="hf")
    with pytest.raises(ValueError, match="verification tree needs token-tree attention"):
        hf.generate(PROMPT, 4)


@pytest.mark.slow
def test_smollm2_tree_greedy_equals_autoregressive(smollm) -> None:  # noqa: F811
    prompt = "Write a Python function that returns the squares of a list of numbers."
    ar = SpeculativeDecoder(smollm, spec=DecodeSpec.of("ar")).generate(prompt, 48, temperature=0)
    draft = load_model(fetch("smollm2-135m"), quant="int8")
    decoder = SpeculativeDecoder(smollm, draft, tree(k=4, branches=3))
    result = decoder.generate(prompt, 48, temperature=0)
    assert result.stats.accepted > 0
    assert_same_greedy_tokens(smollm, prompt, ar.token_ids, result.token_ids)


def test_the_context_check_reserves_a_trees_nodes_beyond_its_depth() -> None:
    """A tree of depth K and ``branches`` nodes a depth takes (branches - 1) K slots more than
    the chain its budget allows; a request that fills the context by that bound decodes to
    its end."""
    target, draft = make_tiny_lm(), make_tiny_lm(seed=1)  # 256 positions
    decoder = SpeculativeDecoder(target, draft, tree(k=4, branches=4))
    decoder.check_context(204, 40)  # 204 + 40 + 3 x 4 fill the context exactly
    with pytest.raises(ValueError, match=r"num_draft_tokens x \(branches - 1\) \(12\) = 257"):
        decoder.check_context(204, 41)
    SpeculativeDecoder(target, draft, DecodeSpec.of("sps", num_draft_tokens=4)).check_context(
        216, 40
    )  # a chain of 4 needs no reserve
    request = Request(prompt_ids=[3] * 204, max_new_tokens=40, seed=0, ignore_eos=True)
    (result,) = decoder.decode_many([request])
    assert len(result.token_ids) == 40 and result.stats.drafted > 0
