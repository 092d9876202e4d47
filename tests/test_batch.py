"""Batched decoding: rows with their own prompts, seeds, sampling, rules and K, verified in one
forward with ragged acceptance, give each row exactly the tokens it gives alone."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from conftest import AR, make_tiny_lm, spec_of
from test_engine import noisy_copy

from cactus_spec.core.rules import TAS, Cactus, SpS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.runtime import policy as policy_module
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Generation, Request
from cactus_spec.runtime.policy import (
    CostTable,
    Pace,
    SpeculationPolicy,
    calibrated_policy,
    expected_tokens,
)
from cactus_spec.runtime.stepper import StepTiming

#: (prompt, seed, sampling, rule, K): every row differs from its neighbours.
ROWS = [
    ([5, 17, 3, 99, 42, 7, 17, 3], 1, SamplingConfig(0.6, 20, 0.95), SpS(), 4),
    ([8, 9], 2, SamplingConfig(1.0, 0, 1.0), Cactus(1.0), 6),
    ([3] * 20 + [4, 5], 3, SamplingConfig(0.0, 20, 0.95), SpS(), 3),
    ([11, 12, 13, 14], 4, SamplingConfig(0.8, 10, 0.9), None, 0),
    ([60, 61, 62, 63, 64, 65], 5, SamplingConfig(0.7, 0, 0.8), TAS(), 5),
]
LENGTHS = [30, 17, 25, 12, 40]


def decoder(batch: int, device: str = "cpu") -> SpeculativeDecoder:
    target = make_tiny_lm(seed=0)
    draft = noisy_copy(target, 0.4, seed=1)
    return SpeculativeDecoder(target, draft, max_batch=batch, device=device)


def start(d: SpeculativeDecoder, index: int, row: int = 0) -> Generation:
    """The generation of ROWS[index] in ``row`` of the engine."""
    prompt, seed, sampling, rule, k = ROWS[index]
    request = Request(
        prompt_ids=prompt,
        max_new_tokens=LENGTHS[index],
        sampling=sampling,
        seed=seed,
        spec=spec_of(rule, k),
    )
    return d.new_generation(request, row)


def fixed_ks(generations: list[Generation]) -> list[int]:
    return [g.spec.num_draft_tokens for g in generations]


def alone(row: int, device: str = "cpu") -> list[int]:
    d = decoder(1, device)
    g = start(d, row)
    d.prefill([g])
    while not g.done:
        d.step([g], fixed_ks([g]))
    return g.new_ids


def together(d: SpeculativeDecoder, shared_generator: bool = False) -> list[list[int]]:
    """Every row of ROWS decoded in one batch; rows that finish leave it."""
    generations = [start(d, row, row) for row in range(len(ROWS))]
    if shared_generator:
        for g in generations:
            g.generator = generations[0].generator
    d.prefill(generations)
    while active := [g for g in generations if not g.done]:
        d.step(active, fixed_ks(active))
    return [g.new_ids for g in generations]


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_in_a_batch_gives_the_tokens_it_gives_alone(device: str) -> None:
    d = decoder(len(ROWS), device)
    batched = together(d)
    assert [len(ids) for ids in batched] == LENGTHS
    for row in range(len(ROWS)):
        assert batched[row] == alone(row, device), row
    accepted = [d._backend.length_of(row) for row in range(len(ROWS))]  # white-box
    assert all(n > 0 for n in accepted)


def test_negative_control_rows_sharing_one_generator_differ_from_alone() -> None:
    batched = together(decoder(len(ROWS)), shared_generator=True)
    assert any(batched[row] != alone(row) for row in range(len(ROWS)))


def test_a_row_joins_a_batch_midway_and_still_gives_its_own_tokens() -> None:
    d = decoder(2)
    first = start(d, 0)
    d.prefill([first])
    for _ in range(3):
        d.step([first], fixed_ks([first]))
    second = start(d, 1, row=1)
    d.prefill([second])
    while active := [g for g in (first, second) if not g.done]:
        d.step(active, fixed_ks(active))
    assert first.new_ids == alone(0)
    assert second.new_ids == alone(1)


class Asked:
    """A drafter that records every proposal it is asked for, then proposes as ``inner``."""

    def __init__(self, inner) -> None:
        self.inner, self.backend, self.asked = inner, inner.backend, []

    def propose(self, requests):
        self.asked.append([(r.row, r.num_draft_tokens, r.sampling) for r in requests])
        return self.inner.propose(requests)

    def reset(self, row=None) -> None:
        self.inner.reset(row)


def test_a_calibration_times_the_draft_steps_through_the_drafter() -> None:
    """The draft steps are timed as the stepper runs them, through the drafter at the
    default sampling, for 1..slots rows (a bare forward leaves out the lag's read and the
    sampling: a third of a step at 8 rows of the default draft)."""
    d = decoder(3)
    drafter = Asked(d._drafter)  # white-box: the engine's own drafter, recorded
    policy = calibrated_policy(d._backend, drafter, max_draft_tokens=4)
    timed = [ask for ask in drafter.asked if ask[0][1] > 1]
    assert sorted({len(ask) for ask in timed}) == policy.draft.sizes == [1, 2, 3]
    assert all(a == (row, 3, SamplingConfig()) for ask in timed for row, a in enumerate(ask))
    assert policy.catch_up_token_s > 0


def test_the_transformers_backend_refuses_a_batch() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="a batch of 4 rows needs the lean backend"):
        SpeculativeDecoder(gpt2, spec=AR, max_batch=4)
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        SpeculativeDecoder(gpt2, spec=AR, max_batch=0)


def test_cost_table_interpolates_and_extrapolates() -> None:
    table = CostTable()
    assert table.estimate(5) == 0.0
    table.observe(1, 0.010)
    table.observe(9, 0.050)
    assert table.estimate(5) == pytest.approx(0.030)
    assert table.estimate(18) == pytest.approx(0.100)
    assert table.estimate(1) == 0.010
    table.observe(1, 0.020)  # a moving average, not a replacement
    assert 0.010 < table.estimate(1) < 0.020


def test_expected_tokens_sums_the_chances_of_reaching_each_draft() -> None:
    assert expected_tokens([0.5] * 3, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 4, 4) == 5
    assert expected_tokens([0.0] * 7, 7) == 1
    assert expected_tokens([0.9, 1.0, 1.0], 3) == pytest.approx(1 + 3 * 0.9)  # a stretch


def policy_with(
    draft_step: float, verify: dict[int, float], policy: SpeculationPolicy | None = None
) -> SpeculationPolicy:
    """``policy`` (a new one for K up to 8 by default) with these costs and a pool rate of 0.8."""
    policy = SpeculationPolicy(max_draft_tokens=8) if policy is None else policy
    policy.draft.observe(1, draft_step)
    policy.draft.observe(16, draft_step)
    for size, seconds in verify.items():
        policy.verify.observe(size, seconds)
    policy.overall.accepted, policy.overall.reached = [80.0] * 8, [100.0] * 8  # 0.8 per position
    return policy


def test_the_policy_drafts_when_verifying_a_block_is_cheap_and_not_when_it_is_dear() -> None:
    d = decoder(1)
    g = generation(d, [1, 2, 3], spec_of(Cactus(1.0), None))
    # memory-bound verifier: 9 tokens cost what 1 does; a cheap draft step
    cheap = policy_with(0.002, {1: 0.050, 9: 0.052, 16: 0.060, 144: 0.9})
    assert cheap.choose([g], [0]) == [8]
    # compute-bound verifier (cost proportional to tokens): drafting cannot pay
    dear = policy_with(0.010, {1: 0.050, 9: 0.450, 144: 7.2})
    assert dear.choose([g], [0]) == [0]
    # rows that fixed K keep it, autoregressive rows draft nothing
    fixed = generation(d, [1, 2, 3], spec_of(Cactus(1.0), 3))
    ar = generation(d, [1, 2, 3], AR)
    cheap.verify.observe(6, 0.051)  # their batch at K = 0: 4 + 1 + 1 tokens, read
    k_fixed, k_ar, k_auto = cheap.choose([fixed, ar, g], [0, 0, 0])
    assert (k_fixed, k_ar) == (3, 0) and k_auto > 0


def test_the_policys_forecast_is_the_model_it_chooses_by() -> None:
    """forecast: K = 0 is one token for one verifier step; K = 3 is 1 + S_1 + S_2 + S_3
    tokens (S_j the row's chances' products, about 0.8^j) for 3 draft steps and a 4-token
    forward; the K chosen maximises tokens per second (control: a dear verifier moves both
    to 0)."""
    g = generation(decoder(1), [1, 2, 3], spec_of(Cactus(1.0), None))
    policy = policy_with(0.002, {1: 0.050, 4: 0.054, 9: 0.060})
    forecast = policy.forecast([g], [0])
    assert forecast[0] == (1.0, pytest.approx(0.050))
    a1, a2, a3 = policy.chances(g)[:3]
    assert forecast[3][0] == pytest.approx(1 + a1 + a1 * a2 + a1 * a2 * a3)
    assert forecast[3][0] == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3, abs=0.05)
    assert forecast[3][1] == pytest.approx(3 * 0.002 + 0.054)
    best = max(range(9), key=lambda k: forecast[k][0] / forecast[k][1])
    assert policy.choose([g], [0]) == [best] and best > 0
    dear = policy_with(0.010, {1: 0.050, 9: 0.450, 144: 7.2}).forecast([g], [0])
    assert max(range(9), key=lambda k: dear[k][0] / dear[k][1]) == 0


def test_the_policy_costs_a_tree_by_its_nodes() -> None:
    """A tree of width 4 verifies 4 K + 1 tokens and drafts 4 rows a step: where verifying
    grows dear past 9 tokens, the policy drafts the chain to its cap and the tree shallower
    (but not 0); with the tree's tokens as cheap as the chain's, both draft to the cap."""
    d = decoder(1)
    chain = generation(d, [1, 2, 3], DecodeSpec.of("sps", num_draft_tokens="auto"))
    tree = DecodeSpec.of("sps", num_draft_tokens="auto", verification="tree", branches=4)
    wide = generation(d, [1, 2, 3], tree)
    policy = policy_with(0.002, {1: 0.050, 9: 0.052, 33: 0.25})
    (k_chain,) = policy.choose([chain], [0])
    (k_tree,) = policy.choose([wide], [0])
    assert k_chain == 8 and 0 < k_tree < k_chain
    flat = policy_with(0.002, {1: 0.050, 9: 0.052, 33: 0.053})
    assert flat.choose([wide], [0]) == [8]


def test_the_policy_drafts_only_for_a_gain_above_its_margin() -> None:
    """Drafting one token is predicted 3% faster than plain decoding here: within the
    policy's error, so it decodes plainly; the negative control predicts 10% and drafts."""
    g = generation(decoder(1), [1, 2, 3], spec_of(Cactus(1.0), None))
    slight = policy_with(0.002, {1: 0.050, 2: 0.0854, 9: 0.45, 144: 7.2})
    assert slight.choose([g], [0]) == [0]
    clear = policy_with(0.002, {1: 0.050, 2: 0.080, 9: 0.45, 144: 7.2})
    assert clear.choose([g], [0]) == [1]


def test_the_policy_counts_the_host_work_each_verified_token_brings() -> None:
    """Eight rows, each draft kept with chance 1/2, whose verifier reads 8 to 88 tokens at
    little more than one price (a block is cheap), but whose iteration spends 6 ms of host
    work per verified token beyond the forward (each token's q processed and judged): K
    drafts multiply that work by K + 1, more than they multiply the tokens, so the policy
    decodes plainly. The control, the same forward costs and no host work, drafts; the
    policy learns the host's part from iterations as the stepper times them."""
    d = decoder(8)
    rows = [generation(d, [1, 2, 3], spec_of(Cactus(1.0), None)) for _ in range(8)]
    forward = {8: 0.090, 16: 0.100, 48: 0.140, 88: 0.180}
    control, policy = policy_with(0.004, forward), policy_with(0.004, forward)
    for chosen in (control, policy):
        chosen.overall.accepted = [50.0] * 8  # 1/2 per position
    assert control.choose(rows, [0] * 8)[0] > 0
    for tokens in (8, 88):
        timing = StepTiming(8, 0, 0.0, tokens, forward[tokens], 8, host_s=0.006 * tokens)
        for _ in range(30):
            policy.observe(timing)
    assert policy.host.estimate(88) == pytest.approx(0.528, rel=0.05)
    assert policy.choose(rows, [0] * 8) == [0] * 8


def one_row_drafted(
    policy: SpeculationPolicy, steps: int, seconds: float, caught_up: int
) -> StepTiming:
    """One row's iteration: ``steps`` draft steps in ``seconds`` after its drafter read
    ``caught_up`` tokens, then a verification that took what ``policy`` expects of it."""
    return StepTiming(
        rows=1,
        draft_steps=steps,
        draft_s=seconds,
        verified_tokens=steps + 1,
        verify_s=policy.verify.estimate(steps + 1),
        emitted=3,
        caught_up=caught_up,
    )


def test_the_policy_learns_the_catch_ups_cost_from_the_steps_that_held_one() -> None:
    policy = policy_with(0.002, {1: 0.050, 9: 0.052})
    policy.catch_up_token_s = 0.0001  # what a calibration guessed
    steady = one_row_drafted(policy, steps=4, seconds=0.008, caught_up=2)
    policy.observe(steady)
    assert policy.catch_up_token_s == 0.0001  # a steady step says nothing about catch-ups
    # 4 steps of 2 ms and 100 tokens read at 1 ms each
    catch_up = dataclasses.replace(steady, draft_s=0.108, caught_up=100)
    for _ in range(40):
        policy.observe(catch_up)
    assert policy.catch_up_token_s == pytest.approx(0.001, rel=0.01)
    assert policy.draft.estimate(1) == pytest.approx(0.002)  # the table kept steady steps only


def test_a_catch_up_never_raises_the_draft_steps_estimate() -> None:
    """Three draft steps that first read 9 tokens cost 1.5x steady ones: folded into the
    steps' table (a step at most 3x its estimate once passed for a step) they raised the
    estimate until drafting stopped, and a policy that drafts nothing measures no step to
    lower it. Told apart by the tokens read, they teach the catch-up's cost and leave the
    steps' estimate; the negative control: steady steps at that cost do move it."""
    policy = policy_with(0.015, {1: 0.035, 11: 0.088})
    caught_up = one_row_drafted(policy, steps=3, seconds=0.066, caught_up=9)
    for _ in range(40):
        policy.observe(caught_up)
    assert policy.draft.estimate(1) == pytest.approx(0.015)
    assert policy.catch_up_token_s == pytest.approx((0.066 - 3 * 0.015) / 9, rel=0.01)
    steady = dataclasses.replace(caught_up, caught_up=2)
    for _ in range(40):
        policy.observe(steady)
    assert policy.draft.estimate(1) == pytest.approx(0.022, rel=0.01)


def an_iteration(k: int, speed: float) -> StepTiming:
    """One row's iteration of K drafts on a machine ``speed`` times slower than its fast
    state, where a draft step costs 15 ms and a verifier forward of n tokens 40 + 10 n."""
    return StepTiming(
        rows=1,
        draft_steps=k,
        draft_s=k * 0.015 * speed,
        verified_tokens=k + 1,
        verify_s=(0.040 + 0.010 * (k + 1)) * speed,
        emitted=k + 1,
        caught_up=2 if k else 0,
    )


def timed_at(speed: float) -> SpeculationPolicy:
    """A policy whose costs were all measured at ``speed`` (0.8 kept per position): at any
    one speed K = 2 yields 2.44 tokens in 2.5 plain steps, 1.22x plain decoding."""
    verify = {n: (0.040 + 0.010 * n) * speed for n in (1, 2, 4, 8, 16)}
    return policy_with(0.015 * speed, verify)


@pytest.mark.parametrize("follows_the_pace", [True, False])
def test_the_policy_weighs_costs_timed_at_one_speed_against_the_others(
    follows_the_pace: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine turns 1.45x faster while the policy decodes plainly (the EPYC's two
    speeds), then 1.45x slower while it drafts K = 1. Read against one pace, the drafting
    timed in the other state still shows its gain (K = 1 or 2, 1.20x and 1.22x plain
    decoding) and the stale costs read as they would be measured now; tables that took each
    size's reading alone (the negative control) weigh a plain step of one state against
    draft steps of the other and choose 0 both times."""
    if not follows_the_pace:
        monkeypatch.setattr(Pace, "follow", lambda *_: None)
    g = generation(decoder(1), [1, 2, 3], spec_of(Cactus(1.0), None))
    policy = timed_at(1.45)
    assert policy.choose([g], [0]) == [2]
    for _ in range(50):
        policy.observe(an_iteration(0, speed=1.0))
    (k,) = policy.choose([g], [0])
    assert k > 0 if follows_the_pace else k == 0
    if follows_the_pace:  # a draft step read at the pace of the plain steps
        assert policy.draft.estimate(1) == pytest.approx(0.015, rel=0.05)
    policy = timed_at(1.0)
    for _ in range(50):
        policy.observe(an_iteration(1, speed=1.45))
    (k,) = policy.choose([g], [0])
    assert k > 0 if follows_the_pace else k == 0
    if follows_the_pace:  # a plain step read at the pace of the drafting
        assert policy.verify.estimate(1) == pytest.approx(0.050 * 1.45, rel=0.05)


def test_each_size_still_learns_its_own_cost_beside_the_pace() -> None:
    """Plain steps and K = 2 iterations alternate at one speed, the 3-token block 30%
    dearer than the calibration said: the pace takes what the two share, and the block's
    entry learns the rest, to within 3% of the ratio measured."""
    policy = timed_at(1.0)
    for _ in range(200):
        policy.observe(an_iteration(0, speed=1.0))
        policy.observe(dataclasses.replace(an_iteration(2, speed=1.0), verify_s=0.091))
    ratio = policy.verify.estimate(3) / policy.verify.estimate(1)
    assert ratio == pytest.approx(0.091 / 0.050, rel=0.03)


def test_a_calibrations_guess_gives_way_to_the_first_reading() -> None:
    """A calibration timed an 11-token block at 100 ms, a plain step at 50; the first
    iteration reads the block at 130 ms: the block's entry takes it and the machine's pace
    stays (a plain step still reads 50 ms). The control: a second reading of the block,
    at 150 ms, surprises a size read before, and moves the pace and the plain step (by a
    fifth of the surprise's log: 2.9%)."""
    policy = SpeculationPolicy(max_draft_tokens=10)
    policy.verify.seed(1, 0.050)
    policy.verify.seed(11, 0.100)
    policy.observe(StepTiming(1, 10, 0.1, 11, 0.130, 11))
    assert policy.verify.estimate(11) == pytest.approx(0.130)
    assert policy.verify.estimate(1) == pytest.approx(0.050)
    policy.observe(StepTiming(1, 10, 0.1, 11, 0.150, 11))
    assert policy.verify.estimate(1) > 0.051


@pytest.mark.parametrize("share, within", [(policy_module._PACE, True), (0.8, False)])
def test_one_iterations_noise_stays_out_of_a_size_first_read_amid_it(
    share: float, within: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain steps of 50 ms that vary by 10% from one iteration to the next (seeded), and at
    each of 30 moments a block of 8 tokens, 80 ms, read for the first time: its entry against
    the plain step's stays within 10% of the 1.6 measured, at every moment. The control: a
    pace that takes 80% of each surprise stands far enough off the machine's at some moment
    that the block's entry keeps more than 10% of error."""
    monkeypatch.setattr(policy_module, "_PACE", share)
    rng = random.Random(0)
    errors = []
    for moment in range(30):
        policy = SpeculationPolicy(max_draft_tokens=8)
        policy.observe(StepTiming(1, 0, 0.0, 1, 0.050, 1))
        for _ in range(20 + moment):
            noisy = 0.050 * math.exp(rng.gauss(0.0, 0.1))
            policy.observe(StepTiming(1, 0, 0.0, 1, noisy, 1))
        policy.observe(StepTiming(1, 7, 0.1, 8, 0.080, 8))
        ratio = policy.verify.estimate(8) / policy.verify.estimate(1)
        errors.append(abs(math.log(ratio / 1.6)))
    assert (max(errors) < math.log(1.1)) == within


def four_rows_at(acceptance: float) -> tuple[SpeculationPolicy, list[Generation]]:
    """A policy past its probe that keeps ``acceptance`` of the drafts at every position, and
    four fresh rows with 96 tokens to go."""
    d = decoder(4)
    policy = SpeculationPolicy(max_draft_tokens=8)
    policy.overall.accepted, policy.overall.reached = [1000 * acceptance] * 8, [1000.0] * 8
    rows = [generation(d, [1, 2, 3], spec_of(Cactus(1.0), None), 96) for _ in range(4)]
    return policy, rows


def test_plain_decodings_cost_is_read_before_drafting_may_beat_it() -> None:
    """A calibration guessed 65 ms for 4 plain rows where an iteration reads 47 (a noisy
    moment of a shared machine): by the guess, K = 3 is a third faster than plain decoding.
    The policy first decodes plainly, reading the batch's plain step, and then keeps to it:
    at 47 ms plain decoding is the faster. The control: read at 65 ms, it drafts."""
    for plain_s, drafts in ((0.047, False), (0.065, True)):
        policy, rows = four_rows_at(0.97)
        policy.verify.seed(4, 0.065)
        policy.verify.seed(16, 0.170)
        policy.draft.seed(4, 0.005)
        (plain, plain_s_guess), *_, (tokens, seconds) = policy.forecast(rows, [0] * 4)[:4]
        assert tokens / seconds > 1.3 * plain / plain_s_guess
        assert policy.choose(rows, [0] * 4) == [0] * 4
        policy.observe(StepTiming(4, 0, 0.0, 4, plain_s, 4))
        assert (policy.choose(rows, [0] * 4)[0] > 0) == drafts


def eleven_percent_ahead() -> tuple[SpeculationPolicy, list[Generation]]:
    """``four_rows_at(0.97)`` with costs at which K = 3 decodes 11% faster than plain (all
    drafters caught up), a token's read costing 1.5 ms."""
    policy, rows = four_rows_at(0.97)
    for tokens, seconds in {1: 0.035, 4: 0.047, 16: 0.110, 32: 0.220}.items():
        policy.verify.observe(tokens, seconds)
    policy.draft.observe(1, 0.010)
    policy.draft.observe(4, 0.017)
    policy.catch_up_token_s = 0.0015
    return policy, rows


def test_a_joining_rows_read_is_weighed_against_the_batchs_gain_over_what_is_left() -> None:
    """Four rows with 96 tokens to go, drafting 11% faster than plain decoding. A row joins:
    its drafter would read 60 tokens at 1.5 ms while all four wait, once, for the batch to
    draft over the 384 tokens left: drafting still pays. The control: a joining prompt of
    600 tokens costs more than that gain."""
    policy, rows = eleven_percent_ahead()
    assert policy.choose(rows, [2, 2, 2, 2])[0] > 0
    assert policy.choose(rows, [2, 2, 2, 60])[0] > 0
    assert policy.choose(rows, [2, 2, 2, 600]) == [0] * 4


#: The weight 32 finished answers keep in the policy's decaying sums: sum_i (1 - 1/32)^i.
ANSWERS_WEIGHT = sum((1 - 1 / 32) ** i for i in range(32))


def learn_answers(policy: SpeculationPolicy, prompt_tokens: int, answer_tokens: int) -> None:
    """Hand the policy 32 finished generations that left K open, each ``answer_tokens`` long
    after a prompt of ``prompt_tokens``."""
    d = decoder(1)
    for _ in range(32):
        g = generation(d, [1] * prompt_tokens, spec_of(Cactus(1.0), None), answer_tokens)
        g.context.extend([2] * answer_tokens)
        policy.learn_acceptance(g)


def test_drafting_is_charged_the_prompt_reads_of_the_requests_to_come() -> None:
    """Four rows drafting 11% faster than plain decoding, no drafter lagging. After 32
    answers of 96 tokens to prompts of 150 (a loaded server's traffic), drafting commits
    every request that joins to its drafter reading 150 tokens at 1.5 ms while all wait:
    2.3 ms a token emitted, more than drafting gains, so the policy decodes plainly though no
    row lags now. The control: answers to prompts of 10 tokens, which leave it drafting."""
    for prompt_tokens, drafts in ((150, False), (10, True)):
        policy, rows = eleven_percent_ahead()
        learn_answers(policy, prompt_tokens, 96)
        assert policy.reads_per_token(rows, [2] * 4) == pytest.approx(prompt_tokens / 96)
        assert (policy.choose(rows, [2] * 4)[0] > 0) == drafts


def test_a_max_tokens_far_above_the_answers_does_not_hide_the_reads() -> None:
    """Rows whose clients allow 4,096 tokens and whose drafters lag 150 tokens, where the
    traffic's answers run 96 (to prompts of 10): each row is counted at 96 tokens left, not
    4,096, which would dilute its read (rho 0.04 instead of 1.5), so the policy decodes
    plainly. The control: where the answers run the 4,096 tokens allowed, the reads are cheap
    per token, and it drafts."""
    for answer_tokens, drafts in ((96, False), (4096, True)):
        policy, _ = eleven_percent_ahead()
        d = decoder(4)
        rows = [generation(d, [1, 2, 3], spec_of(Cactus(1.0), None), 4096) for _ in range(4)]
        learn_answers(policy, 10, answer_tokens)
        assert policy.reads_per_token(rows, [150] * 4) == pytest.approx(150 / answer_tokens)
        assert (policy.choose(rows, [150] * 4)[0] > 0) == drafts


def test_rows_lagging_far_beside_what_they_have_left_decode_plainly() -> None:
    """Four rows whose drafters lag 30 tokens (their batch decoded plainly), 8 tokens from
    their end, where the traffic's prompts are cheap (10 tokens to answers of 96): reading
    120 tokens at 1.5 ms while all wait, for 32 tokens drafted 11% faster, loses, so the
    policy decodes plainly (the traffic's answers, pooled with theirs, would have put the
    reads at 0.3 a token, and it drafted). The control: the same lag with 96 tokens left each
    repays its reads, and the policy drafts."""
    for left, drafts in ((8, False), (96, True)):
        policy, rows = eleven_percent_ahead()
        learn_answers(policy, 10, 96)
        for g in rows:
            g.context.extend([2] * (96 - left))
        assert policy.reads_per_token(rows, [30] * 4) == pytest.approx(30 / left)
        assert (policy.choose(rows, [30] * 4)[0] > 0) == drafts


def test_the_policy_drafts_further_where_acceptance_runs_in_stretches() -> None:
    """Two rows keep 92% of first drafts: one every later draft too (HumanEval's pattern),
    the other 92% at every position. Per-position chances predict 10.0 tokens from ten drafts
    for the first, worth an 11-token block at 3.8 plain steps, and 7.4 for the second, which
    drafts two."""
    d = decoder(1)
    policy = SpeculationPolicy(max_draft_tokens=10)
    policy.draft.observe(1, 0.019)
    policy.verify.observe(1, 0.050)
    policy.verify.observe(11, 0.190)
    policy.judged = 100  # past its probe
    stretch = generation(d, [1, 2, 3], spec_of(SpS(), None))
    stretch.stats.reached_by_position = [100] + [92] * 9
    stretch.stats.accepted_by_position = [92] * 10
    spread = generation(d, [1, 2, 3], spec_of(SpS(), None))
    spread.stats.reached_by_position, spread.stats.accepted_by_position = [100] * 10, [92] * 10
    assert policy.chances(stretch)[1:] == pytest.approx([1.0] * 9, abs=0.005)
    assert policy.choose([stretch], [0]) == [10]
    assert policy.choose([spread], [0]) == [2]


def test_an_answers_opening_is_learned_apart_from_the_rows_chances() -> None:
    """Ten finished answers whose first iteration lost all its drafts at the first (the draft
    opens its answers otherwise than the verifier), the rest keeping 8 of 10: a fresh row
    counts at the pool's chances while it reads its prompt (it does not iterate in the
    iteration chosen), decodes its opening plainly, then drafts, its own opening's
    rejection not counted against it. The control: the same rejection after the opening is
    the row's own, and lowers its chances."""
    d = decoder(1)
    policy = policy_with(0.010, {1: 0.050, 2: 0.053, 11: 0.080})
    policy.judged = 100  # past its probe
    for _ in range(10):
        done = generation(d, [1, 2, 3], spec_of(SpS(), None))
        done.stats.record(10, 0, 1)
        for _ in range(4):
            done.stats.record(10, 8, 9)
        policy.learn_acceptance(done)
    pooled = policy.pool_chances(key=done.acceptance_key)
    fresh = generation(d, [1, 2, 3], spec_of(SpS(), None))
    assert fresh.reading  # joins the batch at the pool's chances, not its opening's
    assert policy.chances(fresh) == pytest.approx(pooled)
    d.prefill([fresh])
    assert policy.chances(fresh)[0] < 0.3 and policy.choose([fresh], [0]) == [0]
    fresh.stats.record(10, 0, 1)  # its opening rejected at the first draft too
    assert policy.chances(fresh)[0] == pytest.approx(pooled[0])
    assert policy.choose([fresh], [0])[0] > 0
    fresh.stats.record(10, 0, 1)  # the control: a rejection of its own
    assert policy.chances(fresh)[0] < pooled[0] - 0.1


def test_rows_still_decoding_teach_the_pool() -> None:
    """Eight rows that began together, none finished, each past its opening with 3 of 3
    drafts kept in four iterations: the pool's chances are theirs (near 1), not the prior of
    1/2 that leaves each row's few counts shrunk halfway back, and the batch drafts further.
    The control: the pool over the finished generations alone, none, is the prior."""
    d = decoder(1)
    policy = policy_with(0.010, {1: 0.050, 8: 0.055, 32: 0.110, 88: 0.300})
    policy.overall.accepted, policy.overall.reached = [0.0] * 8, [0.0] * 8  # none finished
    policy.judged = 100  # past its probe
    rows = [generation(d, [1, 2, 3], spec_of(SpS(), None)) for _ in range(8)]
    for g in rows:
        for _ in range(5):
            g.stats.record(3, 3, 4)
    assert policy.pool_chances() == pytest.approx([0.5] * 8)
    live = policy.pool_chances(rows, rows[0].acceptance_key)
    assert min(live) > 0.9  # 32 drafts kept of 32 at positions 1-3; 4 on takes position 3's
    g = rows[0]  # 4 counts a position of its own, shrunk towards the pool's 4
    assert expected_tokens(policy.chances(g, policy.pool_chances()), 3) < 3.1
    together = expected_tokens(policy.chances(g, live), 3)
    assert together > 3.8 and policy.forecast(rows, [0] * 8)[3][0] == pytest.approx(8 * together)


def test_a_new_policy_measures_acceptance_before_its_estimate_decides() -> None:
    """Where a verification block costs three plain steps, the prior rate of 1/2 never pays
    for drafting; a fresh policy drafts K_max to the end until it has seen 100 drafts
    verified, then follows the rate it measured: it drafts at 0.95 and not at 0.5 (the
    negative control: the same costs, a measured rate of 1/2)."""
    d = decoder(1)
    g = generation(d, [1, 2, 3], spec_of(Cactus(1.0), None))
    fresh = SpeculationPolicy(max_draft_tokens=8)
    fresh.draft.observe(1, 0.002)
    for tokens, seconds in {1: 0.050, 2: 0.100, 9: 0.150}.items():
        fresh.verify.observe(tokens, seconds)
    assert fresh.probing() and fresh.choose([g], [0]) == [8]
    assert fresh.keep_drafting([0.01] * 7)  # a probe is not cut short
    _taught(fresh, 0.99, 0.95)
    g.stats.reached_by_position, g.stats.accepted_by_position = [40] * 8, [38] * 8
    assert not fresh.probing() and fresh.choose([g], [0]) == [8]
    g.stats.accepted_by_position = [20] * 8
    assert fresh.choose([g], [0]) == [0]


def fresh_policy(
    verify: dict[int, float], draft: dict[int, float], catch_up_token_s: float
) -> SpeculationPolicy:
    """A policy that has measured these costs (seconds by tokens, by rows, a token's read)
    and no acceptance yet: probing, with K_max = 10."""
    policy = SpeculationPolicy(max_draft_tokens=10)
    for tokens, seconds in verify.items():
        policy.verify.observe(tokens, seconds)
    for rows, seconds in draft.items():
        policy.draft.observe(rows, seconds)
    policy.catch_up_token_s = catch_up_token_s
    return policy


#: A calibration held to AVX2 (the default pair, int8 verifier): seconds by tokens or rows.
AVX2_VERIFY = {1: 0.046, 2: 0.067, 4: 0.099, 8: 0.167, 16: 0.239, 32: 0.494, 64: 0.937,
               128: 1.842, 176: 2.457}  # fmt: skip
AVX2_DRAFT = {1: 0.020, 2: 0.023, 4: 0.033, 8: 0.058, 16: 0.111}


def test_a_probe_drafts_only_where_drafting_could_pay() -> None:
    """A fresh policy (probing) with costs timed held to AVX2: for 16 rows no K would pay
    even were every draft kept (a block of 32 tokens costs twice one of 16), so the probe
    drafts none, where a probe of K_max would stall the 16; for one row it drafts K_max,
    even with its drafter 158 tokens behind at 5 ms a token: the probe pays that read once
    to learn the acceptance that decides the rest. The control: past the probe, at a rate of
    0.98 a draft, that read keeps the row from drafting, and drafting pays once it is read."""
    d = decoder(1)
    rows = [generation(d, list(range(1, 159)), spec_of(SpS(), None)) for _ in range(16)]
    fresh = fresh_policy(AVX2_VERIFY, AVX2_DRAFT, catch_up_token_s=0.005)
    assert fresh.probing()
    assert fresh.choose(rows, [0] * 16) == [0] * 16
    assert fresh.choose(rows[:1], [158]) == [10]
    fresh.overall.accepted, fresh.overall.reached = [980.0] * 10, [1000.0] * 10  # past its probe
    assert not fresh.probing()
    assert fresh.choose(rows[:1], [158]) == [0]
    assert fresh.choose(rows[:1], [0]) != [0]


def test_a_probe_leaves_a_row_near_its_end_alone() -> None:
    """Held to AVX2, a probing policy's lone row whose drafter lags 240 tokens: with 3 tokens
    of its budget left it decodes plainly (its read, left out of the probe's forecast, would
    stall the batch for at most 2 drafts judged); the control: with 50 left it probes."""
    d = decoder(1)
    fresh = fresh_policy(AVX2_VERIFY, AVX2_DRAFT, catch_up_token_s=0.005)
    for left, probes in ((3, False), (50, True)):
        g = generation(d, list(range(1, 159)), spec_of(SpS(), None), max_new_tokens=96)
        g.context.extend([7] * (96 - left))  # what it emitted
        assert fresh.probing()
        assert (fresh.choose([g], [240]) != [0]) == probes


def test_a_forecast_counts_only_the_drafts_a_rows_budget_can_use() -> None:
    """Past its probe, a policy forecasts two rows leaving K open: one 3 tokens from its
    budget's end (2 drafts of any K can still be emitted), one 50. At K = 10 the near row adds
    the tokens and block of K = 2 only, and the draft steps past the second run over the far
    row alone; the forecast is the sum of those table entries. The control: the far row's
    tokens grow with K beyond 2."""
    d = decoder(1)
    policy = fresh_policy(AVX2_VERIFY, AVX2_DRAFT, catch_up_token_s=0.0)
    policy.overall.accepted, policy.overall.reached = [900.0] * 10, [1000.0] * 10  # past its probe
    near, far = (generation(d, [1, 2, 3], spec_of(SpS(), None), max_new_tokens=96) for _ in "ab")
    near.context.extend([7] * 93)  # what it emitted: 3 tokens left
    forecast = policy.forecast([near, far], [0, 0])
    chances = [policy.chances(g, policy.pool_chances([near, far])) for g in (near, far)]
    tokens, seconds = forecast[10]
    assert tokens == pytest.approx(expected_tokens(chances[0], 2) + expected_tokens(chances[1], 10))
    steps = 2 * policy.draft.estimate(2) + 8 * policy.draft.estimate(1)
    assert seconds == pytest.approx(steps + policy.block((2 + 1) + (10 + 1)))
    alone = policy.forecast([near], [0])
    assert alone[10] == alone[2]  # beyond its budget a K adds nothing and costs nothing
    assert policy.choose([near], [0]) != [10]  # so the policy asks no more than it can use
    lone_far = policy.forecast([far], [0])
    assert lone_far[10][0] > lone_far[2][0]  # control: a row far from its end gains


#: A calibration with AMX's cheap blocks: seconds by tokens or rows.
AMX_VERIFY = {1: 0.050, 4: 0.052, 8: 0.055, 16: 0.060, 32: 0.090, 64: 0.150, 128: 0.300}
AMX_DRAFT = {1: 0.005, 4: 0.008, 16: 0.020}


def test_a_probe_drafts_on_as_many_rows_as_pays() -> None:
    """A fresh policy (probing) over 8 new rows that leave K open and one that fixed K = 3,
    with AMX's cheap blocks but a dear draft step: one row drafting while seven wait cannot
    pay, several can. With their drafters' reads cheap, the least lagging seven probe at one
    K (the eighth's read, 300 tokens, costs more than its drafts gain) and the fixed row keeps
    its K; with reads dear, none probes (the control: the same rows, past the probe, draft
    once caught up)."""
    d = decoder(1)
    lags = [158, 40, 300, 90, 120, 60, 200, 80]
    prompt, auto = list(range(1, 159)), spec_of(SpS(), None)
    rows = [generation(d, prompt, auto, max_new_tokens=200) for _ in lags]
    fixed = generation(d, [1, 2, 3], spec_of(SpS(), 3))
    fresh = fresh_policy(AMX_VERIFY, {1: 0.010, 16: 0.030}, catch_up_token_s=0.001)
    assert fresh.probing()
    ks = fresh.choose([*rows, fixed], [*lags, 0])
    probes = sorted(range(8), key=lags.__getitem__)[:7]
    assert len({ks[i] for i in probes}) == 1 and ks[probes[0]] > 0 and ks[8] == 3
    assert ks[lags.index(max(lags))] == 0
    fresh.catch_up_token_s = 0.050
    assert fresh.choose([*rows, fixed], [*lags, 0]) == [0] * 8 + [3]
    fresh.overall.accepted, fresh.overall.reached = [980.0] * 10, [1000.0] * 10  # past its probe
    fresh.verify.observe(12, 0.058)  # plain decoding's batch (8 + 3 + 1 tokens), read
    ks = fresh.choose([*rows, fixed], [0] * 9)
    assert not fresh.probing() and len(set(ks[:8])) == 1 and ks[0] > 0


def test_a_probe_pays_one_drafters_read_where_one_row_drafting_pays() -> None:
    """With cheap draft steps one row drafting pays even while seven wait: where the reads are
    dear, only the row that lags least probes (its read left out of the forecast), where they
    are cheap, more rows join it."""
    d = decoder(1)
    lags = [158, 40, 300, 90, 120, 60, 200, 80]
    rows = [generation(d, list(range(1, 159)), spec_of(SpS(), None)) for _ in lags]
    fresh = fresh_policy(AMX_VERIFY, AMX_DRAFT, catch_up_token_s=0.050)
    ks = fresh.choose(rows, lags)
    assert ks[1] > 0 and ks.count(0) == 7
    fresh.catch_up_token_s = 0.0005
    assert fresh.choose(rows, lags).count(0) < 7


def test_the_forecast_counts_the_tokens_of_rows_that_do_not_draft() -> None:
    """One row that leaves K open beside seven autoregressive ones: E(K) is the batch's eight
    tokens plus the row's kept drafts, so drafting one token, which pays for the row alone
    (the control), does not pay for the batch, whose seven rows wait for its draft step."""
    d = decoder(1)
    g = generation(d, [1, 2, 3], spec_of(Cactus(1.0), None))
    plain = [generation(d, [1, 2, 3], AR) for _ in range(7)]
    policy = policy_with(0.020, {1: 0.050, 8: 0.055, 9: 0.0557, 18: 0.120})
    forecast = policy.forecast([g, *plain], [0] * 8)
    assert forecast[0][0] == 8
    assert forecast[1][0] == pytest.approx(8 + policy.chances(g)[0])
    assert policy.choose([g], [0]) != [0]
    assert policy.choose([g, *plain], [0] * 8) == [0] * 8


def test_the_policy_counts_the_drafters_catch_up_on_skipped_tokens() -> None:
    d = decoder(1)
    g = generation(d, list(range(1, 101)), spec_of(Cactus(1.0), None))
    policy = policy_with(0.002, {1: 0.050, 9: 0.052, 16: 0.060, 144: 0.9})
    policy.catch_up_token_s = 0.050  # a slow drafter: 100 prompt tokens to read cost 5 s
    behind = d.behind([g])
    assert behind == [100] and policy.choose([g], behind) == [0]
    assert policy.choose([g], [0]) == [8]  # caught up: drafting pays again
    d.prefill([g])
    most = 0
    while not g.done:  # the first step reads the prompt; then the drafter holds its own
        most = max(most, d.step([g], [6]).emitted)  # kept drafts and reads at most two
        assert d.behind([g])[0] <= 2  # tokens: the correction, or last draft and bonus
    assert most >= 3  # not every token emitted: some iterations emitted three or more


def generation(
    d: SpeculativeDecoder, prompt: list[int], spec, max_new_tokens: int = 50
) -> Generation:
    sampling = SamplingConfig()
    request = Request(
        prompt_ids=prompt, max_new_tokens=max_new_tokens, sampling=sampling, spec=spec
    )
    return d.new_generation(request, 0)


def _taught(policy: SpeculationPolicy, confidence: float, kept_share: float) -> None:
    """Show the policy 100 verified drafts at ``confidence``, ``kept_share`` of them kept."""
    kept = round(100 * kept_share)
    timing = StepTiming(1, 100, 0.2, 101, 0.05, kept + 1, 0, ((confidence,) * 100,), (kept,))
    policy.observe(timing)


def test_a_single_stream_stops_drafting_where_the_drafts_confidence_says_it_would_not_pay() -> None:
    policy = policy_with(0.010, {1: 0.050, 2: 0.050, 16: 0.060})  # drafts dear, blocks cheap
    _taught(policy, 0.995, 0.99)  # confident drafts are kept
    policy.overall.bin_reached[0] += 100  # unsure drafts (p < 0.2) are rejected
    assert policy.accept_chance(0.995) > 0.95 and policy.accept_chance(0.05) < 0.1
    assert policy.keep_drafting([0.995] * 5)
    assert not policy.keep_drafting([0.995, 0.05])  # the chain is unlikely to survive
    # negative control: a free draft step verified at no extra cost always pays for one more
    free = policy_with(0.0, {1: 0.050, 16: 0.050})
    assert free.keep_drafting([0.995, 0.05])


def test_a_step_drafts_no_further_than_the_stopping_rule_allows() -> None:
    d = decoder(1)
    g = generation(d, [1, 2, 3], spec_of(SpS(), 6))
    timing = d.step([g], [6], [lambda confidences: len(confidences) < 2])
    assert timing.draft_steps == 2 and len(timing.confidences[0]) == 2
    assert all(0 < c <= 1 for c in timing.confidences[0])
    assert timing.kept[0] == g.stats.accepted


def test_generate_with_k_left_open_keeps_the_verifiers_greedy_tokens() -> None:
    target = make_tiny_lm(seed=3)
    pays = policy_with(0.0001, {1: 0.050, 16: 0.050})  # drafting pays (no timing)
    open_k = SpeculativeDecoder(
        target, noisy_copy(target, 0.5, 1), spec_of(SpS(), None), policy=pays
    )
    ar = SpeculativeDecoder(target, spec=AR)
    prompt = [5, 17, 3, 99, 42]
    assert open_k.generate(prompt, 30, 0.0).token_ids == ar.generate(prompt, 30, 0.0).token_ids
    assert sum(pays.overall.bin_reached) > 0  # it drafted, and learned from the outcomes


def test_decode_many_leaves_k_to_the_engines_policy() -> None:
    """Requests that leave K open draft what the engine's policy chooses for the batch, as
    ``generate``'s and the server's do: where a verification block is dear, nothing. The
    control: the same requests with K fixed draft every iteration."""
    target = make_tiny_lm(seed=3)
    # a compute-bound verifier, every size of a 2-row batch read: drafting cannot pay
    dear = policy_with(0.010, {n: 0.050 * n for n in range(1, 19)})
    engine = SpeculativeDecoder(
        target, noisy_copy(target, 0.5, 1), spec_of(SpS(), None), max_batch=2, policy=dear
    )
    # two rows from start to end: a row left alone would meet costs its batch never read
    requests = [
        Request(prompt_ids=[5, 17, 3 + i], max_new_tokens=12, seed=i, ignore_eos=True)
        for i in range(2)
    ]
    assert [r.stats.drafted for r in engine.decode_many(requests)] == [0, 0]
    fixed = engine.decode_many(requests, spec=spec_of(SpS(), 4))
    assert all(r.stats.drafted >= r.stats.iterations for r in fixed)


class _StopsAtTwo(SpeculationPolicy):
    """A policy whose single-stream stop ends every chain at two drafts, counting its calls."""

    def __init__(self) -> None:
        super().__init__(max_draft_tokens=8)
        self.asked = 0

    def keep_drafting(self, confidences, key=None) -> bool:
        self.asked += 1
        return len(confidences) < 2


def test_a_lone_row_of_a_batch_stops_its_chain_as_a_single_stream_does() -> None:
    """``decode_many`` (the server's scheduler) with one row that leaves K open ends its chain
    where the single stream's stop says (here at two drafts, where the K chosen is 8); rows
    decoding together draft the K chosen for the batch (the control: past two drafts; the
    stop is asked only once a row is left alone)."""
    target = make_tiny_lm(seed=3)

    def decoded(count: int) -> tuple[_StopsAtTwo, list]:
        policy = policy_with(0.001, {n: 0.050 for n in range(1, 19)}, _StopsAtTwo())  # K = 8
        engine = SpeculativeDecoder(
            target, noisy_copy(target, 0.2, 1), spec_of(SpS(), None), max_batch=2, policy=policy
        )
        requests = [
            Request(prompt_ids=[5, 17, 3 + i], max_new_tokens=24, seed=i, ignore_eos=True)
            for i in range(count)
        ]
        return policy, engine.decode_many(requests)

    policy, (alone,) = decoded(1)
    assert policy.asked > 0 and 0 < alone.stats.drafted <= 2 * alone.stats.iterations
    _, together = decoded(2)
    assert any(r.stats.drafted > 2 * r.stats.iterations for r in together)


def _answered(d: SpeculativeDecoder, spec: DecodeSpec, kept: int) -> Generation:
    """A finished answer of ``spec``: an opening that kept all 8 drafts, then ten iterations
    that kept ``kept`` of 8."""
    done = generation(d, [1, 2, 3], spec)
    done.stats.record(8, 8, 9)
    for _ in range(10):
        done.stats.record(8, kept, kept + 1)
    return done


def test_the_policy_learns_acceptance_per_rule_so_one_rules_verdicts_do_not_sink_anothers() -> None:
    """A server that mixes rules: twenty SpS answers kept 2 drafts of 8 an iteration, five
    Cactus answers all 8. A Cactus row past its opening drafts at Cactus's chances (K = 8),
    an SpS row at SpS's; within an iteration a lone row's stop reads its own rule's verdicts
    at the draft's confidence. The control: the same answers counted as one rule's pull the
    Cactus row's chances to the mix, and it drafts less."""
    d = decoder(1)
    sps, cactus = spec_of(SpS(), None), spec_of(Cactus(1.0), None)

    def taught(pooled: bool) -> SpeculationPolicy:
        policy = policy_with(0.008, {1: 0.050, 2: 0.051, 9: 0.062, 16: 0.074})
        for spec, kept, answers in ((sps, 2, 20), (cactus, 8, 5)):
            for _ in range(answers):
                done = _answered(d, spec, kept)
                if pooled:
                    done.acceptance_key = generation(d, [1], cactus).acceptance_key
                policy.learn_acceptance(done)
        return policy

    def row(spec: DecodeSpec) -> Generation:
        g = generation(d, [1, 2, 3], spec)
        g.stats.record(8, 8, 9)  # its opening: its chances are its rule's pool's
        return g

    policy, pooled = taught(pooled=False), taught(pooled=True)
    assert min(policy.chances(row(cactus))) > 0.95
    assert policy.choose([row(cactus)], [0]) == [8]
    assert policy.choose([row(sps)], [0])[0] < 4
    assert pooled.choose([row(cactus)], [0])[0] < 8  # the control
    for key, kept in ((row(sps).acceptance_key, 30), (row(cactus).acceptance_key, 99)):
        verdicts = (1,) * kept + (0,) * (100 - kept)  # a hundred one-draft chains at p = 0.9
        policy.observe(StepTiming(100, 1, 0.01, 200, 0.3, 100 + kept, 0, ((0.9,),) * 100,
                                  verdicts, 0.0, (key,) * 100))  # fmt: skip
    assert policy.accept_chance(0.9, row(cactus).acceptance_key) > 0.95
    assert policy.accept_chance(0.9, row(sps).acceptance_key) < 0.4
    (stop,) = policy.stopping([row(cactus)])
    assert stop([0.9] * 3) and not policy.stopping([row(sps)])[0]([0.9] * 3)


def test_the_policy_keeps_the_acceptance_of_its_most_recently_taught_keys() -> None:
    """Answers of 65 samplings (a server's clients may each send their own): the policy keeps
    the counts of the 64 taught last, a key taught again counting as recent. The control:
    the 64 are all kept."""
    d = decoder(1)
    policy = SpeculationPolicy(max_draft_tokens=8)

    def teach(i: int) -> tuple:
        done = generation(d, [1, 2, 3], spec_of(SpS(), None))
        done.acceptance_key = (done.spec, SamplingConfig(temperature=1.0 + i / 100))
        policy.learn_acceptance(done)
        return done.acceptance_key

    keys = [teach(i) for i in range(policy_module._KEYS)]
    assert set(policy.by_key) == set(keys)  # the control
    teach(0)  # taught again: the least recent is now the second
    last = teach(policy_module._KEYS)
    assert set(policy.by_key) == {*keys, last} - {keys[1]}
