"""Quantised weights for every linear layer: int8 (per-channel weight scales, a per-row
activation scale) or int4 (weight-only, per-group scales and offsets).

Int8.

A weight row c is stored as w8[c] = round(W[c] / s_w[c]) in int8, s_w[c] = max|W[c]| / 127.
Each input row is quantised to 8 bits on its own range, so a row's precision never depends on
the other rows of its block (one range per block made an 11-token verification block several
times further from bfloat16 than one token). Two kernels compute it:

- the native kernel (``backends.native``, compiled for this CPU at set-up), which quantises
  the rows inside the call and reads the weight once per call whatever the rows, in a layout
  made for AVX512-VNNI and AMX tiles (blocks of rows). Each row gives the same bits alone as
  in any block. Whole blocks of such layers run as one C++ call (``native_block``);
  ``docs/DESIGN.md`` has its measured costs;
- fbgemm's int8 GEMM (where no C++ toolchain is at hand, or ``CACTUS_SPEC_NATIVE=0``), which
  quantises its whole input block with one asymmetric scale. So each row x_r is first centred
  and scaled by its own range, x'_r = (x_r - c_r) / h_r with c_r, h_r the midpoint and
  half-width of [min x_r, max x_r], so that every row spans exactly [-1, 1], and then

      y_r = h_r * fbgemm(x'_r) + c_r * rowsum(W8) + b,   rowsum(W8)[c] = sum_i s_w[c] w8[c, i]

  which is exact algebra: each row gets the uint8 grid of its own range, as if alone. On CPUs
  with AVX512-VNNI fbgemm accumulates without saturation, so activations use all 8 bits;
  elsewhere its ``reduce_range`` (7 bits) avoids the int16 overflow of its AVX2 kernel.
  Layers that read the same input (q, k, v; gate, up) share its row scaling (``project``):
  the same numbers, bit for bit, with less elementwise work.

The rest of the model runs in float32 around these layers.

Int4. Each weight row is cut into groups of inputs (as GGUF's Q4 blocks are); group g of
row c holds codes u in 0..15 with w = low + u * s, s = (max - min) / 15 of the group. Two
kernels compute it:

- the native kernel (``native/int4_linear.cpp``), groups of ``NATIVE_INT4_GROUP`` inputs with
  float16 s and low, each input row quantised to int8 symmetrically on its own range
  (x ~ step v, v in -127..127), the products summed exactly in int32 per group
  (AVX512-VNNI, two codes per byte), then y = step sum_g (s <c, v>_g + low sum_g v). It reads
  half the bytes of int8 per weight (plus 4 bytes of s and low per group), which is what a
  one-row draft step is bound by, and computes a row the same way whatever the other rows; a
  block of such layers runs as one native call (``native_block``), the rest of the model in
  float32. Its cost grows with the rows (no AMX tiles): a format for the one-row draft step,
  not for verification blocks or wide batches;
- torch's CPU kernel (where the native one is not built), groups of ``INT4_GROUP``, bfloat16
  activations, the rest of the model in bfloat16; a layer whose shape it refuses (outputs not
  a multiple of 16, inputs not of the group) stays dense.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from cactus_spec import isa
from cactus_spec.backends import native
from cactus_spec.backends.memory import Model, own_memory, trim_heap

QUANTS = ("none", "int8", "int4")

#: Inputs per int4 group: the smallest torch's kernel takes, and the fastest at one row here.
INT4_GROUP = 32
#: Inputs per int4 group of the native kernel (``native/int4_linear.cpp``).
NATIVE_INT4_GROUP = 64


def check_quant(quant: object, name: str = "quant") -> str:
    """``quant`` if it is one of QUANTS, else ValueError naming ``name``."""
    if quant not in QUANTS:
        raise ValueError(f"{name} must be one of {', '.join(QUANTS)}, got {quant!r}")
    return quant


def _cpu_has_vnni() -> bool:
    """Whether this CPU, at the level it is held to (``isa``), has AVX512-VNNI (fbgemm then
    accumulates u8*s8 without saturation)."""
    return isa.allows("avx512_vnni")


def quant_kernel() -> str:
    """The int8 path this CPU takes (results that depend on it record it)."""
    if native.available():
        simd = native.loaded().int_simd()
        if native.loaded().has_amx():
            simd = f"AMX tiles for blocks, {simd} for one row"
        return f"native int8 ({simd}), per-channel weights, per-row 8-bit activations"
    bits = 7 if not _cpu_has_vnni() else 8
    return f"fbgemm int8, per-channel weights, per-row {bits}-bit activations"


def int4_kernel() -> str:
    """The int4 path this CPU takes (results that depend on it record it)."""
    if native.available():
        simd = native.loaded().int_simd()
        return f"native int4 ({simd}), groups of {NATIVE_INT4_GROUP}, per-row 8-bit activations"
    return f"torch int4, groups of {INT4_GROUP}, bfloat16 activations"


#: An input's rows scaled to [-1, 1]: (x' [M, E_in], c [M, 1], h [M, 1]), x = c + h x'.
UnitRows = tuple[Tensor, Tensor, Tensor]


def unit_rows(x: Tensor) -> UnitRows:
    """Centre and scale each row of x [..., E_in] to span exactly [-1, 1] (float32)."""
    rows = x.reshape(-1, x.shape[-1]).float()  # [M, E_in]
    low, high = torch.aminmax(rows, dim=-1, keepdim=True)  # [M, 1] each
    centre, half = (high + low) / 2, ((high - low) / 2).clamp_min(1e-12)
    return (rows - centre) / half, centre, half


def project(x: Tensor, layers: list[nn.Module]) -> list[Tensor]:
    """[layer(x) for layer in layers], scaling x's rows once when every layer is an fbgemm
    int8 layer (the native kernel scales inside each call, at no cost worth sharing)."""
    fbgemm = [layer for layer in layers if isinstance(layer, Int8Linear) and not layer.native]
    if len(fbgemm) == len(layers):
        scaled = unit_rows(x)
        return [layer.from_unit_rows(scaled, x.shape[:-1]) for layer in fbgemm]
    return [layer(x) for layer in layers]


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (per output channel) and per-row activation ranges:
    x [..., E_in] (any float dtype) -> y [..., E_out] float32. See the module docstring."""

    codes: Tensor
    scale: Tensor
    code_sums: Tensor
    row_sums: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [E_out, E_in]
        scale = weight.abs().amax(1).clamp_min(1e-12) / 127  # [E_out]
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch announces the move of quantised tensors
            warnings.simplefilter("ignore")
            w8 = torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8)
            self.native = native.available()
            if self.native:
                codes = w8.int_repr()  # [E_out, E_in] int8
                packed = native.loaded().pack_int8(codes)  # [E_out/16, E_in/4, 16, 4]
                self.register_buffer("codes", packed)
                self.register_buffer("scale", scale)  # [E_out]
                self.register_buffer("code_sums", codes.sum(1, dtype=torch.int32))
            else:
                self._packed = torch.ops.quantized.linear_prepack(w8, None)
                self.register_buffer("row_sums", w8.dequantize().sum(1))  # [E_out]
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._reduce_range = not _cpu_has_vnni()  # 7-bit activations

    def forward(self, x: Tensor) -> Tensor:
        if not self.native:
            return self.from_unit_rows(unit_rows(x), x.shape[:-1])
        rows = x.reshape(-1, self.in_features).float().contiguous()  # [M, E_in]
        y = native.loaded().int8_linear(rows, self.codes, self.scale, self.code_sums, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def block_kind(self) -> str | None:
        """ "int8" when a native block can run this layer (``native_block``), else None."""
        return "int8" if self.native else None

    def block_params(self) -> list[Tensor]:
        """What a native block reads of this layer: codes, scales, code sums, bias (empty:
        none)."""
        bias = torch.empty(0) if self.bias is None else self.bias
        return [self.codes, self.scale, self.code_sums, bias]

    def from_unit_rows(self, scaled: UnitRows, lead: torch.Size) -> Tensor:
        """y [*lead, E_out] from the input's ``unit_rows``."""
        unit, centre, half = scaled
        y = torch.ops.quantized.linear_dynamic(unit, self._packed, self._reduce_range)
        y = torch.addcmul(centre * self.row_sums, y, half)  # [M, E_out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(nn.Module):
    """A linear layer with 4-bit weights in groups of inputs, each group with its own scale
    and low end: x [..., E_in] (any float dtype) -> y [..., E_out] (float32 with the native
    kernel, else bfloat16). See the module docstring."""

    packed: Tensor
    scales: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [E_out, E_in]
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.native = native.available()
        if self.native:
            codes, scale, low = int4_codes(weight, NATIVE_INT4_GROUP, torch.float16)
            packed, scales = native.loaded().pack_int4(codes, scale, low)
            self.register_buffer("packed", packed)  # [E_out/64, G, 4, 8, 16, 4] uint8
            self.register_buffer("scales", scales)  # [E_out/64, G, 2, 64] float16 bits (int16)
            bias = torch.zeros(self.out_features) if linear.bias is None else linear.bias.detach()
            bias = bias.float()  # [E_out]
        else:
            codes, scale, low = int4_codes(weight, INT4_GROUP, torch.float32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
            self.register_buffer("packed", packed)  # [E_out, E_in / 2] uint8
            offset = low + 8 * scale  # the kernel reads a code u as (u - 8) * scale + offset
            scales = torch.stack((scale, offset), -1).transpose(0, 1).contiguous()  # [G, E_out, 2]
            self.register_buffer("scales", scales.to(torch.bfloat16))
            bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.register_buffer("bias", bias)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        """Whether a kernel takes this layer's shape (the native one takes any)."""
        rows, inputs = linear.weight.shape
        return native.available() or (rows % 16 == 0 and inputs % INT4_GROUP == 0)

    def forward(self, x: Tensor) -> Tensor:
        if self.native:
            rows = x.reshape(-1, self.in_features).float().contiguous()  # [M, E_in]
            y = native.loaded().int4_linear(rows, self.packed, self.scales, self.bias)
        else:
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, E_in]
            int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
            y = int4_mm(rows, self.packed, INT4_GROUP, self.scales)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def block_kind(self) -> str | None:
        """ "int4" when a native block can run this layer (``native_block``), else None."""
        return "int4" if self.native else None

    def block_params(self) -> list[Tensor]:
        """What a native block reads of this layer: codes, scales, bias."""
        assert self.bias is not None  # a native layer holds one (zeros without a bias)
        return [self.packed, self.scales, self.bias]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4"


def int4_codes(weight: Tensor, group: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] float32 as 4-bit codes in groups of ``group`` inputs (K zero padded to
    whole groups): (codes [N, K] uint8 in 0..15, scale [N, G], low [N, G]), the scales and low
    ends in ``dtype``, so that weight ~ low + scale * codes group by group, with the codes
    rounded against the stored (``dtype``) scale and low end."""
    rows, inputs = weight.shape
    padded = nn.functional.pad(weight, (0, -inputs % group))  # [N, G * group]
    groups = padded.reshape(rows, -1, group)  # [N, G, group]
    low, high = groups.amin(-1), groups.amax(-1)  # [N, G] each
    tiny = torch.finfo(dtype).tiny  # the smallest normal number of dtype
    scale = ((high - low) / 15).clamp_min(tiny).to(dtype)
    low = low.to(dtype)
    codes = ((groups - low.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15)
    codes = codes.reshape(rows, -1)[:, :inputs].to(torch.uint8)  # [N, K]
    return codes, scale, low


def quantize(model: Model, quant: str) -> Model:
    """Replace the nn.Linear layers of ``model`` (in place) by ``quant`` ones ("int8", or
    "int4" with the native kernel: every layer, the rest of the model in float32; "int4" with
    torch's kernel: every layer it takes, the rest in bfloat16); "none" leaves the model as it
    is. CPU only. Layers are quantised one at a
    time from their own dtype, so the whole model never exists in float32 at once."""
    if check_quant(quant) == "none":
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if quant == "int8":
                setattr(module, name, Int8Linear(child))
            elif Int4Linear.fits(child):
                setattr(module, name, Int4Linear(child))
    if quant == "int8" or native.available():
        model.float()  # new float32 copies of the rest: the checkpoint's map is let go
        trim_heap()  # the float32 copies made while quantising
        return model
    return own_memory(model.to(torch.bfloat16))  # a bfloat16 rest would stay mapped
