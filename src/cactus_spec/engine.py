"""The draft -> verify -> accept -> roll back loop, and its statistics.

One iteration, batch size 1: the drafter proposes K tokens; the verifier scores
``[t, d_1..d_K]`` (t = the last emitted token, not yet in its cache) in ONE
forward pass, giving K+1 rows of q; ``verify`` keeps m drafts and emits one more
token; the verifier's cache is rolled back to the kept prefix. With no draft
(K = 0, the autoregressive baseline) the same step samples one token from q.

The divergence meter sums, over every emitted drafted position, the exact
KL(step_law || q) from ``audit``: an unbiased estimate of the sequence-level
KL(P_method || P_verifier) in nats (0 for SpS and at temperature 0).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from cactus_spec.audit import step_divergences
from cactus_spec.backends.base import Backend
from cactus_spec.backends.load import make_backend
from cactus_spec.backends.quant import check_quant
from cactus_spec.divergence import Divergence, quant_divergence
from cactus_spec.drafters import Draft, Drafter, ModelDrafter, NGramDrafter
from cactus_spec.methods import DEFAULT_NUM_DRAFT_TOKENS
from cactus_spec.models import LoadedModel, check_same_vocabulary, load_model
from cactus_spec.rules import Rule, SpS
from cactus_spec.sampling import (
    SamplingConfig,
    check_seed,
    logits_to_probs,
    sample_inverse_cdf,
    uniforms,
)
from cactus_spec.verification import verify

ModelSource = str | LoadedModel | PreTrainedModel


class TimedBackend:
    """A backend wrapper that adds up the wall time of its forward passes."""

    def __init__(self, backend: Backend, device: torch.device) -> None:
        self.inner = backend
        self.seconds = 0.0
        self._sync = device.type == "cuda"

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def append(self, token_ids: Sequence[int], keep: int = 0) -> Tensor:
        start = time.perf_counter()
        logits = self.inner.append(token_ids, keep=keep)
        if self._sync:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        return logits


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
      emitted a token (see the module docstring).
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
    time_total_s: float = 0.0
    kl_nats: float = 0.0

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

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        """Count one iteration that drafted ``drafted`` tokens, accepted ``accepted`` of them
        and emitted the first ``emitted`` of its ``accepted + 1`` tokens."""
        self.iterations += 1
        self.drafted += drafted
        kept = min(accepted, emitted)  # accepted drafts that were emitted
        self.accepted += kept
        reached = min(accepted + 1, drafted) if emitted > accepted else kept
        grow = drafted - len(self.reached_by_position)
        if grow > 0:
            self.reached_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for j in range(reached):
            self.reached_by_position[j] += 1
        for j in range(kept):
            self.accepted_by_position[j] += 1

    def as_dict(self) -> dict:
        """Every field and derived figure, JSON-ready."""
        derived = (
            "mean_accepted",
            "acceptance_by_position",
            "time_other_s",
            "tokens_per_s",
            "kl_nats_per_token",
        )
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass
class GenerationResult:
    """``token_ids``: the new tokens only; ``text``: None without a tokenizer."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    interrupted: bool = False


def _as_loaded(name: str, source: ModelSource, dtype, device, threads, quant) -> LoadedModel:
    """``source`` loaded; ``quant`` applies only to what is loaded here (never to a model
    object the caller owns)."""
    if isinstance(source, LoadedModel):
        return source
    if not isinstance(source, (str, PreTrainedModel)) and not hasattr(source, "__fspath__"):
        raise TypeError(
            f"{name} must be a model name, path, hub id, LoadedModel or PreTrainedModel, "
            f"got {type(source).__name__}"
        )
    if isinstance(source, PreTrainedModel):
        quant = "none"
    return load_model(source, dtype=dtype, device=device, threads=threads, quant=quant)


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with drafts from ``draft`` or an n-gram lookup.

    ``draft=None`` with ``drafter="model"`` decodes the verifier autoregressively
    through the same sampling code: the baseline every speedup is measured
    against. ``drafter`` may also be "ngram" or any ``Drafter`` object.

    ``backend`` picks the code that runs both models (``backends.load.make_backend``:
    auto, lean or hf). ``draft_quant`` and ``verifier_quant`` ("none" or "int8") apply to
    models this constructor loads from a name or path: the draft is int8 by default (the
    output law depends only on the verifier, so SpS stays exact), the verifier is not.
    """

    def __init__(
        self,
        target: ModelSource,
        draft: ModelSource | None = None,
        rule: Rule | None = None,
        num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
        drafter: str | Drafter = "model",
        *,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        threads: int | None = None,
        backend: str = "auto",
        draft_quant: str = "int8",
        verifier_quant: str = "none",
    ) -> None:
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if rule is not None and not isinstance(rule, Rule):
            raise TypeError(f"rule must be a Rule (SpS(), Cactus(delta), ...), got {rule!r}")
        self.rule = rule if rule is not None else SpS()
        self.num_draft_tokens = num_draft_tokens
        check_quant(draft_quant, "draft_quant")
        self.target = _as_loaded(
            "target", target, dtype, device, threads, check_quant(verifier_quant, "verifier_quant")
        )
        self.tokenizer = self.target.tokenizer
        self.target_backend = TimedBackend(make_backend(self.target, backend), self.target.device)
        self.vocab_size = self.target_backend.vocab_size
        if self.tokenizer is not None:
            self.vocab_size = min(self.vocab_size, len(self.tokenizer))
        load = {"dtype": dtype, "device": device, "threads": threads, "quant": draft_quant}
        self.drafter = self._make_drafter(draft, drafter, load, backend)

    def _make_drafter(self, draft, drafter, load: dict, backend: str) -> Drafter | None:
        if not isinstance(drafter, str):
            return drafter
        if drafter == "ngram":
            return NGramDrafter()
        if drafter != "model":
            raise ValueError(f"drafter must be 'model', 'ngram' or a Drafter, got {drafter!r}")
        if draft is None:
            return None
        loaded = _as_loaded("draft", draft, **load)
        self.vocab_size = check_same_vocabulary(self.target, loaded)
        return ModelDrafter(make_backend(loaded, backend), self.vocab_size)

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """Prompt text (through the chat template when the tokenizer has one) or ids -> ids."""
        if isinstance(prompt, str):
            check_prompt_text(prompt)
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            if chat and getattr(self.tokenizer, "chat_template", None):
                messages = [{"role": "user", "content": prompt}]
                prompt = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        ids = _token_ids(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = SamplingConfig.temperature,
        top_k: int = SamplingConfig.top_k,
        top_p: float = SamplingConfig.top_p,
        seed: int = 0,
        stop: Sequence[str] | None = None,
        chat: bool = True,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt``.

        Stops at EOS (kept in ``token_ids``), at a stop string (the text is cut
        before it; ``token_ids`` end with the token that completed it), or at the
        budget. Ctrl-C returns what was generated so far, with ``interrupted=True``.
        ``on_text`` receives each new piece of text. ``seed`` is an integer in
        [0, 2**64 - 1]; the same seed gives the same tokens.
        """
        sampling = SamplingConfig(temperature, top_k, top_p)
        check_seed(seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt_ids = self.encode(prompt, chat)
        self.check_context(len(prompt_ids), max_new_tokens)
        run = _Run(self, prompt_ids, max_new_tokens, sampling, seed, stop, on_text)
        return run.execute()

    def verifier_divergence(self) -> Divergence | None:
        """How far a quantised verifier's law is from its bfloat16 original (KL in nats per
        token on real text, ``divergence``): measured once per model, then cached. None
        for an unquantised verifier."""
        return quant_divergence(self.target)

    def check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise ValueError when the verifier's cache could overflow (drafts included)."""
        parts = {"prompt": prompt_tokens, "max_new_tokens": max_new_tokens}
        if self.drafter is not None:
            parts["num_draft_tokens"] = self.num_draft_tokens
        limit = self.target_backend.context_length
        if sum(parts.values()) > limit:
            terms = " + ".join(f"{name} ({count})" for name, count in parts.items())
            raise ValueError(
                f"context overflow: {terms} = {sum(parts.values())} tokens exceed the "
                f"verifier's context length {limit}"
            )


def check_prompt_text(prompt: str) -> None:
    """ValueError for an empty prompt or one that is not valid Unicode text (lone
    surrogates, such as the bytes of invalid UTF-8 on a command line)."""
    if not prompt.strip():
        raise ValueError("prompt must not be empty")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"prompt is not valid UTF-8 text (undecodable character at position {err.start})"
        ) from None


def _token_ids(prompt: Sequence[int] | Tensor) -> list[int]:
    """Prompt token ids as ints; floats, bools and other non-integers are refused."""
    if isinstance(prompt, Tensor):
        if prompt.is_floating_point() or prompt.dtype == torch.bool or prompt.dim() != 1:
            raise ValueError(
                f"prompt token ids must be a 1-D integer tensor, got {prompt.dtype} "
                f"of shape {tuple(prompt.shape)}"
            )
        return prompt.tolist()
    ids = list(prompt)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise ValueError(f"prompt token ids must be integers, got {bad[0]!r}")
    return [int(t) for t in ids]


class _Run:
    """State of one generate call: context, caches, statistics, stop conditions."""

    def __init__(self, decoder, prompt_ids, max_new_tokens, sampling, seed, stop, on_text):
        self.d = decoder
        self.context = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_new = max_new_tokens
        self.sampling = sampling
        self.generator = torch.Generator(device=decoder.target.device).manual_seed(seed)
        self.stop = list(stop or [])
        self.on_text = on_text
        self.stats = GenerationStats()
        self.eos = decoder.target.eos_ids
        self.streamed = ""
        self.done = False

    @property
    def new_ids(self) -> list[int]:
        return self.context[self.prompt_len :]

    def execute(self) -> GenerationResult:
        d = self.d
        d.target_backend.reset()
        d.target_backend.seconds = 0.0
        if d.drafter is not None:
            d.drafter.reset()
        start = time.perf_counter()
        interrupted = False
        try:
            if self.prompt_len > 1:
                d.target_backend.append(self.context[:-1], keep=1)
            while not self.done:
                self.step()
        except KeyboardInterrupt:
            interrupted = True
        self.stats.time_total_s = time.perf_counter() - start
        self.stats.time_verify_s = d.target_backend.seconds
        self.stats.new_tokens = len(self.new_ids)
        return GenerationResult(self.new_ids, self.text(), self.stats, interrupted)

    def step(self) -> None:
        """One iteration: draft, score in one pass, verify, roll back, emit."""
        budget = self.max_new - len(self.new_ids) - 1  # drafts beyond it would be cut anyway
        draft = self.propose(min(self.d.num_draft_tokens, budget))
        k = len(draft.tokens)
        backend = self.d.target_backend
        kept = backend.length
        logits = backend.append([self.context[-1], *draft.tokens], keep=k + 1)
        q = logits_to_probs(logits[:, : self.d.vocab_size], self.sampling)  # [K+1, V]
        tokens = [self._sample(q)] if k == 0 else self._verify(draft, q)
        accepted = len(tokens) - 1
        backend.rollback(kept + 1 + accepted)
        emitted = self.emit(tokens)
        self.stats.record(k, accepted, emitted)
        if k and not self.sampling.greedy and not self.d.rule.lossless:
            self._meter(draft, q, min(emitted, k))

    def propose(self, k: int) -> Draft:
        """The drafter's proposal of up to ``k`` tokens, its wall time counted as draft time."""
        if self.d.drafter is None or k < 1:
            return Draft([], None)
        start = time.perf_counter()
        draft = self.d.drafter.propose(self.context, k, self.sampling, self.generator)
        self.stats.time_draft_s += time.perf_counter() - start
        return draft

    def _sample(self, q: Tensor) -> int:
        if self.sampling.greedy:
            return int(q[-1].argmax())
        u = uniforms(1, 1, self.generator, q.device)[:, 0]
        return int(sample_inverse_cdf(q[-1:], u))

    def _verify(self, draft: Draft, q: Tensor) -> list[int]:
        """Run ``verify`` on the chain: the accepted drafts, then the token of its own."""
        ids = torch.tensor([draft.tokens], dtype=torch.long, device=q.device)  # [1, K]
        p = None if draft.probs is None else draft.probs.unsqueeze(0)  # [1, K, V]
        out = verify(
            ids, q.unsqueeze(0), self.d.rule, p, self.generator, self.sampling.greedy, False
        )
        accepted = int(out.num_accepted[0])
        return out.tokens[0, : accepted + 1].tolist()

    def _meter(self, draft: Draft, q: Tensor, positions: int) -> None:
        """Add KL(law || q) of the first ``positions`` drafted positions (those that
        emitted a token) to the divergence meter; q [K+1, V]."""
        start = time.perf_counter()
        ids = torch.tensor(draft.tokens, dtype=torch.long, device=q.device)  # [K]
        p = draft.probs if draft.probs is not None else _one_hot(ids, q)  # [K, V]
        divergence = step_divergences(p[:positions], q[:positions], self.d.rule)  # [positions]
        self.stats.kl_nats += float(divergence.sum())
        self.stats.time_audit_s += time.perf_counter() - start

    def emit(self, tokens: list[int]) -> int:
        """Append tokens, honouring the budget, EOS and stop strings; stream new text.
        Returns how many of ``tokens`` were kept."""
        kept = 0
        for token in tokens:
            self.context.append(token)
            kept += 1
            if token in self.eos or len(self.new_ids) >= self.max_new:
                self.done = True
                break
        if self.d.tokenizer is None or (not self.stop and self.on_text is None):
            return kept  # nothing to look for in the text: skip decoding it on the hot path
        full = self._decode()
        cut = _first_stop(full, self.stop)
        if cut is not None:
            kept = self._cut_at_stop(kept)
            self.done = True
        if self.on_text is not None:
            self._stream(full[:cut])
        return kept

    def _cut_at_stop(self, kept: int) -> int:
        """Drop the tokens after the one that completed a stop string; return how many of
        this iteration's ``kept`` tokens remain."""
        start = len(self.context) - kept
        for count in range(1, kept):
            text = self._decode(self.context[self.prompt_len : start + count])
            if _first_stop(text, self.stop) is not None:
                del self.context[start + count :]
                return count
        return kept

    def _stream(self, text: str) -> None:
        """Pass on the text not yet streamed, holding back what may still change: a
        partial multi-byte character or the start of a stop string."""
        if not self.done:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - _held_back(text, self.stop)]
        if text.startswith(self.streamed) and len(text) > len(self.streamed):
            self.on_text(text[len(self.streamed) :])
            self.streamed = text

    def _decode(self, ids: list[int] | None = None) -> str:
        """The text of ``ids`` (default: every new token)."""
        ids = self.new_ids if ids is None else ids
        return self.d.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self) -> str | None:
        """The new text, cut before the first stop string; None without a tokenizer."""
        if self.d.tokenizer is None:
            return None
        text = self._decode()
        return text[: _first_stop(text, self.stop)]


def _one_hot(token: Tensor, like: Tensor) -> Tensor:
    return torch.nn.functional.one_hot(token, like.shape[-1]).to(like.dtype)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could still become a stop string (not streamed yet)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                longest = max(longest, n)
                break
    return longest
