"""bfloat16 linear layers with their weights repacked once: for the native kernel where the
CPU has AMX or AVX512-BF16 (``NativeBf16Linear``), else for oneDNN (``PackedLinear``).

Native. ``native.bf16_linear`` multiplies bfloat16 rows by a weight packed as AMX tiles,
whose 64-byte rows are also AVX512-BF16's vdpbf16ps operands, the sums in float32, each
output element's sum in the same order whatever the other rows (a row gives the same bits
alone as in any block). It is used because it streams the weight faster than oneDNN at one
row and no slower at a verification block's 11 (measured in ``docs/DESIGN.md``). Its sums
run in another order than oneDNN's, so its outputs differ
from them in the last bits, each as close to float32. A block whose linear layers are all
``NativeBf16Linear`` runs as one native call (``native_block``).

oneDNN.

``F.linear`` on a plain bfloat16 weight reorders it inside every call; a weight stored in
oneDNN's own blocked layout skips that. The products are the same bit for bit for blocks of
up to 32 rows (decode steps and verification blocks; tested); larger blocks (prompts, wide
batches) may round differently where oneDNN picks another kernel for them, as on AMX CPUs,
each as close to float32 as the other (tested against a float32 copy). The lean
backend packs a bfloat16 CPU model when it is built: the model's ``nn.Linear`` modules are
replaced in place (so the weights are not held twice), and anything else running the same
model object runs them too.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from cactus_spec.backends import native
from cactus_spec.backends.memory import own_memory


def packing_available(model: nn.Module) -> bool:
    """Whether ``model`` is a bfloat16 model on a CPU where its linear layers can be packed:
    the native bf16 kernel runs, or oneDNN packs bf16 weights (it needs AVX512 or
    AVX-NE-CONVERT; on an AVX2-only CPU the layers stay torch's own)."""
    weight = next(model.parameters(), None)
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and (NativeBf16Linear.available() or onednn_packs_bf16())
    )


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN reorders a bfloat16 weight on this CPU (tried once on a 16x16 one)."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return False
    return True


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout: x [..., E_in] bf16 -> y [..., E_out]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()  # [E_out, E_in]
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # tuned for 1 row
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed bf16"


class NativeBf16Linear(nn.Module):
    """y = x W^T + b on AMX tiles or AVX512-BF16 (``native.bf16_linear``): x [..., E_in] (any
    float dtype, rounded to bfloat16) -> y [..., E_out] bfloat16."""

    block_kind = "bf16"
    packed: Tensor
    bias: Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()  # [E_out, E_in]
        packed = native.loaded().pack_bf16(weight)  # [E_out/16, E_in/2, 16, 2]
        self.register_buffer("packed", packed)
        bias = torch.zeros(weight.shape[0]) if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias.float())  # [E_out]
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @staticmethod
    def available() -> bool:
        """Whether the native kernels are built with a bf16 path for this CPU (AMX tiles it
        lends this process, or AVX512-BF16)."""
        return native.available() and native.loaded().has_bf16()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, E_in]
        y = native.loaded().bf16_linear(rows, self.packed, self.bias)  # [M, E_out]
        return y.reshape(*x.shape[:-1], self.out_features)

    def block_params(self) -> list[Tensor]:
        """What a native block reads of this layer (``native_block``)."""
        return [self.packed, self.bias]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, native bf16"


def bf16_kernel() -> str:
    """The bfloat16 CPU path the lean backend takes (results that depend on it record it)."""
    if NativeBf16Linear.available():
        simd = "AMX tiles" if native.loaded().has_amx() else "AVX512-BF16"
        return f"native {simd}, whole blocks in C++"
    return "oneDNN, packed once" if onednn_packs_bf16() else "torch's F.linear, unpacked"


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every bfloat16 ``nn.Linear`` of ``model`` by a ``NativeBf16Linear`` where the
    native kernel runs (AMX or AVX512-BF16), else by a ``PackedLinear`` (in place), then give
    the remaining tensors memory of their own (``own_memory``)."""
    packing = NativeBf16Linear if NativeBf16Linear.available() else PackedLinear
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                setattr(module, name, packing(child))
    return own_memory(model)
