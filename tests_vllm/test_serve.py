"""End to end: `vllm serve` on vLLM's CPU build with the plugin installed and n-gram drafting,
driven by the official openai client with ``vllm_xargs``, and the plugin's meter file.

One server for the module (SmolLM2-135M, K = 4): start-up is most of the cost."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serving import (
    assert_counters_match,
    cactus,
    complete,
    meter_lines,
    prometheus,
    vllm_server,
)

MODEL_ENV = "CACTUS_SPEC_VLLM_TEST_MODEL"
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "import os\nimport sys\nimport json\nimport time\nimport math\nimport",
]
DELTAS = (0.0, 0.5, 2.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = os.environ.get(MODEL_ENV)
    if not model:
        pytest.fail(f"{MODEL_ENV} must name SmolLM2's dense folder (make test-vllm sets it)")
    with vllm_server(model, tmp_path_factory) as running:
        yield running


def test_sps_through_the_plugin_is_vllms_own_token_for_token(server) -> None:
    client, _ = server
    for seed, prompt in enumerate(PROMPTS):
        plain = complete(client, prompt, seed)
        assert complete(client, prompt, seed, {"cactus_method": "sps"}) == plain
        assert complete(client, prompt, seed, cactus(0.0)) == plain


def test_a_lossy_rule_changes_the_tokens(server) -> None:
    """The negative control of the test above: the same seeds, Cactus at delta 2."""
    client, _ = server
    changed = [
        complete(client, prompt, seed) != complete(client, prompt, seed, cactus(2.0))
        for seed, prompt in enumerate(PROMPTS)
    ]
    assert any(changed)


def test_acceptance_rises_with_delta_and_exact_cactus_keeps_its_budget(server) -> None:
    client, meter = server
    for delta in DELTAS:
        for seed, prompt in enumerate(PROMPTS * 2):
            complete(client, prompt, 100 + seed, cactus(delta, exact=True), max_tokens=64)
    lines = [x for x in meter_lines(client, meter) if x["params"].get("exact")]
    rates = []
    for delta in DELTAS:
        mine = [x for x in lines if x["params"]["delta"] == delta]
        assert len(mine) == 2 * len(PROMPTS)
        rates.append(sum(x["accepted"] for x in mine) / sum(x["drafted"] for x in mine))
        for x in mine:  # exact Cactus: KL(law || q) <= delta at every emitted position
            assert x["kl_nats"] <= delta * x["positions"] + 1e-6
    assert rates[0] < rates[1] < rates[2], rates


def test_a_mixed_batch_gives_each_request_its_own_rule(server) -> None:
    client, meter = server
    asks = [
        {"cactus_method": "topk", "cactus_k": 3},
        {"cactus_method": "tas", "cactus_epsilon": 0.2},
        {"cactus_method": "interp", "cactus_alpha": 0.25},
        cactus(1.5),
    ]
    before = len(meter_lines(client, meter))
    with ThreadPoolExecutor(len(asks)) as pool:
        texts = list(pool.map(lambda a: complete(client, PROMPTS[0], 5, a, max_tokens=64), asks))
    assert all(texts)
    new = meter_lines(client, meter)[before:]
    got = sorted((x["method"], json.dumps(x["params"], sort_keys=True)) for x in new)
    want = sorted(
        [
            ("topk", '{"k": 3}'),
            ("tas", '{"alpha": 0.3, "epsilon": 0.2}'),
            ("interp", '{"alpha": 0.25}'),
            ("cactus", '{"delta": 1.5, "exact": false}'),
        ]
    )
    assert got == want
    assert all(x["positions"] > 0 for x in new)


def test_a_bad_parameter_is_a_400_for_that_request_while_others_complete(server) -> None:
    client, _ = server

    def ask(xargs: dict) -> str:
        try:
            return complete(client, PROMPTS[1], 3, xargs, max_tokens=32)
        except openai.BadRequestError as error:
            return f"400: {error.message}"

    asks = [cactus(0.5), {"cactus_method": "cactus", "cactus_delta": -1}, {"cactus_method": "sps"}]
    with ThreadPoolExecutor(3) as pool:
        good, bad, other = pool.map(ask, asks)
    assert "cactus_delta must be a finite number >= 0" in bad and bad.startswith("400")
    assert good and not good.startswith("400") and other and not other.startswith("400")


def test_greedy_requests_are_vllms_own(server) -> None:
    client, _ = server
    plain = complete(client, PROMPTS[2], 0, temperature=0.0)
    assert complete(client, PROMPTS[2], 0, cactus(4.0), temperature=0.0) == plain


def test_the_meter_reaches_prometheus(server) -> None:
    """The worker's counters on the API server's /metrics agree with the meter's lines."""
    client, meter = server
    lines = meter_lines(client, meter)
    values = prometheus(client)
    assert_counters_match(values, lines, ("cactus", "sps", "topk"))
    kl = sum(x["kl_nats"] for x in lines if x["method"] == "cactus")
    assert values['cactus_spec:kl_nats_total{method="cactus"}'] == pytest.approx(kl)


def test_block_requests_keep_their_budget_and_reproduce_with_their_seed(server) -> None:
    """Blocks over n-gram drafts: a seeded request draws the same text again, the meter says
    it was judged as a block, KL(t || q) <= delta at every emitted position, and a tree is
    that request's 400."""
    client, meter = server
    block = {**cactus(1.0), "cactus_verification": "block"}
    before = len(meter_lines(client, meter))
    texts = [complete(client, prompt, 7, block) for prompt in PROMPTS]
    assert texts == [complete(client, prompt, 7, block) for prompt in PROMPTS]
    new = [x for x in meter_lines(client, meter)[before:] if x["method"] == "cactus"]
    assert len(new) == 2 * len(PROMPTS)
    assert all(x["verification"] == "block" and x["positions"] > 0 for x in new)
    assert all(x["kl_nats"] <= x["positions"] * (1 + 1e-5) for x in new)
    with pytest.raises(openai.BadRequestError, match="cactus_verification tree does not apply"):
        complete(client, PROMPTS[0], 0, {**block, "cactus_verification": "tree"})
