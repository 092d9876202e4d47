"""The native kernels: their packing holds the weights in place, the int8 and int4 products
are the exact algebra of per-row uint8 codes against int8 or grouped int4 weights (bf16: float
sums of bfloat16 rows), and each row of a block gives the same bits as alone (batch
invariance), on shapes the packing must pad."""

from __future__ import annotations

import pytest
import torch

from cactus_spec.backends import native

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native kernels could not be built here"
)

SHAPES = [(1, 896, 128), (3, 101, 37), (5, 64, 130), (9, 40, 64), (13, 200, 96)]  # (M, K, N)
#: More rows than one AMX tile holds: two tiles at once, then one (37), or two with a short one.
MANY_ROWS = [(20, 96, 70), (37, 200, 130)]


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


@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, *MANY_ROWS])
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


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, *MANY_ROWS])
def test_each_row_gives_the_same_bits_as_alone(m, k, n, kind) -> None:
    layer = _layer(k, n) if kind == "int8" else _int4_layer(k, n)
    run = _run if kind == "int8" else _run4
    ranges = torch.logspace(-2, 2, m)[:, None]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * ranges
    together = run(x, *layer)
    alone = torch.cat([run(x[r : r + 1], *layer) for r in range(m)])
    assert torch.equal(together, alone)


def test_bad_shapes_are_refused_with_a_clear_error() -> None:
    codes, scale, bias = _layer(64, 16)
    with pytest.raises(RuntimeError, match="packed must be pack_int8"):
        _run(torch.randn(2, 200), codes, scale, bias)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        _run(torch.randn(2, 64, dtype=torch.float64), codes, scale, bias)


def _int4_layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random int4 codes [N, K] (uint8 0..15), float16 scales and low ends [N, G], a bias [N]."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // 64)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, groups, generator=g) / 100).half()
    low = (torch.randn(n, groups, generator=g) / 10).half()
    return codes, scale, low, torch.randn(n, generator=g)


def _run4(x: torch.Tensor, codes, scale, low, bias) -> torch.Tensor:
    kernels = native.load()
    packed, scales = kernels.pack_int4(codes, scale, low)
    return kernels.int4_linear(x, packed, scales, torch.zeros(len(codes)) if bias is None else bias)


def _reference4(x: torch.Tensor, codes, scale, low, bias) -> torch.Tensor:
    """Each row to int8 codes on its symmetric range, x ~ step v, then the float product with
    the weights low + scale * code: [M, N]."""
    k = codes.shape[1]
    step = x.abs().amax(1, keepdim=True) / 127  # [M, 1]
    v = (x * (1 / step)).round().clamp(-127, 127)  # the kernel's rounding (half to even)
    weights = low.double().repeat_interleave(64, 1)[:, :k]  # [N, K]
    weights += scale.double().repeat_interleave(64, 1)[:, :k] * codes.double()
    return (step * v).double() @ weights.T + bias


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_int4_products_are_the_algebra_of_per_row_codes(m, k, n) -> None:
    codes, scale, low, bias = _int4_layer(k, n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    expected = _reference4(x, codes, scale, low, bias)
    tolerance = 1e-5 * float(expected.abs().max())
    assert float((_run4(x, codes, scale, low, bias) - expected).abs().max()) < tolerance
    flipped = codes.clone()
    flipped[:, -1] ^= 1  # control: one input's codes one step off in every output
    assert float((_run4(x, flipped, scale, low, bias) - expected).abs().max()) > 10 * tolerance


def test_int4_one_hot_rows_read_back_every_weight() -> None:
    """An identity input is quantised exactly (v = 127 step), so the products are the
    weights low + s c: the packing put every code, scale and low end where the kernel looks
    for it."""
    codes, scale, low, _ = _int4_layer(101, 70)
    lows = low.float().repeat_interleave(64, 1)[:, :101]
    weights = (lows + scale.float().repeat_interleave(64, 1)[:, :101] * codes.float()).T
    got = _run4(torch.eye(101), codes, scale, low, None)  # [K, N]
    tolerance = 1e-5 * float(weights.abs().max())
    assert float((got - weights).abs().max()) < tolerance
    swapped = codes.clone()
    swapped[[0, 69]] = codes[[69, 0]]  # control: two weight rows in each other's place
    wrong = _run4(torch.eye(101), swapped, scale, low, None)
    assert float((wrong - weights).abs().max()) > tolerance


def test_int4_bad_shapes_are_refused_with_a_clear_error() -> None:
    codes, scale, low, bias = _int4_layer(64, 16)
    with pytest.raises(RuntimeError, match="packed and scales must be pack_int4"):
        _run4(torch.randn(2, 200), codes, scale, low, bias)
    with pytest.raises(RuntimeError, match="scale and low must be float16"):
        native.load().pack_int4(codes, scale.float(), low)


bf16 = pytest.mark.skipif(
    not (native.available() and native.load().has_bf16()), reason="no AMX or AVX512-BF16 here"
)


def _bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    kernels = native.load()
    return kernels.bf16_linear(x, kernels.pack_bf16(w), bias)


def _bf16_layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)


@bf16
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


@bf16
def test_bf16_one_hot_rows_read_back_every_weight() -> None:
    w, _ = _bf16_layer(101, 37)
    got = _bf16(torch.eye(101), w, torch.zeros(37))  # [K, N]
    assert torch.equal(got, w.T)
    swapped = w.clone()
    swapped[[0, 1]] = w[[1, 0]]  # control: two weight rows in each other's place
    assert not torch.equal(_bf16(torch.eye(101), swapped, torch.zeros(37)), w.T)


@bf16
@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (37, 96, 70)])
def test_bf16_each_row_gives_the_same_bits_as_alone(m, k, n) -> None:
    w, bias = _bf16_layer(k, n)
    ranges = torch.logspace(-2, 2, m)[:, None]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * ranges
    together = _bf16(x, w, bias)
    alone = torch.cat([_bf16(x[r : r + 1], w, bias) for r in range(m)])
    assert torch.equal(together, alone)


@bf16
def test_bf16_bad_shapes_are_refused_with_a_clear_error() -> None:
    w, bias = _bf16_layer(64, 16)
    with pytest.raises(RuntimeError, match="packed must be pack_bf16"):
        _bf16(torch.randn(2, 100), w, bias)
    with pytest.raises(RuntimeError, match="x must be a float"):
        _bf16(torch.ones(2, 64, dtype=torch.long), w, bias)


@pytest.mark.parametrize("kind", ["int8", "int4", pytest.param("bf16", marks=bf16)])
def test_no_rows_give_no_outputs(kind) -> None:
    """An empty block of rows is an empty product (no division by a tile of no rows)."""
    if kind == "int8":
        codes, scale, bias = _layer(64, 16)
        got = _run(torch.empty(0, 64), codes, scale, bias)
    elif kind == "int4":
        got = _run4(torch.empty(0, 64), *_int4_layer(64, 16))
    else:
        w, bias = _bf16_layer(64, 16)
        got = _bf16(torch.empty(0, 64), w, bias)
    assert got.shape == (0, 16)


@pytest.mark.parametrize("kind", ["int8", "int4", pytest.param("bf16", marks=bf16)])
@pytest.mark.parametrize("m", [1, 11])
def test_the_threads_sharing_a_products_stripes_leave_its_bits_alone(kind, m) -> None:
    """Threads take a product's stripes of outputs as they come free, one thread's the last
    of another's (``share_stripes``): whichever thread sums a stripe, and however many share
    them (more threads than cores included, where they take each other's most), the outputs
    have the bits of one thread's."""
    k, n = 200, 64 * 23 + 5  # 24 stripes, the last short
    if kind == "int8":
        layer, run = _layer(k, n), _run
    elif kind == "int4":
        layer, run = _int4_layer(k, n), _run4
    else:
        layer, run = _bf16_layer(k, n), _bf16
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run(x, *layer)
        shared = []
        for count in (2, 3, 7):
            torch.set_num_threads(count)
            shared += [run(x, *layer) for _ in range(5)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, alone) for out in shared)
    nudged = x.clone()
    nudged[0, 0] = torch.nextafter(x[0, 0], torch.tensor(float("inf"))) * 1.01
    assert not torch.equal(run(nudged, *layer), alone)  # control: the check sees one input move
