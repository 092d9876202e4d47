"""Structured outputs (``runtime.grammar``): the masks, the drafts a grammar admits, and the
law: SpS emits exactly the grammar-masked, renormalised verifier law at every step (binomial
checks, with the unmasked q rejected by the same samples and a run that leaves q unmasked
as negative controls), and Cactus emits the exact law of its rule on the masked p and q.

The masks are checked on SmolLM2's real tokenizer; the laws on a tiny random Llama with a
26-token byte-level BPE tokenizer of its own (letters and their merges), so that thousands
of seeded generations take seconds."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from conftest import make_tiny_lm, spec_of
from lawcheck import binomial_violations, histogram
from test_engine import noisy_copy
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cactus_spec.core.audit import kl, restrict_to_support, step_law
from cactus_spec.core.rules import Cactus, SpS
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.loading.fetch import fetch
from cactus_spec.loading.models import load_model
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.grammar import Constraint, Grammar, Grammars

LETTERS = Grammar("regex", "[a-d]{2,8}")
#: Letters from {a, b} and {c, d} in turn: the allowed tokens change from step to step.
ALTERNATING = Grammar("regex", "([ab][cd]){1,4}")
SAMPLING = SamplingConfig(1.0, 0, 1.0)
RUNS = 3000
#: The tiny tokenizer: its merges (each also a token), the letters and EOS (id 0).
MERGES = [
    ("a", "b"),
    ("c", "d"),
    ("b", "a"),
    ("ba", "d"),
    ("d", "a"),
    ("da", "b"),
    ("ab", "c"),
    ("c", "a"),
    ("d", "d"),
    ("a", "c"),
    ("b", "d"),
    ("x", "y"),
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of 26 tokens: EOS, letters, JSON's punctuation, merges."""
    pieces = list('abcdxyz{}":,') + ["".join(pair) for pair in MERGES]
    vocab = {"<eos>": 0, **{piece: i + 1 for i, piece in enumerate(pieces)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


TINY = tiny_tokenizer()
VOCAB = len(TINY)  # the model's 32 logits are cut to the tokenizer's 26 tokens
PROMPT = TINY.encode("xy ab cd xy")


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer (49,152 tokens)."""
    return load_model(fetch("smollm2-135m")).tokenizer


@pytest.fixture(scope="module")
def smol_grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TINY, VOCAB, [0])


@pytest.fixture(scope="module")
def target():
    """The tiny verifier with the tiny tokenizer and its EOS, its head scaled down so that
    the masked laws spread over several tokens."""
    model = make_tiny_lm(vocab_size=32, seed=0)
    with torch.no_grad():
        model.lm_head.weight *= 0.3
    loaded = load_model(model)
    return replace(loaded, tokenizer=TINY, eos_ids=frozenset({0}))


@pytest.fixture(scope="module")
def draft(target):
    return replace(load_model(noisy_copy(target.model, 0.15, seed=1)), tokenizer=TINY)


def allowed_texts(constraint: Constraint, tokenizer, drafts=()) -> list[str]:
    ids = constraint.mask(list(drafts)).nonzero().flatten().tolist()
    return [tokenizer.decode([t]) for t in ids]


def test_masks_allow_only_what_can_continue_the_grammar(smol_grammars, tokenizer) -> None:
    constraint = smol_grammars.constraint(LETTERS)
    first = allowed_texts(constraint, tokenizer)
    assert first and all(re.fullmatch("[a-d]{1,8}", text) for text in first)
    assert "a" in first and "bad" in first
    assert tokenizer.eos_token_id not in constraint.mask([]).nonzero()  # [a-d]{2,}: not yet
    ab = tokenizer.encode("ab")
    assert constraint.mask(ab)[tokenizer.eos_token_id]  # two letters: it may end
    eight = tokenizer.encode("abcdabcd")
    assert constraint.mask(eight).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    # after an ending token, only ending tokens: nothing later is emitted
    ended = constraint.mask([*ab, tokenizer.eos_token_id])
    assert ended.nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_drafts_are_admitted_up_to_the_first_refused_token(smol_grammars, tokenizer) -> None:
    constraint = smol_grammars.constraint(LETTERS)
    ids = tokenizer.encode("abc") + tokenizer.encode("xyz")
    assert constraint.admitted(ids) == len(tokenizer.encode("abc"))
    assert (
        constraint.admitted([*tokenizer.encode("ab"), tokenizer.eos_token_id, 5])
        == len(tokenizer.encode("ab")) + 1
    )  # the EOS is admitted once the grammar may end; nothing after it counts
    constraint.advance(tokenizer.encode("ab"))
    assert constraint.mask([])[tokenizer.eos_token_id]
    with pytest.raises(RuntimeError, match="refused emitted tokens"):
        constraint.advance(tokenizer.encode("xyz"))


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        (lambda: Grammar("yaml", "x"), "grammar kind must be one of json_schema, json_object"),
        (lambda: Grammar("regex", " "), "a regex grammar needs a non-empty source"),
        (lambda: Grammar.json_schema("{nope"), "the JSON schema is not valid JSON"),
        (lambda: Grammar.json_schema("[1]"), "a JSON schema must be an object"),
    ],
)
def test_bad_grammars_are_refused_naming_what_is_wrong(grammar, words) -> None:
    with pytest.raises(ValueError, match=words):
        grammar()


@pytest.mark.parametrize(
    "grammar",
    [
        Grammar("regex", "(unclosed"),
        Grammar("lark", "start: undefined_rule"),
        Grammar("gbnf", "root ::= ("),
    ],
)
def test_grammars_that_do_not_compile_are_a_value_error(grammars, grammar) -> None:
    with pytest.raises(ValueError, match=f"the {grammar.kind} grammar does not compile"):
        grammars.compile(grammar)


def masked_q(model, context: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """The grammar-masked, renormalised law of ``model`` after ``context`` -> [V]."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1:, :VOCAB]  # [1, V]
    return logits_to_probs(logits.masked_fill(~allowed, float("-inf")), SAMPLING)[0]


def unmasked_q(model, context: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1:, :VOCAB]  # [1, V]
        return logits_to_probs(logits, SAMPLING)[0]


def first_pairs(target, draft, rule, runs: int = RUNS, tokens: int = 2) -> torch.Tensor:
    """The first ``tokens`` of ``runs`` seeded two-token generations by ``rule`` (K = 3)
    under the alternating grammar: [runs, tokens]."""
    decoder = SpeculativeDecoder(target, draft, spec_of(rule, 3))
    out = [
        decoder.generate(PROMPT, 2, 1.0, 0, 1.0, seed=seed, grammar=ALTERNATING).token_ids[:tokens]
        for seed in range(runs)
    ]
    return torch.tensor(out)


def test_sps_emits_the_masked_verifier_law_at_each_step(target, draft, grammars) -> None:
    """The first token's law is the masked q after the prompt; the second's, given the
    first a, the masked q after a with the grammar advanced over a (a draft's mask)."""
    pairs = first_pairs(target, draft, SpS())
    constraint = grammars.constraint(ALTERNATING)
    first = masked_q(target.model, PROMPT, constraint.mask([]))
    firsts = histogram(pairs[:, 0], VOCAB)
    assert binomial_violations(firsts, first) == []
    # negative control: the same samples reject the unmasked law
    assert binomial_violations(firsts, unmasked_q(target.model, PROMPT)) != []
    a = int(firsts.argmax())
    second = masked_q(target.model, [*PROMPT, a], constraint.mask([a]))
    given = pairs[pairs[:, 0] == a, 1]
    assert len(given) >= 300
    assert binomial_violations(histogram(given, VOCAB), second) == []
    # negative control: the mask before a (not advanced over it) is another law
    stale = masked_q(target.model, [*PROMPT, a], constraint.mask([]))
    assert binomial_violations(histogram(given, VOCAB), stale) != []


def test_negative_control_an_unmasked_q_breaks_the_law(target, draft, grammars, monkeypatch):
    """With the verifier's rows left unmasked (the draft still masked), SpS emits q, not the
    masked q: the check above fails. (The matcher is not advanced: the output leaves the
    grammar.)"""
    biases = Constraint.biases

    def draft_only(self, drafts, rows):  # the verifier asks for K + 1 rows, the draft for 1
        out = biases(self, drafts, rows)
        return out if rows == 1 else [torch.zeros_like(bias) for bias in out]

    monkeypatch.setattr(Constraint, "biases", draft_only)
    monkeypatch.setattr(Constraint, "advance", lambda self, tokens: self._biases.clear())
    firsts = first_pairs(target, draft, SpS(), runs=1000, tokens=1)[:, 0]
    first = masked_q(target.model, PROMPT, grammars.constraint(ALTERNATING).mask([]))
    assert binomial_violations(histogram(firsts, VOCAB), first) != []


def test_cactus_emits_its_rules_law_on_the_masked_distributions(target, draft, grammars):
    """The first token follows audit.step_law(p', q', Cactus) with p' and q' the masked
    draft and verifier laws, within delta of q' (and not q' itself: the control)."""
    rule = Cactus(1.0)
    pairs = first_pairs(target, draft, rule)
    allowed = grammars.constraint(ALTERNATING).mask([])
    p, q = masked_q(draft.model, PROMPT, allowed), masked_q(target.model, PROMPT, allowed)
    support = ((p > 0) | (q > 0)).nonzero().flatten()
    p_s, q_s = restrict_to_support(p, q)
    law = torch.zeros(VOCAB, dtype=torch.float64)
    law[support] = step_law(p_s, q_s, rule)
    counts = histogram(pairs[:, 0], VOCAB)
    assert binomial_violations(counts, law) == []
    assert 0 < float(kl(law, q.double())) <= rule.delta
    assert binomial_violations(counts, q) != []


def test_every_emitted_text_matches_the_grammar_and_the_meter_reads_the_masked_q(target, draft):
    decoder = SpeculativeDecoder(target, draft, spec_of(Cactus(1.0), 4))
    for seed in range(20):
        result = decoder.generate(PROMPT, 12, 1.0, 0, 1.0, seed=seed, grammar=LETTERS)
        assert re.fullmatch("[a-d]{2,8}", result.text)
        assert result.finish_reason == "stop" and result.token_ids[-1] in target.eos_ids
        assert 0 <= result.stats.kl_nats < float("inf")


def test_ngram_drafts_outside_the_grammar_are_cut(target) -> None:
    """A prompt-lookup drafter proposes what followed the context before, even where the
    grammar refuses it: greedy output still matches, and equals AR's under the grammar."""
    text = TINY.encode("abab xyz abab xyz abab")
    ngram = SpeculativeDecoder(target, spec=spec_of(SpS(), 4, drafter="ngram"))
    ar = SpeculativeDecoder(target, spec=spec_of(None))
    grammar = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    out = ngram.generate(text, 20, 0.0, grammar=grammar)
    assert out.token_ids == ar.generate(text, 20, 0.0, grammar=grammar).token_ids
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        json.loads(out.text)


def test_a_spec_the_engine_cannot_draft_fails_before_its_grammar_compiles(target) -> None:
    """A row's spec is checked against the engine's drafter before its grammar compiles: a
    request drafting with a model on a prompt-lookup engine gets the drafter's error, not
    its grammar's; control: with the engine's own drafter, the grammar's error."""
    from cactus_spec.runtime.generation import Request

    engine = SpeculativeDecoder(target, spec=spec_of(SpS(), 4, drafter="ngram"))
    broken = Grammar("regex", "(unclosed")

    def start(drafter: str) -> None:
        spec = spec_of(SpS(), 4, drafter=drafter)
        request = Request(
            prompt_ids=[1, 2], max_new_tokens=4, sampling=SAMPLING, spec=spec, grammar=broken
        )
        engine.new_generation(request, 0)

    with pytest.raises(ValueError, match="drafts with model, but this engine drafts with ngram"):
        start("model")
    with pytest.raises(ValueError, match="the regex grammar does not compile"):
        start("ngram")
