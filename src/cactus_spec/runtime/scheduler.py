"""Continuous batching: requests join and leave between iterations of one decode loop.

One thread owns the models, best the one that loaded them (``run`` the loop on it; ``start``
runs it on a thread of its own, for tests and embedding). torch's OpenMP runtime keeps a
team of workers for each thread that ran a parallel region; once they outnumber the CPUs,
they sleep between regions instead of spinning, and every kernel pays a wake-up
(``docs/DESIGN.md``, the end of "Instruction-set levels: AVX2 beside AVX512 and AMX").

Each turn of its loop it admits waiting requests into free rows (each into the free row that
holds the longest prefix of its prompt: prefix caching), drops cancelled ones, reads up to
``prefill_chunk`` prompt tokens per token each row verified in the last iteration for each
row still reading its prompt (the shortest first, in one batched forward where padding
allows; a few chunks when no row is decoding: chunked prefill), admits what arrived
meanwhile, asks the policy for K, lets the drafters of rows about to draft read a budget of
what they lag (a new prompt: those rows draft once caught up, ``_catch_up``), runs one
stepper iteration over every row that has read its prompt, and hands finished generations
back. So a long prompt arriving costs each running row at most one chunk's read per
iteration, not the whole prompt's (nor a drafter's read of it), and a request arriving
while nothing decodes waits for a few chunks of each; and requests sent together are one
batch to the policy: the first one, read alone while the others arrive, would otherwise
look like a lone stream worth drafting for, and its drafter would read its prompt and draft
while the others wait. A bounded queue gives backpressure:
``submit`` raises ``QueueFullError`` when it is full.

Callbacks (``on_text``, ``on_done``, ``on_error``) run on the scheduler's thread: they must
be quick and must not block (the server hands them to its event loop).

Failures are the failing request's own. A request that cannot start (its grammar, its spec)
or whose row fails during an iteration (``Generation.fail``) gets its own error through
``on_error`` and frees its row; its neighbours go on with the tokens they would have had. An
error outside any row (a forward that fails) ends the rows of that iteration, each with
``BatchError``, whose message names nothing of any request; the cause goes to the log.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cactus_spec.runtime.generation import Generation, Request
from cactus_spec.runtime.policy import STEP_CATCH_UP, SpeculationPolicy
from cactus_spec.runtime.rows import Rows
from cactus_spec.runtime.stepper import StepTiming

#: Prompt tokens a server reads per iteration (``prefill_chunk``): a chunk costs a running
#: row a few one-token forwards, not a whole prompt's read (``docs/RESULTS.md``,
#: "Serving under load"; ``benchmarks/forward_cost.py --tokens 1,64,128`` measures it).
PREFILL_CHUNK = 64

#: Chunks read per turn and reading row while no row decodes: each chunk streams the weights
#: once more, and a request that arrives waits for at most these chunks of each other prompt.
_IDLE_CHUNKS = 4

#: Window of the tokens-per-second gauge.
_RATE_WINDOW_S = 10.0

_log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queue`` requests already."""


class BatchError(RuntimeError):
    """A failure outside any one row ended the iteration this request's row was in."""

    def __init__(self) -> None:
        super().__init__("decoding failed in a batch this request was part of (see the log)")


@dataclass
class Counters:
    """Totals since start, for ``/metrics``."""

    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_rejected: int = 0  # refused by a full queue
    requests_failed: int = 0  # ended by an error (their own, or a batch's)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    iterations: int = 0
    kl_nats: float = 0.0  # over the requests whose divergence is finite
    kl_tokens: int = 0  # their tokens
    kl_unbounded: int = 0  # requests whose rule's law left q's support (KL infinite)
    prompt_tokens: int = 0
    read_prompt_tokens: int = 0  # prompt tokens read before decoding (not cached)
    time_prompt_s: float = 0.0  # wall time of those reads
    prefix_queries: int = 0  # requests started (each looks for a cached prefix)
    prefix_hits: int = 0
    cached_tokens: dict[str, int] = field(default_factory=lambda: {"verifier": 0, "draft": 0})
    recent: deque = field(default_factory=deque)  # (time, tokens) per iteration

    def tokens_per_s(self) -> float:
        """Tokens emitted per second over the last ``_RATE_WINDOW_S`` seconds."""
        now = time.monotonic()
        while self.recent and self.recent[0][0] < now - _RATE_WINDOW_S:
            self.recent.popleft()
        return sum(n for _, n in self.recent) / _RATE_WINDOW_S


#: The engine a scheduler runs on (what its owner reads of it beyond ``Rows``).
Engine = TypeVar("Engine", bound=Rows)


class Scheduler(Generic[Engine]):
    """Runs requests on ``engine``'s rows (``engine.max_batch`` at a time)."""

    def __init__(
        self,
        engine: Engine,
        max_queue: int = 64,
        policy: SpeculationPolicy | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.policy = policy
        self.prefill_chunk = prefill_chunk
        self._last_step: StepTiming | None = None
        self.counters = Counters()
        self._free = list(range(engine.max_batch))
        self._waiting: deque[Request] = deque()
        self._cancelled: set[Request] = set()  # asked to stop while decoding
        self._active: list[tuple[Request, Generation]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="cactus-spec-decode", daemon=True)

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return len(self._active)

    def start(self) -> None:
        """Run the loop on a thread of its own."""
        self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until ``stop``."""
        self._loop()

    def stop(self) -> None:
        """Finish the current iteration, then stop (waiting requests are dropped); from
        another thread, wait for the loop to end."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def submit(self, request: Request) -> None:
        """Queue ``request``; QueueFullError when ``max_queue`` requests wait already."""
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                self.counters.requests_rejected += 1
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting)")
            self._waiting.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Forget ``request`` (a client went away): one still waiting leaves the queue at
        once; one decoding stops at the next iteration and frees its row."""
        with self._wake:
            if request in self._waiting:
                self._waiting.remove(request)
                self.counters.requests_cancelled += 1
            else:  # decoding, or about to: its row is freed at the next turn
                self._cancelled.add(request)
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stopping:
                    return
                admitted = self._admit()
            try:
                self._turn(admitted)
            except Exception as err:  # a failed forward fails the rows in it, not the server
                self._fail_all(err)

    def _admit(self) -> list[tuple[Request, Generation]]:
        """Move waiting requests into free rows (under the lock)."""
        admitted = []
        while self._waiting and self._free:
            request = self._waiting.popleft()
            row = self.engine.choose_row(request.prompt_ids, self._free)
            try:
                generation = self.engine.new_generation(request, row)
            except Exception as err:  # noqa: BLE001 - the request's own: it alone fails
                self.counters.requests_failed += 1
                _tell(request.on_error, err)
                continue
            self._free.remove(row)
            admitted.append((request, generation))
            self._count_prompt(generation)
        return admitted

    def _turn(self, admitted: list[tuple[Request, Generation]]) -> None:
        """Take in what joined, drop what was cancelled, read a chunk of the prompts still
        being read, run one iteration over the rest, finish what ended."""
        self._join(admitted)
        cancelled = []
        if self._cancelled:  # rarely: no lock or set work on the decode loop's common turn
            with self._wake:  # what ended before its cancel came is forgotten
                self._cancelled &= {request for request, _ in self._active}
                cancelled = [pair for pair in self._active if pair[0] in self._cancelled]
        for request, g in cancelled:
            self._release(request, g)
            self.counters.requests_cancelled += 1
        reading = sorted((g for _, g in self._active if g.reading), key=_unread)
        generations = [g for _, g in self._active if not g.reading]
        if reading:
            self._read_prompts(reading, running=bool(generations))
            generations = [g for _, g in self._active if not g.reading]
        if not generations:
            return
        if self._waiting:  # what arrived meanwhile joins the batch the policy chooses for
            with self._wake:
                self._join(self._admit())
        joining = [g for _, g in self._active if g.reading]
        behind = self.engine.behind(generations + joining) if self.policy is not None else []
        ks = self._num_draft_tokens(generations, joining, behind)
        ks = self._catch_up(generations, ks, behind)
        stops = self.policy.stopping(generations + joining) if self.policy is not None else None
        timing = self.engine.step(generations, ks, stops)
        self._last_step = timing
        if self.policy is not None:
            self.policy.observe(timing)
        self.counters.iterations += 1
        self.counters.recent.append((time.monotonic(), timing.emitted))
        for request, g in [pair for pair in self._active if pair[1].done]:
            if g.error is None:
                self._finish(request, g)
            else:
                self._fail(request, g)

    def _join(self, admitted: list[tuple[Request, Generation]]) -> None:
        """Add admitted requests to the active rows, in row order (so that a batch of
        neighbouring rows is a view)."""
        if admitted:
            self._active = sorted(self._active + admitted, key=lambda pair: pair[1].row)

    def _read_prompts(self, reading: list[Generation], running: bool) -> None:
        """Read a budget of the prompts still being read, counting the tokens and the time."""
        start = time.perf_counter()
        read = self.engine.prefill(reading, self._prefill_budget(running, len(reading)))
        self.counters.read_prompt_tokens += read
        self.counters.time_prompt_s += time.perf_counter() - start

    def _prefill_budget(self, running: bool, rows: int) -> int | None:
        """Prompt tokens to read this turn for ``rows`` rows reading. With rows decoding:
        ``prefill_chunk`` a reading row per token each decoding row verified in the last
        iteration (K + 1 when drafting), so every row moves on each turn (a decoding row by
        its tokens, a reading row by a chunk: requests sent together form their batch in
        the turns one of them would take, not in as many turns again as there are of them),
        and drafting, which makes iterations longer, does not slow the reading of waiting
        prompts. With none: ``_IDLE_CHUNKS`` chunks a reading row, so a request that arrives
        meanwhile waits for that much of each long prompt's read, not for all of it."""
        if self.prefill_chunk is None:
            return None
        if not running:
            return self.prefill_chunk * _IDLE_CHUNKS * rows
        last = self._last_step
        per_row = last.verified_tokens / last.rows if last is not None and last.rows else 1.0
        return round(self.prefill_chunk * max(1.0, per_row)) * rows

    def _count_prompt(self, g: Generation) -> None:
        """Count a started generation's prompt and what its row had cached of it."""
        c = self.counters
        c.prompt_tokens += g.prompt_len
        c.prefix_queries += 1
        c.prefix_hits += g.stats.cached_prompt_tokens > 0
        c.cached_tokens["verifier"] += g.stats.cached_prompt_tokens
        c.cached_tokens["draft"] += g.stats.draft_cached_prompt_tokens

    def _num_draft_tokens(
        self, generations: list[Generation], joining: list[Generation], behind: list[int]
    ) -> list[int]:
        """K of each generation (``behind``: what the drafter lags, for each of the
        generations then the joining ones): the policy's choice where it leaves K open, else
        the engine's ``draft_tokens`` (the spec's own K, or the engine's
        ``max_draft_tokens``). The policy chooses for the batch these rows make with the
        ``joining`` ones (still reading their prompts): a K worth drafting for a few rows is
        not worth it for the batch they are about to become, and a drafter that starts would
        first read its row's prompt."""
        if self.policy is not None:
            rows = generations + joining
            return self.policy.choose(rows, behind)[: len(generations)]
        return [self.engine.draft_tokens(g.spec) for g in generations]

    def _catch_up(
        self, generations: list[Generation], ks: list[int], behind: list[int]
    ) -> list[int]:
        """K of each generation after the lagging drafters' reads (``behind``: what each
        drafter lags, as ``_num_draft_tokens`` was given it): a row that leaves K to the
        policy and would draft while its drafter lags more than ``STEP_CATCH_UP`` tokens (a
        new prompt, what was emitted while K was 0) has its drafter read a prompt read's
        budget of the lag now, between iterations, and drafts this iteration only if that
        caught it up. Read inside a draft step, the lag would hold up every row (a row that
        fixed its K reads it there, so that its draws stay those it makes alone). The budget
        is a decoding turn's for the lagging rows while some row of the iteration does not
        lag, so that it waits for a piece of each; else an idle turn's
        (``_prefill_budget``): a lone stream's drafter reads a short prompt at once and
        drafts at once, instead of decoding plainly while it reads in pieces, with no one
        else to wait."""
        if self.policy is None or not any(ks):
            return ks
        lagging = [
            g
            for g, k, n in zip(generations, ks, behind[: len(generations)], strict=True)
            if k > 0 and g.spec.auto_k and n > STEP_CATCH_UP
        ]
        if not lagging:
            return ks
        budget = self._prefill_budget(len(lagging) < len(generations), len(lagging))
        start = time.perf_counter()
        read = self.engine.catch_up(lagging, budget)
        self.policy.observe_catch_up(read, time.perf_counter() - start)
        lags = self.engine.behind(lagging)
        still = {id(g) for g, n in zip(lagging, lags, strict=True) if n > STEP_CATCH_UP}
        return [0 if id(g) in still else k for g, k in zip(generations, ks, strict=True)]

    def _finish(self, request: Request, g: Generation) -> None:
        self._release(request, g)
        result = g.finish()
        stats = result.stats
        c = self.counters
        c.requests_finished += 1
        c.tokens += stats.new_tokens
        c.drafted += stats.drafted
        c.accepted += stats.accepted
        if math.isfinite(stats.kl_nats):
            c.kl_nats += stats.kl_nats
            c.kl_tokens += stats.new_tokens
        else:
            c.kl_unbounded += 1
        if self.policy is not None:
            self.policy.learn_acceptance(g)
        _tell(request.on_done, result)

    def _release(self, request: Request, g: Generation) -> None:
        self._active = [pair for pair in self._active if pair[0] is not request]
        with self._wake:
            self._free = sorted([*self._free, g.row])  # the lowest free row is taken first

    def _fail(self, request: Request, g: Generation) -> None:
        """End ``request`` with its generation's own error, and free its row."""
        self._release(request, g)
        self.counters.requests_failed += 1
        _tell(request.on_error, g.error)

    def _fail_all(self, err: Exception) -> None:
        """A failure outside any row: log it, and end every active request with a
        ``BatchError`` (which names none of them)."""
        _log.error("decoding failed outside any one row", exc_info=err)
        for request, g in list(self._active):
            self._release(request, g)
            self.counters.requests_failed += 1
            _tell(request.on_error, BatchError())


def _unread(g: Generation) -> int:
    """Prompt tokens ``g`` has still to read: the shortest are read first, so a short prompt
    that arrives while a long one is read starts decoding at the next turn."""
    return g.prompt_len - g.read


def _tell(callback: Callable | None, value: object) -> None:
    """Hand ``value`` to a request's callback; one that raises (its client's loop is gone) is
    logged, and the decode loop goes on."""
    if callback is None:
        return
    try:
        callback(value)
    except Exception:  # noqa: BLE001 - a callback must not stop the decode loop
        _log.warning("a request's callback failed", exc_info=True)
