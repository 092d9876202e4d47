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

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from cactus_spec.audit import step_divergences
from cactus_spec.drafters import Draft, Drafter, ModelDrafter, NGramDrafter
from cactus_spec.models import (
    LoadedModel,
    TransformersBackend,
    check_same_vocabulary,
    load_model,
)
from cactus_spec.rules import Rule, SpS
from cactus_spec.sampling import SamplingConfig, logits_to_probs, sample_inverse_cdf, uniforms
from cactus_spec.verify import verify

ModelSource = str | LoadedModel | PreTrainedModel


class TimedBackend:
    """A backend wrapper that adds up the wall time of its forward passes."""

    def __init__(self, backend: TransformersBackend) -> None:
        self.inner = backend
        self.seconds = 0.0
        self._sync = backend.model.device.type == "cuda"

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
    """Counts, timings and the divergence meter of one ``generate`` call."""

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

    def record(self, drafted: int, accepted: int) -> None:
        """Count one iteration that drafted ``drafted`` tokens and kept ``accepted``."""
        self.iterations += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.reached_by_position)
        if grow > 0:
            self.reached_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for j in range(min(accepted + 1, drafted)):
            self.reached_by_position[j] += 1
        for j in range(accepted):
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


def _as_loaded(source: ModelSource, dtype, device, threads) -> LoadedModel:
    if isinstance(source, LoadedModel):
        return source
    return load_model(source, dtype=dtype, device=device, threads=threads)


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with drafts from ``draft`` or an n-gram lookup.

    ``draft=None`` with ``drafter="model"`` decodes the verifier autoregressively
    through the same sampling code: the baseline every speedup is measured
    against. ``drafter`` may also be "ngram" or any ``Drafter`` object.
    """

    def __init__(
        self,
        target: ModelSource,
        draft: ModelSource | None = None,
        rule: Rule | None = None,
        num_draft_tokens: int = 10,
        drafter: str | Drafter = "model",
        *,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        threads: int | None = None,
    ) -> None:
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.rule = rule if rule is not None else SpS()
        self.num_draft_tokens = num_draft_tokens
        self.target = _as_loaded(target, dtype, device, threads)
        self.tokenizer = self.target.tokenizer
        self.vocab_size = self.target.model.config.get_text_config().vocab_size
        if self.tokenizer is not None:
            self.vocab_size = min(self.vocab_size, len(self.tokenizer))
        self.target_backend = TimedBackend(TransformersBackend(self.target.model))
        self.draft_backend: TimedBackend | None = None
        self.drafter = self._make_drafter(draft, drafter, dtype, device, threads)

    def _make_drafter(self, draft, drafter, dtype, device, threads) -> Drafter | None:
        if not isinstance(drafter, str):
            return drafter
        if drafter == "ngram":
            return NGramDrafter()
        if drafter != "model":
            raise ValueError(f"drafter must be 'model', 'ngram' or a Drafter, got {drafter!r}")
        if draft is None:
            return None
        loaded = _as_loaded(draft, dtype, device, threads)
        self.vocab_size = check_same_vocabulary(self.target, loaded)
        self.draft_backend = TimedBackend(TransformersBackend(loaded.model))
        return ModelDrafter(self.draft_backend, self.vocab_size)

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """Prompt text (through the chat template when the tokenizer has one) or ids -> ids."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            if chat and getattr(self.tokenizer, "chat_template", None):
                messages = [{"role": "user", "content": prompt}]
                prompt = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt must not be empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.6,
        top_k: int = 20,
        top_p: float = 0.95,
        seed: int = 0,
        stop: Sequence[str] | None = None,
        chat: bool = True,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt``.

        Stops at EOS (kept in ``token_ids``), at a stop string (the text is cut
        before it), or at the budget. Ctrl-C returns what was generated so far,
        with ``interrupted=True``. ``on_text`` receives each new piece of text.
        """
        sampling = SamplingConfig(temperature, top_k, top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt_ids = self.encode(prompt, chat)
        limit = self.target_backend.context_length
        if len(prompt_ids) + max_new_tokens + self.num_draft_tokens > limit:
            raise ValueError(
                f"context overflow: prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({max_new_tokens}) + num_draft_tokens ({self.num_draft_tokens}) exceeds the "
                f"verifier's context length {limit}"
            )
        run = _Run(self, prompt_ids, max_new_tokens, sampling, seed, stop, on_text)
        return run.execute()


class _Run:
    """State of one generate call: context, caches, statistics, stop conditions."""

    def __init__(self, decoder, prompt_ids, max_new_tokens, sampling, seed, stop, on_text):
        self.d = decoder
        self.context = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_new = max_new_tokens
        self.sampling = sampling
        self.generator = torch.Generator(device=decoder.target.model.device).manual_seed(seed)
        self.stop = list(stop or [])
        self.on_text = on_text
        self.stats = GenerationStats()
        self.eos = _eos_ids(decoder)
        self.streamed = ""
        self.done = False

    @property
    def new_ids(self) -> list[int]:
        return self.context[self.prompt_len :]

    def execute(self) -> GenerationResult:
        d = self.d
        d.target_backend.reset()
        d.target_backend.seconds = 0.0
        if d.draft_backend is not None:
            d.draft_backend.seconds = 0.0
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
        self.stats.time_draft_s = d.draft_backend.seconds if d.draft_backend else 0.0
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
        if k:
            self.stats.record(k, accepted)
        else:
            self.stats.iterations += 1
        self.emit(tokens)

    def propose(self, k: int) -> Draft:
        if self.d.drafter is None or k < 1:
            return Draft([], None)
        return self.d.drafter.propose(self.context, k, self.sampling, self.generator)

    def _sample(self, q: Tensor) -> int:
        if self.sampling.greedy:
            return int(q[-1].argmax())
        u = uniforms(1, 1, self.generator, q.device)[:, 0]
        return int(sample_inverse_cdf(q[-1:], u))

    def _verify(self, draft: Draft, q: Tensor) -> list[int]:
        """Run ``verify`` on the chain and meter the divergence of the emitted drafts."""
        k = len(draft.tokens)
        ids = torch.tensor([draft.tokens], dtype=torch.long, device=q.device)  # [1, K]
        p = None if draft.probs is None else draft.probs.unsqueeze(0)  # [1, K, V]
        out = verify(
            ids, q.unsqueeze(0), self.d.rule, p, self.generator, self.sampling.greedy, False
        )
        accepted = int(out.num_accepted[0])
        if not self.sampling.greedy and not self.d.rule.lossless:
            start = time.perf_counter()
            emitted = min(accepted + 1, k)  # drafted positions that emitted a token
            p = draft.probs if draft.probs is not None else _one_hot(ids[0], q)  # [K, V]
            divergence = step_divergences(p[:emitted], q[:emitted], self.d.rule)
            self.stats.kl_nats += float(divergence.sum())
            self.stats.time_audit_s += time.perf_counter() - start
        return out.tokens[0, : accepted + 1].tolist()

    def emit(self, tokens: list[int]) -> None:
        """Append tokens, honouring the budget, EOS and stop strings; stream new text."""
        for token in tokens:
            self.context.append(token)
            if token in self.eos or len(self.new_ids) >= self.max_new:
                self.done = True
                break
        if self.d.tokenizer is None or (not self.stop and self.on_text is None):
            return  # nothing to look for in the text: skip decoding it on the hot path
        full = self._decode()
        cut = _first_stop(full, self.stop)
        self.done = self.done or cut is not None
        if self.on_text is not None:
            self._stream(full[:cut])

    def _stream(self, text: str) -> None:
        """Pass on the text not yet streamed, holding back what may still change: a
        partial multi-byte character or the start of a stop string."""
        if not self.done:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - _held_back(text, self.stop)]
        if text.startswith(self.streamed) and len(text) > len(self.streamed):
            self.on_text(text[len(self.streamed) :])
            self.streamed = text

    def _decode(self) -> str:
        return self.d.tokenizer.decode(self.new_ids, skip_special_tokens=True)

    def text(self) -> str | None:
        """The new text, cut before the first stop string; None without a tokenizer."""
        if self.d.tokenizer is None:
            return None
        text = self._decode()
        return text[: _first_stop(text, self.stop)]


def _one_hot(token: Tensor, like: Tensor) -> Tensor:
    return torch.nn.functional.one_hot(token, like.shape[-1]).to(like.dtype)


def _eos_ids(decoder: SpeculativeDecoder) -> set[int]:
    """End-of-sequence ids from the generation config, the config, or the tokenizer."""
    model = decoder.target.model
    found: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, decoder.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(int(v) for v in value)
    return found


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
