"""Any transformers causal LM as a backend: a DynamicCache, batch size 1.

The fallback for architectures the lean code (``lean``) does not implement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel


class TransformersBackend:
    """Backend over a transformers causal LM with a DynamicCache, batch size 1.

    Rollback needs full-attention layers (sliding-window layers roll back only within their window).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self._cache = DynamicCache(config=model.config)
        self._length = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size

    @property
    def context_length(self) -> int:
        return self.model.config.get_text_config().max_position_embeddings

    @property
    def length(self) -> int:
        return self._length

    def append(self, token_ids: Sequence[int] | torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Run one forward pass over `token_ids`; return float32 logits [T, V] (or of the last
        `keep` positions only: a long prefill then skips the LM head on the others)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.model.device).reshape(1, -1)
        count = ids.shape[1]  # ids: [1, T]
        if count == 0:
            raise ValueError("append needs at least one token")
        if self._length + count > self.context_length:
            raise ValueError(
                f"context overflow: {self._length} cached + {count} new tokens exceed "
                f"context_length {self.context_length}"
            )
        positions = torch.arange(self._length, self._length + count, device=ids.device)[None]
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=keep,
            )
        self._length += count
        return out.logits[0].float()  # [T, V]

    def rollback(self, length: int) -> None:
        """Drop cached tokens after the first `length`, without recomputing anything."""
        if not 0 <= length <= self._length:
            raise ValueError(f"rollback length must be in [0, {self._length}]; got {length}")
        if length < self._length:
            self._cache.crop(length - self._length)  # transformers 5.x: negative = tokens to drop
            self._length = length

    def reset(self) -> None:
        """Start over with an empty cache."""
        self._cache = DynamicCache(config=self.model.config)
        self._length = 0
