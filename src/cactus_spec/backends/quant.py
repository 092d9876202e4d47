"""Int8 weights for every linear layer: fbgemm's int8 GEMM, per-channel weight scales and a
per-row activation scale.

A weight row c is stored as w8[c] = round(W[c] / s_w[c]) in int8, s_w[c] = max|W[c]| / 127.
fbgemm quantises its whole input block with one asymmetric activation scale, so a row's
precision would depend on the other rows of its block (that made an 11-token verification
block several times further from bfloat16 than one token). So each input row x_r is first
centred and scaled by its own range, x'_r = (x_r - c_r) / h_r with c_r, h_r the midpoint and
half-width of [min x_r, max x_r], so that every row spans exactly [-1, 1], and then

    y_r = h_r * fbgemm(x'_r) + c_r * rowsum(W8) + b,   rowsum(W8)[c] = sum_i s_w[c] w8[c, i]

which is exact algebra: each row gets the uint8 grid of its own range, as if alone. On CPUs
with AVX512-VNNI fbgemm accumulates without saturation, so activations use all 8 bits;
elsewhere its ``reduce_range`` (7 bits) avoids the int16 overflow of its AVX2 kernel.

The rest of the model runs in float32 around these layers.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from cactus_spec.backends.memory import trim_heap

QUANTS = ("none", "int8")


def check_quant(quant: object, name: str = "quant") -> str:
    """``quant`` if it is one of QUANTS, else ValueError naming ``name``."""
    if quant not in QUANTS:
        raise ValueError(f"{name} must be one of {', '.join(QUANTS)}, got {quant!r}")
    return quant


@functools.cache
def _cpu_has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (fbgemm then accumulates u8*s8 without saturation)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags.split()


def quant_kernel() -> str:
    """The int8 path this CPU takes (results that depend on it record it)."""
    bits = 7 if not _cpu_has_vnni() else 8
    return f"fbgemm int8, per-channel weights, per-row {bits}-bit activations"


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (per output channel) and per-row activation ranges:
    x [..., E_in] (any float dtype) -> y [..., E_out] float32. See the module docstring."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [E_out, E_in]
        scale = weight.abs().amax(1).clamp_min(1e-12) / 127  # [E_out]
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch announces the move of quantised tensors
            warnings.simplefilter("ignore")
            w8 = torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(w8, None)
            row_sums = w8.dequantize().sum(1)  # [E_out]
        self.register_buffer("row_sums", row_sums)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._reduce_range = not _cpu_has_vnni()  # 7-bit activations

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [M, E_in]
        low, high = torch.aminmax(rows, dim=-1, keepdim=True)  # [M, 1] each
        centre, half = (high + low) / 2, ((high - low) / 2).clamp_min(1e-12)
        unit = (rows - centre) / half  # every row spans [-1, 1]
        y = torch.ops.quantized.linear_dynamic(unit, self._packed, self._reduce_range)
        y = torch.addcmul(centre * self.row_sums, y, half)  # [M, E_out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of ``model`` (in place) by an ``Int8Linear``; the rest of the
    model becomes float32. CPU only (fbgemm). Layers are quantised one at a time from their
    own dtype, so the whole model never exists in float32 at once."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    model.float()
    trim_heap()  # the float32 copies made while quantising
    return model
