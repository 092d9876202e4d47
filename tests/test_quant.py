"""Int8 linear layers: close to float, each row of a block as if alone; packed bf16 layers:
the same products; the divergence
measure of a quantised verifier is 0 against itself and grows with the quantisation error."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_lm
from torch import nn

from cactus_spec.backends.lean import LeanBackend, LeanModel
from cactus_spec.backends.packed import PackedLinear, packing_available
from cactus_spec.backends.quant import Int8Linear, quantize_int8
from cactus_spec.divergence import PREFIX_TOKENS, measure
from cactus_spec.models import load_model

IN, OUT = 256, 96


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(IN, OUT)
    nn.init.normal_(layer.bias, std=0.5)
    return layer


def _block(seed: int = 1) -> torch.Tensor:
    """Rows of very different ranges and offsets, as in a verification block: [6, IN]."""
    torch.manual_seed(seed)
    scales = torch.tensor([0.01, 0.1, 1.0, 10.0, 100.0, 3.0])[:, None]
    offsets = torch.tensor([0.0, 0.05, -1.0, 5.0, 0.0, 2.0])[:, None]
    return torch.randn(6, IN) * scales + offsets


def _relative_errors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per row: |got - expected| / |expected| (L2)."""
    return (got - expected).norm(dim=-1) / expected.norm(dim=-1)


def test_int8_linear_is_close_to_float_for_every_row() -> None:
    layer, x = _linear(), _block()
    with torch.no_grad():
        errors = _relative_errors(Int8Linear(layer)(x), layer(x))
    assert float(errors.max()) < 0.02, errors


def test_each_row_of_a_block_is_quantised_as_if_alone() -> None:
    layer, x = _linear(), _block()
    int8 = Int8Linear(layer)
    together = int8(x)  # [6, OUT]
    alone = torch.cat([int8(x[r : r + 1]) for r in range(x.shape[0])])  # [6, OUT]
    assert float(_relative_errors(together, alone).max()) < 1e-3


def test_negative_control_one_range_per_block_is_not_as_if_alone() -> None:
    """fbgemm on the raw block (one activation range for all rows) fails the same check:
    the check above can fail."""
    packed = Int8Linear(_linear())._packed
    x = _block()
    together = torch.ops.quantized.linear_dynamic(x, packed, False)  # [6, OUT]
    alone = torch.cat(
        [torch.ops.quantized.linear_dynamic(x[r : r + 1], packed, False) for r in range(6)]
    )
    assert float(_relative_errors(together, alone).max()) > 0.1


def test_leading_dimensions_and_dtypes_are_kept() -> None:
    layer = _linear()
    x = torch.randn(2, 3, IN, dtype=torch.bfloat16)
    y = Int8Linear(layer)(x)
    assert y.shape == (2, 3, OUT) and y.dtype == torch.float32


def test_quantize_int8_swaps_every_linear() -> None:
    model = quantize_int8(make_tiny_lm())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == []
    assert any(isinstance(m, Int8Linear) for m in model.modules())


def _tokens(count: int = PREFIX_TOKENS + 40) -> list[int]:
    return torch.randint(0, 128, (count,), generator=torch.Generator().manual_seed(5)).tolist()


def test_divergence_of_a_model_from_itself_is_zero() -> None:
    model = make_tiny_lm()
    backend = LeanBackend(LeanModel(model))
    result = measure(backend, LeanBackend(LeanModel(model)), _tokens(), "none", block=4)
    assert result.kl_one_row < 1e-9 and result.kl_block < 1e-9
    assert result.agreement_one_row == result.agreement_block == 1.0
    assert result.tokens == 40


def test_divergence_of_an_int8_model_is_small_and_positive() -> None:
    reference = make_tiny_lm()
    quantised = quantize_int8(copy.deepcopy(reference))
    result = measure(
        LeanBackend(LeanModel(reference)), LeanBackend(LeanModel(quantised)), _tokens(), "int8", 4
    )
    assert 0 < result.kl_one_row < 0.01 and 0 < result.kl_block < 0.01
    assert result.kl_worst == max(result.kl_one_row, result.kl_block)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packed_bf16_linear_gives_the_same_products_bit_for_bit() -> None:
    layer = _linear().bfloat16()
    x = _block().bfloat16().reshape(2, 3, IN)
    expected = layer(x)  # [2, 3, OUT]
    got = PackedLinear(layer)(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    other = PackedLinear(_linear(seed=1).bfloat16())(x)
    assert not torch.equal(other, expected)  # control: the check tells weights apart


def test_lean_backend_packs_a_bf16_model_in_place_and_keeps_its_logits() -> None:
    model = make_tiny_lm().bfloat16()
    expected = LeanBackend(LeanModel(copy.deepcopy(model).float())).append([3, 17, 42, 8])
    backend = LeanBackend(LeanModel(model))
    assert packing_available(model) == any(isinstance(m, PackedLinear) for m in model.modules())
    got = backend.append([3, 17, 42, 8])  # [4, V]
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def _mapped(path) -> bool:
    """Whether any file under ``path`` is memory-mapped by this process (Linux)."""
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_a_packed_or_quantised_model_does_not_keep_its_checkpoint_mapped(tmp_path, quant) -> None:
    """Once the linear layers hold their own copies, the safetensors file is unmapped (else
    every page read while packing stays resident: the model's size again)."""
    make_tiny_lm().bfloat16().save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="bfloat16")
    assert _mapped(tmp_path)  # control: a fresh load is a memory map of the file
    if quant == "int8":
        quantize_int8(loaded.model)
    elif packing_available(loaded.model):
        LeanModel(loaded.model)
    else:
        pytest.skip("no oneDNN packing in this torch")
    gc.collect()
    assert not _mapped(tmp_path)
