"""The engine: loads the verifier and the drafter, encodes prompts, and decodes by a spec.

One iteration (``stepper``): the drafter proposes K tokens; the verifier scores
``[t, d_1..d_K]`` (t = the last emitted token, not yet in its cache) in ONE forward pass,
giving K+1 rows of q; ``verify`` keeps m drafts and emits one more token; the verifier's
cache is rolled back to the kept prefix. A method that drafts nothing (``ar``) samples one
token from q in the same step.

Callers use the engine's methods and nothing inside it: ``generate`` (one sequence),
``decode_many`` (many, continuously batched over ``max_batch`` rows), ``score``
(log-likelihoods under the verifier), ``encode``/``encode_chat``, ``check_context``, and for
the scheduler ``choose_row``, ``new_generation``, ``prefill``, ``step`` and
``behind``. The engine talks to
models only through ``Backend`` and ``Drafter``: device and EOS ids come with the loaded
model, logits and rollback through the backend.

The divergence meter sums, over every emitted drafted position, the exact
KL(step_law || q) from ``audit``: an unbiased estimate of the sequence-level
KL(P_method || P_verifier) in nats (0 for lossless methods and at temperature 0).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from cactus_spec.backends.base import Backend
from cactus_spec.core.checks import check_int
from cactus_spec.core.methods import DEFAULT_NUM_DRAFT_TOKENS
from cactus_spec.core.penalties import Penalties
from cactus_spec.core.sampling import SamplingConfig, check_seed
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.backend import BACKEND_TYPES, make_backend
from cactus_spec.loading.divergence import Divergence, quant_divergence
from cactus_spec.loading.models import (
    ModelSource,
    as_loaded,
    check_same_vocabulary,
    tokenizers_differ,
)
from cactus_spec.loading.options import LoadOptions, parse_load
from cactus_spec.runtime import scoring
from cactus_spec.runtime.batch import decode_all
from cactus_spec.runtime.drafters import Drafter
from cactus_spec.runtime.drafting import DrafterParts, build_drafter
from cactus_spec.runtime.generation import (
    Generation,
    GenerationResult,
    GenerationStats,
    Request,
    check_stops,
)
from cactus_spec.runtime.grammar import Constraint, Grammar, GrammarLimits, Grammars
from cactus_spec.runtime.logprobs import check_logprobs
from cactus_spec.runtime.policy import SpeculationPolicy, calibrated_policy
from cactus_spec.runtime.prefixes import PrefixCache
from cactus_spec.runtime.stepper import Stepper, StepTiming, Stopping

__all__ = ["GenerationResult", "GenerationStats", "SpeculativeDecoder", "check_prompt_text"]


class SpeculativeDecoder:
    """Decodes with ``verifier`` by ``spec``: its method, K and drafter.

    ``draft`` is the draft model, needed when the spec's drafter needs one
    (``DecodeSpec.needs_draft_model``) and refused otherwise; the drafter is built by its
    registered builder (``drafting``). A request may bring its own spec (``generate``,
    ``decode_many``, the server's ``speculative``), with this engine's drafter (``resolve``).
    A draft whose tokenizer differs from the verifier's drafts text that is encoded again for
    the verifier (``cross_vocab``). ``max_draft_tokens`` bounds K
    for every row (the serving policy's cap, and what ``check_context`` reserves for drafts);
    default: the spec's K.

    ``backend`` picks the code that runs both models (``loading.backend.make_backend``:
    auto, lean, hf, or ggml: llama.cpp over the GGUF files themselves). ``prefix_cache`` lets
    a prompt reuse the keys and values of the longest prefix a row still holds from its last
    sequence (``prefixes``). ``grammar_limits`` bound what a request's grammar may cost
    (``grammar.GrammarLimits``). ``draft_quant`` and ``verifier_quant`` ("none", "int8",
    "int4") apply to models this constructor loads from a name or path: the draft's default
    (``auto``) is int4, int8 where AMX tiles run ``max_batch`` > 1 rows, dense off the CPU
    (``loading.models.resolve_draft_quant``; SpS stays exact whatever the draft; on the ggml
    backend both run the GGUF's own weights), the verifier's is its dense weights.
    ``draft_vocab=N`` keeps the draft's N most frequent tokens in its LM head
    (``loading.head_vocab``: a cheaper draft step, lossless methods stay exact); it applies
    to a draft loaded here, like ``draft_quant``. ``policy`` chooses K for ``generate`` and
    ``decode_many`` where a spec leaves it open (default: one timed on these models when
    first needed, ``calibrated_policy``).
    """

    def __init__(
        self,
        verifier: ModelSource,
        draft: ModelSource | None = None,
        spec: DecodeSpec | None = None,
        *,
        max_draft_tokens: int | None = None,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        threads: int | None = None,
        backend: str = "auto",
        draft_quant: str | None = None,
        draft_vocab: int | None = None,
        verifier_quant: str = "none",
        max_batch: int = 1,
        prefix_cache: bool = True,
        grammar_limits: GrammarLimits | None = None,
        policy: SpeculationPolicy | None = None,
    ) -> None:
        spec = DecodeSpec() if spec is None else spec
        if not isinstance(spec, DecodeSpec):
            raise TypeError(f"spec must be a DecodeSpec (DecodeSpec.of(...)), got {spec!r}")
        check_int("max_batch", max_batch)
        self.spec = spec
        self.max_draft_tokens = _max_draft_tokens(spec, max_draft_tokens)
        _check_draft(spec, draft)
        given: dict[str, Any] = {"verifier": verifier, "draft": draft}
        given["verifier_quant"] = verifier_quant
        given |= {"draft_quant": draft_quant, "draft_vocab": draft_vocab, "backend": backend}
        given |= {"dtype": dtype, "device": device, "threads": threads}
        needs_draft, trees = spec.needs_draft_model, spec.trees
        options = parse_load(
            given, needs_draft=needs_draft, trees=trees, rows=max_batch, default_pair=None
        )
        self.verifier = as_loaded(
            "verifier", options.verifier, **options.model_kwargs(), quant=options.verifier_quant
        )
        self.tokenizer = self.verifier.tokenizer
        self.max_batch = max_batch
        self._backend = make_backend(self.verifier, options.backend, max_batch)
        self.vocab_size = self._backend.vocab_size
        if self.tokenizer is not None:
            self.vocab_size = min(self.vocab_size, len(self.tokenizer))
        self._drafts_text = False  # a draft of another tokenizer: its text is encoded again
        self._drafter = self._make_drafter(options)
        prefixes = PrefixCache(enabled=bool(prefix_cache))
        self._stepper = Stepper(self._backend, self._drafter, self.vocab_size, prefixes)
        self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids, grammar_limits)
        self._policy = policy  # where K is left open; None: timed when first needed

    def _make_drafter(self, options: LoadOptions) -> Drafter | None:
        """The spec's drafter, from its registered builder; the draft model loaded first
        where it needs one (a draft of the verifier's tokenizer sets the vocabulary)."""
        if not self.spec.drafts:
            return None
        assert self.spec.drafter is not None  # a spec that drafts names its drafter
        parts = DrafterParts(self.verifier, self.vocab_size)
        if self.spec.needs_draft_model:
            assert options.draft is not None  # _check_draft: one was given
            draft = as_loaded(
                "draft",
                options.draft,
                **options.model_kwargs(),
                quant=options.draft_quant,
                head_vocab=options.draft_vocab,
            )
            self._drafts_text = tokenizers_differ(self.verifier, draft)
            if not self._drafts_text:
                self.vocab_size = check_same_vocabulary(self.verifier, draft)
            backend = make_backend(draft, options.backend, self.max_batch, draft=True)
            parts = DrafterParts(self.verifier, self.vocab_size, draft, backend, self._drafts_text)
        return build_drafter(self.spec.drafter, parts)

    # --- what callers read ----------------------------------------------------------------

    @property
    def backend(self) -> str:
        """What runs the models: lean, hf or ggml (``loading.backend.BACKEND_TYPES``)."""
        return next(k for k, t in BACKEND_TYPES.items() if isinstance(self._backend, t))

    @property
    def context_length(self) -> int:
        """The most tokens a row of the verifier's cache holds."""
        return self._backend.context_length

    @property
    def device(self) -> torch.device:
        return self.verifier.device

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.verifier.eos_ids

    # --- prompts --------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """Prompt text (through the chat template when the tokenizer has one) or ids -> ids."""
        if isinstance(prompt, str):
            check_prompt_text(prompt)
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            if chat and self.tokenizer.chat_template:
                return self.encode_chat([{"role": "user", "content": prompt}])
            return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        ids = _token_ids(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        return ids

    def encode_chat(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        template: str | None = None,
    ) -> list[int]:
        """Chat messages ({"role", "content"}, and OpenAI's ``tool_calls``) through the chat
        ``template`` (default: the tokenizer's) with ``tools`` offered, and the prompt of the
        assistant's turn, -> ids. ValueError when the template fails on them."""
        template = template or self.chat_template
        if self.tokenizer is None or not template:
            raise ValueError("chat needs a tokenizer with a chat template")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as err:  # jinja2's errors: the template cannot render these messages
            raise ValueError(f"the chat template cannot render them ({err})") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template, None without one."""
        return None if self.tokenizer is None else self.tokenizer.chat_template

    def draft_tokens(self, spec: DecodeSpec) -> int:
        """K a row decoding by ``spec`` drafts when no policy picks it: the spec's own, else
        ``max_draft_tokens`` (0 for a method that drafts nothing)."""
        if not spec.drafts:
            return 0
        return self.max_draft_tokens if spec.num_draft_tokens is None else spec.num_draft_tokens

    def draft_reserve(self, spec: DecodeSpec | None = None) -> int:
        """The cache slots one iteration's drafts may take beyond prompt + max_new_tokens by
        ``spec`` (default: the engine's). None for a chain: a row drafts at most the tokens
        its budget has left but one (``Generation.draft_budget``), so prompt, emitted tokens
        and drafts never pass prompt + max_new_tokens - 1 cached tokens (and a row is never
        padded past its cache's end: ``lean._forward_groups``). (branches - 1) K for a draft
        tree: each of its K depths holds up to ``branches`` nodes, each in a slot of its own."""
        spec = self._spec(spec)
        return self.draft_tokens(spec) * (spec.branches - 1) if spec.trees else 0

    def check_context(
        self, prompt_tokens: int, max_new_tokens: int, spec: DecodeSpec | None = None
    ) -> None:
        """ValueError when decoding by ``spec`` (default: the engine's) could overflow the
        verifier's cache: the prompt, the budget and a draft tree's nodes beyond its depth
        (``draft_reserve``)."""
        spec = self._spec(spec)
        parts = {"prompt": prompt_tokens, "max_new_tokens": max_new_tokens}
        if spec.trees:
            parts["num_draft_tokens x (branches - 1)"] = self.draft_reserve(spec)
        if sum(parts.values()) > self.context_length:
            terms = " + ".join(f"{name} ({count})" for name, count in parts.items())
            raise ValueError(
                f"context overflow: {terms} = {sum(parts.values())} tokens exceed the "
                f"verifier's context length {self.context_length}"
            )

    def check_grammar(self, grammar: Grammar, ignore_eos: bool = False) -> None:
        """ValueError unless ``grammar`` compiles for this model's tokenizer (compiled grammars
        are cached, so a request checked here starts without compiling again)."""
        if not isinstance(grammar, Grammar):
            raise TypeError(f"grammar must be a Grammar, got {type(grammar).__name__}")
        if ignore_eos:
            raise ValueError("ignore_eos cannot be used with a grammar, which ends at EOS")
        self._grammars.compile(grammar)

    # --- decoding -------------------------------------------------------------------------

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
        spec: DecodeSpec | None = None,
        logprobs: int | None = None,
        penalties: Penalties | None = None,
        min_p: float = 0.0,
        grammar: Grammar | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt`` by ``spec`` (default:
        the engine's). A spec with K None leaves the draft length to a policy timed on this
        engine's models once (``policy``): K up to ``max_draft_tokens`` per iteration, and
        drafting stops inside it where the draft's own confidence says another draft would
        not pay (``SpeculationPolicy.keep_drafting``).

        Stops at EOS (kept in ``token_ids``), at a stop string (the text is cut before it;
        ``token_ids`` end with the token that completed it), or at the budget. Ctrl-C returns
        what was generated so far, with ``interrupted=True``. ``on_text`` receives each new
        piece of text. ``seed`` is an integer in [0, 2**64 - 1]; the same seed gives the
        same tokens. ``logprobs`` = N puts each new token's log q and its N most likely
        alternatives in the result (``runtime.logprobs``). ``penalties`` (repetition,
        frequency, presence, logit bias: ``core.penalties``) and ``min_p`` apply to the
        draft's and the verifier's distributions alike, and so does ``grammar``, which the
        output then matches (``runtime.grammar``: SpS emits the grammar-masked q exactly).
        """
        sampling = SamplingConfig(temperature, top_k, top_p, min_p)
        spec = self._spec(spec)
        stops = check_stops(stop)
        prompt_ids = self.encode(prompt, chat)
        request = Request(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            seed=seed,
            spec=spec,
            sampling=sampling,
            stop=tuple(stops),
            logprobs=logprobs,
            penalties=penalties,
            grammar=grammar,
            on_text=on_text,
        )
        self._check_request(request, spec)
        check_logprobs(logprobs)
        if grammar is not None:
            self.check_grammar(grammar)
        if penalties is not None:
            penalties.check_tokens(self.vocab_size)
        policy = self.own_policy() if spec.auto_k else None
        generation = self.new_generation(request, row=0)
        try:
            self._stepper.prefill([generation])
            while not generation.done:
                self._iterate(generation, spec, policy)
        except KeyboardInterrupt:
            return generation.finish(interrupted=True)
        if generation.error is not None:
            raise generation.error
        if policy is not None:
            policy.learn_acceptance(generation)
        return generation.finish()

    def _iterate(
        self, generation: Generation, spec: DecodeSpec, policy: SpeculationPolicy | None
    ) -> None:
        """One iteration of a single stream: K from the policy (and its stopping rule) when
        it has one, else the spec's."""
        if policy is None:
            self.step([generation], [self.draft_tokens(spec)])
            return
        (k,) = policy.choose([generation], self.behind([generation]))
        timing = self.step([generation], [k], policy.stopping([generation]))
        policy.observe(timing)

    def own_policy(self) -> SpeculationPolicy | None:
        """The policy of ``generate`` and ``decode_many`` calls that leave K open: calibrated
        on the first call (a few seconds: call it before timing), then kept (it learns this
        engine's acceptance as it goes); None when nothing is drafted."""
        if self._policy is None:
            self._policy = self.calibrated_policy()
        return self._policy

    def decode_many(
        self,
        requests: Sequence[Request],
        sampling: SamplingConfig | None = None,
        *,
        spec: DecodeSpec | None = None,
        policy: SpeculationPolicy | None = None,
        on_result: Callable[[int, GenerationResult], None] | None = None,
    ) -> list[GenerationResult]:
        """Decode every request by its own spec and sampling, else ``spec`` (default: the
        engine's) and ``sampling`` (default: ``SamplingConfig()``), ``max_batch`` rows at a
        time (``batch.decode_all``); the results in the requests' order, each also handed to
        ``on_result(index, result)`` as it finishes. Every request is checked first. Where a
        request leaves K open, ``policy`` (default: the engine's own, as ``generate``'s)
        chooses it for the batch each iteration, as the server's does."""
        spec = self._spec(spec)
        for index, request in enumerate(requests):
            try:
                self._check_request(request, spec)
            except ValueError as err:
                raise ValueError(f"requests[{index}]: {err}") from None
        if policy is None and any((r.spec or spec).auto_k for r in requests):
            policy = self.own_policy()
        sampling = SamplingConfig() if sampling is None else sampling
        return decode_all(self, requests, sampling, spec, policy=policy, on_result=on_result)

    def _check_request(self, request: Request, spec: DecodeSpec) -> None:
        """What ``generate`` checks of its arguments, for a request of ``decode_many``, by
        its own spec, else ``spec``."""
        self.encode(request.prompt_ids)
        check_seed(request.seed)
        check_int("max_new_tokens", request.max_new_tokens)
        check_stops(request.stop)
        own = self.resolve(request.spec or spec)
        self.check_context(len(request.prompt_ids), request.max_new_tokens, own)

    def score(
        self,
        items: Sequence[scoring.Item],
        on_scored: Callable[[int, scoring.Score], None] | None = None,
    ) -> list[scoring.Score]:
        """(log P(continuation | prefix), whether the continuation is the verifier's greedy
        path) for each (prefix ids, continuation ids), under the verifier alone
        (``scoring``); ``on_scored(index, score)`` as each is done."""
        self._stepper.forget()
        return scoring.score(self._backend, self.vocab_size, items, on_scored)

    def calibrated_policy(self) -> SpeculationPolicy | None:
        """A serving policy for K up to ``max_draft_tokens``, its costs timed on this
        engine's models (``policy.calibrated_policy``); None when nothing is drafted."""
        if self._drafter is None:
            return None
        self._stepper.forget()
        return calibrated_policy(self._backend, self._drafter, self.max_draft_tokens)

    def verifier_divergence(self) -> Divergence | None:
        """How far a quantised verifier's law (int8, int4, or a GGUF run by llama.cpp) is
        from its bfloat16 original (KL in nats per token on real text, ``divergence``):
        measured once per model, then cached. None for an unquantised verifier."""
        return quant_divergence(self.verifier)

    # --- rows, for the scheduler ----------------------------------------------------------

    def new_generation(self, request: Request, row: int) -> Generation:
        """The generation of ``request``, begun in ``row``: the row keeps the longest prefix its
        caches share with the prompt (``Stepper.start``); its spec must draft with this
        engine's drafter, or draft nothing (``resolve``, before its grammar compiles)."""
        if request.spec is not None:
            self.resolve(request.spec)
        generation = Generation(
            request,
            eos_ids=_ends(self.verifier.eos_ids, request),
            tokenizer=self.tokenizer,
            device=self.verifier.device,
            row=row,
            constraint=self._constraint(request),
        )
        self._stepper.start([generation])
        return generation

    def _constraint(self, request: Request) -> Constraint | None:
        """The grammar state of ``request``'s generation, None without a grammar."""
        if request.grammar is None:
            return None
        self.check_grammar(request.grammar, request.ignore_eos)
        return self._grammars.constraint(request.grammar, _ends(self.eos_ids, request))

    def choose_row(self, prompt: Sequence[int], free: Sequence[int]) -> int:
        """The free row ``prompt`` should take (``Stepper.choose_row``)."""
        return self._stepper.choose_row(prompt, free)

    def prefill(self, generations: Sequence[Generation], budget: int | None = None) -> int:
        """Read up to ``budget`` unread prompt tokens (``Stepper.prefill``)."""
        return self._stepper.prefill(generations, budget)

    def step(
        self,
        generations: Sequence[Generation],
        num_draft_tokens: Sequence[int],
        keep_drafting: Sequence[Stopping | None] | None = None,
    ) -> StepTiming:
        """One iteration over the generations, the i-th drafting up to
        ``num_draft_tokens[i]`` tokens, fewer where ``keep_drafting[i]`` stops it
        (``Stepper.step``)."""
        return self._stepper.step(generations, num_draft_tokens, keep_drafting)

    def behind(self, generations: Sequence[Generation]) -> list[int]:
        """Tokens the drafter would read for each generation before drafting again."""
        return self._stepper.behind(generations)

    def catch_up(self, generations: Sequence[Generation], budget: int | None = None) -> int:
        """Let the drafter read up to ``budget`` tokens it lags (``Stepper.catch_up``)."""
        return self._stepper.catch_up(generations, budget)

    def resolve(self, spec: DecodeSpec | None = None, *, seeded: bool = False) -> DecodeSpec:
        """The spec a request decodes by on this engine: ``spec`` (default: the engine's),
        checked against the engine (``_check_drafter``: ValueError naming what is missing),
        with K pinned to ``draft_tokens`` where ``seeded`` and K is left open: the policy's K
        depends on what else is decoding, and a row's draws depend on K, so the seed would
        not reproduce its tokens. Every request the engine decodes is resolved here."""
        spec = self._spec(spec)
        self._check_drafter(spec)
        if seeded and spec.auto_k:
            return spec.with_num_draft_tokens(self.draft_tokens(spec))
        return spec

    def _check_drafter(self, spec: DecodeSpec) -> None:
        """ValueError unless ``spec`` drafts nothing or drafts with this engine's drafter; a
        draft tree needs a drafter of trees (``DecodeSpec.check_trees``), a draft of the
        verifier's tokenizer and token-tree attention in both models."""
        if spec.drafts and spec.drafter != self.spec.drafter:
            have = f"drafts with {self.spec.drafter}" if self.spec.drafts else "has no drafter"
            raise ValueError(
                f"method {spec.method} drafts with {spec.drafter}, but this engine {have}"
            )
        if spec.trees:
            spec.check_trees()
            self._check_tree_models(spec)

    def _check_tree_models(self, spec: DecodeSpec) -> None:
        """A draft tree needs a draft of the verifier's tokenizer (a cross-vocabulary draft
        proposes one text) and token-tree attention in the verifier and the draft."""
        if self._drafts_text:
            raise ValueError(
                f"verification {spec.verification} needs a draft model with the verifier's "
                "tokenizer (this engine's draft drafts text); use chain or block"
            )
        backends: dict[str, Backend] = {"verifier": self._backend}
        if self._drafter is not None and self._drafter.backend is not None:
            backends["draft"] = self._drafter.backend
        for name, backend in backends.items():
            if not backend.reads_trees:
                raise ValueError(
                    f"verification {spec.verification} needs token-tree attention, which the "
                    f"{name}'s backend ({type(backend).__name__}) lacks; use the lean backend "
                    "(--backend lean)"
                )

    def _spec(self, spec: DecodeSpec | None) -> DecodeSpec:
        if spec is None:
            return self.spec
        if not isinstance(spec, DecodeSpec):
            raise TypeError(f"spec must be a DecodeSpec (DecodeSpec.of(...)), got {spec!r}")
        return spec


def _ends(eos_ids: frozenset[int], request: Request) -> frozenset[int]:
    """The tokens that end ``request``'s generation: EOS (unless it ignores EOS) and its
    stop tokens."""
    return (frozenset() if request.ignore_eos else eos_ids) | frozenset(request.stop_token_ids)


def _max_draft_tokens(spec: DecodeSpec, given: int | None) -> int:
    """The largest K a row may draft: ``given``, else the spec's K, else the default K."""
    if given is None:
        return spec.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS
    check_int("max_draft_tokens", given)
    if spec.num_draft_tokens is not None and spec.drafts and spec.num_draft_tokens > given:
        raise ValueError(
            f"num_draft_tokens ({spec.num_draft_tokens}) must not exceed max_draft_tokens ({given})"
        )
    return given


def _check_draft(spec: DecodeSpec, draft: ModelSource | None) -> None:
    """A drafter that needs a draft model has one (``parse_load`` refuses one elsewhere)."""
    if spec.needs_draft_model and draft is None:
        raise ValueError(
            f"method {spec.method} with the {spec.drafter} drafter needs a draft model"
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
    """Prompt token ids as ints; floats, bools and other non-integers are refused, and so is
    anything but a sequence or a tensor (bytes are not token ids)."""
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, Tensor)):
        raise TypeError(
            f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}"
        )
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
