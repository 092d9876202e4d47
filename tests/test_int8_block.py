"""A block of native int8 layers run as one native call (``Int8Block``) computes what the
Python block computes on the same int8 layers: the same logits up to float rounding, on one
row and on a batch of rows of different lengths, for Llama and for Qwen2 (q/k/v biases), and
it writes the same keys and values into the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_lm
from test_lean import make_tiny_qwen2

from cactus_spec.backends import native
from cactus_spec.backends.int8_block import Int8Block
from cactus_spec.backends.lean import Block, LeanBackend, LeanModel
from cactus_spec.backends.quant import quantize

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native kernels could not be built here"
)

MODELS = {"llama": make_tiny_lm, "qwen2": make_tiny_qwen2}
#: Largest |fused - python| / max |python| of the logits: float sums in another order may
#: move an activation code by one step.
TOLERANCE = 1e-4


def _fused_and_python(arch: str, monkeypatch, seed: int = 0) -> tuple[LeanModel, LeanModel]:
    model = quantize(MODELS[arch](seed=seed), "int8")
    fused = LeanModel(model)
    with monkeypatch.context() as patch:
        patch.setattr(Int8Block, "fits", staticmethod(lambda layer: False))
        python = LeanModel(model)
    assert all(isinstance(b, Int8Block) for b in fused.blocks)
    assert all(isinstance(b, Block) for b in python.blocks)
    return fused, python


def _gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("arch", MODELS)
def test_one_row_prefill_then_steps_gives_the_python_logits(arch, monkeypatch) -> None:
    fused, python = (LeanBackend(m) for m in _fused_and_python(arch, monkeypatch))
    for block in ([3, 17, 42, 8, 99, 1, 5], [6], [7, 8], [9]):
        assert _gap(fused.append(block), python.append(block)) < TOLERANCE
    keys, values = fused.cache.layer(1)
    expected_keys, expected_values = python.cache.layer(1)
    assert _gap(keys, expected_keys) < TOLERANCE and _gap(values, expected_values) < TOLERANCE


@pytest.mark.parametrize("arch", MODELS)
def test_rows_of_different_lengths_each_get_the_python_logits(arch, monkeypatch) -> None:
    fused, python = (LeanBackend(m, batch=3) for m in _fused_and_python(arch, monkeypatch))
    prompts = [[3, 17, 42], [5, 6, 7, 8, 9, 10], [11]]
    steps = [[1, 2], [4], [12, 13, 14]]
    for backend in (fused, python):
        backend.append_ragged(prompts, [0, 1, 2])
    got = fused.append_ragged(steps, [2, 0, 1])
    expected = python.append_ragged(steps, [2, 0, 1])
    assert all(_gap(a, b) < TOLERANCE for a, b in zip(got, expected, strict=True))


def test_control_another_model_is_far_beyond_the_tolerance(monkeypatch) -> None:
    fused, _ = _fused_and_python("llama", monkeypatch)
    _, other = _fused_and_python("llama", monkeypatch, seed=1)
    block = [3, 17, 42, 8]
    assert _gap(LeanBackend(fused).append(block), LeanBackend(other).append(block)) > 0.1
