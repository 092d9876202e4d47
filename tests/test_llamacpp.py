"""llama.cpp as a bench peer: on SmolLM2's GGUF when llama-cpp-python is installed (the
``peers`` extra), and a clear skip of its methods when it is not."""

from __future__ import annotations

import pytest
from conftest import AR

from cactus_spec.bench import command, llamacpp
from cactus_spec.bench.grid import expand, parse_entry
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.loading.models import load_model
from cactus_spec.runtime.engine import SpeculativeDecoder

needs_llamacpp = pytest.mark.skipif(
    llamacpp.missing_reason() is not None, reason="llama-cpp-python not installed (extra peers)"
)
PROMPT = "Write a Python function that returns the sum of a list of numbers."


@pytest.fixture(scope="module")
def smollm():
    from cactus_spec.loading.fetch import fetch

    return load_model(fetch("smollm2-135m"), dtype="float32")


@pytest.mark.slow
@needs_llamacpp
def test_greedy_prompt_lookup_equals_plain_decoding(smollm) -> None:
    """Prompt lookup is lossless: at temperature 0 it emits exactly llama.cpp's greedy tokens."""
    plain, lookup = expand([parse_entry("llamacpp"), parse_entry("llamacpp_lookup")])
    peers = llamacpp.LlamaCppPeers(llamacpp.gguf_of(smollm), 512, 2)
    ids = SpeculativeDecoder(smollm, spec=AR).encode(PROMPT)
    greedy = SamplingConfig(temperature=0.0)
    first = peers.generate(plain, ids, 40, greedy, seed=0)
    second = peers.generate(lookup, ids, 40, greedy, seed=0)
    assert 0 < len(first.token_ids) <= 40 and first.seconds > 0
    assert second.token_ids == first.token_ids
    sampled = peers.generate(plain, ids, 40, SamplingConfig(), seed=1)
    assert sampled.token_ids != first.token_ids  # sampling is on (a control on the check above)


def test_bench_skips_llamacpp_methods_with_a_message_when_absent(monkeypatch, capsys) -> None:
    reason = f"llama-cpp-python is not installed; {llamacpp.INSTALL_HINT}"
    monkeypatch.setattr(llamacpp, "missing_reason", lambda: reason)
    grid = expand([parse_entry("ar"), parse_entry("llamacpp"), parse_entry("llamacpp_lookup")])
    kept = command._without_missing_peers(grid)
    assert [c.id for c in kept] == ["ar"]
    err = capsys.readouterr().err
    assert "skipping llamacpp, llamacpp_lookup" in err and "not installed" in err
    assert "cactus-spec[peers]" in err  # printed as written, not eaten as console markup
    with pytest.raises(ValueError, match="nothing to run"):
        command._without_missing_peers(grid[1:])


def test_llamacpp_needs_the_verifier_as_a_gguf_file(tiny_lm) -> None:
    with pytest.raises(ValueError, match="need the verifier as a GGUF file"):
        llamacpp.gguf_of(load_model(tiny_lm))
