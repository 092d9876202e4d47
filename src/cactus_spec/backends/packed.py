"""bfloat16 linear layers with their weights repacked once for oneDNN (CPU).

``F.linear`` on a plain bfloat16 weight reorders it inside every call; a weight stored in
oneDNN's own blocked layout skips that. The products are the same bit for bit for blocks of
up to 32 rows (decode steps and verification blocks; tested); larger blocks (prompts, wide
batches) may round differently where oneDNN picks another kernel for them, as on AMX CPUs,
each as close to float32 as the other (SmolLM2 on a 252-token text: mean KL to float32
0.0006 repacked, 0.0007 stock); a one-token 8960×1536 product took 1.3–1.5 ms instead of
2.2–2.4 ms on this project's CPU (an 11-token block 2.4–2.5 ms instead of 3.3). The lean
backend packs a bfloat16 CPU model when it is built: the model's ``nn.Linear`` modules are
replaced in place (so the weights are not held twice), and anything else running the same
model object runs them too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cactus_spec.backends.memory import own_memory


def packing_available(model: nn.Module) -> bool:
    """Whether ``model`` is a bfloat16 model on a CPU whose torch has oneDNN's packed linear."""
    weight = next(model.parameters(), None)
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


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


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every bfloat16 ``nn.Linear`` of ``model`` by a ``PackedLinear`` (in place),
    then give the remaining tensors memory of their own (``own_memory``)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                setattr(module, name, PackedLinear(child))
    return own_memory(model)
