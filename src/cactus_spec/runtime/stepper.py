"""One iteration over a batch of generations: draft, verify in ONE forward, keep, roll back.

Before its first iteration a generation is started in its row (``start``: the row keeps the
longest prefix its caches share with the prompt, ``prefixes``) and its prompt is read
(``prefill``: all but the last token, in chunks under a token budget if the caller wants,
prompts of similar lengths in one forward). Then, for B generations in rows r_1..r_B, an
iteration

1. asks the drafter for K_b tokens per row (one draft forward per step over the rows still
   drafting; K_b = 0 for an autoregressive row, or when the budget is spent);
2. feeds each row ``[t_b, d_b1..d_bK_b]`` (t_b = its last emitted token, not yet in the
   verifier's cache) in one verifier forward over all rows, ragged: K_b + 1 rows of q each;
3. judges each row's drafts by its row's kind (``verifications``: a chain, a block, a tree
   or a traversal, each with the row's rule, sampling and generator), so a row keeps a
   different number of tokens than its neighbours (ragged acceptance);
4. rolls each row's verifier cache back to its kept prefix (a length per row, O(1)).

A row verifying draft trees gets a tree from the drafter (up to ``branches`` nodes per depth),
and a chain row a chain, whatever its neighbours draft; when any row of the batch has a tree,
the verifier reads every row as a token tree (a chain is a tree; ``Backend.append_tree``), a
tree row's nodes are judged top down (``Tree``) or leaf to root (``Traversal``), a chain
row's as a chain, and each cache keeps its accepted path (``Backend.commit_path``). A
traversal row of one branch drafts a chain and judges it as a block (the same verifier on a
chain).

Every random draw of a row comes from its own generator in the same order as when it is
decoded alone, so a row decoded in a batch gives the tokens it gives alone (up to the
rounding of batched matrix products, which moves a draw only when a uniform lands within
rounding of a boundary).

A row's own failure (its grammar, its rule, its penalties: ``Generation.fail``) ends that row
only: its remaining work in the iteration is skipped, its cache drops what the iteration fed,
and its neighbours, whose draws never read it, go on as they would without the error.

The divergence meter adds, per row, the exact KL(step_law || q) of every emitted drafted
position (``audit``; on blocks and trees the law is the rule's target t, so KL(t || q)): an unbiased
estimate of the sequence-level KL(P_method || P_verifier).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cactus_spec.backends.base import Backend, read_in_pieces
from cactus_spec.core.audit import support
from cactus_spec.core.sampling import draw
from cactus_spec.core.tree_verification import ROOT
from cactus_spec.runtime.drafters import Draft, Drafter, DraftRequest
from cactus_spec.runtime.generation import Generation
from cactus_spec.runtime.prefixes import PrefixCache, common_prefix_length
from cactus_spec.runtime.verifications import path_rows

#: A row's stopping rule within an iteration: given the draft's probability of each token it
#: drew so far, whether to draw another.
Stopping = Callable[[Sequence[float]], bool]


@dataclass(frozen=True)
class StepTiming:
    """What one iteration cost: the draft steps over ``rows`` rows (their drafters first
    reading ``caught_up`` tokens of context they had not seen), one verifier forward over
    ``verified_tokens`` tokens in all, and ``host_s``, the rest of the iteration (processing
    the verifier's rows, judging, the meter, bookkeeping); and what it kept: per row, the
    draft's probability of each token it drafted (``confidences``; 1 for a deterministic
    drafter), how many of them were accepted (``kept``) and the row's
    ``Generation.acceptance_key`` (``keys``)."""

    rows: int
    draft_steps: int
    draft_s: float
    verified_tokens: int
    verify_s: float
    emitted: int
    caught_up: int = 0
    confidences: tuple[tuple[float, ...], ...] = ()
    kept: tuple[int, ...] = ()
    host_s: float = 0.0
    keys: tuple[Hashable, ...] = ()


class Stepper:
    """Advances generations that occupy rows of ``verifier`` (and of the drafter's model)."""

    def __init__(
        self,
        verifier: Backend,
        drafter: Drafter | None,
        vocab_size: int,
        prefixes: PrefixCache | None = None,
    ) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.prefixes = PrefixCache() if prefixes is None else prefixes

    def choose_row(self, prompt: Sequence[int], free: Sequence[int]) -> int:
        """The free row a new ``prompt`` should take: the one holding its longest prefix
        (``prefixes``), else the first."""
        lengths = [self.verifier.length_of(row) for row in free]
        return self.prefixes.choose(prompt, free, lengths)

    def start(self, generations: Sequence[Generation]) -> None:
        """Begin the generations in their rows: each row keeps the longest prefix its caches
        share with the prompt (prefix caching; none when it is off), and ``prefill`` reads
        the rest."""
        reuse = self.prefixes.enabled
        for g in generations:
            held = self.prefixes.held(g.row, self.verifier.length_of(g.row))
            g.read = min(common_prefix_length(held, g.context), max(0, g.prompt_len - 1))
            self.verifier.rollback(g.read, g.row)
            g.stats.cached_prompt_tokens = g.read
            if self.drafter is not None:
                kept = self.drafter.start(g.row, g.context[: g.prompt_len], reuse)
                g.stats.draft_cached_prompt_tokens = kept
            self.prefixes.record(g.row, g.context)

    def forget(self) -> None:
        """Another user of the verifier's rows (scoring, a calibration) overwrote them."""
        self.prefixes.forget()
        if self.drafter is not None:
            self.drafter.reset()

    def prefill(self, generations: Sequence[Generation], budget: int | None = None) -> int:
        """Feed the verifier the generations' unread prompt tokens (all but each prompt's
        last, which the first iteration feeds with the drafts), in the generations' order
        and at most ``budget`` in all (None: every one), in as few forwards as padding and
        ``PROMPT_PIECE`` allow (``read_in_pieces``); counted as verifier time. Returns the
        tokens read. The drafter reads a prompt only when its row is about to draft
        (``catch_up``, ``drafters``)."""
        chunks: list[tuple[Generation, list[int]]] = []
        left = budget
        for g in generations:
            unread = g.prompt_len - 1 - g.read
            take = unread if left is None else min(left, unread)
            if take > 0:
                chunks.append((g, g.context[g.read : g.read + take]))
                left = None if left is None else left - take
        if not chunks:
            return 0
        start = time.perf_counter()
        pieces = [piece for _, piece in chunks]
        read_in_pieces(self.verifier, pieces, [g.row for g, _ in chunks])
        elapsed = self._elapsed(start)
        for g, piece in chunks:
            g.read += len(piece)
            g.stats.read_prompt_tokens += len(piece)
            g.stats.time_prompt_s += elapsed
            g.stats.time_verify_s += elapsed
        return sum(len(piece) for piece in pieces)

    def catch_up(self, generations: Sequence[Generation], budget: int | None = None) -> int:
        """Let the drafter read, in the generations' order and at most ``budget`` tokens in
        all (None: every one), what it has not seen of their contexts (``Drafter.catch_up``),
        counted as draft time. Returns the tokens read."""
        if self.drafter is None:
            return 0
        start = time.perf_counter()
        read = self.drafter.catch_up(
            [g.row for g in generations], [g.context for g in generations], budget
        )
        elapsed = self._elapsed(start)
        for g in generations:
            g.stats.time_draft_s += elapsed
        return read

    def behind(self, generations: Sequence[Generation]) -> list[int]:
        """Tokens the drafter would read for each generation before drafting (0 without
        a drafter)."""
        if self.drafter is None:
            return [0] * len(generations)
        return [self.drafter.behind(g.row, g.context) for g in generations]

    def step(
        self,
        generations: Sequence[Generation],
        num_draft_tokens: Sequence[int],
        keep_drafting: Sequence[Stopping | None] | None = None,
    ) -> StepTiming:
        """One iteration for every generation, drafting up to ``num_draft_tokens[i]`` tokens
        for the i-th, fewer where ``keep_drafting[i]`` stops it (``DraftRequest``)."""
        stops = keep_drafting or [None] * len(generations)
        began = time.perf_counter()
        drafts, draft_steps, draft_s, caught_up = self._propose(
            generations, num_draft_tokens, stops
        )
        feeds = [[g.context[-1], *d.tokens] for g, d in zip(generations, drafts, strict=True)]
        kept = [self.verifier.length_of(g.row) for g in generations]
        pairs = list(zip(generations, drafts, strict=True))
        trees = any(g.verification.trees and d.tokens for g, d in pairs)  # a tree-shaped read
        start = time.perf_counter()
        logits = self._read(feeds, drafts, [g.row for g in generations], trees)  # [K_b+1, V]
        verify_s = self._elapsed(start)
        qs = [
            _verifier_rows(g, d, row_logits[:, : self.vocab_size])  # [K_b+1, V]
            for g, d, row_logits in zip(generations, drafts, logits, strict=True)
        ]
        emitted, accepted_counts = 0, []
        rows = zip(generations, drafts, qs, kept, strict=True)
        for g, draft, q, length in rows:
            g.stats.time_verify_s += verify_s
            count, accepted = g.own(_keep, self.verifier, g, draft, q, length, trees) or (0, 0)
            accepted_counts.append(accepted)
            if g.error is not None:
                self.verifier.rollback(length, g.row)  # what this iteration fed is dropped
            emitted += count
        verified = sum(len(f) for f in feeds)
        confidences = tuple(_confidences(g, d) for g, d in pairs)
        host_s = time.perf_counter() - began - draft_s - verify_s
        return StepTiming(
            len(generations),
            draft_steps,
            draft_s,
            verified,
            verify_s,
            emitted,
            caught_up,
            confidences,
            tuple(accepted_counts),
            max(0.0, host_s),
            tuple(g.acceptance_key for g in generations),
        )

    def _propose(self, generations, num_draft_tokens, stops) -> tuple[list[Draft], int, float, int]:
        """Each generation's draft (empty where it drafts nothing), the number of draft
        steps, their wall time (added to the draft time of every row that drafted), and the
        context tokens the drafter read first."""
        counts = [g.draft_budget(k) for g, k in zip(generations, num_draft_tokens, strict=True)]
        asks = [
            DraftRequest(
                g.row,
                g.context,
                k,
                g.sampling,
                g.generator,
                g.process if g.processes_drafts else None,  # None: the sampling alone
                stop,
                g.verification.branches,
                g.allowed,
            )
            for g, k, stop in zip(generations, counts, stops, strict=True)
            if k > 0
        ]
        if self.drafter is None or not asks:
            return [Draft([], None) for _ in generations], 0, 0.0, 0
        caught_up = sum(self.drafter.behind(a.row, a.context) for a in asks)
        start = time.perf_counter()
        proposed = iter(self.drafter.propose(asks))
        elapsed = self._elapsed(start)
        drafts = []
        for g, k in zip(generations, counts, strict=True):
            if k > 0:
                g.stats.time_draft_s += elapsed
            proposal = next(proposed) if k > 0 else Draft([], None)
            drafts.append(g.own(_admitted, g, proposal) or Draft([], None))
        return drafts, max(len(d.tokens) for d in drafts), elapsed, caught_up

    def _read(
        self, feeds: list[list[int]], drafts: list[Draft], rows: list[int], trees: bool
    ) -> list[Tensor]:
        """The verifier's logits [K_b+1, V] of each row's feed (its last token, then its
        drafts): one ragged forward, or one token-tree forward when a row drafted a tree."""
        if not trees:
            return self.verifier.append_ragged(feeds, rows)
        parents = [[ROOT, *(j + 1 for j in d.tree.parents)] for d in drafts]
        return self.verifier.append_tree(feeds, parents, rows)

    def _elapsed(self, start: float) -> float:
        self.verifier.synchronize()
        return time.perf_counter() - start


def _confidences(g: Generation, draft: Draft) -> tuple[float, ...]:
    """The draft's probability of each token it drafted along a chain (1 for a deterministic
    drafter); none for a tree, whose nodes are not positions of one chain."""
    if g.verification.trees:
        return ()
    if draft.probs is None:
        return (1.0,) * len(draft.tokens)
    ids = torch.tensor(draft.tokens, dtype=torch.long, device=draft.probs.device)  # [K]
    return tuple(draft.probs.gather(-1, ids[:, None]).squeeze(-1).tolist())


def _admitted(g: Generation, draft: Draft) -> Draft:
    """The draft cut before its first token the generation's grammar refuses. Only a drafter
    without probabilities proposes one: a draft drawn from p was drawn from the masked p."""
    if draft.probs is not None:
        return draft
    count = g.admitted(draft.tokens)
    if count == len(draft.tokens):
        return draft
    return Draft(draft.tokens[:count], None)


def _verifier_rows(g: Generation, draft: Draft, logits: Tensor) -> Tensor:
    """q [K+1, V] of the verifier's logits after the row's last token and each draft: processed
    along the chain, or, for a tree under penalties or a grammar, each node after its own
    path."""
    if not (g.verification.trees and draft.tokens and g.processes_drafts):
        return g.process(logits, draft.tokens)
    tree = draft.tree
    rows = [g.process(logits[:1], [])]
    for j in range(len(draft.tokens)):
        rows.append(g.process(logits[j + 1 : j + 2], [tree.tokens[i] for i in tree.path(j)]))
    return torch.cat(rows)


def _keep(
    verifier: Backend, g: Generation, draft: Draft, q: Tensor, length: int, trees: bool
) -> tuple[int, int]:
    """Judge the row's drafts by its kind (``g.verification``), keep the accepted ones in the
    verifier's cache, emit them with the row's own token and meter them: (tokens emitted,
    drafts accepted). A lossy rule's drafts away from temperature 0 are judged against the
    kind's judged rows (its targets on blocks and trees) and metered; the rest against q. A row
    that drafted is judged and metered on its support (``_on_support``)."""
    kind, rule = g.verification, g.spec.rule
    metered = bool(draft.tokens) and not g.sampling.greedy and not g.spec.lossless
    if draft.tokens:
        assert rule is not None  # a row drafts only by a method that drafts
        columns, cut_q, cut = _on_support(q, draft)  # [S]; [K+1, S]; the draft over them
        judged = kind.judged_rows(rule, cut, cut_q) if metered else cut_q  # [K+1, S]
        numbered, path = kind.judge(rule, cut, judged, g.generator, g.sampling.greedy)
        tokens = columns[numbered].tolist()
    else:
        tokens, path = [draw(q[-1:], g.sampling.greedy, g.generator)], []
    accepted = len(tokens) - 1
    if trees:
        verifier.commit_path(path_rows(path), g.row)
    else:
        verifier.rollback(length + 1 + accepted, g.row)
    count = g.emit(tokens, kind.emitted_rows(q, path) if draft.tokens else q)
    g.stats.record(draft.depth, accepted, count)
    if metered:
        assert rule is not None  # metered: a lossy rule
        start = time.perf_counter()
        divergence = kind.divergence(rule, cut, cut_q, judged, path, count)  # [P]
        g.stats.kl_nats += float(divergence.sum())
        g.stats.time_audit_s += time.perf_counter() - start
    return count, accepted


def _on_support(q: Tensor, draft: Draft) -> tuple[Tensor, Tensor, Draft]:
    """A row's q [K+1, V] and draft cut to the tokens q's rows, the draft's rows and its tokens
    hold (``audit.support``): every rule's acceptance, residual, target and law lie there.
    Returns the tokens [S], q [K+1, S] and the draft over them (its tokens numbered among
    them). The columns keep vocabulary order, so an inverse-CDF draw adds the same masses in
    the same order and picks the same token; judging and the meter cost O(S) per position
    rather than O(V) (S <= (2K + 1) k under top-k)."""
    columns = support(q, draft.probs, ids=draft.tokens)  # [S]
    numbered = torch.searchsorted(columns, torch.tensor(draft.tokens, device=q.device))
    probs = None if draft.probs is None else draft.probs[:, columns]  # [K, S]
    return columns, q[:, columns], Draft(numbered.tolist(), probs, draft.parents)
