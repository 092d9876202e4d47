"""Qwen2 and Llama decoders in plain torch, with a static KV cache that holds a length per row.

One block of the model, for hidden states x [B, T, E] of T new tokens per row::

    h = x + o(attention(rope(q(rms(x))), rope(k(rms(x))), v(rms(x))))
    y = h + down(silu(gate(rms(h))) * up(rms(h)))

with grouped-query attention (H query heads share H_kv key/value heads; two float32 matrix
products for short queries, ``scaled_dot_product_attention`` for long ones), rotary
embeddings on the first and second halves of each head (the Hugging Face layout, which the
dense GGUF copies use), q/k/v biases where the checkpoint has them (Qwen2), and RMSNorm
computed in float32.

The cache ``k, v [L, B, H_kv, S, D]`` is written in place: row b's new tokens go to
positions ``lengths[b] .. lengths[b] + T - 1``, and a query at position t attends to the
keys at positions <= t of its own row. Rolling a row back only sets its length; stale
entries beyond it are masked out and overwritten later. So a forward over rows of different
lengths gives each row exactly the logits it would get alone.

Weights are the Hugging Face model's own tensors (shared, not copied); a bfloat16 model on
the CPU first has its linear layers repacked, in place, for the native AMX kernel or for
oneDNN (``packed``). Int8 layers that read the same input (q, k, v; gate, up) share its row
scaling (``quant.project``); a block whose layers are all native int8, all native
int4 or all native bfloat16 runs as one native call (``native_block``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from cactus_spec.backends.base import synchronize
from cactus_spec.backends.native_block import NativeBlock
from cactus_spec.backends.packed import pack_linears, packing_available
from cactus_spec.backends.quant import project

#: Architectures this module implements, by ``config.model_type``.
SUPPORTED = ("llama", "qwen2")


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot run on the lean code (then the transformers backend runs it)."""
    config = model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or {}
    if config.model_type not in SUPPORTED:
        return f"architecture {config.model_type!r} (lean code covers {', '.join(SUPPORTED)})"
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope.get('rope_type')!r}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on [B, H, T, D]: x cos + (-x2, x1) sin, with halves x1, x2."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


#: Up to this many new tokens per row, attention runs as two batched float32 matrix products:
#: SDPA's CPU kernel pays a fixed cost per row and head that dominates short queries (8 rows
#: of one token: 2.3 ms per layer against 0.22 ms here); longer ones (prefill) take SDPA.
_MATMUL_ATTENTION_TOKENS = 16


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D), over the keys ``mask`` shows) v, grouped-query: q [B, H, T, D],
    keys and values [B, H_kv, S, D], mask [B, 1, T, S] (True = visible) -> [B, H, T, D]. Query
    head i reads key/value head i // G, G = H / H_kv (the Hugging Face grouping)."""
    batch, heads, count, dim = q.shape
    kv_heads = keys.shape[1]
    if count > _MATMUL_ATTENTION_TOKENS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    group = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group * count, dim).float()  # [B, H_kv, G T, D]
    scores = grouped @ keys.float().transpose(-1, -2) * dim**-0.5  # [B, H_kv, G T, S]
    scores = scores.view(batch, kv_heads, group, count, -1)  # [B, H_kv, G, T, S]
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask [B, 1, 1, T, S]
    weights = scores.softmax(-1).view(batch, kv_heads, group * count, -1)
    out = weights @ values.float()  # [B, H_kv, G T, D]
    return out.to(q.dtype).view(batch, heads, count, dim)


class Attention(nn.Module):
    """Grouped-query self-attention over the static cache of one layer."""

    def __init__(self, hf_attention: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q, self.k = hf_attention.q_proj, hf_attention.k_proj
        self.v, self.o = hf_attention.v_proj, hf_attention.o_proj
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache, feed: Feed, layer: int
    ) -> Tensor:
        batch, count, _ = x.shape  # x: [B, T, E]
        q, k, v = project(x, [self.q, self.k, self.v])  # [B, T, H D], [B, T, H_kv D] x2
        q = q.view(batch, count, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, count, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, count, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, *rope), rotate(k, *rope)  # [B, H, T, D], [B, H_kv, T, D]
        keys, values = cache.write(layer, k, v, feed)  # [B, H_kv, S, D] x2
        mask = feed.mask  # [B, 1, T, S]
        out = attend(q, keys, values, mask)  # [B, H, T, D]
        return self.o(out.transpose(1, 2).reshape(batch, count, self.heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm attention and SwiGLU MLP, each added to the residual stream."""

    def __init__(self, hf_layer: nn.Module, eps: float, heads: int, kv: int, dim: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(hf_layer.input_layernorm.weight, eps)
        self.attention = Attention(hf_layer.self_attn, heads, kv, dim)
        self.mlp_norm = RMSNorm(hf_layer.post_attention_layernorm.weight, eps)
        mlp = hf_layer.mlp
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache, feed: Feed, layer: int
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache, feed, layer)
        m = self.mlp_norm(h)
        gate, up = project(m, [self.gate, self.up])
        return h + self.down(F.silu(gate) * up)


#: Tokens per row a cache holds at first; it doubles (up to its size) when a forward needs more.
_FIRST_CAPACITY = 256


@dataclass(frozen=True)
class Feed:
    """One forward's rows of the cache (``KVCache.begin``): where their new tokens go and
    which keys each new token sees."""

    rows: list[int]
    starts: list[int]  # each row's first new position
    span: slice | None  # the rows, when contiguous (their cache is a view, no copy)
    index: Tensor | None  # [b] the rows otherwise
    end: int  # one past the furthest position written
    mask: Tensor  # [b, 1, T, S'] which keys each query sees
    positions: Tensor  # [b, T]


class KVCache:
    """Keys and values [L, B, H_kv, S, D] and a length per row [B], for up to ``size`` tokens
    per row. Memory grows with use (capacity doubles, copying once), so an idle decoder or
    a short prompt does not hold the whole context."""

    def __init__(self, shape: tuple[int, int, int, int, int], dtype, device) -> None:
        layers, batch, kv_heads, size, head_dim = shape
        first = (layers, batch, kv_heads, min(size, _FIRST_CAPACITY), head_dim)
        self.keys = torch.zeros(first, dtype=dtype, device=device)
        self.values = torch.zeros(first, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        self.size = size

    def begin(self, count: int, rows: list[int]) -> Feed:
        """The feed of ``count`` new tokens to each of ``rows``, after their cached ones
        (the cache grows here if it must); lengths move only with ``advance``."""
        device = self.lengths.device
        first = rows[0]
        contiguous = rows == list(range(first, first + len(rows)))
        span = slice(first, first + len(rows)) if contiguous else None
        index = None if contiguous else torch.tensor(rows, device=device)  # [b]
        lengths = self.lengths[span] if contiguous else self.lengths[index]  # [b]
        positions = lengths[:, None] + torch.arange(count, device=device)  # [b, T]
        end = int(positions.max()) + 1
        if end > self.size:
            raise ValueError(f"context overflow: {end} tokens exceed the cache ({self.size})")
        if end > self.keys.shape[3]:
            self._grow(min(self.size, max(end, 2 * self.keys.shape[3])))
        keys_at = torch.arange(end, device=device)  # [S']
        mask = (keys_at[None, None, None, :] <= positions[:, None, :, None]).contiguous()
        return Feed(list(rows), lengths.tolist(), span, index, end, mask, positions)

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """The keys and values of every row at ``layer``: [B, H_kv, S, D] each (views)."""
        return self.keys[layer], self.values[layer]

    def advance(self, feed: Feed, counts: Tensor | int) -> None:
        """Grow the lengths of the feed's rows by ``counts`` (int or [b])."""
        if feed.span is not None:
            self.lengths[feed.span] += counts
        else:
            self.lengths[feed.index] += counts

    def _grow(self, capacity: int) -> None:
        """Reallocate keys and values for ``capacity`` tokens per row, keeping their content."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], capacity, old.shape[4]))
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)

    def write(self, layer: int, k: Tensor, v: Tensor, feed: Feed) -> tuple[Tensor, Tensor]:
        """Store k, v [b, H_kv, T, D] at the feed's new positions; return its rows' keys and
        values up to the furthest position written [b, H_kv, S', D] each."""
        count = k.shape[2]
        for i, (row, start) in enumerate(zip(feed.rows, feed.starts, strict=True)):
            self.keys[layer, row, :, start : start + count] = k[i]  # slices: no copy
            self.values[layer, row, :, start : start + count] = v[i]
        end = feed.end
        if feed.span is not None:  # a view: no copy
            return self.keys[layer, feed.span, :, :end], self.values[layer, feed.span, :, :end]
        keys = self.keys[layer, :, :, :end].index_select(0, feed.index)
        values = self.values[layer, :, :, :end].index_select(0, feed.index)
        return keys, values


class LeanModel(nn.Module):
    """A Qwen2/Llama decoder over a static per-row KV cache (see the module docstring)."""

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__()
        reason = unsupported_reason(hf_model)
        if reason is not None:
            raise ValueError(f"the lean backend does not support {reason}")
        if packing_available(hf_model):
            pack_linears(hf_model)  # same products, no per-call weight reorder
        config = hf_model.config.get_text_config()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.max_positions = config.max_position_embeddings
        self.vocab_size = config.vocab_size
        inner = hf_model.model
        eps = config.rms_norm_eps
        self.embed = inner.embed_tokens
        self.blocks = nn.ModuleList(
            NativeBlock(layer, eps, self.heads, self.kv_heads)
            if NativeBlock.kind(layer)
            else Block(layer, eps, self.heads, self.kv_heads, self.head_dim)
            for layer in inner.layers
        )
        self.norm = RMSNorm(inner.norm.weight, eps)
        self.lm_head = hf_model.lm_head
        theta = config.rope_parameters["rope_theta"]
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.inv_freq = (1.0 / (theta**exponents)).to(self.embed.weight.device)  # [D/2]
        self.dtype = self.embed.weight.dtype

    def new_cache(self, batch: int, size: int) -> KVCache:
        """An empty cache for ``batch`` rows of up to ``size`` tokens each."""
        shape = (len(self.blocks), batch, self.kv_heads, size, self.head_dim)
        return KVCache(shape, self.dtype, self.embed.weight.device)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, 1, T, D] for positions [B, T] (float32, then the model's dtype)."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, keep: int = 0) -> Tensor:
        """Feed tokens [B, T] to every row of the cache, after each row's cached ones; return
        float32 logits of the last ``keep`` positions [B, keep, V] (all T when keep = 0).
        Every row's length grows by T (``LeanBackend.append_ragged`` feeds chosen rows)."""
        feed = cache.begin(tokens.shape[1], list(range(tokens.shape[0])))
        x = self.hidden(tokens, cache, feed)
        if keep:
            x = x[:, -keep:]
        cache.advance(feed, tokens.shape[1])
        return self.logits(x)

    @torch.inference_mode()
    def hidden(self, tokens: Tensor, cache: KVCache, feed: Feed) -> Tensor:
        """Hidden states [b, T, E] after the last block; writes the feed's rows of the cache
        but leaves their lengths to the caller (``cache.advance``)."""
        rope = self.rope(feed.positions)
        x = self.embed(tokens)  # [b, T, E]
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, cache, feed, layer)
        return x

    @torch.inference_mode()
    def logits(self, x: Tensor) -> Tensor:
        """Float32 logits [..., V] of hidden states [..., E]."""
        return self.lm_head(self.norm(x)).float()


#: Cache size when the caller gives none: enough for long chats, 235 MB for the 1.5B verifier.
DEFAULT_CONTEXT = 8192


#: Rows fed more tokens than this get a forward of their own, so a prompt being prefilled
#: does not pad every decoding row to its length.
_SHARED_FORWARD_TOKENS = 16


#: Rows fed more than ``_SHARED_FORWARD_TOKENS`` share a forward with those at least this
#: fraction of the longest one's length: padding wastes at most a quarter of the forward.
_SHARED_LONG_FILL = 0.75


def _forward_groups(lengths: list[int]) -> list[list[int]]:
    """Which rows go in one forward: every row of at most ``_SHARED_FORWARD_TOKENS`` tokens
    together; longer ones (prompts being read) longest first, each with the following ones
    down to ``_SHARED_LONG_FILL`` of its length."""
    short = [i for i, n in enumerate(lengths) if n <= _SHARED_FORWARD_TOKENS]
    long = sorted(
        (i for i, n in enumerate(lengths) if n > _SHARED_FORWARD_TOKENS), key=lambda i: -lengths[i]
    )
    groups = [short] if short else []
    widths: list[int] = []
    for i in long:
        if widths and lengths[i] >= _SHARED_LONG_FILL * widths[-1]:
            groups[-1].append(i)
        else:
            groups.append([i])
            widths.append(lengths[i])
    return groups


class LeanBackend:
    """The Backend protocol over ``LeanModel``: ``slots`` rows, each with its own length.

    ``append``/``rollback`` act on row 0 by default (a batch of one);
    ``append_ragged`` feeds any rows at once, each its own number of tokens.
    """

    def __init__(self, model: LeanModel, batch: int = 1, context_length: int | None = None):
        self.model = model
        size = min(model.max_positions, context_length or DEFAULT_CONTEXT)
        self.cache = model.new_cache(batch, size)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def context_length(self) -> int:
        return self.cache.size

    @property
    def slots(self) -> int:
        """How many rows the cache holds."""
        return self.cache.lengths.shape[0]

    @property
    def device(self) -> torch.device:
        return self.cache.lengths.device

    def length_of(self, row: int) -> int:
        """Tokens cached in ``row``."""
        return int(self.cache.lengths[row])

    def append(self, token_ids, keep: int = 0, row: int = 0) -> Tensor:
        """Feed tokens to one row; float32 logits [keep or T, V]."""
        return self.append_ragged([list(token_ids)], [row], last_only=False, keep=keep)[0]

    def append_ragged(
        self,
        token_lists: list[list[int]],
        rows: list[int],
        last_only: bool = False,
        keep: int = 0,
    ) -> list[Tensor]:
        """Feed row ``rows[i]`` the tokens ``token_lists[i]`` after its cached ones, in as few
        forwards as padding allows (right-padded, then each row's length set to its real
        count, so padding is never seen); return each row's float32 logits [T_i, V], of its
        last ``keep`` tokens when keep > 0, or of its last token when ``last_only``."""
        if any(len(ids) == 0 for ids in token_lists):
            raise ValueError("append needs at least one token")
        groups = _forward_groups([len(ids) for ids in token_lists])
        out: list[Tensor | None] = [None] * len(token_lists)
        for group in groups:
            lists = [token_lists[i] for i in group]
            logits = self._forward_padded(lists, [rows[i] for i in group], last_only, keep)
            for i, rows_logits in zip(group, logits, strict=True):
                out[i] = rows_logits
        return out

    def _forward_padded(self, lists, rows, last_only, keep) -> list[Tensor]:
        """One forward of right-padded token lists over ``rows``."""
        width = max(len(ids) for ids in lists)
        device = self.cache.lengths.device
        padded = torch.zeros(len(lists), width, dtype=torch.long)
        for i, ids in enumerate(lists):
            padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        counts = torch.tensor([len(ids) for ids in lists], device=device)  # [b]
        feed = self.cache.begin(width, rows)
        x = self.model.hidden(padded.to(device), self.cache, feed)  # [b, T, E]
        self.cache.advance(feed, counts)
        lengths = counts.tolist()
        sizes = [1 if last_only else keep or n for n in lengths]
        at = [  # flat positions of each row's last ``size`` real tokens
            i * width + n - size + j
            for i, (n, size) in enumerate(zip(lengths, sizes, strict=True))
            for j in range(size)
        ]
        picked = x.reshape(-1, x.shape[-1])[torch.tensor(at, device=device)]  # [N, E]
        return list(self.model.logits(picked).split(sizes))  # b x [T_i, V]

    def rollback(self, length: int, row: int = 0) -> None:
        """Keep only the first ``length`` cached tokens of ``row``: O(1), nothing recomputed."""
        current = self.length_of(row)
        if not 0 <= length <= current:
            raise ValueError(f"rollback length must be in [0, {current}]; got {length}")
        self.cache.lengths[row] = length

    def reset(self, row: int | None = None) -> None:
        """Empty ``row`` (default: every row)."""
        if row is None:
            self.cache.lengths.zero_()
        else:
            self.cache.lengths[row] = 0

    def synchronize(self) -> None:
        synchronize(self.device)
