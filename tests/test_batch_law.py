"""The batch law: every kind of row the engine accepts, decoded side by side in one batch,
gives each row exactly the tokens it gives alone. SmolLM2-135M as verifier and draft, each
row seeded at temperature 1, so a row's tokens depend on every draw it makes."""

from __future__ import annotations

import pytest

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request
from cactus_spec.runtime.verifications import verification_of

pytestmark = pytest.mark.slow

#: Every (method, verification) the engine accepts: each rule on chains, the rules with a
#: target per position on blocks and trees (SpS, Cactus), Cactus under an answer's budget.
KINDS = [
    *(DecodeSpec.of(m) for m in ("sps", "cactus", "tas", "interp", "topk")),
    *(DecodeSpec.of(m, verification="block") for m in ("sps", "cactus")),
    *(DecodeSpec.of("cactus", kl_budget=0.1, verification=v) for v in ("chain", "block")),
    DecodeSpec.of("cactus", kl_budget=0.1, allocation="paced"),
    DecodeSpec.of("cactus", kl_budget=0.1, verification="tree", branches=2),
    *(
        DecodeSpec.of(m, verification=v, branches=2)
        for m in ("sps", "cactus")
        for v in ("tree", "traversal")
    ),
]
SAMPLING = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def engine():
    from cactus_spec.loading.fetch import fetch
    from cactus_spec.loading.models import load_model

    smollm = load_model(fetch("smollm2-135m"), dtype="float32")
    spec = DecodeSpec.of("sps").with_num_draft_tokens(None)
    return SpeculativeDecoder(
        smollm, smollm, spec, max_draft_tokens=3, max_batch=len(KINDS), backend="lean"
    )


def _prompts(engine, seeds: list[int]) -> list[Request]:
    ids = engine.encode("Write a long story about a dragon.")
    return [
        Request(prompt_ids=ids, max_new_tokens=24, seed=seed, spec=spec.with_num_draft_tokens(3))
        for spec, seed in zip(KINDS, seeds, strict=True)
    ]


def test_every_kind_beside_every_other_gives_the_tokens_it_gives_alone(engine) -> None:
    seeds = list(range(100, 100 + len(KINDS)))
    prompts = _prompts(engine, seeds)
    alone = [engine.decode_many([p], SAMPLING)[0].token_ids for p in prompts]
    together = [r.token_ids for r in engine.decode_many(prompts, SAMPLING)]
    for spec, own, mixed in zip(KINDS, alone, together, strict=True):
        assert mixed == own, spec
    # negative control: the check can fail; a row decoded with its neighbour's seed differs
    swapped = _prompts(engine, [seeds[1], seeds[0], *seeds[2:]])
    assert engine.decode_many(swapped, SAMPLING)[0].token_ids != alone[0]


def test_each_spec_declares_its_kind_once() -> None:
    greedy, sampled = SamplingConfig(temperature=0.0), SAMPLING
    names = {
        (spec.method, spec.verification): verification_of(spec, sampled).name for spec in KINDS
    }
    assert names[("sps", "chain")] == "chain" and names[("cactus", "block")] == "block"
    assert names[("sps", "tree")] == "tree" and names[("cactus", "traversal")] == "traversal"
    one_branch = {
        v: DecodeSpec.of("sps", verification=v, branches=1) for v in ("tree", "traversal")
    }
    assert verification_of(one_branch["tree"], sampled).name == "chain"  # its draft is a chain
    assert verification_of(one_branch["traversal"], sampled).name == "block"
    block = DecodeSpec.of("cactus", verification="block")
    assert verification_of(block, greedy).name == "chain"  # at temperature 0 the same test
