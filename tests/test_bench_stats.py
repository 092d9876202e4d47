"""Intervals and the speedup bound against known values."""

from __future__ import annotations

import pytest

from cactus_spec.bench.bound import iid_speedup_bound, measured_bound
from cactus_spec.bench.stats import median_spread, paired_difference, wilson
from cactus_spec.bench.summary import claim_check


def table(both: int, only_a: int, only_b: int, neither: int) -> tuple[list[bool], list[bool]]:
    """Paired outcomes (a, b) from the four cells of a 2x2 table."""
    a = [True] * (both + only_a) + [False] * (only_b + neither)
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * neither
    return a, b


def test_wilson_known_values() -> None:
    assert wilson(8, 10).as_list() == pytest.approx([0.8, 0.4902, 0.9433], abs=5e-5)
    assert wilson(0, 10).low == pytest.approx(0.0)
    assert wilson(0, 10).high == pytest.approx(0.2775, abs=5e-5)
    assert wilson(10, 10).high == pytest.approx(1.0)


def test_wilson_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="successes"):
        wilson(3, 2)
    with pytest.raises(ValueError, match="n > 0"):
        wilson(0, 0)


def test_paired_difference_matches_newcombe_square_and_add() -> None:
    # Cavo et al. (2012), Fagerland et al. "Statistical Analysis of Contingency Tables",
    # chapter 8: estimate -0.0621, 95% CI -0.1186 to -0.0046.
    interval = paired_difference(*table(59, 6, 16, 80))
    assert interval.as_list() == pytest.approx([-0.0621, -0.1186, -0.0046], abs=5e-5)


def test_paired_difference_is_antisymmetric_and_zero_when_outcomes_agree() -> None:
    a, b = table(12, 5, 2, 6)
    forward, backward = paired_difference(a, b), paired_difference(b, a)
    assert forward.as_list() == pytest.approx([-backward.estimate, -backward.high, -backward.low])
    same = paired_difference([True, False, True], [True, False, True])
    assert same.estimate == 0 and same.low < 0 < same.high


def test_paired_difference_needs_pairs() -> None:
    with pytest.raises(ValueError, match="one length"):
        paired_difference([True], [True, False])


def test_median_spread() -> None:
    assert median_spread([3.0, 1.0, 2.0, 10.0]).as_list() == [2.5, 1.0, 10.0]


def test_iid_bound_formula() -> None:
    # alpha 0.8, K 4, free drafts, v 1: (1 - 0.8^5) / 0.2 = 3.3616 tokens per iteration.
    assert iid_speedup_bound(0.8, 4, 0.0, 1.0) == pytest.approx(3.3616)
    assert iid_speedup_bound(1.0, 4, 0.25, 1.0) == pytest.approx(5 / 2)
    assert iid_speedup_bound(0.0, 4, 0.1, 1.0) == pytest.approx(1 / 1.4)


def test_measured_bound_from_totals() -> None:
    totals = {
        "accepted": 8, "reached": 10, "drafted": 40, "iterations": 10,
        "time_draft_s": 4.0, "time_verify_s": 12.0,
    }  # fmt: skip
    bound = measured_bound(totals, ar_step_s=1.0)
    assert (bound.alpha, bound.k, bound.c, bound.v) == pytest.approx((0.8, 4.0, 0.1, 1.2))
    assert bound.speedup == pytest.approx(3.3616 / 1.6)


def test_note_says_hf_rows_ran_packed_bf16_layers() -> None:
    from cactus_spec.bench.grid import expand, parse_entry
    from cactus_spec.bench.summary import _notes

    grid = expand([parse_entry("ar"), parse_entry("hf")])
    meta = {"environment": {"device": "cpu", "dtype": "bfloat16"}, "run": {"setup": {}}}
    assert any("repacked" in note for note in _notes(grid, "ar", meta))
    meta["run"]["setup"]["backend"] = "hf"  # transformers runs the model: nothing repacked
    assert not any("repacked" in note for note in _notes(grid, "ar", meta))


def _config(cid: str, method: str, accepted: float | None, accuracy: float) -> dict:
    return {
        "id": cid,
        "method": method,
        "num_draft_tokens": 0 if accepted is None else 10,
        "drafter": None if accepted is None else "model",
        "verifier": "none",
        "mean_accepted": accepted,
        "accuracy": [accuracy, accuracy - 0.1, accuracy + 0.1],
    }


def test_the_claim_holds_only_with_both_more_acceptance_and_quality_inside() -> None:
    configs = [
        _config("ar", "ar", None, 0.60),
        _config("sps", "sps", 5.0, 0.62),
        _config("cactus", "cactus", 7.5, 0.55),  # 1.5x SpS, inside [0.5, 0.7]: holds
        _config("tas", "tas", 8.0, 0.45),  # 1.6x SpS, outside: does not hold
        _config("interp", "interp", 6.0, 0.60),  # inside, but only 1.2x SpS
    ]
    found = {x["id"]: x for x in claim_check(configs, "ar")}
    assert set(found) == {"cactus", "tas", "interp"}  # not ar, not SpS itself
    assert found["cactus"]["holds"] and found["cactus"]["gain_over_sps"] == 1.5
    assert found["cactus"]["ceiling"] == 2.0  # K = 10 drafts over SpS's 5 accepted
    assert found["tas"]["inside"] is False and not found["tas"]["holds"]
    assert found["interp"]["inside"] and not found["interp"]["holds"]
    assert claim_check(configs, None) == []


def test_block_verified_runs_are_compared_with_chain_sps() -> None:
    block = {**_config("sps-block", "sps", 5.5, 0.61), "verification": "block"}
    configs = [
        _config("ar", "ar", None, 0.60),
        {**_config("sps", "sps", 5.0, 0.62), "verification": "chain"},
        block,  # listed after chain SpS: it must not become the base
    ]
    found = {x["id"]: x for x in claim_check(configs, "ar")}
    assert set(found) == {"sps-block"}
    assert found["sps-block"]["gain_over_sps"] == pytest.approx(1.1)


def test_gain_per_nat_ranks_ways_of_spending_divergence_against_sps() -> None:
    """Two nats bought 2 more accepted tokens an iteration (1 per nat), eight bought 3 (0.375
    per nat); SpS, AR, a row that spent nothing and one drafting otherwise get no figure."""
    from cactus_spec.bench.summary import _gain_per_nat

    def spent(cid: str, method: str, accepted: float | None, kl: float, k: int = 10) -> dict:
        config = _config(cid, method, accepted, 0.5) | {"kl_nats_per_sequence": kl}
        return config | ({"num_draft_tokens": k} if accepted is not None else {})

    configs = [
        spent("ar", "ar", None, 0.0),
        spent("sps", "sps", 5.0, 0.0),
        spent("budget", "cactus", 7.0, 2.0),
        spent("free", "cactus", 8.0, 8.0),
        spent("none", "cactus", 5.5, 0.0),
        spent("k4", "cactus", 4.0, 1.0, k=4),  # no SpS at K = 4 in this run
    ]
    per_nat = {c["id"]: _gain_per_nat(c, configs).get("gain_per_nat") for c in configs}
    assert per_nat == {
        "ar": None, "sps": None, "budget": 1.0, "free": 0.375, "none": None, "k4": None,
    }  # fmt: skip
