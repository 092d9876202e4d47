"""Any transformers causal LM as a backend: a DynamicCache, batch size 1.

The fallback for architectures the lean code (``lean``) does not implement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from cactus_spec.backends.base import synchronize


class TransformersBackend:
    """Backend over a transformers causal LM with a DynamicCache, batch size 1.

    Rollback needs full-attention layers (sliding-window layers roll back only within their window).
    """

    #: No token-tree attention here (``append_tree`` refuses).
    reads_trees = False

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
    def slots(self) -> int:
        """One row: a DynamicCache holds one sequence here."""
        return 1

    @property
    def device(self) -> torch.device:
        return self.model.device

    def length_of(self, row: int) -> int:
        _check_row(row)
        return self._length

    def append_ragged(
        self,
        token_lists: list[list[int]],
        rows: list[int],
        last_only: bool = False,
        keep: int = 0,
    ) -> list[torch.Tensor]:
        """``append`` for the one row (``rows == [0]``), in the batched interface's shape."""
        for row in rows:
            _check_row(row)
        (ids,) = token_lists
        return [self.append(ids, keep=1 if last_only else keep)]

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

    def rollback(self, length: int, row: int = 0) -> None:
        """Drop cached tokens after the first `length`, without recomputing anything."""
        _check_row(row)
        if not 0 <= length <= self._length:
            raise ValueError(f"rollback length must be in [0, {self._length}]; got {length}")
        if length < self._length:
            self._cache.crop(length - self._length)  # transformers 5.x: negative = tokens to drop
            self._length = length

    def reset(self, row: int | None = None) -> None:
        """Start over with an empty cache."""
        if row is not None:
            _check_row(row)
        self._cache = DynamicCache(config=self.model.config)
        self._length = 0

    def append_tree(
        self, token_lists: list[list[int]], parent_lists: list[list[int]], rows: list[int]
    ) -> list[torch.Tensor]:
        """Not here: a DynamicCache has no per-token mask to feed a token tree with."""
        raise NotImplementedError(_NO_TREES)

    def commit_path(self, path: list[int], row: int = 0) -> None:
        """Not here (see ``append_tree``)."""
        raise NotImplementedError(_NO_TREES)

    def synchronize(self) -> None:
        synchronize(self.device)


_NO_TREES = "token trees (append_tree, commit_path) need the lean backend"


def _check_row(row: int) -> None:
    if row != 0:
        raise ValueError(f"row must be 0 (the transformers backend holds one row), got {row}")
