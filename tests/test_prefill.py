"""Chunked, batched prefill: prompts are read at most ``prefill_chunk`` tokens per iteration,
interleaved with the decoding rows' iterations, prompts of similar lengths in one forward;
every row still decodes the tokens it decodes alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from conftest import AR, make_tiny_lm, spec_of
from test_engine import noisy_copy

from cactus_spec.backends.lean import _forward_groups
from cactus_spec.core.rules import SpS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import as_loaded
from cactus_spec.runtime.drafters import DraftRequest
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request
from cactus_spec.runtime.policy import STEP_CATCH_UP, SpeculationPolicy
from cactus_spec.runtime.scheduler import Scheduler
from cactus_spec.runtime.stepper import StepTiming

SAMPLING = SamplingConfig(0.8, 0, 1.0)
SHORT = [5, 17, 3, 99]
LONG = [(7 * i + 3) % 120 + 1 for i in range(70)]
OTHER_LONG = [(5 * i + 2) % 120 + 1 for i in range(60)]


class Recorded(SpeculativeDecoder):
    """The engine, logging what each prefill read and which rows each iteration stepped."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, object]] = []
        self.while_reading: list[Callable[[], None]] = []  # each called once, in a prefill
        self.timings: list[StepTiming] = []

    def prefill(self, generations, budget=None):
        read = super().prefill(generations, budget)
        self.log.append(("prefill", read))
        while self.while_reading:
            self.while_reading.pop()()
        return read

    def step(self, generations, num_draft_tokens, keep_drafting=None):
        self.log.append(("step", [g.row for g in generations]))
        timing = super().step(generations, num_draft_tokens, keep_drafting)
        self.timings.append(timing)
        return timing

    def catch_up(self, generations, budget=None):
        read = super().catch_up(generations, budget)
        self.log.append(("catch_up", (read, budget)))
        return read


def engine(cls=SpeculativeDecoder, max_batch: int = 2) -> SpeculativeDecoder:
    target = make_tiny_lm(seed=0)
    return cls(target, noisy_copy(target, 0.4, seed=1), spec_of(SpS(), 3), max_batch=max_batch)


SHORT_BUDGET, LONG_BUDGET = 40, 8


def serve_two(
    prefill_chunk: int | None,
    policy: SpeculationPolicy | None = None,
    long_arrives_while_short_is_read: bool = False,
    pinned: bool = False,
    longs: tuple[list[int], ...] = (LONG,),
) -> tuple[Recorded, dict[str, list[int]]]:
    """SHORT decoding (EOS ignored, so it runs its budget), then ``longs`` (LONG) arriving
    together once SHORT has stepped (or while SHORT's prompt is read); their new tokens, by
    name ("short", then "long", "long 1", ...). With ``policy``, all leave K to it, unless
    ``pinned`` (K = 3, the policy still asked)."""
    d = engine(Recorded, max_batch=1 + len(longs))
    spec = d.spec if policy is None or pinned else spec_of(SpS(), None)
    out: dict[str, list[int]] = {}
    done = threading.Event()

    def finish(name: str):
        def record(result) -> None:
            out[name] = result.token_ids
            if len(out) == 1 + len(longs):
                done.set()

        return record

    scheduler = Scheduler(d, max_queue=4, policy=policy, prefill_chunk=prefill_chunk)
    scheduler.start()
    common = {"sampling": SAMPLING, "seed": 1, "spec": spec}
    short = Request(
        prompt_ids=SHORT, max_new_tokens=SHORT_BUDGET, on_done=finish("short"), ignore_eos=True,
        **common,
    )  # fmt: skip
    names = ["long", *(f"long {i}" for i in range(1, len(longs)))]
    arriving = [
        Request(prompt_ids=prompt, max_new_tokens=LONG_BUDGET, on_done=finish(name), **common)
        for name, prompt in zip(names, longs, strict=True)
    ]
    if long_arrives_while_short_is_read:
        d.while_reading.extend(lambda r=r: scheduler.submit(r) for r in arriving)
    scheduler.submit(short)
    if not long_arrives_while_short_is_read:
        deadline = time.monotonic() + 30
        while not any(kind == "step" for kind, _ in d.log) and time.monotonic() < deadline:
            time.sleep(0.001)
        for request in arriving:
            scheduler.submit(request)
    assert done.wait(60)
    scheduler.stop()
    return d, out


def alone(prompt: list[int], budget: int, ignore_eos: bool = False) -> list[int]:
    """The tokens of ``prompt`` decoded alone."""
    d = engine()
    request = Request(
        prompt_ids=prompt,
        max_new_tokens=budget,
        sampling=SAMPLING,
        seed=1,
        spec=d.spec,
        ignore_eos=ignore_eos,
    )
    g = d.new_generation(request, 0)
    d.prefill([g])
    while not g.done:
        d.step([g], [3])
    return g.new_ids


def test_a_long_prompt_is_read_in_chunks_while_the_other_row_decodes() -> None:
    """A chunk of 4 per token a row verified: SHORT verifies K + 1 = 4 a row, so LONG is read
    16 tokens at a time."""
    d, out = serve_two(prefill_chunk=4)
    reads = [n for kind, n in d.log if kind == "prefill"]
    assert reads[0] == len(SHORT) - 1  # nothing ran yet: read at once
    assert sum(reads[1:]) == len(LONG) - 1 and max(reads[1:]) == 16
    # while LONG (row 1) is read, SHORT (row 0) decodes: an iteration after each chunk
    long_reads = [i for i, (kind, _) in enumerate(d.log) if kind == "prefill"][1:]
    first, last = long_reads[0], long_reads[-1]
    between = [rows for kind, rows in d.log[first:last] if kind == "step"]
    assert len(between) >= 3 and all(rows == [0] for rows in between)
    assert out["short"] == alone(SHORT, SHORT_BUDGET, ignore_eos=True)
    assert out["long"] == alone(LONG, LONG_BUDGET)


def test_each_prompt_waiting_is_read_a_chunk_a_turn() -> None:
    """Two prompts arriving together while SHORT decodes at K = 3: a turn reads a chunk of
    16 for each (32), so the batch forms in the turns one of them takes; the control above
    reads one prompt 16 at a time. Every row decodes what it decodes alone."""
    d, out = serve_two(prefill_chunk=4, longs=(LONG, OTHER_LONG))
    reads = [n for kind, n in d.log if kind == "prefill"]
    assert sum(reads[1:]) == len(LONG) + len(OTHER_LONG) - 2 and max(reads[1:]) == 32
    assert out["long"] == alone(LONG, LONG_BUDGET)
    assert out["long 1"] == alone(OTHER_LONG, LONG_BUDGET)


def first_idle_read(prompts: list[list[int]]) -> int:
    """Tokens the first turn reads of ``prompts`` sent together to an idle scheduler (every
    one admitted before it starts), with a chunk of 4."""
    d = engine(Recorded, max_batch=len(prompts))
    done = threading.Event()
    left = [len(prompts)]

    def finished(_) -> None:
        left[0] -= 1
        if not left[0]:
            done.set()

    scheduler = Scheduler(d, max_queue=4, prefill_chunk=4)
    for prompt in prompts:
        scheduler.submit(Request(prompt_ids=prompt, max_new_tokens=2, sampling=SAMPLING,
                                 seed=1, spec=d.spec, on_done=finished))  # fmt: skip
    scheduler.start()
    assert done.wait(60)
    scheduler.stop()
    return next(n for kind, n in d.log if kind == "prefill")


def test_an_idle_turn_reads_four_chunks_of_each_prompt_waiting() -> None:
    """Nothing decodes: a turn reads four chunks (16) for each prompt waiting, 32 for two."""
    assert first_idle_read([LONG]) == 16
    assert first_idle_read([LONG, OTHER_LONG]) == 32


def test_negative_control_without_a_chunk_the_prompt_is_read_at_once() -> None:
    d, out = serve_two(prefill_chunk=None)
    reads = [n for kind, n in d.log if kind == "prefill"]
    assert reads == [len(SHORT) - 1, len(LONG) - 1]
    assert out["long"] == alone(LONG, LONG_BUDGET)


def test_the_policy_chooses_k_for_the_rows_still_reading_too() -> None:
    """While LONG is read, the policy is asked about both rows (the batch forming), and
    only SHORT's K is used."""
    asked: list[list[int]] = []

    class Recording(SpeculationPolicy):
        def choose(self, generations, behind):
            asked.append([g.row for g in generations])
            return super().choose(generations, behind)

    d, _ = serve_two(prefill_chunk=16, policy=Recording(3))
    first_read = next(i for i, (kind, _) in enumerate(d.log[1:], 1) if kind == "prefill")
    steps_before = sum(kind == "step" for kind, _ in d.log[:first_read])
    assert asked[steps_before] == [0, 1]  # SHORT steps, LONG reads: both count
    assert asked[0] == [0]  # negative control: LONG came after SHORT's first step


def test_a_request_arriving_while_a_prompt_is_read_joins_the_batch_the_policy_sees() -> None:
    """LONG arrives while SHORT's prompt is read (alone, nothing decodes yet): SHORT's first
    K is chosen for both rows, not for a lone stream; and both decode what they decode
    alone (K pinned at alone's 3 by their spec, so the tokens can be compared: a row leaving
    K open catches its drafter up before it drafts, ``test_scheduler``)."""
    asked: list[list[int]] = []

    class Recording(SpeculationPolicy):
        def choose(self, generations, behind):
            asked.append([g.row for g in generations])
            return [3] * len(generations)

    d, out = serve_two(16, Recording(3), long_arrives_while_short_is_read=True, pinned=True)
    assert asked[0] == [0, 1]
    assert d.log[0] == ("prefill", len(SHORT) - 1) and d.log[1] == ("step", [0])
    assert out["long"] == alone(LONG, LONG_BUDGET)


class Drafting(SpeculationPolicy):
    """A policy that asks every row that leaves K open for ``max_draft_tokens``."""

    def choose(self, generations, behind):
        return [self.max_draft_tokens if g.spec.auto_k else 3 for g in generations]


def test_a_row_leaving_k_open_catches_its_drafter_up_between_iterations() -> None:
    """LONG joins SHORT's drafting batch: LONG's drafter reads its 69-token prompt in
    pieces of at most the prompt budget, between iterations, while LONG drafts nothing; no
    draft step reads more than STEP_CATCH_UP tokens a row, so SHORT never waits for the
    read. The control: with K pinned by the spec, LONG's first draft step reads it all."""
    policy = Drafting(3)
    d, out = serve_two(prefill_chunk=4, policy=policy)
    assert policy.catch_up_token_s > 0  # learned from the reads
    reads = [value for kind, value in d.log if kind == "catch_up"]
    assert len(reads) >= 2 and all(0 < read <= budget for read, budget in reads)
    assert sum(read for read, _ in reads) >= len(LONG) - 1 - STEP_CATCH_UP
    assert all(t.caught_up <= STEP_CATCH_UP * t.rows for t in d.timings)
    assert len(out["long"]) == LONG_BUDGET and len(out["short"]) == SHORT_BUDGET
    pinned, _ = serve_two(prefill_chunk=4, policy=Drafting(3), pinned=True)
    assert not any(kind == "catch_up" for kind, _ in pinned.log)
    assert max(t.caught_up for t in pinned.timings) >= len(LONG) - 1


def serve_alone(prefill_chunk: int) -> Recorded:
    """LONG alone, leaving K to a policy that always drafts 3, until it has drafted."""
    d = engine(Recorded)
    done = threading.Event()
    scheduler = Scheduler(d, max_queue=4, policy=Drafting(3), prefill_chunk=prefill_chunk)
    scheduler.start()
    request = Request(
        prompt_ids=LONG, max_new_tokens=LONG_BUDGET, sampling=SAMPLING, seed=1,
        spec=spec_of(SpS(), None), ignore_eos=True, on_done=lambda _: done.set(),
    )  # fmt: skip
    scheduler.submit(request)
    assert done.wait(60)
    scheduler.stop()
    return d


def test_a_lone_row_catches_its_drafter_up_at_once_and_drafts_at_once() -> None:
    """No other row waits for LONG's drafter: it reads the lag in one idle turn's budget
    (4 chunks of 32) and LONG drafts in its first iteration. The control: a budget of 4 x 4
    tokens reads it in pieces, and LONG decodes plainly until its drafter has caught up."""
    d = serve_alone(prefill_chunk=32)
    reads = [value for kind, value in d.log if kind == "catch_up"]
    assert len(reads) == 1 and reads[0][1] == 128 and reads[0][0] > len(LONG) - STEP_CATCH_UP
    assert d.timings[0].draft_steps > 0
    control = serve_alone(prefill_chunk=4)
    reads = [value for kind, value in control.log if kind == "catch_up"]
    assert len(reads) > 1 and all(0 < read <= budget == 16 for read, budget in reads)
    assert control.timings[0].draft_steps == 0


def test_a_drafter_caught_up_in_pieces_drafts_what_it_drafts_after_one_read() -> None:
    """catch_up reads a context but its last token in pieces of 16; the proposal after it
    (reading the last token) is the one a drafter reading the whole context in its first
    draft step makes: the same tokens, p equal to float tolerance. The control: a drafter
    that believes it holds the context while its cache holds another proposes otherwise."""

    def proposal(pieces: int | None, held: list[int] | None = None):
        drafter = engine()._stepper.drafter
        drafter.start(0, LONG, reuse=False)
        while pieces and drafter.catch_up([0], [held or LONG], pieces):
            pass
        if held is not None:
            drafter._cached[0] = list(LONG[:-1])
        ask = DraftRequest(0, LONG, 4, SAMPLING, torch.Generator().manual_seed(3))
        return drafter.propose([ask])[0]

    at_once, in_pieces = proposal(None), proposal(16)
    assert in_pieces.tokens == at_once.tokens
    torch.testing.assert_close(in_pieces.probs, at_once.probs, rtol=1e-4, atol=1e-6)
    other = [(t + 1) % 120 for t in LONG]
    wrong = proposal(16, held=other)
    assert wrong.tokens != at_once.tokens or not torch.allclose(wrong.probs, at_once.probs)


def test_long_rows_of_similar_lengths_share_a_forward() -> None:
    roomy = [1000] * 7
    groups = _forward_groups([3, 100, 90, 40, 5, 20], roomy)
    assert groups == [[0, 4], [1, 2], [3], [5]]
    lengths = [100, 90, 80, 75, 74, 17, 16]
    for group in _forward_groups(lengths, roomy):
        widths = [lengths[i] for i in group]
        assert max(widths) <= 16 or min(widths) >= 0.75 * max(widths)
    assert sorted(i for g in _forward_groups(lengths, roomy) for i in g) == list(range(7))
    # a row with less room than its group's width is read alone, at its own width
    assert _forward_groups([3, 100, 90, 40, 5, 20], [4, 100, 95, 40, 5, 20]) == [
        [4],
        [0],
        [1],
        [2],
        [3],
        [5],
    ]


def test_short_rows_share_a_forward_unless_padding_would_more_than_double_it() -> None:
    roomy = [1000] * 8
    assert _forward_groups([11, 11, 11, 11, 1, 1, 1, 1], roomy) == [list(range(8))]
    assert _forward_groups([11, 1, 1, 1, 1, 1, 1, 1], roomy) == [[0], list(range(1, 8))]
    assert _forward_groups([1, 9, 1, 11, 1, 1, 1, 1], roomy) == [[1, 3], [0, 2, 4, 5, 6, 7]]
    assert _forward_groups([1] * 8, roomy) == [list(range(8))]
    assert _forward_groups([16, 2, 2, 2], roomy[:4]) == [[0, 1, 2, 3]]  # no row fed one


def test_a_row_at_the_context_end_beside_a_drafting_row_decodes() -> None:
    """An autoregressive row whose prompt and budget fill the cache, batched with a row that
    drafts K = 8: padding its one token to the drafting row's nine would write past its
    cache's end, and failed the batch (both rows) before rows were grouped by their room."""
    target, draft = make_tiny_lm(), make_tiny_lm(seed=1)
    engine = SpeculativeDecoder(
        target, draft, DecodeSpec.of("sps", num_draft_tokens=8), max_batch=2
    )
    full = engine.context_length - 20
    ar = Request(prompt_ids=[1] * full, max_new_tokens=20, seed=0, spec=AR, ignore_eos=True)
    drafting = Request(prompt_ids=[2] * 10, max_new_tokens=60, seed=1, ignore_eos=True)
    together = engine.decode_many([ar, drafting])
    assert [len(r.token_ids) for r in together] == [20, 60]
    assert together[0].token_ids == engine.decode_many([ar])[0].token_ids


def test_prompts_read_in_one_forward_give_the_logits_they_give_alone() -> None:
    backend = make_backend(as_loaded("verifier", make_tiny_lm(seed=0)), "lean", 3)
    prompts = [LONG[:40], LONG[5:40], LONG[10:52]]
    together = backend.append_ragged(prompts, [0, 1, 2])
    for row, (prompt, logits) in enumerate(zip(prompts, together, strict=True)):
        backend.reset(row)
        torch.testing.assert_close(logits, backend.append(prompt, row=row), rtol=0, atol=1e-5)


def test_a_request_that_does_not_draft_leaves_the_drafts_cache_untouched() -> None:
    """An AR request reads its prompt into the verifier only: the draft model's row stays
    empty (white-box), and a drafting request after it on the same row decodes the tokens it
    decodes on a fresh engine. The control, a drafting request, fills the draft's row."""
    d = engine()
    drafts_row = d._drafter.backend.length_of  # white-box: the draft model's cache
    ar = Request(prompt_ids=LONG, max_new_tokens=12, sampling=SAMPLING, seed=0, spec=AR)
    sps = Request(prompt_ids=LONG[:50], max_new_tokens=12, sampling=SAMPLING, seed=1)
    d.decode_many([ar])
    assert drafts_row(0) == 0
    after = d.decode_many([sps])[0].token_ids
    assert drafts_row(0) >= 50  # the control: a drafting request reads its prompt there
    assert after == engine().decode_many([sps])[0].token_ids
