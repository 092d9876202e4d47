"""The engine's ``decode_many`` (``batch.decode_all``): a list of prompts through the
scheduler's rows, refilled as rows free up, gives each prompt the tokens it gives alone,
hands each result over once, and stops on a failing callback."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import AR, make_tiny_lm, spec_of
from test_engine import noisy_copy

from cactus_spec.core.rules import SpS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request

PROMPTS = [
    Request(prompt_ids=[5, 17, 3, 99], max_new_tokens=20, seed=1),
    Request(prompt_ids=[8, 9], max_new_tokens=9, seed=2),
    Request(prompt_ids=[3] * 12 + [4], max_new_tokens=25, seed=3),
    Request(prompt_ids=[11, 12, 13], max_new_tokens=6, seed=4),
    Request(prompt_ids=[60, 61, 62, 63, 64], max_new_tokens=14, seed=5),
]
SAMPLING = SamplingConfig(0.8, 0, 1.0)


def decoder(batch: int) -> SpeculativeDecoder:
    target = make_tiny_lm(seed=0)
    return SpeculativeDecoder(
        target, noisy_copy(target, 0.4, seed=1), spec_of(SpS(), 3), max_batch=batch
    )


def test_more_prompts_than_rows_each_give_their_tokens_alone() -> None:
    single = decoder(1)
    expected = [
        single.generate(p.prompt_ids, p.max_new_tokens, 0.8, 0, 1.0, seed=p.seed).token_ids
        for p in PROMPTS
    ]
    seen: list[int] = []
    results = decoder(2).decode_many(PROMPTS, SAMPLING, on_result=lambda i, _: seen.append(i))
    assert [r.token_ids for r in results] == expected
    assert sorted(seen) == list(range(len(PROMPTS)))
    assert seen != list(range(len(PROMPTS)))  # short prompts finish first: rows were refilled


def test_negative_control_other_seeds_give_other_tokens() -> None:
    results = decoder(2).decode_many(PROMPTS, SAMPLING)
    reseeded = [replace(p, seed=p.seed + 100) for p in PROMPTS]
    others = decoder(2).decode_many(reseeded, SAMPLING)
    assert [r.token_ids for r in results] != [r.token_ids for r in others]


def test_autoregressive_rows_draft_nothing() -> None:
    results = decoder(3).decode_many(PROMPTS, SAMPLING, spec=AR)
    assert all(r.stats.drafted == 0 and r.stats.new_tokens > 0 for r in results)


def test_a_failing_callback_stops_the_run_and_is_raised() -> None:
    def explode(index: int, _) -> None:
        raise OSError(f"disk full at {index}")

    with pytest.raises(OSError, match="disk full"):
        decoder(2).decode_many(PROMPTS, SAMPLING, on_result=explode)


def test_bad_input_is_refused_before_decoding() -> None:
    with pytest.raises(ValueError, match="seed"):
        decoder(1).decode_many([Request(prompt_ids=[1, 2], max_new_tokens=4, seed=-1)], SAMPLING)
    with pytest.raises(ValueError, match="context overflow"):
        decoder(1).decode_many([Request(prompt_ids=[1, 2], max_new_tokens=10_000)], SAMPLING)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (Request(prompt_ids=[], max_new_tokens=4), r"requests\[1\]: prompt must not be empty"),
        (
            Request(prompt_ids=[1, 500], max_new_tokens=4),
            r"requests\[1\]: prompt token ids must lie in \[0, 128\)",
        ),
        (
            Request(prompt_ids=[1, 2], max_new_tokens=0),
            "max_new_tokens must be an integer >= 1, got 0",
        ),
        (
            Request(prompt_ids=[1, 2], max_new_tokens=4, stop=("",)),
            "stop strings must be non-empty",
        ),
        (
            Request(
                prompt_ids=[1, 2], max_new_tokens=4, spec=DecodeSpec.of("sps", drafter="ngram")
            ),
            "drafts with ngram",
        ),
    ],
)
def test_every_prompt_is_checked_as_generate_checks_it(prompt, message) -> None:
    """Before any row decodes: no IndexError from deep inside, no token past a budget of 0."""
    seen: list[int] = []
    with pytest.raises(ValueError, match=message):
        decoder(1).decode_many(
            [PROMPTS[0], prompt], SAMPLING, on_result=lambda i, _: seen.append(i)
        )
    assert seen == []
