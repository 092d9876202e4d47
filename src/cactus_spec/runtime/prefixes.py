"""Prefix caching: a new prompt reuses the keys and values of the longest prefix a free row
still holds.

A row's cache keeps its content after its generation ends (only its length moves), so a free
row holds the keys and values of the last sequence decoded in it: its context up to the
row's cached length. A new prompt goes to the free row that shares the longest prefix with
it (the lowest row on a tie), the row is rolled back to that prefix, and only the rest of the
prompt is read, by the verifier and (when it first drafts) by the draft model. A multi-turn
chat that resends its history, or requests that share a system prompt, read only what is
new. Nothing is held beyond the rows themselves, so memory is bounded by ``max_batch``.

Exact: the reused keys and values are those of the same tokens at the same positions. A
fresh prefill computes them in a forward of another width, which changes them only by the
rounding of matrix products of another shape, as batching rows does (``stepper``).
"""

from __future__ import annotations

from collections.abc import Sequence

#: Tokens compared at once (a slice comparison, in C) before the one that differs is sought.
_CHUNK = 256


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists. Runs on every decode
    iteration for every drafting row (``ModelDrafter.behind``), over contexts of thousands of
    tokens: equal chunks are compared as slices when both are of one type (a list never
    equals a tuple), and only the chunk that differs token by token."""
    limit = min(len(a), len(b))
    start = 0
    if type(a) is type(b):
        while start + _CHUNK <= limit and a[start : start + _CHUNK] == b[start : start + _CHUNK]:
            start += _CHUNK
    return next((i for i in range(start, limit) if a[i] != b[i]), limit)


class PrefixCache:
    """Which tokens each row's cache holds, and the free row a prompt should take."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._contexts: dict[int, list[int]] = {}  # row -> the context its cache holds a prefix of

    def record(self, row: int, context: list[int]) -> None:
        """``row`` now decodes ``context`` (the generation's own list, which grows)."""
        self._contexts[row] = context

    def forget(self) -> None:
        """Another user of the caches (scoring, a calibration) overwrote every row."""
        self._contexts.clear()

    def held(self, row: int, length: int) -> list[int]:
        """The tokens at the first ``length`` positions of ``row``'s cache that are known:
        a row may hold drafts past its context, which are not."""
        context = self._contexts.get(row, []) if self.enabled else []
        return context[: min(length, len(context))]

    def choose(self, prompt: Sequence[int], free: Sequence[int], lengths: Sequence[int]) -> int:
        """The free row (``lengths[i]`` tokens cached in ``free[i]``) sharing the longest
        prefix with ``prompt``; the first of ``free`` on a tie or when caching is off."""
        if not self.enabled:
            return free[0]
        shared = [
            common_prefix_length(self.held(row, length), prompt)
            for row, length in zip(free, lengths, strict=True)
        ]
        return free[max(range(len(free)), key=lambda i: (shared[i], -i))]
