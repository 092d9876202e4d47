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

A row may also hold a token tree (``LeanBackend.append_tree``): N nodes after its L cached
tokens, in slots L .. L + N - 1 in feeding order, node n at rotary position L + depth(n)
and attending to slots 0 .. L - 1 and to its ancestors' and its own (a mask, not the causal
one), so each node gets the logits of its root-to-node path. ``commit_path`` moves one
path's keys and values to slots L, L + 1, ... and drops the rest; the length counts cached
tokens only, so a tree never moves it until then.

Weights are the Hugging Face model's own tensors (shared, not copied); a bfloat16 model on
the CPU first has its linear layers repacked, in place, for the native AMX kernel or for
oneDNN (``packed``). Int8 layers that read the same input (q, k, v; gate, up) share its row
scaling (``quant.project``); a block whose layers are all native int8, all native
int4 or all native bfloat16 runs as one native call (``native_block``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from cactus_spec.backends.base import synchronize
from cactus_spec.backends.native_block import NativeBlock, NativeStack
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
#: SDPA's CPU kernel pays a fixed cost per row and head that dominates short queries; longer
#: ones (prefill) take SDPA.
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

    def __init__(self, hf_attention: Any, heads: int, kv_heads: int, head_dim: int) -> None:
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

    def __init__(self, hf_layer: Any, eps: float, heads: int, kv: int, dim: int) -> None:
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
    """One forward's rows of the cache (``KVCache.begin``, ``KVCache.begin_tree``): where
    their new tokens go and which keys each new token sees."""

    rows: list[int]
    starts: list[int]  # each row's first new slot
    span: slice | None  # the rows, when contiguous (their cache is a view, no copy)
    index: Tensor | None  # [b] the rows otherwise
    end: int  # one past the furthest slot written
    positions: Tensor  # [b, T] rotary positions
    tree_mask: Tensor | None = None  # [b, 1, T, S'] a token tree's keys seen; None: causal

    @property
    def causal(self) -> bool:
        """Whether each query sees the slots up to its own (a native block needs no mask)."""
        return self.tree_mask is None

    @functools.cached_property
    def mask(self) -> Tensor:
        """[b, 1, T, S'] which keys each query sees: the tree's, or the slots up to the
        query's own; made when first asked (a native forward never asks for a causal one)."""
        if self.tree_mask is not None:
            return self.tree_mask
        keys_at = torch.arange(self.end, device=self.positions.device)  # [S']
        return (keys_at[None, None, None, :] <= self.positions[:, None, :, None]).contiguous()


@dataclass(frozen=True)
class PendingTree:
    """The tree nodes a row holds after its cached tokens, in feeding order (node n in slot
    L + n, L the row's length): each node's parent (-1: it follows the cached tokens), its
    depth (0 for those; its rotary position is L + depth) and its line, the nodes from its
    root down to itself (the tree slots it sees)."""

    parents: tuple[int, ...] = ()
    depths: tuple[int, ...] = ()
    lines: tuple[tuple[int, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.parents)

    def grown(self, parents: list[int]) -> PendingTree:
        """This tree with new nodes of the given parents (indices among all its nodes)."""
        tree_parents, depths, lines = list(self.parents), list(self.depths), list(self.lines)
        for parent in parents:
            node = len(tree_parents)
            if not -1 <= parent < node:
                raise ValueError(f"tree node {node}'s parent must be in [-1, {node}); got {parent}")
            tree_parents.append(parent)
            depths.append(0 if parent < 0 else depths[parent] + 1)
            lines.append((lines[parent] if parent >= 0 else ()) + (node,))
        return PendingTree(tuple(tree_parents), tuple(depths), tuple(lines))

    def feed(self, length: int, count: int, width: int) -> tuple[list[int], list[list[int]]]:
        """The rotary positions of this tree's last ``count`` nodes after ``length`` cached
        tokens and the tree slots each one sees, right-padded to ``width`` queries (a
        padding query, at position 0, sees its own slot only)."""
        first = len(self) - count
        positions = [length + depth for depth in self.depths[first:]] + [0] * (width - count)
        slots = [[length + node for node in self.lines[first + t]] for t in range(count)]
        slots += [[length + first + t] for t in range(count, width)]
        return positions, slots

    def check_path(self, path: list[int]) -> None:
        """Raise ValueError unless ``path`` is a chain of this tree's nodes from a root."""
        if path and (not 0 <= path[-1] < len(self) or list(self.lines[path[-1]]) != path):
            raise ValueError(
                f"path must be a chain of tree nodes from a root (the tree holds {len(self)} "
                f"nodes); got {path}"
            )


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
        span, index, lengths = self._rows(rows)
        starts = lengths.tolist()
        end = max(starts) + count
        self._reserve(end)
        positions = lengths[:, None] + torch.arange(count, device=lengths.device)  # [b, T]
        return Feed(list(rows), starts, span, index, end, positions)

    def begin_tree(self, rows: list[int], trees: list[PendingTree], counts: list[int]) -> Feed:
        """The feed of the last ``counts[i]`` nodes of ``trees[i]`` to ``rows[i]``, right-padded
        to the largest count: node n of a row of length L goes to slot L + n, at rotary
        position L + depth(n), and sees slots 0 .. L - 1 and those of its line; a padding
        token sees slots 0 .. L - 1 and its own. Lengths do not move."""
        device = self.lengths.device
        span, index, lengths = self._rows(rows)
        width, cached = max(counts), lengths.tolist()
        starts = [n + len(tree) - c for n, tree, c in zip(cached, trees, counts, strict=True)]
        end = max(starts) + width
        self._reserve(end)
        places, seen = [], []  # rotary positions [b][T]; (row, query, slot) of the tree keys seen
        for i, (length, tree, count) in enumerate(zip(cached, trees, counts, strict=True)):
            row_places, slots = tree.feed(length, count, width)
            places.append(row_places)
            seen += [(i, t, slot) for t, query_slots in enumerate(slots) for slot in query_slots]
        keys_at = torch.arange(end, device=device)  # [S']
        mask = (keys_at[None, None, :] < lengths[:, None, None]).repeat(1, width, 1)  # [b, T, S']
        mask[tuple(torch.tensor(seen, device=device).T)] = True
        positions = torch.tensor(places, device=device)  # [b, T]
        return Feed(list(rows), starts, span, index, end, positions, mask[:, None])

    def _rows(self, rows: list[int]) -> tuple[slice | None, Tensor | None, Tensor]:
        """``rows`` as a slice (when contiguous) or an index [b], and their lengths [b]."""
        first = rows[0]
        if rows == list(range(first, first + len(rows))):
            span = slice(first, first + len(rows))
            return span, None, self.lengths[span]
        index = torch.tensor(rows, device=self.lengths.device)  # [b]
        return None, index, self.lengths[index]

    def _reserve(self, end: int) -> None:
        """Make room for ``end`` tokens per row (growing the cache), or raise if it cannot."""
        if end > self.size:
            raise ValueError(f"context overflow: {end} tokens exceed the cache ({self.size})")
        if end > self.keys.shape[3]:
            self._grow(min(self.size, max(end, 2 * self.keys.shape[3])))

    def move(self, row: int, sources: list[int], first: int) -> None:
        """Copy the keys and values (every layer) of ``row`` at slots ``sources`` to slots
        ``first``, ``first + 1``, ... (all read before any is written)."""
        at = torch.tensor(sources, device=self.lengths.device)  # [n]
        for cache in (self.keys, self.values):  # [L, B, H_kv, S, D]
            cache[:, row, :, first : first + len(sources)] = cache[:, row].index_select(2, at)

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
        assert feed.index is not None  # a feed's rows are a span or an index
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
        self.stack = NativeStack.of(list(self.blocks))  # None unless every block is native
        self.norm = RMSNorm(inner.norm.weight, eps)
        self.lm_head = hf_model.lm_head
        theta = config.rope_parameters["rope_theta"]
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.inv_freq = (1.0 / (theta**exponents)).to(self.embed.weight.device)  # [D/2]
        self.dtype = self.embed.weight.dtype

    @property
    def native(self) -> bool:
        """Whether every block runs as one native call (``NativeBlock``), which reads a cache
        of any float dtype (a Python block's attention needs the model's)."""
        return all(isinstance(block, NativeBlock) for block in self.blocks)

    def new_cache(self, batch: int, size: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for ``batch`` rows of up to ``size`` tokens each, in ``dtype``
        (None: the model's; another only where the model is ``native``)."""
        if dtype is not None and dtype != self.dtype and not self.native:
            raise ValueError(f"a cache in {dtype} needs native blocks; the model's is {self.dtype}")
        shape = (len(self.blocks), batch, self.kv_heads, size, self.head_dim)
        return KVCache(shape, dtype or self.dtype, self.embed.weight.device)

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
        if self.stack is not None:
            return self.stack(x, rope, cache, feed)
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


def _forward_groups(lengths: list[int], rooms: list[int]) -> list[list[int]]:
    """Which rows go in one forward: every row of at most ``_SHARED_FORWARD_TOKENS`` tokens
    together (one read of the weights), unless padding them to the widest would more than
    double the forward's tokens: then the rows fed one token (decoding without drafts) go in
    a forward of their own (AMX, int8 1.5B, 8 rows after 150 tokens: one row's 11 and seven
    rows' 1 padded to 8 x 11 took 352 ms, as much as 8 x 11, apart 100 + 96 ms); longer ones
    (prompts being read) longest first, each with the following ones down to
    ``_SHARED_LONG_FILL`` of its length. A row with fewer free slots (``rooms``) than its
    group's width goes alone: padding it to the width would write past its cache's end."""
    groups = []
    for group in _by_width(lengths):
        width = max(lengths[i] for i in group)
        fits = [i for i in group if rooms[i] >= width]
        groups += ([fits] if fits else []) + [[i] for i in group if rooms[i] < width]
    return groups


def _short_groups(short: list[int], lengths: list[int]) -> list[list[int]]:
    """The rows of at most ``_SHARED_FORWARD_TOKENS`` tokens in one forward, or, where padding
    would more than double its tokens, those fed more than one token and those fed one."""
    padded = len(short) * max(lengths[i] for i in short)
    if padded <= 2 * sum(lengths[i] for i in short):
        return [short]
    wide = [i for i in short if lengths[i] > 1]
    ones = [i for i in short if lengths[i] == 1]
    return [group for group in (wide, ones) if group]


def _by_width(lengths: list[int]) -> list[list[int]]:
    """``_forward_groups`` before the rows' rooms are considered."""
    short = [i for i, n in enumerate(lengths) if n <= _SHARED_FORWARD_TOKENS]
    long = sorted(
        (i for i, n in enumerate(lengths) if n > _SHARED_FORWARD_TOKENS), key=lambda i: -lengths[i]
    )
    groups = _short_groups(short, lengths) if short else []
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
    ``append_ragged`` feeds any rows at once, each its own number of tokens;
    ``append_tree`` feeds token trees, ``commit_path`` keeps one path of a row's tree.
    """

    #: Token trees are read in one forward (``append_tree``).
    reads_trees = True

    def __init__(
        self,
        model: LeanModel,
        batch: int = 1,
        context_length: int | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        size = min(model.max_positions, context_length or DEFAULT_CONTEXT)
        self.cache = model.new_cache(batch, size, cache_dtype)  # cache_dtype None: the model's
        self.trees = [PendingTree()] * batch  # each row's pending tree nodes

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
        for row in rows:
            self.trees[row] = PendingTree()
        cached = self.cache.lengths.tolist()
        rooms = [self.context_length - cached[row] for row in rows]
        groups = _forward_groups([len(ids) for ids in token_lists], rooms)
        out: list[Tensor | None] = [None] * len(token_lists)
        for group in groups:
            lists = [token_lists[i] for i in group]
            logits = self._forward_padded(lists, [rows[i] for i in group], last_only, keep)
            for i, rows_logits in zip(group, logits, strict=True):
                out[i] = rows_logits
        return out  # type: ignore[return-value]  # every row is in one group

    def _forward_padded(self, lists, rows, last_only, keep) -> list[Tensor]:
        """One forward of right-padded token lists over ``rows``."""
        lengths = [len(ids) for ids in lists]
        width = max(lengths)
        feed = self.cache.begin(width, rows)
        x = self.model.hidden(self._padded(lists, width), self.cache, feed)  # [b, T, E]
        even = min(lengths) == width  # no padding (a decode step): one count for every row
        device = self.cache.lengths.device
        self.cache.advance(feed, width if even else torch.tensor(lengths, device=device))
        return self._last_logits(x, lengths, [1 if last_only else keep or n for n in lengths])

    def _padded(self, lists: list[list[int]], width: int) -> Tensor:
        """The token lists right-padded with zeros to ``width``: [b, T] on the cache's device."""
        padded = [[*ids, *[0] * (width - len(ids))] for ids in lists]
        return torch.tensor(padded, dtype=torch.long, device=self.cache.lengths.device)

    def _last_logits(self, x: Tensor, lengths: list[int], sizes: list[int]) -> list[Tensor]:
        """Float32 logits of the last ``sizes[i]`` of the ``lengths[i]`` real tokens of each
        row of hidden states x [b, T, E]: b x [sizes[i], V]."""
        width = x.shape[1]
        if min(lengths) == width and min(sizes) == max(sizes):  # unpadded, one size: a slice
            picked = x[:, width - sizes[0] :].reshape(-1, x.shape[-1])  # [N, E]
        else:
            at = [  # flat positions of each row's last ``size`` real tokens
                i * width + n - size + j
                for i, (n, size) in enumerate(zip(lengths, sizes, strict=True))
                for j in range(size)
            ]
            picked = x.reshape(-1, x.shape[-1])[torch.tensor(at, device=x.device)]  # [N, E]
        return list(self.model.logits(picked).split(sizes))  # b x [T_i, V]

    def append_tree(
        self, token_lists: list[list[int]], parent_lists: list[list[int]], rows: list[int]
    ) -> list[Tensor]:
        """Feed row ``rows[i]`` the nodes ``token_lists[i]`` of a token tree, after its cached
        tokens and the tree nodes it already holds (fed since its last ``commit_path``,
        ``rollback``, ``reset`` or append). ``parent_lists[i][j]`` is the index of node j's
        parent among the row's tree nodes (earlier calls' nodes first, in feeding order, then
        this call's; a parent comes before its child), or -1 for a node that directly follows
        the cached tokens. Returns each row's float32 logits [N_i, V], one per new node, each
        what a plain append of the node's root-to-node path gives (up to float rounding).

        Node n of a row of length L sits in cache slot L + n at rotary position L + depth(n)
        and attends to slots 0 .. L - 1 and to its ancestors' and its own; rows are
        right-padded into as few forwards as ``append_ragged`` takes. Lengths do not move."""
        if not len(token_lists) == len(parent_lists) == len(rows) == len(set(rows)):
            raise ValueError("append_tree needs a token list and a parent list per distinct row")
        if any(len(ids) != len(ps) for ids, ps in zip(token_lists, parent_lists, strict=True)):
            raise ValueError("each token list needs a parent list of the same length")
        if any(len(ids) == 0 for ids in token_lists):
            raise ValueError("append_tree needs at least one node per row")
        trees = [self.trees[row].grown(ps) for row, ps in zip(rows, parent_lists, strict=True)]
        out: list[Tensor | None] = [None] * len(token_lists)
        held = [len(tree) - len(ids) for tree, ids in zip(trees, token_lists, strict=True)]
        rooms = [
            self.context_length - self.length_of(row) - n for row, n in zip(rows, held, strict=True)
        ]
        for group in _forward_groups([len(ids) for ids in token_lists], rooms):
            lists = [token_lists[i] for i in group]
            logits = self._forward_tree(lists, [rows[i] for i in group], [trees[i] for i in group])
            for i, rows_logits in zip(group, logits, strict=True):
                out[i] = rows_logits
        for row, tree in zip(rows, trees, strict=True):
            self.trees[row] = tree
        return out  # type: ignore[return-value]  # every row is in one group

    def _forward_tree(self, lists, rows, trees) -> list[Tensor]:
        """One forward of right-padded tree nodes ``lists`` (the last nodes of ``trees``)."""
        counts = [len(ids) for ids in lists]
        feed = self.cache.begin_tree(rows, trees, counts)
        x = self.model.hidden(self._padded(lists, max(counts)), self.cache, feed)  # [b, T, E]
        return self._last_logits(x, counts, counts)

    def commit_path(self, path: list[int], row: int = 0) -> None:
        """Keep the row's tree nodes ``path`` (feeding-order indices, a chain from a root) as
        the tokens following its cached ones: their keys and values move to slots L, L + 1,
        ... (L the row's length), which grows by len(path); drop every other tree node."""
        self.trees[row].check_path(path)
        length = self.length_of(row)
        if path:
            self.cache.move(row, [length + node for node in path], length)
            self.cache.lengths[row] = length + len(path)
        self.trees[row] = PendingTree()

    def rollback(self, length: int, row: int = 0) -> None:
        """Keep only the first ``length`` cached tokens of ``row``: O(1), nothing recomputed."""
        current = self.length_of(row)
        if not 0 <= length <= current:
            raise ValueError(f"rollback length must be in [0, {current}]; got {length}")
        self.cache.lengths[row] = length
        self.trees[row] = PendingTree()

    def reset(self, row: int | None = None) -> None:
        """Empty ``row`` (default: every row)."""
        if row is None:
            self.cache.lengths.zero_()
            self.trees = [PendingTree()] * self.slots
        else:
            self.cache.lengths[row] = 0
            self.trees[row] = PendingTree()

    def synchronize(self) -> None:
        synchronize(self.device)
