"""The backend protocol: a language model with a KV cache the engine can roll back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Backend(Protocol):
    """A sequence model with a KV cache that can be rolled back in O(1).

    The engine talks to models only through this: it never touches a transformers object.
    """

    @property
    def vocab_size(self) -> int:
        """Width of the logits `append` returns."""

    @property
    def context_length(self) -> int:
        """Maximum number of tokens the cache can hold."""

    @property
    def length(self) -> int:
        """Number of tokens currently in the cache."""

    def append(self, token_ids: Sequence[int] | torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Feed tokens after the cached ones; return float32 logits of the last `keep` new
        positions (all T when keep = 0) [T or keep, V]."""

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""

    def reset(self) -> None:
        """Empty the cache."""
