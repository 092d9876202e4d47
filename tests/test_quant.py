"""Int8 linear layers (with the native kernel and with fbgemm's): close to float, each row of a
block as if alone, the same numbers when layers share an input's scaling; int4 layers (native
and torch's kernel): every weight within half a step of its group, close to float; packed bf16
layers: the same products; the divergence measure of a quantised verifier is 0 against itself
and grows with the quantisation error."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_lm
from torch import nn

from cactus_spec.backends import native
from cactus_spec.backends.lean import LeanBackend, LeanModel
from cactus_spec.backends.packed import (
    NativeBf16Linear,
    PackedLinear,
    onednn_packs_bf16,
    packing_available,
)
from cactus_spec.backends.quant import (
    INT4_GROUP,
    NATIVE_INT4_GROUP,
    Int4Linear,
    Int8Linear,
    project,
    quantize,
)
from cactus_spec.loading.divergence import PREFIX_TOKENS, measure
from cactus_spec.loading.models import load_model

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


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch) -> str:
    """Quantised layers made in the test use this kernel (native: cactus_spec.backends.native;
    torch: fbgemm's int8, torch's int4)."""
    if request.param == "torch":
        monkeypatch.setenv("CACTUS_SPEC_NATIVE", "0")
    native.load.cache_clear()
    if request.param == "native" and not native.available():
        pytest.skip("the native kernels could not be built here (no C++ toolchain)")
    yield request.param
    native.load.cache_clear()  # the next load sees the restored environment


def _relative_errors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per row: |got - expected| / |expected| (L2)."""
    return (got - expected).norm(dim=-1) / expected.norm(dim=-1)


def test_int8_linear_is_close_to_float_for_every_row(kernel) -> None:
    layer, x = _linear(), _block()
    with torch.no_grad():
        errors = _relative_errors(Int8Linear(layer)(x), layer(x))
    assert float(errors.max()) < 0.02, errors


def test_each_row_of_a_block_is_quantised_as_if_alone(kernel) -> None:
    layer, x = _linear(), _block()
    int8 = Int8Linear(layer)
    together = int8(x)  # [6, OUT]
    alone = torch.cat([int8(x[r : r + 1]) for r in range(x.shape[0])])  # [6, OUT]
    assert float(_relative_errors(together, alone).max()) < 1e-3


def test_negative_control_one_range_per_block_is_not_as_if_alone() -> None:
    """fbgemm on the raw block (one activation range for all rows) fails the same check:
    the check above can fail."""
    weight = _linear().weight.detach()
    scale = weight.abs().amax(1) / 127
    zero = torch.zeros(OUT, dtype=torch.long)
    w8 = torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(w8, None)
    x = _block()
    together = torch.ops.quantized.linear_dynamic(x, packed, False)  # [6, OUT]
    alone = torch.cat(
        [torch.ops.quantized.linear_dynamic(x[r : r + 1], packed, False) for r in range(6)]
    )
    assert float(_relative_errors(together, alone).max()) > 0.1


def test_leading_dimensions_and_dtypes_are_kept(kernel) -> None:
    layer = _linear()
    x = torch.randn(2, 3, IN, dtype=torch.bfloat16)
    int8 = Int8Linear(layer)
    y = int8(x)
    assert y.shape == (2, 3, OUT) and y.dtype == torch.float32
    assert int8.native == (kernel == "native")


def test_quantize_int8_swaps_every_linear(kernel) -> None:
    model = quantize(make_tiny_lm(), "int8")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == []
    assert any(isinstance(m, Int8Linear) for m in model.modules())


def test_layers_sharing_an_input_give_the_same_numbers_bit_for_bit(kernel) -> None:
    layers = [Int8Linear(_linear(seed)) for seed in range(3)]
    x = _block().reshape(2, 3, IN)
    for shared, alone in zip(project(x, layers), [layer(x) for layer in layers], strict=True):
        assert torch.equal(shared, alone)
    mixed = [layers[0], _linear(seed=4)]  # a dense layer among them: each on its own
    with torch.no_grad():
        got, expected = project(x, mixed), [m(x) for m in mixed]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def _int4_weights_seen_by_the_kernel(int4: Int4Linear) -> torch.Tensor:
    """W [OUT, IN] as the kernel multiplies it: the products with the identity's rows."""
    return int4(torch.eye(IN)).float().T


def _group_steps(weight: torch.Tensor, group: int) -> torch.Tensor:
    """Each weight's quantisation step (max - min) / 15 of its group: [OUT, IN]."""
    groups = weight.reshape(weight.shape[0], -1, group)
    steps = (groups.amax(-1) - groups.amin(-1)) / 15  # [OUT, G]
    return steps.repeat_interleave(group, dim=1)


def test_int4_weights_lie_within_half_a_step_of_their_group(kernel) -> None:
    """Every weight the kernel uses is the original within half its group's step (plus the
    rounding of scale, offset and product: bfloat16 with torch's kernel, float16 and float32
    with the native one); one step off fails (control)."""
    layer = _linear()
    layer.bias = None  # the products with the identity are then the weights alone
    weight = layer.weight.detach()
    seen = _int4_weights_seen_by_the_kernel(Int4Linear(layer))
    group = NATIVE_INT4_GROUP if kernel == "native" else INT4_GROUP
    steps, slack = _group_steps(weight, group), 2**-7 * weight.abs().amax(1, keepdim=True)
    assert ((seen - weight).abs() <= steps / 2 + slack).all()
    shifted = seen.clone()
    shifted[0, 0] += steps[0, 0]
    assert not ((shifted - weight).abs() <= steps / 2 + slack).all()


def test_int4_linear_is_close_to_float_and_keeps_shapes(kernel) -> None:
    layer, x = _linear(), _block()
    int4 = Int4Linear(layer)
    assert int4.native == (kernel == "native")
    with torch.no_grad():
        errors = _relative_errors(int4(x).float(), layer(x))
    assert float(errors.max()) < 0.1, errors
    y = int4(x.reshape(2, 3, IN))
    expected_dtype = torch.float32 if kernel == "native" else torch.bfloat16
    assert y.shape == (2, 3, OUT) and y.dtype == expected_dtype


def test_quantize_int4_swaps_the_layers_a_kernel_takes(kernel) -> None:
    """torch's kernel leaves a layer of 120 outputs dense (the rest of the model bfloat16);
    the native one takes it (the rest float32)."""
    model = make_tiny_lm()
    model.model.layers[0].mlp.gate_proj = nn.Linear(64, 120, bias=False)  # 120 % 16 != 0
    quantize(model, "int4")
    dense = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]
    native_kernel = kernel == "native"
    assert dense == ([] if native_kernel else [(120, 64)])
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 2 * 7 + 1 - len(dense)
    rest = torch.float32 if native_kernel else torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {rest}
    with pytest.raises(ValueError, match="quant must be one of none, int8, int4, got 'int2'"):
        quantize(model, "int2")


def _tokens(count: int = PREFIX_TOKENS + 40) -> list[int]:
    return torch.randint(0, 128, (count,), generator=torch.Generator().manual_seed(5)).tolist()


def test_divergence_of_a_model_from_itself_is_zero() -> None:
    model = make_tiny_lm()
    backend = LeanBackend(LeanModel(model))
    result = measure(backend, LeanBackend(LeanModel(model)), _tokens(), "none", block=4)
    assert result.kl_one_row < 1e-9 and result.kl_block < 1e-9
    assert result.agreement_one_row == result.agreement_block == 1.0
    assert result.tokens == 40


@pytest.mark.parametrize(("quant", "bound"), [("int8", 0.01), ("int4", 0.1)])
def test_divergence_of_a_quantised_model_is_small_and_positive(quant, bound, kernel) -> None:
    reference = make_tiny_lm()
    quantised = quantize(copy.deepcopy(reference), quant)
    result = measure(
        LeanBackend(LeanModel(reference)), LeanBackend(LeanModel(quantised)), _tokens(), quant, 4
    )
    assert 0 < result.kl_one_row < bound and 0 < result.kl_block < bound
    assert result.kl_worst == max(result.kl_one_row, result.kl_block)


@pytest.mark.skipif(not onednn_packs_bf16(), reason="oneDNN packs no bf16 weight on this CPU")
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
    packed = any(isinstance(m, PackedLinear | NativeBf16Linear) for m in model.modules())
    assert packing_available(model) == packed
    got = backend.append([3, 17, 42, 8])  # [4, V]
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def _mapped(path) -> bool:
    """Whether any file under ``path`` is memory-mapped by this process (Linux)."""
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_a_packed_or_quantised_model_does_not_keep_its_checkpoint_mapped(tmp_path, quant) -> None:
    """Once the linear layers hold their own copies, the safetensors file is unmapped (else
    every page read while packing stays resident: the model's size again)."""
    make_tiny_lm().bfloat16().save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="bfloat16")
    assert _mapped(tmp_path)  # control: a fresh load is a memory map of the file
    if quant != "none":
        quantize(loaded.model, quant)
    elif packing_available(loaded.model):
        LeanModel(loaded.model)
    else:
        pytest.skip("no oneDNN packing in this torch")
    gc.collect()
    assert not _mapped(tmp_path)
