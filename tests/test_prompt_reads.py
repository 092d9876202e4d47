"""A prompt read in one piece, in chunks of any size, or token by token leaves the same cache
and gives the same next logits, float rounding apart: SmolLM2-135M in float32 through the
engine (a read longer than ``PROMPT_PIECE`` takes several forwards; attention query by query
for a feed of up to 16 tokens, in blocks beyond). The control shifts one chunk boundary by a
slot in the cache, and the check fails. (In int8 the same reads differ by several percent of
the logits, on the Python blocks as on the native ones: each token's activations are rounded
to 255 steps of their own range, and SmolLM2's outliers make the steps coarse, so a float
summed in another order moves codes and the moves add up over 30 layers. The native blocks'
reads are checked against the Python blocks' on small models in ``test_native_block``.)"""

from __future__ import annotations

import pytest
import torch

from cactus_spec.backends.base import PROMPT_PIECE
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.fetch import fetch
from cactus_spec.loading.models import load_model
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request

pytestmark = pytest.mark.slow

PROMPT = [(37 * i) % 4000 + 100 for i in range(PROMPT_PIECE + 150)]
#: Largest gap, relative to the reference's largest magnitude: float32 sums in another order.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine() -> SpeculativeDecoder:
    model = load_model(fetch("smollm2-135m"), dtype="float32")
    return SpeculativeDecoder(model, spec=DecodeSpec.of("ar"), prefix_cache=False)


def _read(engine: SpeculativeDecoder, budget: int | None, shift_at: int | None = None):
    """The cache's keys and values of row 0 after reading PROMPT ``budget`` tokens a call
    (None: in one call), and the logits after its last token; ``shift_at``: the control,
    the token at that chunk boundary fed twice, so every later one sits a slot further."""
    request = Request(
        prompt_ids=PROMPT, max_new_tokens=1, sampling=SamplingConfig(), seed=0,
        spec=DecodeSpec.of("ar"),
    )  # fmt: skip
    g = engine.new_generation(request, 0)
    backend = engine._backend  # white-box: the cache is what the law is about
    while engine.prefill([g], budget):
        if shift_at is not None and g.read >= shift_at:
            backend.append([PROMPT[g.read - 1]], row=0)
            shift_at = None
    slots = min(backend.length_of(0), len(PROMPT) - 1)
    keys, values = (c[:, 0, :, :slots].clone() for c in (backend.cache.keys, backend.cache.values))
    logits = backend.append([PROMPT[-1]], row=0)  # [1, V]
    g.finish()
    return keys, values, logits


def _gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def _agree(got, expected) -> bool:
    return all(_gap(a, b) < TOLERANCE for a, b in zip(got, expected, strict=True))


def test_a_prompt_read_in_any_chunks_leaves_the_same_cache_and_logits(engine) -> None:
    whole = _read(engine, None)
    assert whole[0].shape[2] == len(PROMPT) - 1  # every token but the last read
    for budget in (1, 16, 17, 100, PROMPT_PIECE + 1):
        assert _agree(_read(engine, budget), whole), budget


def test_control_a_chunk_boundary_shifted_by_one_fails_the_check(engine) -> None:
    whole = _read(engine, None)
    shifted = _read(engine, 100, shift_at=100)
    assert shifted[0].shape == whole[0].shape
    assert not _agree(shifted, whole)
