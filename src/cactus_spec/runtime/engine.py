"""The public decoder: loads the verifier and the drafter, encodes prompts, and generates.

One iteration (``stepper``): the drafter proposes K tokens; the verifier scores
``[t, d_1..d_K]`` (t = the last emitted token, not yet in its cache) in ONE forward pass,
giving K+1 rows of q; ``verify`` keeps m drafts and emits one more token; the verifier's
cache is rolled back to the kept prefix. With no draft (K = 0, the autoregressive baseline)
the same step samples one token from q. ``generate`` decodes one sequence in row 0; the
scheduler (``scheduler``) decodes many at once through the same stepper.

The divergence meter sums, over every emitted drafted position, the exact
KL(step_law || q) from ``audit``: an unbiased estimate of the sequence-level
KL(P_method || P_verifier) in nats (0 for SpS and at temperature 0).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from cactus_spec.backends.quant import check_quant
from cactus_spec.core.methods import DEFAULT_NUM_DRAFT_TOKENS
from cactus_spec.core.rules import Rule, SpS
from cactus_spec.core.sampling import SamplingConfig, check_seed
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.divergence import Divergence, quant_divergence
from cactus_spec.loading.models import LoadedModel, check_same_vocabulary, load_model
from cactus_spec.runtime.drafters import Drafter, ModelDrafter, NGramDrafter
from cactus_spec.runtime.generation import Generation, GenerationResult, GenerationStats
from cactus_spec.runtime.stepper import Stepper

__all__ = ["GenerationResult", "GenerationStats", "SpeculativeDecoder", "check_prompt_text"]

ModelSource = str | LoadedModel | PreTrainedModel


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
    auto, lean or hf). ``draft_quant`` and ``verifier_quant`` ("none", "int8", "int4") apply to
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
        max_batch: int = 1,
    ) -> None:
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if rule is not None and not isinstance(rule, Rule):
            raise TypeError(f"rule must be a Rule (SpS(), Cactus(delta), ...), got {rule!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.rule = rule if rule is not None else SpS()
        self.num_draft_tokens = num_draft_tokens
        check_quant(draft_quant, "draft_quant")
        self.target = _as_loaded(
            "target", target, dtype, device, threads, check_quant(verifier_quant, "verifier_quant")
        )
        self.tokenizer = self.target.tokenizer
        self.target_backend = make_backend(self.target, backend, max_batch)
        self.max_batch = max_batch
        self.vocab_size = self.target_backend.vocab_size
        if self.tokenizer is not None:
            self.vocab_size = min(self.vocab_size, len(self.tokenizer))
        load = {"dtype": dtype, "device": device, "threads": threads, "quant": draft_quant}
        self.drafter = self._make_drafter(draft, drafter, load, backend)
        self.stepper = Stepper(self.target_backend, self.drafter, self.vocab_size)

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
        return ModelDrafter(make_backend(loaded, backend, self.max_batch), self.vocab_size)

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """Prompt text (through the chat template when the tokenizer has one) or ids -> ids."""
        if isinstance(prompt, str):
            check_prompt_text(prompt)
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            if chat and getattr(self.tokenizer, "chat_template", None):
                return self.encode_chat([{"role": "user", "content": prompt}])
            return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        ids = _token_ids(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        return ids

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Chat messages ({"role", "content"}) through the chat template, with the prompt of
        the assistant's turn, -> ids."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat needs a tokenizer with a chat template")
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

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
        generation = self.new_generation(
            prompt_ids, max_new_tokens, sampling, seed, stop=stop, on_text=on_text
        )
        try:
            self.stepper.prefill([generation])
            while not generation.done:
                self.stepper.step([generation], [self.num_draft_tokens])
        except KeyboardInterrupt:
            return generation.finish(interrupted=True)
        return generation.finish()

    def new_generation(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        seed: int,
        *,
        rule: Rule | None | str = "default",
        num_draft_tokens: int | None = None,
        stop: Sequence[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        row: int = 0,
    ) -> Generation:
        """A generation of ``prompt_ids`` in ``row``, with this decoder's rule unless ``rule``
        is given (None: autoregressive). Without a drafter nothing is ever drafted."""
        rule = self.rule if rule == "default" else rule
        return Generation(
            prompt_ids,
            max_new_tokens,
            sampling,
            seed,
            rule=rule if self.drafter is not None else None,
            num_draft_tokens=num_draft_tokens,
            eos_ids=self.target.eos_ids,
            tokenizer=self.tokenizer,
            stop=stop,
            on_text=on_text,
            device=self.target.device,
            row=row,
        )

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
