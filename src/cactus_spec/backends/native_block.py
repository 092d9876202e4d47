"""A whole decoder block of native layers in one native call (``native.int8_block`` for
int8 layers, ``native.int4_block`` for int4 ones, ``native.bf16_block`` for AMX bfloat16
ones).

A lean ``Block`` of native layers spends more of a one-token step in its ~150 small tensor
operations (views included: norms, rotary embeddings, attention over the cache, SwiGLU,
each a dispatch through torch) than in its products (profiled in ``docs/DESIGN.md``).
``NativeBlock`` computes the same block, the same products included, in C++ and in float32
whatever the model's dtype (see ``native/block.cpp``): the same law up to float rounding
(sums in another order, which may move an activation code by one step; a bfloat16
model's block rounds at its ends and at its products' inputs only). It takes the layers'
tensors by reference (nothing is copied) and writes the rows' keys and values into the
lean ``KVCache`` as the Python block does. ``NativeStack`` runs a model's blocks, all native
of one kind, in one native call: the same computation, bit for bit, without a Python call
per block (24 of them in a draft step of 10 ms, 0.3-0.4 ms among them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from cactus_spec.backends import native


def _layers(hf_layer: Any) -> list[Any]:
    """The linear layers of a transformers decoder layer (attributes of its modules, which
    torch's types cannot name)."""
    attention, mlp = hf_layer.self_attn, hf_layer.mlp
    return [
        attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
        mlp.gate_proj, mlp.up_proj, mlp.down_proj,
    ]  # fmt: skip


class NativeBlock(nn.Module):
    """lean.Block's computation for a block whose linear layers are all native layers of one
    kind: int8, int4 or bfloat16 (``kind``)."""

    def __init__(self, hf_layer: Any, eps: float, heads: int, kv_heads: int) -> None:
        super().__init__()
        kind = self.kind(hf_layer)
        if kind is None:
            raise ValueError("a native block needs linear layers of one native kind")
        norms = [hf_layer.input_layernorm.weight, hf_layer.post_attention_layernorm.weight]
        self.params = [n.detach().float().contiguous() for n in norms]
        for layer in _layers(hf_layer):
            self.params += layer.block_params()
        self._call = getattr(native.loaded(), f"{kind}_block")
        self.native_kind = kind
        self.eps, self.heads, self.kv_heads = eps, heads, kv_heads

    @staticmethod
    def kind(hf_layer: nn.Module) -> str | None:
        """The block's native kind, "int8", "int4" or "bf16", when every linear layer of the
        block is a native one of that kind; else None."""
        kinds = {getattr(layer, "block_kind", None) for layer in _layers(hf_layer)}
        return kinds.pop() if len(kinds) == 1 else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache, feed, layer: int) -> Tensor:
        """x [b, T, E] -> [b, T, E]; writes the feed's new keys and values into ``cache``
        (a ``lean.KVCache``, at ``feed.starts`` of ``feed.rows``). A causal feed's queries see
        the slots up to their own; another's (a token tree's) those of its mask."""
        cos, sin = rope  # [b, 1, T, D] each
        keys, values = cache.layer(layer)  # [B, H_kv, S, D] each
        mask = None if feed.causal else feed.mask[:, 0]  # [b, T, S']
        return self._call(
            x, cos, sin, keys, values, feed.rows, feed.starts, mask, self.params,
            self.eps, self.heads, self.kv_heads,
        )  # fmt: skip


class NativeStack:
    """Every block of a model, all ``NativeBlock``s of one kind, in one native call
    (``native.DecoderStack``, which holds the blocks' tensors by reference)."""

    def __init__(self, blocks: Sequence[NativeBlock]) -> None:
        first = blocks[0]
        self._call = native.loaded().DecoderStack(
            first.native_kind, [b.params for b in blocks], first.eps, first.heads, first.kv_heads
        )

    @staticmethod
    def of(blocks: Sequence[nn.Module]) -> NativeStack | None:
        """The stack of ``blocks`` when they are all native blocks of one kind; else None."""
        kinds = {getattr(b, "native_kind", None) for b in blocks}
        if len(kinds) != 1 or None in kinds:
            return None
        return NativeStack(blocks)  # type: ignore[arg-type]  # each has a native kind

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], cache, feed) -> Tensor:
        """x [b, T, E] through every block (``NativeBlock.forward``'s arguments, the whole
        cache for every layer) -> [b, T, E]."""
        cos, sin = rope  # [b, 1, T, D] each
        mask = None if feed.causal else feed.mask[:, 0]  # [b, T, S']
        return self._call(x, cos, sin, cache.keys, cache.values, feed.rows, feed.starts, mask)
