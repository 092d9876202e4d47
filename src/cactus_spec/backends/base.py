"""The backend protocol: a language model with a KV cache the engine can roll back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Backend(Protocol):
    """A sequence model with a KV cache that can be rolled back in O(1).

    The engine talks to models only through this: it never touches a transformers object.
    """

    #: Whether ``append_tree`` and ``commit_path`` work (token-tree attention).
    reads_trees: bool

    @property
    def vocab_size(self) -> int:
        """Width of the logits `append` returns."""

    @property
    def context_length(self) -> int:
        """Maximum number of tokens the cache can hold."""

    @property
    def slots(self) -> int:
        """How many rows (sequences) the cache holds, each with its own length."""

    @property
    def device(self) -> torch.device:
        """Where the model's weights and cache live."""

    def length_of(self, row: int) -> int:
        """Number of tokens currently in ``row`` of the cache."""

    def append(self, token_ids: Sequence[int] | torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Feed tokens to row 0 after the cached ones; return float32 logits of the last
        `keep` new positions (all T when keep = 0) [T or keep, V]."""

    def append_ragged(
        self,
        token_lists: list[list[int]],
        rows: list[int],
        last_only: bool = False,
        keep: int = 0,
    ) -> list[torch.Tensor]:
        """Feed row ``rows[i]`` the tokens ``token_lists[i]``, every row in one pass where the
        backend batches; return each row's float32 logits [T_i, V] (its last ``keep``, or its
        last one when ``last_only``)."""

    def append_tree(
        self, token_lists: list[list[int]], parent_lists: list[list[int]], rows: list[int]
    ) -> list[torch.Tensor]:
        """Feed row ``rows[i]`` the nodes ``token_lists[i]`` of a token tree, after its cached
        tokens and after the tree nodes it already holds (fed by earlier ``append_tree`` calls
        since its last ``commit_path``, rollback, reset or append). ``parent_lists[i][j]`` is
        the index of node j's parent among the row's tree nodes (earlier calls' nodes first,
        in feeding order, then this call's; a parent always comes before its child), or -1
        for a node that directly follows the cached tokens. Returns each row's float32 logits
        [N_i, V], one per new node, each equal (up to float rounding) to what a plain append
        of the node's root-to-node path gives. ``length_of`` counts cached tokens only."""

    def commit_path(self, path: list[int], row: int = 0) -> None:
        """Keep the row's tree nodes ``path`` (indices in feeding order; path[0]'s parent is
        -1 and each next node is a child of the one before) as the tokens following its
        cached ones (its length grows by len(path)); drop every other tree node. An empty
        path just drops the tree."""

    def rollback(self, length: int, row: int = 0) -> None:
        """Keep only the first `length` cached tokens of ``row`` (dropping its tree nodes)."""

    def reset(self, row: int | None = None) -> None:
        """Empty ``row``, or every row."""

    def synchronize(self) -> None:
        """Wait until queued work is done (CUDA runs asynchronously), so a timing is whole."""


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: CUDA runs asynchronously, a CPU does not."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: Most tokens a row reads in one forward: a forward's working memory grows with its tokens
#: (an [T, I] activation per layer), and the native products run no faster a token beyond a
#: few hundred rows (docs/RESULTS.md, "Prompt reads"); a longer read takes several.
PROMPT_PIECE = 256


def read_in_pieces(
    backend: Backend, token_lists: Sequence[Sequence[int]], rows: Sequence[int]
) -> None:
    """Feed ``rows[i]`` the tokens ``token_lists[i]`` (none of their logits wanted), at most
    ``PROMPT_PIECE`` a row a forward, the rows together."""
    longest = max((len(ids) for ids in token_lists), default=0)
    for first in range(0, longest, PROMPT_PIECE):
        pairs = zip(token_lists, rows, strict=True)
        part = [
            (list(ids[first : first + PROMPT_PIECE]), row) for ids, row in pairs if len(ids) > first
        ]
        backend.append_ragged([ids for ids, _ in part], [row for _, row in part], True)
