"""What the engine offers those who drive it: the scheduler's ``Rows`` and a server's
``ServingEngine``. ``runtime.engine.SpeculativeDecoder`` implements both; the scheduler and
the server call nothing else, so a test or another engine can stand in for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime.generation import Generation, Request
from cactus_spec.runtime.grammar import Grammar
from cactus_spec.runtime.policy import SpeculationPolicy
from cactus_spec.runtime.stepper import StepTiming, Stopping

__all__ = ["Rows", "ServingEngine"]


class Rows(Protocol):
    """What the scheduler asks of the engine (``runtime.engine.SpeculativeDecoder``)."""

    max_batch: int

    def draft_tokens(self, spec: DecodeSpec) -> int:
        """K a row of ``spec`` drafts when no policy picks it."""

    def choose_row(self, prompt: Sequence[int], free: Sequence[int]) -> int:
        """The free row ``prompt`` should take (the one caching its longest prefix)."""

    def new_generation(self, request: Request, row: int) -> Generation:
        """The generation of ``request``, begun in ``row`` (which keeps what it caches of the
        prompt)."""

    def prefill(self, generations: Sequence[Generation], budget: int | None = None) -> int:
        """Read up to ``budget`` unread prompt tokens of the generations, in their order."""

    def step(
        self,
        generations: Sequence[Generation],
        num_draft_tokens: Sequence[int],
        keep_drafting: Sequence[Stopping | None] | None = None,
    ) -> StepTiming:
        """One iteration over the generations, drafting up to ``num_draft_tokens[i]`` tokens
        for the i-th, fewer where ``keep_drafting[i]`` stops it."""

    def behind(self, generations: Sequence[Generation]) -> list[int]:
        """Tokens the drafter would read for each generation before drafting."""

    def catch_up(self, generations: Sequence[Generation], budget: int | None = None) -> int:
        """Let the drafter read up to ``budget`` tokens of what it lags of the generations'
        contexts (all but each one's last), in their order; the tokens read."""


class ServingEngine(Rows, Protocol):
    """What a server reads of the engine beyond ``Rows``: its spec and vocabulary, and its
    checks of a request before the request is queued (spec, prompt, context, grammar)."""

    spec: DecodeSpec
    tokenizer: PreTrainedTokenizerBase | None
    vocab_size: int

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template, None without one."""

    @property
    def context_length(self) -> int:
        """The most tokens a row of the verifier's cache holds."""

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """Prompt text or ids -> ids; ValueError for an empty or out-of-vocabulary prompt."""

    def encode_chat(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        template: str | None = None,
    ) -> list[int]:
        """Chat messages with ``tools`` offered, through ``template`` -> ids."""

    def resolve(self, spec: DecodeSpec | None = None, *, seeded: bool = False) -> DecodeSpec:
        """The spec a request decodes by, checked against the engine (ValueError), with K
        pinned where ``seeded`` leaves it open."""

    def check_context(
        self, prompt_tokens: int, max_new_tokens: int, spec: DecodeSpec | None = None
    ) -> None:
        """ValueError when the prompt, the budget and one iteration's drafts overflow."""

    def check_grammar(self, grammar: Grammar, ignore_eos: bool = False) -> None:
        """ValueError unless ``grammar`` compiles for this model's tokenizer."""

    def calibrated_policy(self) -> SpeculationPolicy | None:
        """A serving policy timed on these models; None when nothing is drafted."""
