"""The library refuses bad input with a ValueError (TypeError for a wrong type) naming the
argument, never a traceback from deep inside torch or a silent truncation."""

from __future__ import annotations

import pytest
import torch
from conftest import AR, make_tiny_lm, spec_of

from cactus_spec import (
    TAS,
    Cactus,
    Interp,
    SpeculativeDecoder,
    SpS,
    TopK,
    acceptance_prob,
    kl,
    step_law,
    tv,
    verify,
)

V = 5


def _chain(batch: int = 1, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid draft ids [B, K] and target rows [B, K+1, V]."""
    ids = torch.zeros(batch, k, dtype=torch.long)
    return ids, torch.full((batch, k + 1, V), 1.0 / V)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Cactus(delta=True), "delta must be a finite number"),
        (lambda: Cactus(delta=float("nan")), "delta must be a finite number"),
        (lambda: TAS(epsilon=True), "epsilon must be a number in"),
        (lambda: TAS(alpha=False), "alpha must be a number in"),
        (lambda: Interp(alpha=True), "alpha must be a number in"),
        (lambda: TopK(k=True), "k must be an integer >= 1"),
    ],
)
def test_rules_refuse_booleans_as_numbers(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_verify_refuses_an_empty_batch() -> None:
    ids, q = _chain()
    with pytest.raises(ValueError, match="draft_ids must hold B >= 1 rows"):
        verify(ids[:0], q[:0], SpS())


@pytest.mark.parametrize("generator", [0, "seed", [torch.Generator(), 3], 1.5])
def test_verify_refuses_a_generator_of_the_wrong_type(generator) -> None:
    ids, q = _chain(batch=2)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or a sequence"):
        verify(ids, q, SpS(), generator=generator)


def test_verify_refuses_a_wrong_number_of_generators() -> None:
    ids, q = _chain(batch=2)
    with pytest.raises(ValueError, match=r"one generator per row \(2\), got 3"):
        verify(ids, q, SpS(), generator=[torch.Generator() for _ in range(3)])


@pytest.mark.parametrize("rule", [None, "cactus", Cactus])
def test_verify_refuses_what_is_not_a_rule(rule) -> None:
    ids, q = _chain()
    with pytest.raises(TypeError, match="rule must be a Rule"):
        verify(ids, q, rule)


def test_verify_still_accepts_valid_input() -> None:
    """Positive control for the checks above."""
    ids, q = _chain(batch=2)
    out = verify(ids, q, SpS(), generator=[torch.Generator(), torch.Generator()])
    assert out.tokens.shape == (2, 3)


@pytest.mark.parametrize("function", [step_law, acceptance_prob])
def test_audit_refuses_mismatched_shapes_nan_and_non_rules(function) -> None:
    p, q = torch.full((V,), 1.0 / V), torch.full((V,), 1.0 / V)
    shapes = r"p and q must have the same shape, got \(5,\) and \(4,\)"
    with pytest.raises(ValueError, match=shapes):
        function(p, q[:4], SpS())
    with pytest.raises(ValueError, match="q contains NaN"):
        function(p, torch.full((V,), float("nan")), SpS())
    with pytest.raises(TypeError, match="rule must be a Rule"):
        function(p, q, "sps")
    assert torch.isfinite(torch.as_tensor(function(p, q, SpS()))).all()


@pytest.mark.parametrize("function", [kl, tv])
def test_divergences_refuse_mismatched_shapes_and_nan(function) -> None:
    a = torch.full((V,), 1.0 / V)
    with pytest.raises(ValueError, match=r"a and b must have the same shape"):
        function(a, a[:3])
    with pytest.raises(ValueError, match="a contains NaN"):
        function(torch.full((V,), float("nan")), a)
    with pytest.raises(TypeError, match="b must be a tensor"):
        function(a, [0.2] * V)
    assert float(function(a, a)) == 0


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    return SpeculativeDecoder(make_tiny_lm(), spec=AR)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1.0, 2.0], "prompt token ids must be integers, got 1.0"),
        ([1, 2.7], "prompt token ids must be integers, got 2.7"),
        ([True, 3], "prompt token ids must be integers, got True"),
        (torch.tensor([1.0, 2.0]), "must be a 1-D integer tensor"),
        ("abc\udcff\udcfe", r"prompt is not valid UTF-8 text .*position 3"),
    ],
)
def test_prompts_that_are_not_token_ids_or_text_are_refused(decoder, prompt, message) -> None:
    with pytest.raises(ValueError, match=message):
        decoder.encode(prompt)


def test_integer_tensors_are_token_ids(decoder) -> None:
    assert decoder.encode(torch.tensor([4, 5, 6])) == [4, 5, 6]


@pytest.mark.parametrize("seed", [1.5, -1, 2**64, True, "3"])
def test_generate_refuses_a_bad_seed(decoder, seed) -> None:
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\]"):
        decoder.generate([1, 2, 3], 2, seed=seed)


def test_generate_takes_the_largest_seed(decoder) -> None:
    assert len(decoder.generate([1, 2, 3], 2, seed=2**64 - 1).token_ids) == 2


@pytest.mark.parametrize(("verifier", "kind"), [(None, "NoneType"), (3, "int")])
def test_decoder_refuses_a_verifier_that_is_no_model(verifier, kind: str) -> None:
    with pytest.raises(TypeError, match=f"verifier must be a model name, path.*got {kind}"):
        SpeculativeDecoder(verifier, spec=AR)


def test_decoder_refuses_a_spec_that_is_no_spec() -> None:
    with pytest.raises(TypeError, match="spec must be a DecodeSpec"):
        SpeculativeDecoder(make_tiny_lm(), None, "cactus")


def test_context_overflow_without_drafting_does_not_mention_drafts(decoder) -> None:
    with pytest.raises(ValueError, match="context overflow") as caught:
        decoder.generate(list(range(100)) * 2 + [1] * 50, 10)
    assert "draft" not in str(caught.value)
    # a chain's drafts stay within the budget's slots (``draft_reserve``): no reserve, and a
    # prompt that fills the context with the budget decodes
    drafting = SpeculativeDecoder(make_tiny_lm(), make_tiny_lm(seed=1), spec_of(SpS(), 4))
    assert len(drafting.generate(list(range(100)) * 2 + [1] * 46, 10).token_ids) <= 10
    with pytest.raises(ValueError, match="context overflow") as caught:
        drafting.generate(list(range(100)) * 2 + [1] * 47, 10)
    assert "draft" not in str(caught.value)


def test_public_api_is_importable_from_the_package() -> None:
    import cactus_spec

    for name in cactus_spec.__all__:
        assert getattr(cactus_spec, name) is not None, name
    assert cactus_spec.__version__ and cactus_spec.__version__ != "0+unknown"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        cactus_spec.Nope  # noqa: B018


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        (None, TypeError, "prompt must be text or a sequence of token ids, got NoneType"),
        (b"hi", TypeError, "prompt must be text or a sequence of token ids, got bytes"),
        (42, TypeError, "prompt must be text or a sequence of token ids, got int"),
    ],
)
def test_a_prompt_of_another_type_is_refused_by_name(decoder, prompt, error, message) -> None:
    with pytest.raises(error, match=message):
        decoder.generate(prompt, 2)


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        ([1], "stop strings must be strings, got 1"),
        ([""], "stop strings must be non-empty"),
        (["ok", None], "stop strings must be strings, got None"),
    ],
)
def test_bad_stop_strings_are_refused_by_name(decoder, stop, message) -> None:
    with pytest.raises(ValueError, match=message):
        decoder.generate([1, 2, 3], 2, stop=stop)


def test_one_stop_string_is_one_stop_not_its_characters() -> None:
    from cactus_spec.runtime.generation import check_stops

    assert check_stops("ab") == ["ab"] and check_stops(None) == []
    assert check_stops(("a", "bc")) == ["a", "bc"]
