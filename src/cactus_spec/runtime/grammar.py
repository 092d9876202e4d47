"""Structured outputs: a grammar masks every distribution a generation draws from.

A ``Grammar`` says what the output must match: a JSON schema, any JSON object, a regular
expression, or a grammar in Lark or GBNF. ``Grammars`` compiles it with llguidance (MIT;
chosen against xgrammar and outlines-core on the default pair's vocabulary for its
compile and mask costs, rollback and canonical tokens where text is forced;
``docs/DESIGN.md``, "Structured outputs and tool calls") against the engine's tokenizer,
and a ``Constraint`` is one generation's matcher.

The law. At a position whose context is the output o plus drafts d_1..d_j, the grammar
allows the token set A(o d_1..d_j), and both distributions are masked and renormalised
there:

    p'(x) ∝ p(x) 1[x ∈ A],    q'(x) ∝ q(x) 1[x ∈ A]

(before temperature, top-k and top-p, after penalties: ``Generation.process``). Drafts are
drawn from p', so they stay inside the grammar; a drafter without probabilities (n-gram)
has its proposal cut at the first token the grammar refuses. Verification then runs on
(p', q'), so SpS emits exactly q' at every step, Cactus stays within its delta of q', and
the divergence meter measures against q'. This is the same local masking vLLM and
llama.cpp use: it is NOT the law of q conditioned on the whole sequence matching the
grammar (that would reweight each token by the probability that the rest can still
match), which no engine samples.

EOS: the grammar allows the generation's ending tokens (EOS, stop token ids) exactly where
it may end; after an ending token nothing more is emitted, so the masks of later draft
positions allow only the ending tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from cactus_spec.core.checks import check_int

#: What a grammar may be written in.
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")


@dataclass(frozen=True)
class GrammarLimits:
    """What a request's grammar may cost, checked before it decodes: ``max_bytes`` of
    source (a grammar's compile time grows faster than its source: the limit keeps it short
    beside the request's decoding),
    ``max_symbols`` in llguidance's compiled grammar (its ``max_grammar_size``) and
    ``step_fuel``, the lexer's work per mask (its ``step_lexer_fuel``; a grammar that needs
    more fails that request when it does)."""

    max_bytes: int = 32_768
    max_symbols: int = 100_000
    step_fuel: int = 200_000

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_symbols", "step_fuel"):
            check_int(f"grammar limit {name}", getattr(self, name))

    def parser_limits(self) -> Any:
        """The limits as llguidance's, its errors kept free of the grammar's text."""
        import llguidance

        return llguidance.LLParserLimits(
            max_grammar_size=self.max_symbols, step_lexer_fuel=self.step_fuel, verbose_errors=False
        )


#: Compiled grammars kept per engine (a server sees the same schema again and again).
_CACHED_GRAMMARS = 64


class GrammarError(RuntimeError):
    """A request's grammar cannot go on (it refused the tokens it was given, or ran past its
    limits): the fault of that request alone, which it ends (``Generation.fail``)."""


@dataclass(frozen=True)
class Grammar:
    """What the output must match. ``kind`` is one of ``GRAMMAR_KINDS``; ``source`` is the
    JSON schema (as JSON text), the regular expression or the grammar's text (unused for
    ``json_object``: any JSON object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.source, str):
            raise TypeError(f"grammar source must be a string, got {type(self.source).__name__}")
        if self.kind != "json_object" and not self.source.strip():
            raise ValueError(f"a {self.kind} grammar needs a non-empty source")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """Output matching a JSON schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise ValueError(f"the JSON schema is not valid JSON ({err})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order kept: it is the output's

    def llguidance(self) -> str:
        """The grammar in llguidance's own form."""
        import llguidance

        match self.kind:
            case "json_object":
                text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
            case "json_schema":
                text = llguidance.LLMatcher.grammar_from_json_schema(self.source)
            case "regex" | "lark" | "gbnf" as kind:
                text = llguidance.grammar_from(kind, self.source)
        return text


class Grammars:
    """Compiles grammars for one tokenizer: its llguidance view is built once, on first use
    (it walks the whole vocabulary), and compiled grammars are cached. Thread-safe: a
    server checks a request's grammar on its event loop, the scheduler's thread starts it.

    ``vocab_size`` is the width of the logits rows masked; ``eos_ids`` the tokens that end
    a generation where the grammar may end."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: Iterable[int],
        limits: GrammarLimits | None = None,
    ) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.limits = GrammarLimits() if limits is None else limits
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, grammar: Grammar, ends: Iterable[int] = ()) -> Constraint:
        """A new generation's constraint by ``grammar``; ``ends`` are its ending tokens
        (default: ``eos_ids``). ValueError with the engine's message for a bad grammar."""
        ends = set(ends) or set(self.eos_ids)
        matcher = self.compile(grammar).deep_copy()
        return Constraint(matcher, self.vocab_size, self.eos_ids[0], ends)

    def compile(self, grammar: Grammar) -> Any:
        """The llguidance matcher of ``grammar`` at its start (cached); ValueError when it
        is larger than ``limits`` allow, does not compile, or cannot start (no first token:
        a schema that only refers to itself, ``{"$ref": "#"}``, a lexer past its fuel)."""
        import llguidance

        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
            size = len(grammar.source.encode("utf-8"))
            if size > self.limits.max_bytes:
                raise ValueError(
                    f"the {grammar.kind} grammar has {size} bytes, more than the "
                    f"{self.limits.max_bytes} this server takes (--max-grammar-bytes)"
                )
            try:
                text = grammar.llguidance()
            except ValueError as err:
                raise ValueError(f"the {grammar.kind} grammar does not compile: {err}") from None
            limits = self.limits.parser_limits()
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0, limits=limits)
            if matcher.is_error():
                raise ValueError(f"the {grammar.kind} grammar does not compile: {_first(matcher)}")
            self._check_start(grammar, matcher)
            self._compiled[grammar] = matcher
            if len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return matcher

    def _check_start(self, grammar: Grammar, matcher: Any) -> None:
        """ValueError unless copies of ``matcher`` allow a first token: compiling checks the
        grammar's form, its first mask what it can match. The mask is computed twice, on two
        copies: the lexer they share may spend its states on the first (``(a{1000}){1000}``)
        and fail every later one."""
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        for copy in (matcher.deep_copy(), matcher.deep_copy()):
            copy.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            if copy.is_error():
                raise ValueError(
                    f"the {grammar.kind} grammar cannot match any output ({_first(copy)})"
                )
        if not words.any():
            raise ValueError(f"the {grammar.kind} grammar allows no first token")

    def _llg_tokenizer(self) -> Any:
        import llguidance

        if self._tokenizer is None:
            if self._hf is None or not hasattr(self._hf, "backend_tokenizer"):
                raise ValueError("a grammar needs the model's fast (Rust) tokenizer")
            if not self.eos_ids:
                raise ValueError("a grammar needs the model's end-of-sequence token")
            backend = self._hf.backend_tokenizer
            self._tokenizer = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
        return self._tokenizer


class Constraint:
    """One generation's grammar state: a matcher at the emitted output, the allowed tokens
    after the output and any prefix of drafts, and the drafts it admits.

    Masks are computed by advancing the matcher over the drafts and rolling it back, and
    kept until the output next grows: the draft model's step j and the verifier's row j ask
    for the same prefix."""

    def __init__(self, matcher: Any, vocab_size: int, eos: int, ends: Iterable[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.ends = frozenset(t for t in ends if t < vocab_size)
        self._end = eos  # the matcher's EOS: what it consumes for any ending token
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # the bitmask
        self._biases: dict[tuple[int, ...], Tensor] = {}
        self._ends_only = torch.full((vocab_size,), float("-inf"))  # [V]
        self._ends_only[list(self.ends)] = 0.0

    def biases(self, drafts: Sequence[int], rows: int) -> list[Tensor]:
        """The additive masks ([V] float32: 0 where allowed, -inf elsewhere) of the last
        ``rows`` positions of a block fed after the output, row t following the first
        len(drafts) - rows + 1 + t drafts. (Built once per position, a bias serves the
        draft's step and the verifier's row; adding it costs a fraction of ``masked_fill``
        with a boolean row.)"""
        first = len(drafts) - rows + 1
        return [self.bias(drafts[: first + t]) for t in range(rows)]

    def bias(self, drafts: Sequence[int]) -> Tensor:
        """[V] float32: 0 for the tokens allowed after the output and ``drafts``, -inf for
        the others."""
        key = tuple(drafts)
        if key not in self._biases:
            self._biases[key] = self._compute(key)
        return self._biases[key]

    def mask(self, drafts: Sequence[int]) -> Tensor:
        """[V] bool: the tokens allowed after the output and ``drafts``."""
        return self.bias(drafts) == 0

    def admitted(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` (from the first) the grammar allows after the output; an
        ending token ends the count."""
        count = self.matcher.validate_tokens(self._mapped(drafts))
        return min(count, self._through_end(drafts))

    def advance(self, tokens: Sequence[int]) -> None:
        """The output grew by ``tokens`` (each allowed, up to an ending token)."""
        self._biases.clear()
        tokens = list(tokens[: self._through_end(tokens)])
        if tokens and tokens[-1] in self.ends:
            tokens.pop()  # the generation ends: nothing more is masked
        if not self.matcher.consume_tokens(tokens):
            raise GrammarError(f"the grammar refused emitted tokens: {_first(self.matcher)}")

    def _compute(self, drafts: tuple[int, ...]) -> Tensor:
        if any(t in self.ends for t in drafts):
            return self._ends_only  # the generation has ended before this position
        if drafts and not self.matcher.consume_tokens(list(drafts)):
            raise GrammarError(f"the grammar refused drafts: {_first(self.matcher)}")
        try:
            self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            if self.matcher.is_error():
                raise GrammarError(f"the grammar cannot go on: {_first(self.matcher)}")
        finally:
            self.matcher.rollback(len(drafts))
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size]
        bits[list(self.ends)] = bits[self._end]
        allowed = torch.from_numpy(bits.view(np.bool_))  # [V]
        return torch.zeros(self.vocab_size).masked_fill_(~allowed, float("-inf"))

    def _mapped(self, tokens: Sequence[int]) -> list[int]:
        return [self._end if t in self.ends else t for t in tokens]

    def _through_end(self, tokens: Sequence[int]) -> int:
        """Length of ``tokens`` up to and including the first ending token."""
        for i, t in enumerate(tokens):
            if t in self.ends:
                return i + 1
        return len(tokens)


def _first(matcher: Any) -> str:
    """The first line of an llguidance matcher's error (its limits keep the grammar out)."""
    lines = matcher.get_error().splitlines()
    return lines[0] if lines else "unknown error"
