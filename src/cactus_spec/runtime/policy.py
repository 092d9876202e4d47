"""How far to draft: K from measured costs, and none where drafting is forecast not to pay.

In an iteration over B rows, row b keeps its j-th draft, once it kept every draft before
it, with chance a_bj. Drafting K tokens for each row yields in expectation

    E(K) = sum_b (1 + S_b1 + ... + S_bK_b),   S_bj = a_b1 ... a_bj     tokens (kept drafts + one)

K_b = min(K, the drafts row b's budget can still use: ``Generation.draft_budget``; a row 3
tokens from its end drafts 2 whatever K); a row that fixed its own K counts its own K's
tokens at its key's pool's chances, and a row at K = 0 one: the batch's tokens, not only the
drafting rows'. The chances are estimated per
position, because acceptance runs in stretches: where rejections fall mostly on an
iteration's first drafts, one rate for all positions, held down by them, undervalues the
later drafts, and with them long chains. The pool's chance at position j, over the
generations that finished and those decoding, is r_j = (A_j + P r_(j-1)) / (R_j + P) (A_j,
R_j: drafts kept and reached at j; P = ``_PRIOR_POSITIONS``; r_0 = 1/2); a row's is its own
counts shrunk the same way, towards m_j = a_b(j-1) r_j / r_(j-1) (its level, the pool's
change along the chain; m_1 = r_1), so a position not yet reached takes the rate of the one
before it. A row's first iteration (its answer's opening) is counted apart: where an answer
starts, a draft and its verifier often disagree on the first token (a code fence or a
sentence), and one such rejection, counted as the row's, would sink its level at every
position and stop it drafting for good. A row that has read its prompt and not iterated yet
takes the openings' pool, o_j = (A°_j + P r_j) / (R°_j + P) over the finished generations'
first iterations; every later iteration's counts (the row's, the pool's r_j) leave the
opening out. The pools are kept per acceptance key (``Generation.acceptance_key``: the row's
rule, drafter, verification and sampling, K aside) and over every row: a key's r_j, o_j and
confidence rates are its own counts shrunk towards every row's the same way (a key not seen
yet takes every row's), and a row shrinks towards its key's. Acceptance is a property of the
rule: the default pair keeps 0.96 of Cactus(1)'s drafts and 0.85-0.91 of SpS's, and where
one server serves both, one pool pulled each Cactus row's chances towards SpS's and kept its
chains short (a Cactus row leaving K open decoded 6-11% below Cactus at K = 10 in servers
that served both, level with it where only Cactus was served). A row still reading its
prompt takes the pool's r_j: it counts in the batch the
policy chooses for (the scheduler asks for the batch forming) but not in the iteration
chosen, and joins the batch's later iterations at their chances. At its openings' (a first
draft kept about 0.3 of the time in HumanEval chats' openings, 0.95 later), eight requests sent
together kept their batch's first iterations plain while it formed, each drafter falling a
token behind an iteration, which weighs against drafting once the batch has formed.

and costs

    T(K) = sum_j t_draft(R_j) + t_block(n) + [K > 0] c rho E_auto(K)   seconds,
    n = n_fixed + sum_b (w_b K_b + 1),   t_block(n) = t_verify(n) + t_host(n),

where w_b is row b's width (a draft tree's nodes per depth, 1 for a chain; a tree's a_bj is
its rate at depth j, read off the same history), R_j = sum of w_b over the rows with
K_b >= j the rows of the j-th draft step (j = 1 .. max K_b),
t_draft(r) one draft step over r rows, t_verify(n) one verifier forward over n tokens in
all, t_host(n) the rest of an iteration that verifies n tokens (processing each token's row
of q, judging, the meter: it grows with n as the forward does, and is no share of either
model's time), and c rho E_auto(K) the model drafters' reads that drafting commits to, per
token the rows that leave K open emit: c seconds a token read while every row waits, rho
tokens read a token emitted. A drafter reads what its row emitted without it (a new prompt,
or what was emitted while K was 0) only when its row drafts again, and every request that
joins a drafting batch has its drafter read its prompt, so

    rho = max(H_L / H_A, L / A),

L the whole lag of the rows whose drafters lag beyond the steady lag and A the tokens those
rows have left, H_L and H_A the prompt tokens the drafters of recent finished generations read
(or would have) and the tokens those emitted (sums decaying by 1 / ``_READ_WINDOW`` a
generation). H_L / H_A is what drafting costs in the long run: at a steady load with prompts
of L_p tokens and answers of A_p, every request that joins a drafting batch has its drafter
read its prompt while all rows wait, c L_p / A_p a token, charged in every iteration that
drafts, not only at a join. Weighed only where a row lags, drafting pays between joins and
not at one, and at 16 rows (a join every other iteration on AMX) the batch stopped at each
join, its drafters falling behind by a token a row an iteration; drafting at 16 rows paid
1.10x plain decoding with every drafter caught up, and served 0.92-0.97x AR. Charged in every
iteration, the reads (prompts of 130 tokens, answers of 90, 1 ms a token read) cost 14% of a
plain step's time a token there, more than drafting gains: the policy decodes plainly at 16
rows, and drafts as rows leave. L / A is what drafting now costs the rows decoding: their
drafters read L tokens once, for the A tokens they have left. Where they lag far beside what
they have left (a batch that decoded plainly, its drafters a token behind a row an
iteration, near its end), that exceeds the traffic's ratio, and drafting would stall every
row for reads its few remaining tokens cannot repay. Pooled into one ratio,
(H_L + L) / (H_A + A), the traffic's answers diluted such a lag: at the end of each
16-client run on AMX, nine rows lagging 2,100-2,300 tokens with about 20 left each drafted,
and every row waited 2.5-3.4 s for their reads (7% of the run).

Costs are read off ``CostTable``s that every iteration updates (an exponential moving average
per size, held relative to the machine's pace, below), seeded by a short calibration that times
t_draft through the drafter, as the stepper runs it. A calibration's timing is a guess at a
size, and a noisy one (a few forwards in one moment of a shared machine, at a short context): a
size's first reading in an iteration replaces it, and plain decoding's size (the batch at K =
0) is read in an iteration before any forecast may choose drafting over it. The policy drafts
the K in 0..K_max that maximises E(K) / T(K), and drafts at all only when that is at least
``_MARGIN`` above K = 0, plain decoding (E = B, T = t_block(B)): so it never picks a K it
predicts to be slower than plain decoding, nor one within its own error of it. At high
concurrency, where a verifier forward over B (K + 1) tokens costs much more than over B, it
drafts less or not at all. The scheduler asks for the batch that is forming (rows still reading
their prompts included), not only for the rows already decoding.

A single stream (``engine.generate`` with K left open, or a server or ``decode_many`` batch
of one row: ``stopping``) also stops drafting inside an iteration (``keep_drafting``): after
j drafts with acceptance chances a_1..a_j, read off the draft's own probability of each
drafted token (acceptance rates by bins of that probability, learned from every verified
draft and shrunk towards the pool's rate), the iteration promises E_j = 1 + S_1 + ... + S_j
tokens (S_i = a_1 ... a_i) for T_j = j t_draft + t_block(j + 1) seconds; one more draft adds
about S_j a_j tokens (its chance taken as the last draft's: confidence runs in stretches)
for t_draft + t_block(j + 2) - t_block(j + 1) seconds, and is drawn only when that rate
beats E_j / T_j. The draft's probabilities come from the draft alone, so the stop never
looks at the verifier: every rule keeps its law. A draft tree is grown to the K chosen,
without that stop. On the same drafts and verdicts (``benchmarks/stop_replay.py``: 840
iterations of one row drafted to K = 10, each replayed cut where a rule cuts it; the default
pair on AVX512-BF16, HumanEval chats) the stop decodes Cactus 1.11x K = 10 and 1.04x its best
fixed K (6), SpS 1.34x K = 10 and 1.13x its best (4). In a batch each row's chain runs to the
K the forecast chose for the rows together: a draft step costs about the same for a row more
or less, so the single stream's costs would misjudge what a row's stop saves.

A machine's speed changes under the policy: thermal limits and turbo on a laptop, other
tenants' memory traffic on a shared host (``docs/RESULTS.md``: the machines there drift
by up to 1.6x within minutes). An iteration measures only the sizes it runs, so
without a common scale the plain step timed in one state is weighed against draft steps and
blocks timed in the other: a gain reads as a loss, and a policy that drafts nothing
measures no drafting to correct it. So the costs are read against a ``Pace`` p: every
verifier forward of a size read before moves log p by ``_PACE`` times the log of its
surprise (measured over estimated seconds), every measurement is stored divided by p and
read multiplied by it, and what p leaves of a surprise is what its size's entry learns, at
a slower rate (a size's first reading is its entry's, and moves no pace: what it says of the
size is surer than what it says of the machine). All costs scale with p together, so the K
chosen depends on their ratios alone. p follows a lasting change within a few iterations but
not one iteration's noise: a plain step of the EPYC varies by up to 25% from one iteration to
the next, so a pace that takes most of each surprise (80%, measured) stands up to 30% off the
machine's at times; a size first read at such a moment keeps that error in its entry, and
while plain decoding reads only its own size, p takes the entry's error in turn and carries
it into every other cost (at 8 rows there, a plain step's entry 27% dear forecast drafting 5%
faster than plain decoding where it measured 10% slower).

Acceptance is measured before it is trusted: until the verifier has judged ``_PROBE_DRAFTS``
drafts, some rows that leave K open draft, to the end, the K that would pay best were every
draft kept (K_max before any cost was measured). Which rows: of those with the budget for K_max
drafts, for P = 1, 2, ... of them, least lagging first, the P whose best K pays best, the first
row's read left out of the forecast (a lone row's read would otherwise keep it from ever
drafting) and the others' weighed as above. A policy that drafted only where its prior (a rate
of 1/2) promised a gain would never learn a higher rate where a verification block costs
several plain steps (a float32 verifier on a CPU without AMX): it would decode plainly forever,
right or wrong. A probe that drafted K_max whatever the batch would stall a wave of joining
rows: at 16 rows a block of 176 tokens costs more than the plain steps its tokens replace, and
each drafter first reads its prompt. A probe on one row of eight new ones cannot pay where a
draft step is dear beside a plain step: the seven wait for its K_max draft steps (AMX, int8
pair, 8 rows: 0.46 s an iteration for 18 tokens, where plain decoding takes 0.11 s for 8), so
all eight probe, at K = 3, where their reads are cheap beside the gain (AMX), and one row or
none where they are dear.
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from cactus_spec.backends.base import Backend
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.runtime.drafters import Drafter, DraftRequest
from cactus_spec.runtime.generation import Generation
from cactus_spec.runtime.stepper import StepTiming, Stopping

#: How K is chosen for rows that fix none: ``auto`` by this policy, ``fixed`` the engine's
#: ``max_draft_tokens``.
POLICIES = ("auto", "fixed")
#: Weight of a new measurement in a cost table's moving average.
_EMA = 0.2
#: Share of a verifier forward's surprise (log of measured over estimated seconds) taken as
#: a change of the machine's pace: a one-iteration outlier of 30% moves it by 5%.
_PACE = 0.2
#: Weight of a new measurement in a verifier forward's entry, of what the pace leaves of its
#: surprise: an entry learns (1 - _PACE) _SIZE_RATE = 2% of a surprise a reading, so 91% of
#: a lasting change of speed goes to the pace (_PACE / (_PACE + 2%)), whose common scale is
#: what keeps the costs of sizes read at different moments comparable.
_SIZE_RATE = 0.025
#: Tokens a drafting row's drafter is normally behind (the correction, or draft + bonus).
_STEADY_LAG = 2
#: Finished generations whose prompts and answers weigh most in the drafters' reads per
#: token: each sum decays by 1 - 1 / _READ_WINDOW a generation, to follow the traffic.
_READ_WINDOW = 32
#: Most tokens a drafter of a row that leaves K open reads inside a draft step, which every
#: row waits for; a row lagging more (a new prompt, what was emitted while K was 0) drafts
#: nothing until it caught up between iterations (``runtime.scheduler``).
STEP_CATCH_UP = 16
#: Drafting must promise this much more than plain decoding: the estimates err (costs timed
#: at other contexts, acceptance from short histories), and a wrong K > 0 costs more than a
#: wrong 0 (drafters read their rows' prompts for iterations that then draft nothing).
_MARGIN = 0.05
#: The chance of keeping a first draft before any was measured.
_FIRST_PRIOR = 0.5
#: Drafts the verifier judges before the policy's acceptance estimates decide K.
_PROBE_DRAFTS = 100
#: Pseudo-positions of the pool's acceptance rate in a row's estimate.
_PRIOR_POSITIONS = 4.0
#: Acceptance keys a policy keeps counts of (a server whose clients each send their own
#: sampling would otherwise keep one more a client, for good).
_KEYS = 64
#: Upper edges of the bins of a draft's probability of its own token (the last bin ends at 1).
_CONFIDENCE_EDGES = (0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99)


class Pace:
    """How much slower than the cost tables' stored readings the machine runs now (the
    module docstring); 1 until a verifier forward surprises the policy."""

    def __init__(self) -> None:
        self.factor = 1.0

    def follow(self, measured: float, estimated: float) -> None:
        """Move by ``_PACE`` of the surprise ``measured / estimated`` (both in seconds)."""
        if measured > 0 and estimated > 0:
            self.factor *= (measured / estimated) ** _PACE


class CostTable:
    """Seconds by size (rows or tokens), interpolated linearly between measured sizes and
    extrapolated in proportion beyond the largest; stored over ``pace`` and read times it.
    An entry is a calibration's guess (``seed``) until the size's first reading in an
    iteration (``observe``) replaces it."""

    def __init__(self, pace: Pace | None = None, rate: float = _EMA) -> None:
        self.pace = Pace() if pace is None else pace
        self.rate = rate  # the moving average's weight of a new measurement
        self.sizes: list[int] = []
        self.seconds: list[float] = []  # at a pace of 1
        self.read: set[int] = set()  # the sizes measured in an iteration

    def seed(self, size: int, seconds: float) -> None:
        """Enter a calibration's timing of ``size``: the entry until the size is read."""
        if size not in self.read:
            self._set(size, seconds / self.pace.factor)

    def observe(self, size: int, seconds: float) -> None:
        """Fold one measurement of ``size`` into the table: the first replaces what the
        calibration or the sizes around it said; later ones move a moving average."""
        seconds /= self.pace.factor
        if size in self.read:
            at = self.sizes.index(size)
            self.seconds[at] += self.rate * (seconds - self.seconds[at])
        else:
            self.read.add(size)
            self._set(size, seconds)

    def _set(self, size: int, seconds: float) -> None:
        at = bisect.bisect_left(self.sizes, size)
        if at < len(self.sizes) and self.sizes[at] == size:
            self.seconds[at] = seconds
        else:
            self.sizes.insert(at, size)
            self.seconds.insert(at, seconds)

    def estimate(self, size: int) -> float:
        """The cost of ``size`` at the pace now: 0 before any measurement."""
        return self._stored(size) * self.pace.factor

    def _stored(self, size: int) -> float:
        if not self.sizes:
            return 0.0
        at = bisect.bisect_left(self.sizes, size)
        if at < len(self.sizes) and self.sizes[at] == size:
            return self.seconds[at]
        if at == 0:
            return self.seconds[0]
        if at == len(self.sizes):
            return self.seconds[-1] * size / self.sizes[-1]
        lo, hi = self.sizes[at - 1], self.sizes[at]
        weight = (size - lo) / (hi - lo)
        return self.seconds[at - 1] + weight * (self.seconds[at] - self.seconds[at - 1])


def expected_tokens(chances: Sequence[float], k: int) -> float:
    """Tokens one iteration emits in expectation with K drafts, the j-th kept with chance
    ``chances[j - 1]`` once every draft before it was: 1 + S_1 + ... + S_K."""
    total, survival = 1.0, 1.0
    for chance in chances[:k]:
        survival *= chance
        total += survival
    return total


class Acceptance:
    """What the verifier judged of one key's drafts (``Generation.acceptance_key``), or of
    every row's: drafts kept and reached by position, of the finished generations' first
    iterations (``open_*``) and of the rest, and by the draft's confidence (``bin_*``, of
    every verified draft)."""

    def __init__(self, positions: int) -> None:
        self.accepted = [0.0] * positions  # drafts kept, by position, openings left out,
        self.reached = [0.0] * positions  # and reached
        self.open_accepted = [0.0] * positions  # the same of the openings
        self.open_reached = [0.0] * positions
        bins = len(_CONFIDENCE_EDGES) + 1
        self.bin_accepted = [0.0] * bins  # drafts accepted, by the draft's confidence
        self.bin_reached = [0.0] * bins  # drafts verified (every draft before them kept)

    def learn(self, g: Generation) -> None:
        """Fold a finished generation's drafts kept and reached, by position, in: its first
        iteration's into the openings', the others' into the rest."""
        kept, reached = _after_opening(g)
        opened, opened_kept = g.stats.opening
        for j in range(min(len(reached), len(self.reached))):
            self.accepted[j] += kept[j]
            self.reached[j] += reached[j]
            self.open_accepted[j] += j < opened_kept
            self.open_reached[j] += j < opened

    def learn_confidences(self, confidences: Sequence[float], kept: int) -> None:
        """Count each verified draft of one row's chain (every one before it kept) in its
        confidence's bin."""
        for position, confidence in enumerate(confidences[: kept + 1]):
            b = _bin(confidence)
            self.bin_reached[b] += 1
            self.bin_accepted[b] += float(position < kept)

    def chances(self, prior: Sequence[float], live: Sequence[Generation] = ()) -> list[float]:
        """Its counts and the ``live`` generations', by position, shrunk along ``prior``
        (``_along``)."""
        kept, reached = list(self.accepted), list(self.reached)
        for g in live:
            row_kept, row_reached = _after_opening(g)
            for j in range(min(len(row_reached), len(reached))):
                kept[j] += row_kept[j]
                reached[j] += row_reached[j]
        return _along(kept, reached, prior)

    def openings(self, prior: Sequence[float]) -> list[float]:
        """The openings' chances by position, each shrunk towards ``prior``'s."""
        pairs = zip(self.open_accepted, self.open_reached, prior, strict=True)
        return [_shrunk(a, n, r) for a, n, r in pairs]

    def rate(self, prior: float) -> float:
        """Its rate over every position, shrunk towards ``prior``."""
        return _shrunk(sum(self.accepted), sum(self.reached), prior)

    def bin_chances(self, priors: Sequence[float]) -> list[float]:
        """Each confidence bin's rate, shrunk towards its ``priors``' entry."""
        bins = zip(self.bin_accepted, self.bin_reached, priors, strict=True)
        return [_shrunk(a, n, prior) for a, n, prior in bins]


def _bin(confidence: float) -> int:
    """The confidence bin of a draft the draft model drew with probability ``confidence``."""
    return bisect.bisect_left(_CONFIDENCE_EDGES, confidence)


def _shrunk(accepted: float, reached: float, prior: float) -> float:
    """A rate of ``accepted`` in ``reached`` with ``_PRIOR_POSITIONS`` pseudo-counts of
    ``prior``."""
    return (accepted + _PRIOR_POSITIONS * prior) / (reached + _PRIOR_POSITIONS)


def _along(kept: Sequence[float], reached: Sequence[float], pool: Sequence[float]) -> list[float]:
    """Chances by position from counts ``kept`` and ``reached`` (shorter than ``pool``: a
    position not reached counts none), each shrunk towards m_j = a_(j-1) r_j / r_(j-1), the
    chance found at the position before times ``pool``'s change along the chain (m_1 = r_1;
    a pool of 1/2 everywhere: the position before's chance)."""
    chances, before, level = [], _FIRST_PRIOR, _FIRST_PRIOR
    for j, r in enumerate(pool):
        prior = min(1.0, level * r / before)
        own_kept, own_reached = (kept[j], reached[j]) if j < len(reached) else (0.0, 0.0)
        level = _shrunk(own_kept, own_reached, prior)
        chances.append(level)
        before = r
    return chances


class SpeculationPolicy:
    """Picks K per iteration for the generations that leave it to the policy (see the module
    docstring); ``max_draft_tokens`` bounds it."""

    def __init__(self, max_draft_tokens: int) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.pace = Pace()
        self.draft = CostTable(self.pace)  # one draft step, by rows
        self.verify = CostTable(self.pace, _SIZE_RATE)  # one verifier forward, by tokens
        self.host = CostTable(self.pace)  # the rest of an iteration, by tokens verified
        self.overall = Acceptance(max_draft_tokens)  # every row's drafts,
        self.by_key: dict[Hashable, Acceptance] = {}  # and each acceptance key's
        self.judged = 0  # drafted tokens (chain positions or tree nodes) the verifier judged
        self.prompts_read = 0.0  # H_L: recent generations' prompt tokens a drafter reads,
        self.answered = 0.0  # H_A: the tokens they emitted,
        self.finished = 0.0  # and how many they were (each sum decayed, _READ_WINDOW)
        self._catch_up_token = 0.0  # a model drafter reading one token it skipped, at pace 1

    @property
    def catch_up_token_s(self) -> float:
        """Seconds a model drafter takes to read one token it skipped, at the pace now."""
        return self._catch_up_token * self.pace.factor

    @catch_up_token_s.setter
    def catch_up_token_s(self, seconds: float) -> None:
        self._catch_up_token = seconds / self.pace.factor

    def pool_chances(self, live: Sequence[Generation] = (), key: Hashable = None) -> list[float]:
        """r_1..r_Kmax: the pool's chance of keeping the j-th draft once every draft before it
        was kept, each position shrunk towards the one before it, over the generations that
        finished and the ``live`` ones, still decoding; with a ``key``, that key's pool,
        shrunk towards every row's (the module docstring)."""
        overall = self.overall.chances([_FIRST_PRIOR] * self.max_draft_tokens, live)
        return self._key_pool(overall, live, key)

    def _key_pool(
        self, overall: list[float], live: Sequence[Generation], key: Hashable
    ) -> list[float]:
        """``key``'s pool over its finished generations and its ``live`` ones, shrunk
        towards every row's (``overall``)."""
        mine = [g for g in live if g.acceptance_key == key]
        if key not in self.by_key and not mine:
            return overall
        counts = self.by_key.get(key) or Acceptance(self.max_draft_tokens)
        return counts.chances(overall, mine)

    def chances(self, g: Generation, pool: Sequence[float] | None = None) -> list[float]:
        """a_b1..a_bKmax: the row's own counts shrunk towards m_j (the pool's r_j while it
        reads its prompt), or between its prompt's read and its first iteration the openings'
        o_j (the module docstring); ``pool``: its key's ``pool_chances``, when the caller has
        it."""
        key = g.acceptance_key
        pool = self.pool_chances((), key) if pool is None else pool
        if g.stats.iterations == 0 and not g.reading and not any(g.stats.reached_by_position):
            openings = self.overall.openings(pool)
            return self.by_key[key].openings(openings) if key in self.by_key else openings
        return _along(*_after_opening(g), pool)

    def _pools(self, generations: Sequence[Generation]) -> dict[Hashable, list[float]]:
        """Each of the ``generations``' keys' ``pool_chances``, over them all."""
        overall = self.overall.chances([_FIRST_PRIOR] * self.max_draft_tokens, generations)
        keys = {g.acceptance_key for g in generations}
        return {key: self._key_pool(overall, generations, key) for key in keys}

    def choose(self, generations: Sequence[Generation], behind: Sequence[int]) -> list[int]:
        """K for each generation: its own when it fixed one, 0 for autoregressive rows, else
        the K that maximises expected tokens per second over the whole batch. ``behind[i]``:
        the tokens the drafter would read for generation i before drafting."""
        if not any(g.spec.auto_k for g in generations):
            return [_fixed_k(g) for g in generations]
        if self.probing():
            probes, best = self._probe(generations, behind)
            return [best * probe if g.spec.auto_k else _fixed_k(g)
                    for g, probe in zip(generations, probes, strict=True)]  # fmt: skip
        if _plain_tokens(generations) not in self.verify.read:
            best = 0  # plain decoding's cost at this batch is measured before it is beaten
        else:
            best = _best_k(self.forecast(generations, behind))
        return [best if g.spec.auto_k else _fixed_k(g) for g in generations]

    def _probe(
        self, generations: Sequence[Generation], behind: Sequence[int]
    ) -> tuple[list[bool], int]:
        """While probing: which rows draft, and K. For P = 1, 2, ... of the rows that leave K
        open, least lagging first, the K that would pay best were those P to draft with every
        draft kept (the others at K = 0 or their own K), and the P whose K pays best (the
        fewest of equals; none where no K pays: K_max for the least lagging before any cost
        was measured). The least lagging row's read is left out of its forecast, so a probe
        pays one drafter's read to learn the acceptance that decides the rest; every other
        probing row's read is weighed as ``forecast`` weighs it. Only rows with the budget for
        K_max drafts probe: a row near its end judges a few drafts at most, and its drafter's
        read, left out, would stall every row for nothing (held to AVX2, 8 clients: the last row
        of a run, 3 tokens left and 240 unread, caught up for 0.9 s, 1.5% of the run)."""
        full = self.max_draft_tokens
        order = sorted((i for i, g in enumerate(generations)
                        if g.spec.auto_k and g.draft_budget(full) == full),
                       key=behind.__getitem__)  # fmt: skip
        if not order:
            return [False] * len(generations), 0
        if not self.verify.sizes:
            return [i == order[0] for i in range(len(generations))], full
        probes, best, best_rate = [False] * len(generations), 0, 0.0
        pools, certain = self._pools(generations), [1.0] * self.max_draft_tokens
        for p in range(1, len(order) + 1):
            chosen = set(order[:p])
            auto = [generations[i] for i in order[:p]]
            lags = [0, *(behind[i] for i in order[1:p])]
            rest = [g for i, g in enumerate(generations) if i not in chosen]
            forecast = self._forecast(auto, [certain] * p, lags, rest, pools)
            k = _best_k(forecast)
            rate = forecast[k][0] / forecast[k][1]
            if k > 0 and rate > best_rate:
                probes = [i in chosen for i in range(len(generations))]
                best, best_rate = k, rate
        return probes, best

    def forecast(
        self, generations: Sequence[Generation], behind: Sequence[int]
    ) -> list[tuple[float, float]]:
        """(E(K), T(K)) for K = 0..K_max: the tokens and seconds the module docstring's model
        expects of one iteration in which the rows that leave K open draft K (the others
        their own K), at the chances learned; what ``choose`` weighs."""
        auto = [g for g in generations if g.spec.auto_k]
        lags = [n for g, n in zip(generations, behind, strict=True) if g.spec.auto_k]
        fixed = [g for g in generations if not g.spec.auto_k]
        pools = self._pools(generations)
        chances = [self.chances(g, pools[g.acceptance_key]) for g in auto]
        return self._forecast(auto, chances, lags, fixed, pools)

    def _forecast(
        self,
        auto: list[Generation],
        chances: list[list[float]],
        lags: list[int],
        fixed: list[Generation],
        pools: dict[Hashable, list[float]],
    ) -> list[tuple[float, float]]:
        widths = [g.verification.branches for g in auto]
        fixed_tokens = _plain_tokens(fixed)
        fixed_emitted = sum(expected_tokens(pools[g.acceptance_key], _budget(g)) for g in fixed)
        fixed_drafts = [(g.verification.branches, _budget(g)) for g in fixed]
        read = self.catch_up_token_s * self.reads_per_token(auto, lags)  # c rho

        def forecast(k: int) -> tuple[float, float]:
            drafts = [g.draft_budget(k) for g in auto]  # what a row near its end can still use
            rows = list(zip(widths, drafts, strict=True))
            per_row = [expected_tokens(c, n) for c, n in zip(chances, drafts, strict=True)]
            cost = self.block(fixed_tokens + sum(w * n + 1 for w, n in rows))
            if k > 0 and per_row:
                cost += self._draft_steps([*rows, *fixed_drafts])
                cost += read * sum(per_row)
            return fixed_emitted + sum(per_row), cost

        return [forecast(k) for k in range(self.max_draft_tokens + 1)]

    def _draft_steps(self, rows: Sequence[tuple[int, int]]) -> float:
        """Seconds of an iteration's draft steps for rows of (width, drafts): step j runs over
        the rows that draft j or more (``Drafter.propose`` drops a row once it drafted its
        own)."""
        steps = max((n for _, n in rows), default=0)
        return sum(
            self.draft.estimate(sum(w for w, n in rows if n >= j)) for j in range(1, steps + 1)
        )

    def reads_per_token(self, auto: Sequence[Generation], lags: Sequence[int]) -> float:
        """rho: the tokens drafters read beyond their steady lag per token the rows that leave
        K open emit, while they draft: max(H_L / H_A, L / A), H_L and H_A the recent finished
        generations' prompt reads and answers (``learn_acceptance``), L the ``lags`` of the
        ``auto`` rows lagging beyond the steady lag, A the tokens those rows have left, each at
        most the recent answers' mean (a client's ``max_tokens`` is often far above its answers)."""
        owed = sum(n for n in lags if n > _STEADY_LAG)
        answer = self.answered / self.finished if self.finished else math.inf
        left = sum(min(g.remaining, answer) for g in auto)
        traffic = self.prompts_read / self.answered if self.answered else 0.0
        return max(traffic, owed / max(1.0, left))

    def probing(self) -> bool:
        """Whether the policy has seen fewer than ``_PROBE_DRAFTS`` drafts judged by the
        verifier (those of every iteration it observed, or of the finished generations it
        learned from, whichever counts more)."""
        return max(self.judged, sum(self.overall.reached)) < _PROBE_DRAFTS

    def accept_chance(self, confidence: float, key: Hashable = None) -> float:
        """The chance a draft the draft model drew with probability ``confidence`` is
        accepted: its bin's rate over every row, shrunk towards the pool's, and with a
        ``key`` that key's bin rate, shrunk towards it."""
        return self._bin_chances(key)[_bin(confidence)]

    def _bin_chances(self, key: Hashable) -> list[float]:
        """``accept_chance`` of each confidence bin, for acceptance ``key`` (None: every
        row's)."""
        chances = self.overall.bin_chances([self._pool_rate()] * (len(_CONFIDENCE_EDGES) + 1))
        return self.by_key[key].bin_chances(chances) if key in self.by_key else chances

    def stopping(self, generations: Sequence[Generation]) -> list[Stopping | None] | None:
        """What ends each row's chain inside an iteration: ``keep_drafting`` at the row's key
        for a single stream (one row that leaves K open), nothing in a batch (the module
        docstring)."""
        if len(generations) == 1 and generations[0].spec.auto_k:
            return [functools.partial(self.keep_drafting, key=generations[0].acceptance_key)]
        return None

    def keep_drafting(self, confidences: Sequence[float], key: Hashable = None) -> bool:
        """Whether a single stream of acceptance ``key`` that drafted tokens with these
        ``confidences`` should draft one more (the module docstring's rule; always while
        probing)."""
        if self.probing():
            return True
        j = len(confidences)
        chances = self._bin_chances(key)
        survival, expected = 1.0, 1.0
        for c in confidences:
            survival *= chances[_bin(c)]
            expected += survival
        t_draft = self.draft.estimate(1)
        cost = j * t_draft + self.block(j + 1)
        more = t_draft + self.block(j + 2) - self.block(j + 1)
        nearest = chances[_bin(confidences[-1])] if confidences else self._pool_rate(key)
        gain = survival * nearest
        return cost <= 0 or gain * cost >= expected * more

    def block(self, tokens: int) -> float:
        """t_block: seconds of an iteration's verification of ``tokens`` tokens, the
        verifier's forward and the host's work on its rows."""
        return self.verify.estimate(tokens) + self.host.estimate(tokens)

    def _pool_rate(self, key: Hashable = None) -> float:
        """The pool's rate over every position (the prior of the confidence bins), with a
        ``key`` that key's, shrunk towards it."""
        rate = self.overall.rate(_FIRST_PRIOR)
        return self.by_key[key].rate(rate) if key in self.by_key else rate

    def observe(self, timing: StepTiming) -> None:
        """Fold one iteration's measured costs and its drafts' outcomes into the tables.
        Draft steps whose drafters read no more than the steady lag are draft steps; those
        that first caught up on more (a new prompt, what was emitted while K was 0) hold the
        catch-up: their time beyond the steps' estimate, per token caught up, is its cost
        per token. Told apart by the tokens read, not by the time: a catch-up folded into
        the steps' table would raise the estimate that stops drafting, and with no drafting
        no step would ever lower it again."""
        self._learn_confidences(timing)
        self.judged += timing.verified_tokens - timing.rows  # each row feeds one more token
        tokens = timing.verified_tokens
        if tokens in self.verify.read:  # a size's first reading is its entry's alone
            self.pace.follow(timing.verify_s, self.verify.estimate(tokens))
        self.verify.observe(tokens, timing.verify_s)
        self.host.observe(tokens, timing.host_s)
        if not timing.draft_steps:
            return
        if timing.caught_up <= _STEADY_LAG * timing.rows:
            self.draft.observe(timing.rows, timing.draft_s / timing.draft_steps)
            return
        excess = timing.draft_s - timing.draft_steps * self.draft.estimate(timing.rows)
        per_token = max(0.0, excess) / timing.caught_up
        self.catch_up_token_s += _EMA * (per_token - self.catch_up_token_s)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """Fold a drafter's read of ``tokens`` it lagged, between iterations, into the cost
        of catching up one token."""
        if tokens > 0:
            self.catch_up_token_s += _EMA * (seconds / tokens - self.catch_up_token_s)

    def _learn_confidences(self, timing: StepTiming) -> None:
        """Count each verified draft (every one before it kept) in its confidence's bin, of
        every row's and of its row's key (a timing that names no keys: every row's alone); a
        row that drafted nothing keeps no key."""
        keys = timing.keys or (None,) * len(timing.kept)
        for confidences, kept, key in zip(timing.confidences, timing.kept, keys, strict=True):
            self.overall.learn_confidences(confidences, kept)
            if key is not None and confidences:
                self._of(key).learn_confidences(confidences, kept)

    def _of(self, key: Hashable) -> Acceptance:
        """The counts of acceptance ``key``, made empty at its first use; of more than
        ``_KEYS`` keys, the one taught least recently is forgotten."""
        counts = self.by_key.pop(key, None) or Acceptance(self.max_draft_tokens)
        self.by_key[key] = counts  # the keys in the order last taught
        if len(self.by_key) > _KEYS:
            del self.by_key[next(iter(self.by_key))]
        return counts

    def learn_acceptance(self, g: Generation) -> None:
        """Fold a drafting generation's drafts kept and reached, by position, into the pool's
        and its key's (``Acceptance.learn``) once it finished; and, where it left K open, the
        prompt its drafter read (or would have, had it drafted) and its answer's length into
        H_L and H_A."""
        if g.spec.auto_k:
            keep = 1.0 - 1.0 / _READ_WINDOW
            read = g.prompt_len - g.stats.draft_cached_prompt_tokens
            self.prompts_read = keep * self.prompts_read + read
            self.answered = keep * self.answered + len(g.new_ids)
            self.finished = keep * self.finished + 1
        if g.spec.drafts:
            self.overall.learn(g)
            self._of(g.acceptance_key).learn(g)

    def calibrate(
        self,
        verify_forward: Callable[[int], float],
        draft_step: Callable[[int], float] | None,
        max_rows: int,
    ) -> None:
        """Seed the tables with ``verify_forward(n)``, the seconds of a verifier forward of n
        tokens, for n = 1, 2, 4, ... up to max_rows (K_max + 1), and ``draft_step(b)``, the
        seconds of one draft step over b rows, for b = 1, 2, 4, ... max_rows. Each size is
        run three times and the least timing kept (noise only ever adds time)."""
        for size in _doubling(max_rows * (self.max_draft_tokens + 1)):
            self.verify.seed(size, _least_of_three(verify_forward, size))
        if draft_step is not None:
            for rows in _doubling(max_rows):
                self.draft.seed(rows, _least_of_three(draft_step, rows))


def _after_opening(g: Generation) -> tuple[list[int], list[int]]:
    """The row's drafts kept and reached by position, its first iteration's left out."""
    opened, opened_kept = g.stats.opening
    kept = [n - (j < opened_kept) for j, n in enumerate(g.stats.accepted_by_position)]
    reached = [n - (j < opened) for j, n in enumerate(g.stats.reached_by_position)]
    return kept, reached


def _plain_tokens(generations: Sequence[Generation]) -> int:
    """Tokens the verifier reads in an iteration where the rows that leave K open draft none
    (their ``_fixed_k`` is 0) and the others their own K, as far as their budgets reach."""
    return sum(_budget(g) * g.verification.branches + 1 for g in generations)


def _budget(g: Generation) -> int:
    """The drafts a row drafts at its own K (0 for one that leaves K open): as many as its
    budget can still use."""
    return g.draft_budget(_fixed_k(g))


def _best_k(forecast: Sequence[tuple[float, float]]) -> int:
    """The K of the highest forecast rate E(K) / T(K), if it beats plain decoding (K = 0) by
    ``_MARGIN``, else 0."""
    rates = [
        tokens / seconds if seconds > 0 else float(k == 0)
        for k, (tokens, seconds) in enumerate(forecast)
    ]
    best = max(range(len(rates)), key=rates.__getitem__)
    return best if rates[best] >= (1 + _MARGIN) * rates[0] else 0


def _least_of_three(work: Callable[[int], float], size: int) -> float:
    return min(work(size) for _ in range(3))


def _fixed_k(g: Generation) -> int:
    return g.spec.num_draft_tokens or 0


def _doubling(limit: int) -> list[int]:
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def calibrated_policy(
    verifier: Backend, drafter: Drafter | None, max_draft_tokens: int
) -> SpeculationPolicy:
    """A policy whose cost tables are seeded by timing ``verifier`` (forwards of 1 to
    slots x (K_max + 1) tokens spread over up to ``slots`` rows, each row after a context of
    ``_CONTEXT`` tokens) and, for a model drafter, its draft steps over 1 to ``slots`` rows
    (``_timed_steps``) and its reading of skipped tokens. Leaves the caches empty."""
    policy = SpeculationPolicy(max_draft_tokens)
    slots = verifier.slots
    verifier.append_ragged([[0] * _CONTEXT] * slots, list(range(slots)), last_only=True)
    draft_backend = drafter.backend if drafter is not None else None

    def verify_forward(tokens: int) -> float:
        return _timed_spread(verifier, tokens, slots)

    def draft_step(rows: int) -> float:
        assert drafter is not None  # timed only with a draft model
        return _timed_steps(drafter, rows)

    policy.calibrate(verify_forward, draft_step if draft_backend else None, slots)
    verifier.reset()
    if draft_backend is not None:
        assert drafter is not None  # a draft backend is a drafter's
        drafter.reset()
        draft_backend.append_ragged([[0] * _CONTEXT], [0], last_only=True)
        read = _least_of_three(lambda tokens: _timed_spread(draft_backend, tokens, 1), _CONTEXT)
        policy.catch_up_token_s = read / _CONTEXT
        drafter.reset()
    return policy


#: Tokens in each row's cache while a calibration forward is timed.
_CONTEXT = 64
#: Draft steps of a timed calibration proposal.
_CALIBRATION_STEPS = 3


def _timed_steps(drafter: Drafter, rows: int) -> float:
    """Seconds a draft step costs the stepper over ``rows`` rows: one proposal of
    ``_CALIBRATION_STEPS`` drafts each at the default sampling, every row's drafter the
    steady lag behind a context of ``_CONTEXT`` tokens, over the steps; so the lag's read,
    the forwards and the sampling, what an iteration's steps cost (a step costs a third or
    more over a bare forward; ``docs/DESIGN.md``, "Serving: prefix caching, chunked prefill,
    the policy")."""
    prefix, tail = [0] * _CONTEXT, [1] * _STEADY_LAG
    sampling, generator = SamplingConfig(), torch.Generator().manual_seed(0)

    def asks(context: list[int], steps: int) -> list[DraftRequest]:
        return [DraftRequest(row, context, steps, sampling, generator) for row in range(rows)]

    drafter.propose(asks(prefix, 1))  # untimed: each row's drafter then holds the prefix
    start = time.perf_counter()
    drafter.propose(asks(prefix + tail, _CALIBRATION_STEPS))
    if drafter.backend is not None:
        drafter.backend.synchronize()
    return (time.perf_counter() - start) / _CALIBRATION_STEPS


def _timed_spread(backend: Backend, tokens: int, rows: int) -> float:
    """Seconds of one forward of ``tokens`` tokens spread evenly over ``rows`` rows that
    hold ``_CONTEXT`` tokens each; the rows are rolled back to that context after."""
    rows = min(rows, tokens, backend.slots)
    share = -(-tokens // rows)
    every = list(range(rows))
    start = time.perf_counter()
    backend.append_ragged([[0] * share for _ in every], every)
    backend.synchronize()
    seconds = time.perf_counter() - start
    for row in every:
        backend.rollback(_CONTEXT, row)
    return seconds
