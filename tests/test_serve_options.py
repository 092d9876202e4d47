"""A server's options check every field when they are made, before any model loads, naming
it as its caller wrote it; ``build_server`` gives the engine the K the policy may pick."""

from __future__ import annotations

import pytest
from conftest import spec_of

from cactus_spec.core.checks import flag
from cactus_spec.core.rules import SpS
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.options import LoadOptions
from cactus_spec.server.build import build_server
from cactus_spec.server.options import ServeOptions


def options(**fields) -> ServeOptions:
    """Options of a model that is nowhere: nothing loads while they are made."""
    return ServeOptions(DecodeSpec.of("ar"), LoadOptions("/no/such.gguf"), **fields)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("policy", "sometimes", "policy must be one of auto, fixed, got 'sometimes'"),
        ("max_batch", 0, "max_batch must be an integer >= 1, got 0"),
        ("max_queue", 1.5, "max_queue must be an integer >= 1, got 1.5"),
        ("default_max_tokens", True, "default_max_tokens must be an integer >= 1, got True"),
        ("max_request_bytes", -1, "max_request_bytes must be an integer >= 1, got -1"),
        ("grammar_step_fuel", 0, "grammar_step_fuel must be an integer >= 1, got 0"),
        ("prefill_chunk", 0, "prefill_chunk must be an integer >= 1, got 0"),
        ("body_timeout", 0, "body_timeout must be > 0 seconds, got 0"),
        ("header_timeout", "10", "header_timeout must be > 0 seconds, got '10'"),
        ("shutdown_grace", -1.0, "shutdown_grace must be >= 0 seconds, got -1.0"),
        ("port", 65536, r"port must be in \[0, 65535\], got 65536"),
        ("api_key", 42, "api_key must be text, got 42"),
    ],
)
def test_a_bad_field_is_one_line_naming_it_and_what_it_allows(field, value, words) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        options(**{field: value})
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=f"^{flag(field)} must be"):  # the command line's name
        options(**{field: value}, label=flag)


def test_the_defaults_and_the_edges_are_accepted() -> None:
    """The control: the same checks let every default and every bound through."""
    assert options().model_id == "/no/such.gguf"
    edges = options(prefill_chunk=None, port=0, shutdown_grace=0, policy="fixed", api_key="k")
    assert edges.app_config("lean").api_key == "k"
    assert options(served_model_name="tiny").app_config("lean").model_id == "tiny"


@pytest.mark.parametrize(("policy", "k"), [("auto", None), ("fixed", 3)])
def test_the_auto_policy_picks_k_up_to_the_specs(models, policy: str, k: int | None) -> None:
    """With policy auto, requests that give no K leave it to the policy (timed on the models
    first), up to the spec's K; with policy fixed, they draft the spec's K."""
    server = build_server(ServeOptions(spec_of(SpS(), 3), LoadOptions(*models), policy))
    assert server.engine.spec.num_draft_tokens == k
    assert server.engine.max_draft_tokens == 3
    assert (server.scheduler.policy is not None) == (policy == "auto")
    assert server.scheduler.engine is server.engine
