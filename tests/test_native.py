"""The native int8 kernel: its packing holds the weights in place, its products are the
exact algebra of per-row uint8 codes against int8 weights, and each row of a block gives
the same bits as alone (batch invariance), on shapes the packing must pad."""

from __future__ import annotations

import pytest
import torch

from cactus_spec.backends import native

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native kernels could not be built here"
)

SHAPES = [(1, 896, 128), (3, 101, 37), (5, 64, 130), (9, 40, 64)]  # (M, K, N)


def _layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random int8 codes [N, K], scales [N] and a bias [N]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return codes, torch.rand(n, generator=g) / 100, torch.randn(n, generator=g)


def _run(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias) -> torch.Tensor:
    kernels = native.load()
    sums = codes.sum(1, dtype=torch.int32)
    return kernels.int8_linear(x, kernels.pack_int8(codes), scale, sums, bias)


def _reference(x: torch.Tensor, codes, scale, bias, per_row: bool = True) -> torch.Tensor:
    """Each row (or, per_row=False, the whole block) to uint8 codes on its range, then the
    float product with the dequantised weights: [M, N]."""
    dim = 1 if per_row else None
    low = x.amin(dim, keepdim=per_row)
    step = (x.amax(dim, keepdim=per_row) - low) / 255
    u = ((x - low) * (1 / step) + 0.5).floor().clamp(max=255)  # the kernel's rounding
    return (low + step * u).double() @ (codes.double() * scale.double()[:, None]).T + bias


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_products_are_the_algebra_of_per_row_codes(m, k, n) -> None:
    codes, scale, bias = _layer(k, n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    got = _run(x, codes, scale, bias)
    expected = _reference(x, codes, scale, bias)
    tolerance = 1e-5 * float(expected.abs().max())
    assert float((got - expected).abs().max()) < tolerance
    if m > 1:  # control: one range for the whole block is a different product
        shared = _reference(x * torch.arange(1, m + 1)[:, None], codes, scale, bias, False)
        spread = _run(x * torch.arange(1, m + 1)[:, None], codes, scale, bias)
        assert float((spread - shared).abs().max()) > 100 * tolerance


def test_one_hot_rows_read_back_every_weight() -> None:
    """An identity input is quantised exactly, so the products are the weights: the packing
    put every weight where the kernel looks for it."""
    codes, scale, _ = _layer(101, 37)
    got = _run(torch.eye(101), codes, scale, None)  # [K, N]
    weights = (codes.float() * scale[:, None]).T
    tolerance = 1e-5 * float(weights.abs().max())  # float rounding of the centred sums
    assert float((got - weights).abs().max()) < tolerance
    swapped = codes.clone()
    swapped[[0, 1]] = codes[[1, 0]]  # control: two weight rows in each other's place
    assert float((_run(torch.eye(101), swapped, scale, None) - weights).abs().max()) > tolerance


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_each_row_gives_the_same_bits_as_alone(m, k, n) -> None:
    codes, scale, bias = _layer(k, n)
    ranges = torch.logspace(-2, 2, m)[:, None]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * ranges
    together = _run(x, codes, scale, bias)
    alone = torch.cat([_run(x[r : r + 1], codes, scale, bias) for r in range(m)])
    assert torch.equal(together, alone)


def test_bad_shapes_are_refused_with_a_clear_error() -> None:
    codes, scale, bias = _layer(64, 16)
    with pytest.raises(RuntimeError, match="packed must be pack_int8"):
        _run(torch.randn(2, 200), codes, scale, bias)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        _run(torch.randn(2, 64, dtype=torch.float64), codes, scale, bias)


amx = pytest.mark.skipif(
    not (native.available() and native.load().has_amx()), reason="no AMX on this CPU"
)


def _bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    kernels = native.load()
    return kernels.bf16_linear(x, kernels.pack_bf16(w), bias)


def _bf16_layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)


@amx
@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (20, 96, 70)])
def test_bf16_products_are_float_sums_of_bf16_rows(m, k, n) -> None:
    """y = round_bf16(sum_k bf16(x) w + b), the sums in float32: within float32 summation
    error of the exact sums before the final rounding (rows past one AMX tile included)."""
    w, bias = _bf16_layer(k, n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    got = _bf16(x, w, bias)
    exact = x.bfloat16().double() @ w.double().T + bias.double()  # [M, N]
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-4 * float(exact.abs().max()))
    shuffled = _bf16(x, w[torch.randperm(n, generator=torch.Generator().manual_seed(3))], bias)
    assert not torch.allclose(shuffled.double(), exact, rtol=2**-8)  # control: wrong weights


@amx
def test_bf16_one_hot_rows_read_back_every_weight() -> None:
    w, _ = _bf16_layer(101, 37)
    got = _bf16(torch.eye(101), w, torch.zeros(37))  # [K, N]
    assert torch.equal(got, w.T)
    swapped = w.clone()
    swapped[[0, 1]] = w[[1, 0]]  # control: two weight rows in each other's place
    assert not torch.equal(_bf16(torch.eye(101), swapped, torch.zeros(37)), w.T)


@amx
@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (37, 96, 70)])
def test_bf16_each_row_gives_the_same_bits_as_alone(m, k, n) -> None:
    w, bias = _bf16_layer(k, n)
    ranges = torch.logspace(-2, 2, m)[:, None]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * ranges
    together = _bf16(x, w, bias)
    alone = torch.cat([_bf16(x[r : r + 1], w, bias) for r in range(m)])
    assert torch.equal(together, alone)


@amx
def test_bf16_bad_shapes_are_refused_with_a_clear_error() -> None:
    w, bias = _bf16_layer(64, 16)
    with pytest.raises(RuntimeError, match="packed must be pack_bf16"):
        _bf16(torch.randn(2, 100), w, bias)
    with pytest.raises(RuntimeError, match="x must be a float"):
        _bf16(torch.ones(2, 64, dtype=torch.long), w, bias)


@pytest.mark.parametrize("kind", ["int8", pytest.param("bf16", marks=amx)])
def test_no_rows_give_no_outputs(kind) -> None:
    """An empty block of rows is an empty product (no division by a tile of no rows)."""
    if kind == "int8":
        codes, scale, bias = _layer(64, 16)
        got = _run(torch.empty(0, 64), codes, scale, bias)
    else:
        w, bias = _bf16_layer(64, 16)
        got = _bf16(torch.empty(0, 64), w, bias)
    assert got.shape == (0, 16)
