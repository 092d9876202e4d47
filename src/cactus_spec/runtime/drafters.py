"""Where draft tokens come from.

A drafter sees the whole token context (prompt and output so far) and proposes
up to K next tokens, with their draft distributions ``p`` [K, V] when it samples
them, or ``None`` when its drafts are deterministic (``p`` one-hot). A model drafter
proposes a draft tree when asked for ``branches`` > 1: up to that many nodes at each depth,
the candidates of a node drawn from p without replacement, the nodes of the next depth given
to the likeliest paths (``tree_widths``; ``core.tree_verification`` judges them). The engine
knows drafters only through ``Drafter``; a new drafter (layer skipping, trained
heads) is a new class (here, or anywhere) registered by name (``drafting``), with no change
to the decode loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from cactus_spec.backends.base import Backend, read_in_pieces
from cactus_spec.core.sampling import SamplingConfig, draw, logits_to_probs
from cactus_spec.core.tree_verification import ROOT, TokenTree, path_to, sample_distinct
from cactus_spec.runtime.prefixes import common_prefix_length


@dataclass(frozen=True)
class Draft:
    """``tokens``: the proposed ids; ``probs`` [len(tokens), V] (row j: the draft's row token j
    was drawn from) or None (one-hot); ``parents``: a draft tree's parent of each token
    (``TokenTree``), None for a chain."""

    tokens: list[int]
    probs: Tensor | None
    parents: tuple[int, ...] | None = None

    @property
    def depth(self) -> int:
        """The positions drafted: a chain's length, a tree's longest path."""
        return len(self.tokens) if self.parents is None else self.tree.depth()

    @property
    def tree(self) -> TokenTree:
        """The draft as a token tree (a chain's parents are its previous tokens)."""
        if self.parents is None:
            return TokenTree.chain(self.tokens)
        return TokenTree(tuple(self.tokens), self.parents)


@dataclass(frozen=True)
class DraftRequest:
    """One row's ask: up to ``num_draft_tokens`` tokens after ``context``, drawn with
    ``generator`` from ``process(logits [1, V], drafts so far)`` (the row's penalties and
    sampling; default: ``sampling`` alone). ``keep_drafting(confidences)``, given the draft's
    probability of each token it drew so far, says whether to draw another (default:
    always, up to ``num_draft_tokens``). ``branches`` > 1 asks for a draft tree of depth
    ``num_draft_tokens`` with up to ``branches`` nodes at each depth (``tree_widths``).
    ``allowed(drafts so far)`` is the [V] bool mask of the tokens the row's grammar allows
    next (None: any), which ranks a greedy tree's runners-up among allowed tokens only."""

    row: int  # the sequence's slot: a stateful drafter keeps a cache per row
    context: Sequence[int]
    num_draft_tokens: int
    sampling: SamplingConfig
    generator: torch.Generator
    process: Callable[[Tensor, Sequence[int]], Tensor] | None = None
    keep_drafting: Callable[[Sequence[float]], bool] | None = None
    branches: int = 1
    allowed: Callable[[Sequence[int]], Tensor | None] | None = None

    def probs(self, logits: Tensor, drafted: Sequence[int]) -> Tensor:
        """p [1, V] of the next draft after ``drafted``."""
        if self.process is None:
            return logits_to_probs(logits, self.sampling)
        return self.process(logits, drafted)


class Drafter(Protocol):
    """Proposes continuations of token contexts, for several rows at once.

    ``backend`` is the draft model's (None for a drafter without a model): the engine times
    one draft step on it to seed the serving policy's costs.
    """

    @property
    def backend(self) -> Backend | None: ...

    def reset(self, row: int | None = None) -> None:
        """Forget any state from an earlier sequence in ``row`` (default: every row)."""

    def start(self, row: int, prompt: Sequence[int], reuse: bool) -> int:
        """A new sequence begins in ``row`` with ``prompt``: keep what its state shares with
        the prompt when ``reuse`` (prefix caching), else forget it; the prompt tokens kept."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """For each request, up to its ``num_draft_tokens`` tokens that may follow its
        context."""

    def behind(self, row: int, context: Sequence[int]) -> int:
        """Tokens of ``context`` the drafter would read before drafting for ``row`` again."""

    def catch_up(
        self, rows: Sequence[int], contexts: Sequence[Sequence[int]], budget: int | None
    ) -> int:
        """Read what each row has not seen of its context but the last token (which its next
        proposal reads), in the rows' order and at most ``budget`` tokens in all (None:
        every one), so the next proposal reads little; the tokens read."""


class ModelDrafter:
    """Drafts by sampling K tokens from a small language model on its own KV cache.

    Each row's cache keeps the longest prefix it shares with the row's new context (it is
    rolled back after a rejection, never recomputed), then catches up on the tokens it has
    not seen in the first of its K forward passes: the corrected token, or the last draft
    and the bonus token after a fully accepted block, or, the first time (or after
    iterations that drafted nothing), the prompt and everything since, unless ``catch_up``
    read those before, in budgeted pieces between iterations (a server's rows do not wait
    for one drafter's long read). Reading a prompt only when a row is about to draft means
    a row that never drafts costs the draft model nothing; a new prompt keeps the prefix it
    shares with the row's last sequence (prefix caching, ``start``). Every draft step is one
    forward over all rows still drafting; each row draws from its own generator, in the same order
    as alone. ``head``: the ids a truncated LM head keeps (``loading.head_vocab``); the
    draft then proposes only those.

    A draft tree is drafted depth by depth, every node of a depth in one forward of the
    backend's token-tree attention (``Backend.append_tree``), K forwards in all as for a
    chain; each depth's ``branches`` nodes go to the frontier's likeliest continuations
    (``tree_widths``), decided before they are drawn. The fed nodes stay in the cache as a
    tree until the next proposal, which keeps the path the verifier accepted
    (``Backend.commit_path``).
    """

    def __init__(self, backend: Backend, vocab_size: int, head: Tensor | None = None) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.head = head  # [N] the ids a truncated head's logits stand for; None: all
        self._head_ids = [] if head is None else head.tolist()  # the same, for one id at a time
        self._cached: dict[int, list[int]] = {}  # row -> the tokens its cache holds
        self._trees: dict[int, TokenTree] = {}  # row -> the draft tree its cache holds

    def reset(self, row: int | None = None) -> None:
        self.backend.reset(row)
        if row is None:
            self._cached, self._trees = {}, {}
        else:
            self._cached.pop(row, None)
            self._trees.pop(row, None)

    def start(self, row: int, prompt: Sequence[int], reuse: bool) -> int:
        cached = self._cached.get(row, []) if reuse else []
        self._trees.pop(row, None)  # the rollback drops it from the cache
        keep = _kept(cached, prompt)
        self.backend.rollback(keep, row)
        self._cached[row] = list(prompt[:keep])
        return keep

    def behind(self, row: int, context: Sequence[int]) -> int:
        """The tokens the row's next proposal feeds before it drafts: those of ``context``
        after the prefix the row's cache holds (its own drafts that the context kept, a
        pending tree's kept path included, are not read again)."""
        held, _ = self._held(row, context)
        return len(context) - _kept(held, context)

    def catch_up(
        self, rows: Sequence[int], contexts: Sequence[Sequence[int]], budget: int | None
    ) -> int:
        """Read what the rows' caches lack of their contexts but the last token, at most
        ``budget`` tokens in all, the rows together (``read_in_pieces``)."""
        pieces: list[list[int]] = []
        left = budget
        for row, context in zip(rows, contexts, strict=True):
            unread = self._unread(row, context)[:-1]
            take = unread if left is None else unread[:left]
            pieces.append(take)
            self._cached[row] += take
            left = None if left is None else left - len(take)
        read_in_pieces(self.backend, pieces, rows)
        return sum(len(piece) for piece in pieces)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Each request's draft, shaped by its own ``branches``: the chains drafted together,
        the trees together, so a row drafts what it drafts alone whatever its neighbours ask
        (a chain beside a tree is still a chain, drawn as alone)."""
        shapes = (
            [i for i, r in enumerate(requests) if r.branches == 1],
            [i for i, r in enumerate(requests) if r.branches > 1],
        )
        drafts: list[Draft | None] = [None] * len(requests)
        for shape, draft in zip(shapes, (self._propose_chains, self._propose_trees), strict=True):
            if shape:
                for i, d in zip(shape, draft([requests[i] for i in shape]), strict=True):
                    drafts[i] = d
        return drafts  # type: ignore[return-value]  # every request is in one shape

    def _propose_chains(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Every request's chain, one draft step over the rows still drafting at a time; a
        row drafted on the head keeps its p over the head's ids until its chain is drawn,
        then all its rows are placed at once (``_chain_rows``)."""
        pending = [self._unread(r.row, r.context) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        rows: list[list[Tensor]] = [[] for _ in requests]
        confidences: list[list[float]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.num_draft_tokens > 0]
        while active:
            feeds = [pending[i] for i in active]
            rows_fed = [requests[i].row for i in active]
            logits = self.backend.append_ragged(feeds, rows_fed, last_only=True)
            asked = [requests[i] for i in active]
            last = [row_logits[-1:] for row_logits in logits]  # [1, N] each
            step = self._next_probs(asked, [tokens[i] for i in active], last)
            for i, probs in zip(active, step, strict=True):
                token, confidence = self._draw(probs, requests[i])
                rows[i].append(probs)
                tokens[i].append(token)
                confidences[i].append(confidence)
                pending[i] = [token]
            active = [i for i in active if _drafts_more(requests[i], confidences[i])]
        drafts = []
        for request, drafted, drafted_rows in zip(requests, tokens, rows, strict=True):
            if drafted:  # the cache holds the context and every draft but the last
                self._cached[request.row] = list(request.context) + drafted[:-1]
            drafts.append(Draft(drafted, self._chain_rows(request, drafted_rows)))
        return drafts

    def _propose_trees(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Every request's draft tree, depth by depth."""
        pending = [self._unread(r.row, r.context) for r in requests]
        logits = self.backend.append_ragged(pending, [r.row for r in requests], last_only=True)
        trees = [_Growing(r) for r in requests]
        for tree, row_logits in zip(trees, logits, strict=True):
            tree.see(ROOT, self._full_row(row_logits))
        for depth in range(max(r.num_draft_tokens for r in requests)):
            growing = [t for t in trees if depth < t.request.num_draft_tokens and t.frontier]
            fresh = [(t, t.grow()) for t in growing]
            fed = [(t, nodes) for t, nodes in fresh if depth + 1 < t.request.num_draft_tokens]
            for t, _ in fed:
                t.fed = len(t.tokens)  # every node so far: each depth is read whole
            self._read_nodes([(t, nodes) for t, nodes in fed if nodes])
        for t, r in zip(trees, requests, strict=True):
            self._cached[r.row] = list(r.context)
            self._trees[r.row] = TokenTree(tuple(t.tokens[: t.fed]), tuple(t.parents[: t.fed]))
        return [t.draft() for t in trees]

    def _read_nodes(self, fed: list[tuple[_Growing, list[int]]]) -> None:
        """Feed each growing tree its newest nodes (one forward of token-tree attention) and
        set their rows as the trees' frontiers."""
        if not fed:
            return
        logits = self.backend.append_tree(
            [[t.tokens[j] for j in nodes] for t, nodes in fed],
            [[t.parents[j] for j in nodes] for t, nodes in fed],
            [t.request.row for t, _ in fed],
        )
        for (t, nodes), node_logits in zip(fed, logits, strict=True):
            for i, j in enumerate(nodes):
                t.see(j, self._full_row(node_logits[i : i + 1]))

    def _next_probs(
        self, requests: Sequence[DraftRequest], drafted: Sequence[list[int]], logits: list[Tensor]
    ) -> list[Tensor]:
        """p of each request's next draft from its head's logits [1, N]: [1, N] over the
        head's ids for a request drafted on the head (``_on_head``), else [1, V]. Rows drafted
        on the head at one sampling config are processed together, on the head's logits (the
        distribution the config gives the whole vocabulary with -inf off the head, ties
        broken alike since the head's ids ascend); the others alone over the whole
        vocabulary. Each row's p has the bits it has alone."""
        out: list[Tensor | None] = [None] * len(requests)
        together: dict[SamplingConfig, list[int]] = {}
        for j, r in enumerate(requests):
            if self._on_head(r):
                together.setdefault(r.sampling, []).append(j)
            else:
                out[j] = r.probs(self._full_row(logits[j]), drafted[j])
        for sampling, members in together.items():
            head_logits = torch.cat([logits[j][:, : self._width] for j in members])  # [A, N]
            probs = logits_to_probs(head_logits, sampling)  # [A, N]
            for a, j in enumerate(members):
                out[j] = probs[a : a + 1]
        return out  # type: ignore[return-value]  # every row is in one of the two

    def _draw(self, probs: Tensor, request: DraftRequest) -> tuple[int, float]:
        """One token and its probability from ``_next_probs``'s p for ``request``, drawn over
        the head's ids where the head is truncated: p is 0 off the head and the head's ids
        ascend, so an inverse-CDF draw (or an argmax) over the head's columns adds the same
        masses in the same order and picks the same token, at N / V of the cost."""
        greedy, generator = request.sampling.greedy, request.generator
        if self.head is None:
            token = draw(probs, greedy, generator)
            return token, float(probs[0, token])
        if not self._on_head(request):
            probs = probs[:, self.head]  # [1, N]
        at = draw(probs, greedy, generator)
        return self._head_ids[at], float(probs[0, at])

    def _on_head(self, request: DraftRequest) -> bool:
        """Whether the request's p is drafted over the head's ids: it only samples (no
        ``process``) by a config that gives the head's logits the distribution it gives the
        whole vocabulary's with -inf off the head (any config for a whole head)."""
        if request.process is not None:
            return False
        sampling = request.sampling
        return self.head is None or sampling.greedy or 0 < sampling.top_k < self._width

    @property
    def _width(self) -> int:
        """N, the tokens the head's logits stand for."""
        return self.vocab_size if self.head is None else len(self.head)

    def _chain_rows(self, request: DraftRequest, rows: list[Tensor]) -> Tensor | None:
        """A chain's p rows [K, V] over the vocabulary, from ``_next_probs``'s (a cut
        head's [1, N] placed at its ids, 0 elsewhere); None for no rows."""
        if not rows:
            return None
        probs = torch.cat(rows)  # [K, N or V]
        if self.head is None or not self._on_head(request):
            return probs
        placed = probs.new_zeros((probs.shape[0], self.vocab_size))  # [K, V]
        return placed.index_copy_(1, self.head, probs)

    def _full_row(self, logits: Tensor) -> Tensor:
        """Logits [1, V] over the whole vocabulary: a truncated head's [1, N] placed at its
        ids, -inf elsewhere (p is 0 there)."""
        if self.head is None:
            return logits[:, : self.vocab_size]
        row = logits.new_full((1, self.vocab_size), float("-inf"))  # [1, V]
        return row.index_copy_(1, self.head, logits)

    def _unread(self, row: int, context: Sequence[int]) -> list[int]:
        """Roll the row's cache back to what it shares with the context; the tokens to feed."""
        cached = self._keep_tree_path(row, context)
        keep = _kept(cached, context)
        self.backend.rollback(keep, row)
        self._cached[row] = list(context[:keep])
        return list(context[keep:])

    def _keep_tree_path(self, row: int, context: Sequence[int]) -> list[int]:
        """The tokens the row's cache holds, after keeping the path of its draft tree (if it
        holds one) that the context continues with; the rest of the tree is dropped."""
        held, path = self._held(row, context)
        if self._trees.pop(row, None) is not None:
            self.backend.commit_path(path, row)
        return held

    def _held(self, row: int, context: Sequence[int]) -> tuple[list[int], list[int]]:
        """The tokens the row's cache holds for ``context``: its cached tokens, then the nodes
        of its pending draft tree (if any) that the context continues them with; and that
        path of nodes."""
        cached = self._cached.get(row, [])
        tree = self._trees.get(row)
        path: list[int] = []
        if tree is None or common_prefix_length(cached, context) < len(cached):
            return cached, path
        for token in context[len(cached) :]:
            kids = tree.children[path[-1] if path else ROOT]
            match = [j for j in kids if tree.tokens[j] == token]
            if not match:
                break
            path.append(match[0])
        return [*cached, *(tree.tokens[j] for j in path)], path


def _kept(held: Sequence[int], context: Sequence[int]) -> int:
    """The tokens of a cache holding ``held`` that a proposal after ``context`` keeps: their
    common prefix, short of the context's last token (a proposal always feeds one)."""
    return min(common_prefix_length(held, context), len(context) - 1)


class _Growing:
    """A draft tree being drafted for one request: its nodes, the draft's row each was drawn
    from, each node's path value (the draft's probability of its path) and its frontier (the
    newest nodes, with the draft's logits, row and scores after each)."""

    def __init__(self, request: DraftRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.rows: list[Tensor] = []  # [1, V] each
        self.values: dict[int, float] = {ROOT: 1.0}
        self.frontier: list[tuple[int, Tensor, Tensor]] = []  # node, p, scores [1, V] each
        self.fed = 0  # nodes the draft's cache has read

    def see(self, node: int, logits: Tensor) -> None:
        """Add ``node`` to the frontier with the draft's logits [1, V] after it. Its scores
        are p, or at temperature 0 (p one-hot) the draft's softmax over the tokens the
        row's grammar allows, which ranks its runners-up."""
        path = self.path_tokens(node)
        probs = self.request.probs(logits, path)  # [1, V]
        scores = probs  # [1, V]
        if self.request.sampling.greedy:
            scores = torch.softmax(logits.float(), dim=-1)  # [1, V]
            allowed = None if self.request.allowed is None else self.request.allowed(path)
            if allowed is not None:
                scores = scores * allowed.to(scores.device)  # [1, V]
        self.frontier.append((node, probs, scores))

    def grow(self) -> list[int]:
        """Draw the children of the frontier's nodes, ``tree_widths`` of them each; the new
        nodes."""
        values = [self.values[node] for node, *_ in self.frontier]
        scores = torch.cat([s for *_, s in self.frontier])  # [F, V]
        widths = tree_widths(values, scores, self.request.branches)
        fresh = []
        for (node, probs, score), width in zip(self.frontier, widths, strict=True):
            for token in self._children(probs[0], score[0], width):
                fresh.append(len(self.tokens))
                self.values[fresh[-1]] = self.values[node] * float(score[0, token])
                self.tokens.append(token)
                self.parents.append(node)
                self.rows.append(probs)
        self.frontier = []
        return fresh

    def _children(self, probs: Tensor, scores: Tensor, width: int) -> list[int]:
        """``width`` distinct tokens drawn from p [V]; at temperature 0 (p one-hot) its mode,
        then the next most likely by the draft's softmax ``scores`` [V] (greedy verification
        keeps a child only if it is the verifier's choice: any candidate is exact)."""
        if width == 0:
            return []
        if not self.request.sampling.greedy:
            return sample_distinct(probs, width, self.request.generator, greedy=False)
        mode = int(probs.argmax())
        ranked = scores.topk(min(width + 1, scores.shape[-1])).indices.tolist()
        return [mode, *(t for t in ranked if t != mode)][:width]

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root's child down to ``node``."""
        return [self.tokens[j] for j in path_to(self.parents, node)]

    def draft(self) -> Draft:
        probs = torch.cat(self.rows) if self.rows else None  # [N, V]
        return Draft(self.tokens, probs, tuple(self.parents))


def tree_widths(values: Sequence[float], scores: Tensor, budget: int) -> list[int]:
    """How many children each frontier node gets: the ``budget`` largest gains
    v_f * s_f(j) over frontier nodes f and ranks j, where v_f is f's path value and s_f(j)
    the j-th largest of its scores [F, V] (a zero gain is never picked).

    The j-th child's gain estimates the chance that the verifier walks into it. The widths
    depend only on nodes already drawn and their rows, never on the children they admit, so
    each node's children are still drawn from p without replacement, as verification
    requires: the emitted law is unchanged by the shape (``core.tree_verification``)."""
    top = scores.topk(min(budget, scores.shape[-1]), dim=-1).values  # [F, b]
    gains = (torch.tensor(values, dtype=top.dtype, device=top.device)[:, None] * top).flatten()
    picked = gains.topk(min(budget, gains.numel())).indices  # [b]
    picked = picked[gains[picked] > 0]
    return torch.bincount(picked // top.shape[1], minlength=len(values)).tolist()


def _drafts_more(request: DraftRequest, confidences: list[float]) -> bool:
    """Whether the row draws another draft: below its K, and its stopping rule agrees."""
    if len(confidences) >= request.num_draft_tokens:
        return False
    return request.keep_drafting is None or request.keep_drafting(confidences)


class StatelessDrafter:
    """A ``Drafter`` without a model or a cache: it reads the whole context at each proposal,
    so it has nothing to forget, keep or catch up on. A subclass defines ``propose``."""

    backend = None  # no draft model

    def reset(self, row: int | None = None) -> None:
        """Nothing to forget."""

    def start(self, row: int, prompt: Sequence[int], reuse: bool) -> int:
        """Nothing to keep."""
        return 0

    def behind(self, row: int, context: Sequence[int]) -> int:
        """Nothing to read: it looks at the whole context each time."""
        return 0

    def catch_up(
        self, rows: Sequence[int], contexts: Sequence[Sequence[int]], budget: int | None
    ) -> int:
        """Nothing to read."""
        return 0


class NGramDrafter(StatelessDrafter):
    """Prompt lookup: continue the latest earlier occurrence of the context's last n-gram.

    Tries n = max_ngram down to min_ngram and proposes the up to K tokens that
    followed the most recent earlier match. No model and no randomness, so the
    drafts are deterministic (p one-hot). Proposes nothing when nothing matches.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                "ngram sizes must satisfy 1 <= min_ngram <= max_ngram, "
                f"got min_ngram={min_ngram}, max_ngram={max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self.propose_one(r.context, r.num_draft_tokens) for r in requests]

    def propose_one(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens that followed the latest earlier match of the context's end."""
        if k < 1:
            return Draft([], None)
        ids = torch.as_tensor(context, dtype=torch.long)  # [L]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            start = latest_match(ids, n)
            if start is not None:
                return Draft(ids[start + n : start + n + k].tolist(), None)
        return Draft([], None)


def latest_match(ids: Tensor, n: int) -> int | None:
    """Start of the latest earlier occurrence of the last ``n`` tokens of ids [L] that
    is followed by at least one token, or None."""
    if ids.numel() <= n:
        return None
    windows = ids[:-1].unfold(0, n, 1)  # [L-n, n], every window followed by a token
    hits = (windows == ids[-n:]).all(-1).nonzero()  # [M, 1]
    return int(hits[-1]) if hits.numel() else None
