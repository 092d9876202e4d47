"""The decoding spec and its one parser: every interface's method flags go through here."""

from __future__ import annotations

import pytest

from cactus_spec.core.drafters import DRAFTERS
from cactus_spec.core.methods import DEFAULT_NUM_DRAFT_TOKENS, METHODS
from cactus_spec.core.rules import TAS, Cactus, SpS
from cactus_spec.core.spec import SPEC_KEYS, DecodeSpec, parse_spec


def test_default_spec_is_the_registry_default_method_with_its_defaults():
    spec = DecodeSpec()
    assert spec.method == "cactus"
    assert dict(spec.params) == METHODS["cactus"].defaults
    assert spec.rule == Cactus(1.0)
    assert spec.num_draft_tokens == DEFAULT_NUM_DRAFT_TOKENS and spec.drafter == "model"


def test_ar_is_a_method_that_drafts_nothing():
    spec = DecodeSpec.of("ar")
    assert spec.rule is None and not spec.drafts and spec.lossless
    assert spec.num_draft_tokens == 0 and spec.drafter is None


def test_parameters_fill_defaults_and_build_the_rule():
    spec = DecodeSpec.of("cactus", delta=0.5, num_draft_tokens=4, drafter="ngram")
    assert spec.rule == Cactus(0.5, exact=False)
    assert spec.params == (("delta", 0.5), ("exact", False))
    assert (spec.num_draft_tokens, spec.drafter) == (4, "ngram")
    assert DecodeSpec.of("tas").rule == TAS()
    assert DecodeSpec.of("sps").rule == SpS() and DecodeSpec.of("sps").lossless


def test_text_values_are_converted_only_when_asked():
    values = {"method": "cactus", "delta": "0.5", "exact": "true", "num_draft_tokens": "3"}
    spec = parse_spec(values, text=True)
    assert spec.rule == Cactus(0.5, exact=True) and spec.num_draft_tokens == 3
    with pytest.raises(ValueError, match="delta must be a number, got '0.5'"):
        parse_spec(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"method": "nope"}, "method must be one of ar, sps, cactus"),
        ({"method": "sps", "delta": 1.0}, "delta does not apply to method sps"),
        ({"method": "ar", "num_draft_tokens": 4}, "num_draft_tokens does not apply to method ar"),
        ({"method": "ar", "drafter": "ngram"}, "drafter does not apply to method ar"),
        ({"method": "cactus", "delta": -1.0}, "delta"),
        ({"method": "cactus", "delta": True}, "delta must be a number, got True"),
        ({"method": "cactus", "exact": 1}, "exact must be true or false, got 1"),
        ({"method": "topk", "k": 2.5}, "k must be an integer, got 2.5"),
        ({"method": "cactus", "delta": float("nan")}, "delta must be a number"),
        ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1 or auto, got 0"),
        ({"num_draft_tokens": True}, "num_draft_tokens must be an integer >= 1 or auto, got True"),
        ({"drafter": "eagle"}, f"drafter must be one of {', '.join(DRAFTERS)}, got 'eagle'"),
        ({"delta": 0.5}, "method is required with method parameters"),
        ({"temperature": 0.5}, "unknown key 'temperature'"),
        (
            {"verification": "trie"},
            "verification must be one of chain, block, tree, traversal, got 'trie'",
        ),
        ({"branches": 2}, "branches applies to verification tree or traversal only"),
        ({"verification": "tree", "branches": 0}, "branches must be an integer >= 1, got 0"),
        ({"method": "ar", "verification": "block"}, "verification does not apply to method ar"),
        (
            {"method": "tas", "verification": "block"},
            r"verification block takes a method with a target per position \(sps, cactus\)",
        ),
    ],
)
def test_bad_values_name_the_key_and_what_it_allows(values, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(values)


def test_a_base_keeps_its_method_and_k_when_they_are_not_given():
    base = DecodeSpec.of("tas", epsilon=0.2, drafter="ngram").with_num_draft_tokens(None)
    assert base.num_draft_tokens is None  # a serving policy picks K
    assert parse_spec({}, base=base) == base
    k4 = parse_spec({"num_draft_tokens": 4}, base=base)
    assert k4.rule == TAS(0.2) and k4.num_draft_tokens == 4 and k4.drafter == "ngram"
    other = parse_spec({"method": "cactus"}, base=base)
    assert other.rule == Cactus(1.0) and other.num_draft_tokens is None
    assert parse_spec({"method": "sps"}, base=DecodeSpec.of("ar")).num_draft_tokens == (
        DEFAULT_NUM_DRAFT_TOKENS
    )


def test_none_values_count_as_not_given():
    assert parse_spec({"method": "sps", "num_draft_tokens": None, "delta": None}) == (
        DecodeSpec.of("sps")
    )


def test_spec_keys_hold_every_registry_parameter():
    params = {p.name for m in METHODS.values() for p in m.params}
    own = {"method", "num_draft_tokens", "drafter", "verification", "branches", "kl_budget"}
    own |= {"allocation"}
    assert own | params == set(SPEC_KEYS)


def test_a_spec_built_by_hand_must_list_its_method_parameters():
    with pytest.raises(ValueError, match="params of cactus"):
        DecodeSpec("cactus", (("delta", 1.0),))


def test_block_verification_is_kept_where_it_applies_and_chain_elsewhere():
    block = parse_spec({"method": "sps", "verification": "block"})
    assert block.verification == "block" and block.as_dict()["verification"] == "block"
    assert parse_spec({"num_draft_tokens": 4}, base=block).verification == "block"
    assert parse_spec({"method": "cactus"}, base=block).verification == "block"
    # a server's block default does not stop a request for a rule without a block target
    assert parse_spec({"method": "tas"}, base=block).verification == "chain"
    assert DecodeSpec.of("sps").verification == "chain"
    assert DecodeSpec.of("ar").verification is None


def test_k_auto_leaves_the_draft_length_to_a_policy():
    assert parse_spec({"method": "sps", "num_draft_tokens": "auto"}).num_draft_tokens is None
    assert DecodeSpec.of("cactus", num_draft_tokens="auto").drafts
    tree = DecodeSpec.of("sps", num_draft_tokens="auto", verification="traversal", branches=3)
    assert tree.auto_k and tree.trees and tree.branches == 3  # the policy picks its depth
    with pytest.raises(
        ValueError, match="num_draft_tokens must be an integer >= 1 or auto, got 'often'"
    ):
        parse_spec({"num_draft_tokens": "often"})


def test_an_answers_budget_is_cactus_with_an_allocation():
    spec = parse_spec({"method": "cactus", "kl_budget": "0.25", "delta": "0.5"}, text=True)
    assert (spec.kl_budget, spec.rule.delta, spec.allocation) == (0.25, 0.5, "greedy")
    assert spec.as_dict()["kl_budget"] == 0.25 and "kl_budget" not in DecodeSpec().as_dict()
    assert parse_spec({"num_draft_tokens": 4}, base=spec).kl_budget == 0.25  # kept
    assert parse_spec({"method": "cactus"}, base=spec).kl_budget is None  # a new method
    paced = parse_spec({"method": "cactus", "kl_budget": 1, "allocation": " paced"}, text=True)
    assert paced.as_dict()["allocation"] == "paced" and DecodeSpec().allocation is None
    assert parse_spec({"num_draft_tokens": 4}, base=paced).allocation == "paced"
    tree = DecodeSpec.of("cactus", kl_budget=0.1, verification="traversal")
    assert tree.trees and tree.kl_budget == 0.1
    for values, message in [
        ({"method": "sps", "kl_budget": 0.1}, "kl_budget applies to method cactus, not sps"),
        ({"method": "cactus", "kl_budget": -1}, "kl_budget must be a finite number >= 0"),
        ({"method": "cactus", "kl_budget": "x"}, "kl_budget must be a finite number >= 0"),
        (
            {"method": "cactus", "kl_budget": 0.1, "allocation": "lavish"},
            "allocation must be one of greedy, paced, marginal, got 'lavish'",
        ),
        ({"method": "cactus", "allocation": "paced"}, "allocation applies with kl_budget only"),
        ({"method": "ar", "kl_budget": 0.1}, "kl_budget does not apply to method ar"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_spec(values, text=True)
