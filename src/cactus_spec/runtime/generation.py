"""One generation: the request that asks for it, its state while it decodes, its result.

A ``Request`` is what a caller asks for (the server, ``generate``, ``decode_many``, lm-eval
and the bench build one the same way, by keyword) and never changes. A ``Generation`` holds
its request and occupies one row (slot) of the backends' caches while it decodes; the
stepper (``stepper``) advances any number of them together. Everything that belongs to a
single sequence lives here: what to emit (budget, EOS, stop strings), what to stream, and
the counts of its iterations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from cactus_spec.core.audit import reported_kl
from cactus_spec.core.budget import pinsker_bound
from cactus_spec.core.penalties import Penalties
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime.grammar import Constraint, Grammar
from cactus_spec.runtime.logprobs import TokenLogprob, token_logprobs
from cactus_spec.runtime.verifications import Verification, verification_of


@dataclass(frozen=True, kw_only=True, eq=False)
class Request:
    """One generation to run: ``max_new_tokens`` tokens at most after ``prompt_ids``, drawn
    with ``seed`` by ``spec`` (None: the run's or the engine's; its K None leaves K to the
    policy) under ``sampling`` (None: the run's, ``decode_many``'s). It ends at EOS (unless
    ``ignore_eos``), at a token of ``stop_token_ids`` or a string of ``stop``; ``logprobs``
    alternatives per token (``runtime.logprobs``; None: none), ``penalties`` and ``grammar``
    (what the output must match) shape its distributions. The callbacks hear its text, its
    log-probabilities, its result or its own error. Two requests are never equal unless
    they are the same object: a scheduler tells them apart by identity."""

    prompt_ids: Sequence[int]  # kept as a tuple, as are the stops
    max_new_tokens: int
    seed: int = 0
    spec: DecodeSpec | None = None
    sampling: SamplingConfig | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    penalties: Penalties | None = None
    grammar: Grammar | None = None
    on_text: Callable[[str], None] | None = None
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
    on_done: Callable[[GenerationResult], None] | None = None
    on_error: Callable[[BaseException], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclass
class GenerationStats:
    """Counts, timings and the divergence meter of one ``generate`` call.

    Only what was emitted counts. An iteration verifies its drafts and emits the
    accepted ones plus one token of its own (the correction or the bonus), unless
    EOS, a stop string or the token budget ends generation first: then the tokens
    after the end are dropped, and so are the drafts among them. So

    - ``drafted``: tokens the drafter proposed (work done, emitted or not);
    - ``accepted``: drafted tokens that were accepted *and emitted* (an EOS draft
      counts; drafts verified after it do not);
    - ``new_tokens == accepted + iterations`` when every iteration emitted its own
      token, ``accepted + iterations - 1`` when generation ended inside the last
      iteration's accepted drafts;
    - ``reached_by_position[j]`` / ``accepted_by_position[j]``: iterations in which
      draft position j had its verdict emitted (the chain reached it and generation
      had not ended before it) / in which it was accepted and emitted;
    - ``kl_nats``: the exact KL(law || q) summed over the drafted positions that
      emitted a token (see the module docstring); inf where a rule's law left q's support
      (``as_dict`` then gives None and ``kl_unbounded``: ``audit.reported_kl``);
    - ``time_grammar_s``: wall time computing and applying the grammar's masks (part of
      the draft and verify times it happened in);
    - ``kl_budget``: the answer's divergence budget in nats when its spec sets one
      (``core.budget``; ``kl_nats`` never exceeds it), and ``tv_bound``, sqrt(budget / 2):
      how far the budget lets the probability of any event move from the verifier's;
    - ``opening``: the first iteration's (drafts reached, drafts kept): where the answer
      starts, a draft and its verifier often disagree on the first token (its style: a code
      fence or a sentence), so the serving policy learns that iteration apart
      (``policy.SpeculationPolicy.chances``);
    - ``cached_prompt_tokens`` / ``draft_cached_prompt_tokens``: prompt tokens the verifier
      / the draft model did not read because their row's cache held them from an earlier
      sequence (prefix caching, ``prefixes``);
    - ``read_prompt_tokens`` / ``time_prompt_s``: prompt tokens the verifier read before the
      first iteration (every one but the cached ones and the last, which the first iteration
      reads) and the wall time of the forwards that read them (a forward that read several
      prompts counted whole in each; part of ``time_verify_s``).
    """

    iterations: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    reached_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_audit_s: float = 0.0
    time_grammar_s: float = 0.0
    time_total_s: float = 0.0
    kl_nats: float = 0.0
    kl_budget: float | None = None
    opening: tuple[int, int] = (0, 0)
    cached_prompt_tokens: int = 0
    draft_cached_prompt_tokens: int = 0
    read_prompt_tokens: int = 0
    time_prompt_s: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per iteration."""
        return self.accepted / self.iterations if self.iterations else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Rate at which draft position j is accepted, given the chain reached it."""
        pairs = zip(self.accepted_by_position, self.reached_by_position, strict=True)
        return [a / r if r else 0.0 for a, r in pairs]

    @property
    def time_other_s(self) -> float:
        """Wall time outside the two models' forward passes and the divergence meter."""
        spent = self.time_draft_s + self.time_verify_s + self.time_audit_s
        return max(0.0, self.time_total_s - spent)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total_s if self.time_total_s else 0.0

    @property
    def kl_nats_per_token(self) -> float:
        return self.kl_nats / self.new_tokens if self.new_tokens else 0.0

    @property
    def tv_bound(self) -> float | None:
        """Pinsker's bound on |P(A) - Q(A)| for any event A the budget allows; None without."""
        return None if self.kl_budget is None else pinsker_bound(self.kl_budget)

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        """Count one iteration that drafted ``drafted`` tokens, accepted ``accepted`` of them
        and emitted the first ``emitted`` of its ``accepted + 1`` tokens."""
        self.iterations += 1
        self.drafted += drafted
        kept = min(accepted, emitted)  # accepted drafts that were emitted
        self.accepted += kept
        reached = min(accepted + 1, drafted) if emitted > accepted else kept
        if self.iterations == 1:
            self.opening = (reached, kept)
        grow = drafted - len(self.reached_by_position)
        if grow > 0:
            self.reached_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for j in range(reached):
            self.reached_by_position[j] += 1
        for j in range(kept):
            self.accepted_by_position[j] += 1

    def as_dict(self) -> dict:
        """Every field and derived figure, JSON-ready: an unbounded divergence is None with
        ``kl_unbounded`` true."""
        derived = ("mean_accepted", "acceptance_by_position", "time_other_s", "tokens_per_s")
        divergence = reported_kl(self.kl_nats)
        per_token = reported_kl(self.kl_nats_per_token)["kl_nats"]
        return {
            **asdict(self),
            **{name: getattr(self, name) for name in derived},
            **divergence,
            "kl_nats_per_token": per_token,
            "tv_bound": self.tv_bound,
        }


@dataclass
class GenerationResult:
    """``token_ids``: the new tokens only; ``text``: None without a tokenizer; ``logprobs``:
    each new token's log q and alternatives (``runtime.logprobs``), when asked for."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    interrupted: bool = False
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", None if cut off
    logprobs: list[TokenLogprob] | None = None


#: The longest error message a failed row reports (a grammar's error may quote its source).
MAX_ERROR_CHARS = 300


def row_error_message(err: BaseException) -> str:
    """``err`` as one line of at most ``MAX_ERROR_CHARS`` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class Generation:
    """The state of one sequence being decoded in row ``row`` of the caches, by ``spec``
    (its method and K; K None leaves it to the caller's policy), its drafts judged by the
    kind ``verification`` declares for the row (``verifications``)."""

    def __init__(
        self,
        request: Request,
        *,
        eos_ids: frozenset[int],
        tokenizer=None,
        device: torch.device | str = "cpu",
        row: int = 0,
        constraint: Constraint | None = None,
    ) -> None:
        if request.spec is None or request.sampling is None:
            raise ValueError("a generation's request needs its spec and sampling")
        self.request = request
        self.spec: DecodeSpec = request.spec
        self.sampling: SamplingConfig = request.sampling
        self.row = row
        self.context = list(request.prompt_ids)
        self.prompt_len = len(request.prompt_ids)
        self.read = 0  # prompt tokens in the verifier's cache (``Stepper.prefill``)
        self.generator = torch.Generator(device=device).manual_seed(request.seed)
        # its kind, once
        self.verification: Verification = verification_of(
            self.spec, self.sampling, request.max_new_tokens
        )
        # what its drafts' acceptance depends on, so rows of one key share what the policy
        # learns of it: its spec but K (rows at a fixed K and those that leave it open alike),
        # and its sampling
        self.acceptance_key = (replace(self.spec, num_draft_tokens=None), self.sampling)
        self.eos = eos_ids
        self.tokenizer = tokenizer
        self.token_logprobs: list[TokenLogprob] = []
        penalties = request.penalties
        self.penalties = penalties if penalties is not None and penalties.active else None
        self._prompt_tokens: torch.Tensor | None = None  # [V] bool, for the repetition penalty
        self.constraint = constraint  # the grammar the output must match (``grammar``)
        self.stats = GenerationStats(kl_budget=self.spec.kl_budget)
        self.streamed = ""
        self.done = False
        self.finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
        self.error: Exception | None = None  # what ended this row alone (``fail``)
        self.started = time.perf_counter()

    def fail(self, err: Exception) -> None:
        """End this generation with ``err``, raised by its own processing (its grammar, its
        rule, its penalties): the stepper finishes the iteration for its neighbours, whose
        draws never depend on this row, and the caller reports ``err`` to this request only."""
        if self.error is None:
            self.error = err
        self.done = True

    def own(self, work: Callable, *args):
        """``work(*args)``, this row's own work, or None once the row has failed: an exception
        fails this row only (``fail``)."""
        if self.error is not None:
            return None
        try:
            return work(*args)
        except Exception as err:  # noqa: BLE001 - the row's own: it ends the row alone
            self.fail(err)
            return None

    @property
    def new_ids(self) -> list[int]:
        return self.context[self.prompt_len :]

    def process(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> torch.Tensor:
        """The distributions [T, V] of logits [T, V]: the penalties (row t counting the
        output and the first len(drafts) - T + 1 + t drafts, ``core.penalties``), the
        grammar's mask after those same tokens (``grammar``), then the sampling processing.
        The drafter and the verifier both call this, so p and q of a position are processed
        alike. An error of the penalties or the grammar fails this row only (``fail``) and
        its row gets the unprocessed logits' distribution, which nothing emits."""
        processed = self.own(self._penalised_and_masked, logits, drafts)
        return logits_to_probs(logits if processed is None else processed, self.sampling)

    def _penalised_and_masked(self, logits: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        if self.penalties is not None:
            width = logits.shape[-1]
            new = torch.tensor(self.new_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(new, minlength=width)[:width]  # [V]
            if self._prompt_tokens is None:
                prompt = torch.tensor(self.context[: self.prompt_len], device=logits.device)
                self._prompt_tokens = torch.zeros(width, dtype=torch.bool, device=logits.device)
                self._prompt_tokens[prompt[prompt < width]] = True
            logits = self.penalties.apply(logits, counts, self._prompt_tokens, drafts)
        if self.constraint is not None:
            start = time.perf_counter()
            masked = torch.empty_like(logits)  # [T, V]
            for t, bias in enumerate(self.constraint.biases(drafts, logits.shape[0])):
                torch.add(logits[t], bias.to(logits.device), out=masked[t])
            logits = masked
            self.stats.time_grammar_s += time.perf_counter() - start
        return logits

    def allowed(self, drafts: Sequence[int]) -> torch.Tensor | None:
        """[V] bool: the tokens the grammar allows after the output and ``drafts``; None
        without a grammar, or once the row has failed (an error here fails it)."""
        return None if self.constraint is None else self.own(self.constraint.mask, drafts)

    @property
    def processes_drafts(self) -> bool:
        """Whether ``process`` reads the drafts (penalties or a grammar)."""
        return self.penalties is not None or self.constraint is not None

    def admitted(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` (from the first) may be verified: all, unless the output
        must match a grammar that refuses one."""
        return len(drafts) if self.constraint is None else self.constraint.admitted(drafts)

    @property
    def reading(self) -> bool:
        """Whether the verifier has prompt tokens left to read: all but the last, which the
        first iteration feeds with the drafts."""
        return self.read < self.prompt_len - 1

    @property
    def remaining(self) -> int:
        """Tokens of the budget not yet emitted."""
        return self.request.max_new_tokens - len(self.new_ids)

    def draft_budget(self, k: int) -> int:
        """How many of ``k`` drafts could still be emitted: one token of the budget is the
        verifier's own (drafts beyond it would be cut anyway)."""
        if not self.spec.drafts:
            return 0
        return max(0, min(k, self.request.max_new_tokens - len(self.new_ids) - 1))

    def finish(self, interrupted: bool = False) -> GenerationResult:
        """The result so far; the total time runs from construction."""
        self.stats.time_total_s = time.perf_counter() - self.started
        self.stats.new_tokens = len(self.new_ids)
        return GenerationResult(
            self.new_ids,
            self.text(),
            self.stats,
            interrupted,
            self.finish_reason,
            None if self.request.logprobs is None else self.token_logprobs,
        )

    def emit(self, tokens: list[int], q: torch.Tensor | None = None) -> int:
        """Append tokens, honouring the budget, EOS and stop strings; stream new text (and
        the kept tokens' log q, from q [>= len(tokens), V], the rows they were emitted at).
        Returns how many of ``tokens`` were kept."""
        kept = self._append(tokens)
        if self.constraint is not None:
            self.constraint.advance(tokens[:kept])
        if self.request.logprobs is not None and q is not None:
            entries = token_logprobs(q, tokens[:kept], self.request.logprobs)
            self.token_logprobs += entries
            if self.request.on_logprobs is not None:
                self.request.on_logprobs(entries)
        if self.request.on_text is not None and self.tokenizer is not None:
            text = self._decode()
            self._stream(text[: _first_stop(text, self.request.stop)])
        return kept

    def _append(self, tokens: list[int]) -> int:
        """Append tokens up to the budget, EOS or a stop string; how many were kept."""
        kept = 0
        for token in tokens:
            self.context.append(token)
            kept += 1
            if token in self.eos or len(self.new_ids) >= self.request.max_new_tokens:
                self.done = True
                self.finish_reason = "stop" if token in self.eos else "length"
                break
        if self.tokenizer is None or not self.request.stop:
            return kept  # nothing to look for in the text: skip decoding it on the hot path
        if _first_stop(self._decode(), self.request.stop) is not None:
            kept = self._cut_at_stop(kept)
            self.done = True
            self.finish_reason = "stop"
        return kept

    def _cut_at_stop(self, kept: int) -> int:
        """Drop the tokens after the one that completed a stop string; return how many of
        this iteration's ``kept`` tokens remain."""
        start = len(self.context) - kept
        for count in range(1, kept):
            text = self._decode(self.context[self.prompt_len : start + count])
            if _first_stop(text, self.request.stop) is not None:
                del self.context[start + count :]
                return count
        return kept

    def _stream(self, text: str) -> None:
        """Pass on the text not yet streamed, holding back what may still change: a
        partial multi-byte character or the start of a stop string."""
        if not self.done:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - held_back(text, self.request.stop)]
        if text.startswith(self.streamed) and len(text) > len(self.streamed):
            assert self.request.on_text is not None  # emit streams to a listener only
            self.request.on_text(text[len(self.streamed) :])
            self.streamed = text

    def _decode(self, ids: list[int] | None = None) -> str:
        """The text of ``ids`` (default: every new token)."""
        ids = self.new_ids if ids is None else ids
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self) -> str | None:
        """The new text, cut before the first stop string; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._decode()
        return text[: _first_stop(text, self.request.stop)]


def check_stops(stop: str | Sequence[str] | None) -> list[str]:
    """Stop strings as a list: one string is one stop (not its characters); each must be a
    non-empty string, else ValueError naming it."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stops:
        if not isinstance(s, str):
            raise ValueError(f"stop strings must be strings, got {s!r}")
        if not s:
            raise ValueError("stop strings must be non-empty")
    return stops


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could still become a stop string (not streamed yet)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                longest = max(longest, n)
                break
    return longest
