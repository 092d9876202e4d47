"""Prefix caching: a prompt reuses the keys and values of the longest prefix a free row holds,
for the verifier and the draft model, and decodes exactly as it would from a fresh prefill."""

from __future__ import annotations

import torch
from conftest import make_tiny_lm, spec_of
from test_engine import noisy_copy

from cactus_spec.core.rules import SpS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import as_loaded
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request
from cactus_spec.runtime.prefixes import PrefixCache, common_prefix_length

SAMPLING = SamplingConfig(0.8, 0, 1.0)
FIRST = [5, 17, 3, 99, 42, 7, 17, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22]


def decoder(prefix_cache: bool = True, batch: int = 2) -> SpeculativeDecoder:
    target = make_tiny_lm(seed=0)
    draft = noisy_copy(target, 0.4, seed=1)
    return SpeculativeDecoder(
        target, draft, spec_of(SpS(), 4), max_batch=batch, prefix_cache=prefix_cache
    )


def run(d: SpeculativeDecoder, prompt: list[int], seed: int, row: int = 0):
    """Decode ``prompt`` in ``row`` to the end; the generation."""
    g = d.new_generation(
        Request(prompt_ids=prompt, max_new_tokens=12, sampling=SAMPLING, seed=seed, spec=d.spec),
        row,
    )
    d.prefill([g])
    while not g.done:
        d.step([g], [4])
    return g


def test_the_free_row_holding_the_longest_prefix_is_chosen() -> None:
    cache = PrefixCache()
    cache.record(0, [1, 2, 3, 4])
    cache.record(1, [1, 2, 9])
    cache.record(2, [1, 2, 3, 4, 5, 6])
    assert cache.choose([1, 2, 3, 4, 5, 7], [0, 1, 2], [4, 3, 6]) == 2
    assert cache.choose([1, 2, 3, 4, 5, 7], [0, 1, 2], [4, 3, 3]) == 0  # row 2 holds 3 now
    assert cache.choose([7], [1, 2], [3, 6]) == 1  # no hit: the first free row
    assert cache.held(2, 10) == [1, 2, 3, 4, 5, 6]  # drafts past the context are not known
    assert PrefixCache(enabled=False).choose([1, 2, 3], [3, 2], [6, 6]) == 3
    assert common_prefix_length([1, 2, 3], [1, 2]) == 2
    long = list(range(1000))
    for cut in (0, 255, 256, 257, 999):  # a difference at, before and after a chunk's edge
        other = [*long[:cut], -1, *long[cut + 1 :]]
        assert common_prefix_length(long, other) == cut
        assert common_prefix_length(long, tuple(other)) == cut  # types differ: token by token
    assert common_prefix_length(long, long[:700]) == 700


def test_logits_after_a_reused_prefix_equal_a_fresh_prefill() -> None:
    backend = make_backend(as_loaded("verifier", make_tiny_lm(seed=0)), "lean", 2)
    second = FIRST[:12] + [40, 41, 42, 43, 44, 45, 46]
    backend.append(FIRST, row=0)
    backend.append([1, 2, 3], row=0)  # what a decode would leave past the prompt
    backend.rollback(12, 0)
    reused = backend.append(second[12:], row=0)  # [7, V]
    fresh = backend.append(second, row=1)[12:]
    torch.testing.assert_close(reused, fresh, rtol=0, atol=1e-5)
    # negative control: a row rolled back to a prefix it does not hold gives other logits
    backend.reset(1)
    backend.append([60] * 12, row=1)
    wrong = backend.append(second[12:], row=1)
    assert (wrong - fresh).abs().max() > 1e-2


def test_a_second_turn_reads_only_what_is_new_and_decodes_as_from_scratch() -> None:
    cached, fresh = decoder(prefix_cache=True), decoder(prefix_cache=False)
    turns = []
    for d in (cached, fresh):
        first = run(d, FIRST, seed=1)
        follow_up = first.context + [30, 31, 32]  # the history, the answer, a new message
        second = run(d, follow_up, seed=2)
        turns.append((first, second))
    (first, second), (first_fresh, second_fresh) = turns
    assert second.new_ids == second_fresh.new_ids
    # the row held the first turn up to its last token (fed with the next drafts)
    assert len(first.context) - 1 <= second.stats.cached_prompt_tokens < second.prompt_len
    assert second.stats.draft_cached_prompt_tokens > len(FIRST)  # the draft's cache too
    assert first.stats.cached_prompt_tokens == 0
    assert second_fresh.stats.cached_prompt_tokens == 0  # caching off reads everything


def test_scoring_in_between_leaves_no_stale_prefix() -> None:
    d = decoder()
    run(d, FIRST, seed=1)
    d.score([(FIRST[:5], [70, 71])])  # rows overwritten by the scorer
    again = run(d, FIRST, seed=1)
    assert again.stats.cached_prompt_tokens == 0
    assert again.new_ids == run(decoder(prefix_cache=False), FIRST, seed=1).new_ids


def test_a_batch_reuses_the_rows_of_earlier_prompts() -> None:
    """decode_many over prompts sharing a long system prefix: later prompts go to rows that
    hold the prefix, read only their own tail, and give the tokens they give uncached."""
    system = list(range(40, 70))
    prompts = [
        Request(prompt_ids=system + [i, i + 1, i + 2], max_new_tokens=10, seed=i) for i in range(6)
    ]
    cached = decoder(batch=2).decode_many(prompts, SAMPLING)
    fresh = decoder(prefix_cache=False, batch=2).decode_many(prompts, SAMPLING)
    assert [r.token_ids for r in cached] == [r.token_ids for r in fresh]
    assert [r.stats.cached_prompt_tokens for r in cached[2:]] == [len(system)] * 4
    assert all(r.stats.cached_prompt_tokens == 0 for r in fresh)
