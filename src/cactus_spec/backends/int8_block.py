"""A whole decoder block of an int8 model in one native call (``native.int8_block``).

A lean ``Block`` whose seven linear layers are native ``Int8Linear`` spends more of a
one-token step in its ~150 small tensor operations (views included: norms, rotary
embeddings, attention over the cache, SwiGLU, each a dispatch through torch) than in its
products: on this project's Xeon the 0.5B draft's step was 28 ms, of which ~17 ms are
products; as ``Int8Block`` it is 21.7 ms. ``Int8Block`` computes the same block, the same
per-row int8 products included, in C++: the same law up to float rounding (sums in another
order), which may move an activation code by one step. It takes the block's tensors by
reference (nothing is copied) and writes the rows' keys and values into the lean
``KVCache`` as the Python block does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cactus_spec.backends import native
from cactus_spec.backends.quant import Int8Linear

_NO_BIAS = torch.empty(0)


def _layers(hf_layer: nn.Module) -> list[nn.Module]:
    attention, mlp = hf_layer.self_attn, hf_layer.mlp
    return [
        attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
        mlp.gate_proj, mlp.up_proj, mlp.down_proj,
    ]  # fmt: skip


class Int8Block(nn.Module):
    """lean.Block's computation for a block of native int8 layers in a float32 model."""

    def __init__(self, hf_layer: nn.Module, eps: float, heads: int, kv_heads: int) -> None:
        super().__init__()
        norms = [hf_layer.input_layernorm.weight, hf_layer.post_attention_layernorm.weight]
        self.params = [n.detach().contiguous() for n in norms]
        for layer in _layers(hf_layer):
            bias = _NO_BIAS if layer.bias is None else layer.bias
            self.params += [layer.codes, layer.scale, layer.code_sums, bias]
        self.eps, self.heads, self.kv_heads = eps, heads, kv_heads

    @staticmethod
    def fits(hf_layer: nn.Module) -> bool:
        """Whether every linear layer of the block is a native int8 one, the rest float32."""
        norms = (hf_layer.input_layernorm.weight, hf_layer.post_attention_layernorm.weight)
        return all(isinstance(m, Int8Linear) and m.native for m in _layers(hf_layer)) and all(
            n.dtype == torch.float32 for n in norms
        )

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache, layer: int) -> Tensor:
        """x [b, T, E] -> [b, T, E]; writes the rows' new keys and values into ``cache``."""
        cos, sin = rope  # [b, 1, T, D] each
        keys, values = cache.layer(layer)  # [B, H_kv, S, D] each
        return native.load().int8_block(
            x.contiguous(), cos, sin, keys, values, cache.rows, cache.starts, self.params,
            self.eps, self.heads, self.kv_heads,
        )  # fmt: skip
